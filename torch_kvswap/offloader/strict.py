"""Strict mode's record of stores: which host rows a load may read.

Per host sub-block row of each cache tensor, the latest store submitted for
it (its :attr:`Job.serial`; -1: none), and the id of that store when it failed
(-1: it did not). A load may read a row whose latest store exists and did not
fail; any other load is refused before anything is queued. A bit of work per
row a job touches: far cheaper than checked mode (``_checked.py``), which
tracks the whole contract.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .lanes import Job


class StoreRecord:
    """A :class:`~.lanes.JobTracker` for ``KVCacheOffloader(strict=True)``.

    Args:
        cache_names: the name of each cache tensor, for errors.
        rows: host sub-block rows per tensor (``num_host_blocks * factor``).
        factor: host sub-blocks per host block, for errors.
    """

    def __init__(self, cache_names: Sequence[str], rows: int, factor: int) -> None:
        self.cache_names, self.factor = list(cache_names), factor
        shape = (len(self.cache_names), rows)
        self._last_store = np.full(shape, -1, dtype=np.int64)
        self._failed_store = np.full(shape, -1, dtype=np.int64)

    def admit(self, job: Job) -> None:
        """A store becomes the latest store of the host rows it writes; a
        load is refused unless every row it reads has a latest store that
        did not fail."""
        if job.is_store:
            for c in job.copies:
                rows = np.ix_(c.tensors, c.dst_ids.numpy())
                self._last_store[rows] = job.serial
                self._failed_store[rows] = -1
            return
        for c in job.copies:
            rows = c.src_ids.numpy()
            ix = np.ix_(c.tensors, rows)
            stored = (self._last_store[ix] >= 0) & (self._failed_store[ix] < 0)
            if not stored.all():
                t, j = (int(x[0]) for x in np.nonzero(~stored))
                row = int(rows[j])
                where = (
                    f"load (job {job.job_id}) reads host block {row // self.factor} (sub-block "
                    f"{row % self.factor}) of cache {self.cache_names[c.tensors[t]]}"
                )
                failed = int(self._failed_store[c.tensors[t], row])
                if failed >= 0:
                    raise ValueError(
                        f"{where}, whose latest store (job {failed}) failed, so the block holds no "
                        "complete data; store it again before loading it (strict=True; nothing "
                        "was copied)"
                    )
                raise ValueError(
                    f"{where}, which no store has written; strict=True refuses loads of "
                    "never-stored host blocks (nothing was copied)"
                )

    def observed(self, jobs: list[Job]) -> None:
        """Nothing: a store's rows are readable once it is submitted (loads
        run after it only if the caller orders them; checked mode checks that)."""

    def finish(self, job: Job, ok: bool) -> None:
        """A failed store may have written part of its rows: those it is
        still the latest store of hold nothing a load may read."""
        if ok or not job.is_store:
            return
        for c in job.copies:
            rows = np.ix_(c.tensors, c.dst_ids.numpy())
            failed = self._failed_store[rows]
            failed[self._last_store[rows] == job.serial] = job.job_id
            self._failed_store[rows] = failed
