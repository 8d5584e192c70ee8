"""`python -m kvlab.cli ...` runs the `kvlab` command (as `python -m kvlab` does)."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
