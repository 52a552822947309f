"""``python3 -m bench.device_check``: the orchestrator, or with ``--worker`` one measurement child."""

import sys

from bench.device_check.main import main

if __name__ == "__main__":
    sys.exit(main())
