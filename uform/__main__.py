"""`python -m uform ...`: the same command line as the `uform` console script."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
