"""``python -m lowproxy.pack``: build the one-file archive."""

import sys

from .build import main

if __name__ == "__main__":
    sys.exit(main())
