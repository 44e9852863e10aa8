"""A process may end with offloader jobs in flight.

At interpreter exit every offloader that was not shut down finishes its
in-flight jobs and stops its worker threads, so the process exits with its
own status, never an abort ("terminate called without an active exception",
status 134), and a job it reports done has really been copied.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import textwrap

import pytest

# Runs of each way to exit: each is a new Python importing torch, seconds apiece;
# KVSWAP_EXIT_RUNS=50 hunts a rare race at exit.
RUNS = int(os.environ.get("KVSWAP_EXIT_RUNS", "5"))

SCRIPT = textwrap.dedent("""
    import atexit, sys
    state = {}

    def verify():  # registered before torch_kvswap's own handler, so it runs after it
        off, mirror, device = state["off"], state["mirror"], state["device"]
        import torch
        done = bool(torch.equal(mirror, device))
        print("STORED" if done else "PARTIAL", flush=True)

    atexit.register(verify)
    import torch, torch_kvswap
    device = torch.randn(16, 8, 64, 256)  # 16 blocks of 512 KiB
    off = torch_kvswap.KVCacheOffloader({"l": device}, 1, 2, num_host_blocks=8)
    state.update(off=off, mirror=off.host_tensors[0], device=device)
    for j in range(8):  # 8 MiB in flight at exit
        off.store(j, [2 * j, 2 * j + 1], [j])
    how = sys.argv[1]
    if how == "sys.exit":
        sys.exit(7)
    if how == "exception":
        raise RuntimeError("the script's own error")
""")

EXPECTED_STATUS = {"falling off the end": 0, "sys.exit": 7, "exception": 1}


def run_once(how: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.parametrize("how", sorted(EXPECTED_STATUS))
def test_exiting_with_jobs_in_flight_finishes_them_and_keeps_the_scripts_status(how):
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run_once, [how] * RUNS))
    for status, out, err in results:
        assert "terminate called" not in err, err[-2000:]
        assert status == EXPECTED_STATUS[how], (status, err[-2000:])
        assert out.strip() == "STORED", (out, err[-2000:])
        if how == "exception":
            assert "RuntimeError: the script's own error" in err
