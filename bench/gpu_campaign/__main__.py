"""``python3 -m bench.gpu_campaign``: the campaign, or with ``--worker`` one measurement child."""

import sys

from bench.gpu_campaign.main import main

if __name__ == "__main__":
    sys.exit(main())
