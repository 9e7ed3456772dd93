"""`python -m meshax.cli`: the `meshax` command."""

import sys

from meshax.cli import main

if __name__ == "__main__":  # (not when a tool imports every module, as the docs build does)
    sys.exit(main())
