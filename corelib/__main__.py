"""Entry point: ``python -m corelib``."""

import sys

from corelib.cli import main

if __name__ == "__main__":
    sys.exit(main())
