"""``python -m lowproxy``: parse the configuration, then run the daemon."""

from __future__ import annotations

import sys

from .daemon import main

if __name__ == "__main__":
    sys.exit(main())
