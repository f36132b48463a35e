"""``python -m strawq``: the same command line as ``strawq``."""

import sys

from strawq.app.cli import main

sys.exit(main())
