import sys

from lightning_debug.cli import main

if __name__ == "__main__":
    sys.exit(main())
