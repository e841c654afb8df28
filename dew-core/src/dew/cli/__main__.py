"""``python -m dew.cli``: the ``dew`` command, for a process started by path (the ranks of dew launch)."""

import sys

from dew.cli import main

sys.exit(main())
