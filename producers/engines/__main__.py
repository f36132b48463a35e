import sys

from strawq.producers.engines.cli import main

sys.exit(main())
