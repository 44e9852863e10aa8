"""``python -m torch_kvswap.bench``: the throughput benchmark (:mod:`.throughput`);
``python -m torch_kvswap.bench host-memory``: host mirrors' readiness (:mod:`.host_memory`)."""

import sys

if sys.argv[1:2] == ["host-memory"]:
    from torch_kvswap.bench.host_memory import main

    sys.exit(main(sys.argv[2:]))
from torch_kvswap.bench.throughput import main

sys.exit(main())
