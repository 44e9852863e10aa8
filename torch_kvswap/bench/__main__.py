"""``python -m torch_kvswap.bench``: the throughput benchmark (:mod:`.throughput`)."""

import sys

from torch_kvswap.bench.throughput import main

sys.exit(main())
