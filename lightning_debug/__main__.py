import sys

from lightning_debug.cli import main

sys.exit(main())
