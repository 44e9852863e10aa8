"""The tiering spec's real engine through vLLM's fs tier on a release without
vLLM 0.32's per-tier byte metrics (0.26.0 and 0.27.1 have none;
scripts/test_vllm.sh step 6 runs it on 0.26.0): tests/test_vllm_tiering.py's
disk-tier test, steps 1 to 3, waiting for the block files instead of the
write-bytes metric.

A, B, C in turn (24 chunks through a 12-chunk host tier): every stored block
lands in a file; A again is promoted from disk (256 cached tokens, same
tokens, every block byte-exact); B's files flipped: every block of B must
differ. Exits non-zero on any failure. Run from the repository root with
the engine's venv: python scripts/vllm_tiering_by_hand.py
"""

import shutil
import sys
import tempfile
import time
from pathlib import Path

if sys.flags.optimize:
    sys.exit("run without -O: the checks are asserts")
sys.path.insert(0, "tests")
import test_vllm_tiering as t
from torch_kvswap.integrations import vllm as kv
from torch_kvswap.integrations.vllm.offloading import _host_chunks

root = Path(tempfile.mkdtemp())
llm = t.tiered_engine(root)
try:
    wc = t.connector().connector_worker
    spec, worker = wc.spec, wc.worker
    assert type(spec) is kv.KVSwapTieringOffloadingSpec and type(worker) is kv.KVSwapOffloadingWorker
    assert _host_chunks(spec) == t.HOST_CHUNKS and spec.kv_bytes_per_chunk == t.chunk_bytes()
    row = spec.kv_bytes_per_chunk
    off = worker.offloader
    tensors = [off.device_tensors[i] for i in off.groups[0]]
    tr = t.Tracker(worker)
    base = {}
    for n, name in enumerate("ABC", 1):
        base[name], cached = t.generate(llm, name, tr)
        assert cached == 0
        for _ in range(200):  # a filler request steps the engine until the writes land
            if len(t.block_files(root)) >= n * t.FULL:
                break
            tr.current = "filler"
            llm.generate(
                [{"prompt_token_ids": [5, 6, 7]}],
                t.SamplingParams(max_tokens=1, detokenize=False),
                use_tqdm=False,
            )
            time.sleep(0.05)
        print(name, "files", len(t.block_files(root)))
    files = t.block_files(root)
    assert len(files) == 3 * t.FULL and all(f.stat().st_size == row for f in files), len(files)
    owners = {f: t.chunk_owner(f.read_bytes(), tensors, off._pages, tr.rec.snapshots) for f in files}
    assert sorted(owners.values()) == sorted(tr.rec.snapshots), "a file is not a stored block"
    assert llm.reset_prefix_cache()
    tokens, cached = t.generate(llm, "A", tr)
    print("A again: cached", cached, "counts", tr.counts())
    assert tokens == base["A"] and cached == t.FULL * t.BLOCK
    assert tr.counts() == (t.FULL, 0)
    assert llm.reset_prefix_cache(reset_connector=True)
    for f, (name, _) in owners.items():
        if name == "B":
            f.write_bytes(bytes(b ^ 0xFF for b in f.read_bytes()))
    t.generate(llm, "B", tr)
    print("control: counts", tr.counts())
    assert tr.counts() == (2 * t.FULL, t.FULL), "the control's flipped file bytes went unnoticed"
    print("TIERING BY HAND OK")
finally:
    t.close(llm)
    shutil.rmtree(root)
