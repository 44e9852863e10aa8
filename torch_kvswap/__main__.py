"""``python -m torch_kvswap``: prints the environment report (torch_kvswap.envreport)."""

import sys

from .envreport import main

sys.exit(main())
