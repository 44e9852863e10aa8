"""Smoke test of an installed torch_kvswap, run from outside the source tree
(scripts/check_install.sh): import, one swap_blocks against a plain
reference, one offloader round trip, and `python -m torch_kvswap`."""

import subprocess
import sys
from pathlib import Path

import torch

import torch_kvswap

here = Path.cwd().resolve()
assert not (Path(torch_kvswap.__file__).resolve().parent.parent / "csrc").exists(), (
    f"imported the source tree, not the installed package: {torch_kvswap.__file__}"
)

# swap_blocks: blocks 3, 0 of each source cache into blocks 1, 2 of each destination.
gen = torch.Generator().manual_seed(0)
src = [torch.randint(0, 255, (4, 2, 64), dtype=torch.uint8, generator=gen) for _ in range(2)]
dst = [torch.zeros(3, 2, 64, dtype=torch.uint8) for _ in range(2)]
want = [d.clone() for d in dst]
for s, w in zip(src, want):
    w[1], w[2] = s[3], s[0]
torch_kvswap.swap_blocks(src, dst, torch.tensor([3, 0]), torch.tensor([1, 2]))
assert all(torch.equal(d, w) for d, w in zip(dst, want)), "swap_blocks copied the wrong bytes"

# Offloader round trip: store device blocks 2, 5 to host block 0, wipe them, load them back.
caches = {f"layer.{i}": torch.randn(2, 8, 4, 16, generator=gen) for i in range(2)}
before = {k: v[:, [2, 5]].clone() for k, v in caches.items()}
with torch_kvswap.KVCacheOffloader(caches, device_block_size=4, host_block_size=8, num_host_blocks=2) as off:
    off.store(job_id=1, device_block_ids=[2, 5], host_block_ids=[0])
    off.wait({1})
    for v in caches.values():
        v[:, [2, 5]] = 0
    off.load(job_id=2, host_block_ids=[0], device_block_ids=[2, 5])
    off.wait({2})
    results = off.get_finished()
assert all(r.success for r in results) and {r.job_id for r in results} == {1, 2}, results
assert all(torch.equal(caches[k][:, [2, 5]], before[k]) for k in caches), "offloader round trip lost bytes"

report = subprocess.run([sys.executable, "-m", "torch_kvswap"], capture_output=True, text=True, cwd=here)
print(report.stdout)
assert report.returncode == 0, report.stderr
assert "engine host" in report.stdout and "loaded" in report.stdout, report.stdout
print(f"smoke test passed: torch_kvswap {torch_kvswap.__version__} from {Path(torch_kvswap.__file__).parent}")
