import sys

from devtools.cli import main

if __name__ == "__main__":   # not when a spawned bench process imports this module again
    sys.exit(main())
