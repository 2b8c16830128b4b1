import sys

from sluice.entrypoints.cli import main

sys.exit(main())
