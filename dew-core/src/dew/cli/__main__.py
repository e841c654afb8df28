"""``python -m dew.cli``: the ``dew`` command, for a process started by path (the ranks of dew launch)."""

import sys

from dew.cli import main

if __name__ == "__main__":
    sys.exit(main())
