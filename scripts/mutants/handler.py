"""Mutants of torch_kvswap/handler.py (data for scripts/mutation_check.py)."""

_T = ["tests/test_handler.py"]

MUTANTS = [
    dict(
        name="handler-offset-ignored",
        file="torch_kvswap/handler.py",
        find="                skip = offs[g]\n",
        replace="                skip = 0\n",
        tests=_T,
        why="an explicit first-sub-block offset must place the first block at that sub-block, "
            "not at sub-block 0",
    ),
    dict(
        name="handler-partial-last-chunk-dropped",
        file="torch_kvswap/handler.py",
        find="spans.append((skip, -(-(n + skip) // f) if n else 0))",
        replace="spans.append((skip, (n + skip) // f))",
        tests=_T,
        why="a job that ends mid chunk needs the partial last chunk counted",
    ),
    dict(
        name="handler-groups-copy-every-tensor",
        file="torch_kvswap/handler.py",
        find="copies.append(_Copy(self.groups[g], src, dst))",
        replace="copies.append(_Copy(list(range(len(self.device_tensors))), src, dst))",
        tests=_T,
        why="a group's block ids must move only that group's tensors",
    ),
    dict(
        name="handler-failure-reported-as-success",
        file="torch_kvswap/handler.py",
        find="        ok = job.error is None\n",
        replace="        ok = True\n",
        tests=_T,
        why="a job whose copy failed must never be reported as a success",
    ),
    dict(
        name="handler-mirror-not-page-aligned",
        file="torch_kvswap/handler.py",
        find="        start = -allocation.data_ptr() % _PAGE\n        buffer = allocation[start:start + total]\n        if pin:",
        replace="        start = 64\n        buffer = allocation[start:start + total]\n        if pin:",
        tests=_T,
        why="in-place registration needs the mirror buffer to start on a page boundary",
    ),
    dict(
        name="handler-mirror-padding-64k",
        file="torch_kvswap/handler.py",
        find="            total += -(-rows * bb // _PAGE) * _PAGE\n",
        replace="            total += -(-rows * bb // _PAGE) * _PAGE + 65536\n",
        tests=_T,
        why="padding must stay under one page per cache tensor",
    ),
    dict(
        name="handler-transfer-time-zero",
        file="torch_kvswap/handler.py",
        find="            job.seconds = time.perf_counter() - t0\n",
        replace="            job.seconds = 0.0\n",
        tests=_T,
        why="a job that moved bytes took time; vLLM's stats divide by it",
    ),
    dict(
        name="handler-get-finished-order-reversed",
        file="torch_kvswap/handler.py",
        find="                    results.append(self._report(fifo.popleft()))\n",
        replace="                    results.insert(0, self._report(fifo.popleft()))\n",
        tests=_T,
        why="results of one lane are reported in submission order",
    ),
    dict(
        name="handler-destination-repeat-check-dropped",
        file="torch_kvswap/handler.py",
        find="            if len(torch.unique(a.dst_ids)) != len(a.dst_ids):\n",
        replace="            if False:\n",
        tests=_T,
        why="two copies into one destination block in one job race; the job must be refused",
    ),
    dict(
        name="handler-expedited-shares-load-lane",
        file="torch_kvswap/handler.py",
        find='return self._submit(job_id, "expedited" if expedited else "load",',
        replace='return self._submit(job_id, "load",',
        tests=_T,
        why="an expedited load must not queue behind ordinary loads",
    ),
    dict(
        name="handler-launch-under-table-lock",
        file="torch_kvswap/handler.py",
        find="                self._fifo[lane].append(job)\n            # Launched outside",
        replace="                self._fifo[lane].append(job)\n                if self._workers is not None:\n"
                "                    self._queues[lane].put(job)\n                    return True\n            # Launched outside",
        tests=_T,
        why="get_finished must not wait behind a launch",
    ),
]
