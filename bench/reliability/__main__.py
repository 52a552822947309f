"""``python -m bench.reliability``: see the package docstring."""

import sys

from bench.reliability.main import main

if __name__ == "__main__":
    sys.exit(main())
