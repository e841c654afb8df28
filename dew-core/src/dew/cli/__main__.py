"""``python -m dew.cli``: the ``dew`` command, for a process started by path (the ranks of dew launch)."""

import sys

from dew.cli import main
from dew.cli.output import guard_stdout

if __name__ == "__main__":
    guard_stdout()
    sys.exit(main())
