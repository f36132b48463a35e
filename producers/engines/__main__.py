import sys

from producers.engines.cli import main

sys.exit(main())
