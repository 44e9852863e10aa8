"""Methods vLLM adds to each of its workers (``worker_extension_cls``), so a
test reaches every tensor-parallel rank of an engine, in whatever process it
runs, through ``collective_rpc`` (``LLM.collective_rpc``, or the OpenAI
server's ``POST /collective_rpc`` under ``VLLM_SERVER_DEV_MODE=1``).

``kvswap_track`` wraps this rank's torch_kvswap worker (the
OffloadingConnector's ``KVSwapOffloadingWorker``, or the
SimpleCPUOffloadConnector's copy backend) to record:

- at each store, the device bytes of each stored block, keyed by the block's
  position in its request (the OffloadingConnector paths, whose specs carry
  positions) or by its host block (the simple connector);
- at each finished load, the device bytes each loaded block now holds, with
  the same key.

``kvswap_records`` saves them to a file (one per rank) that the test reads:
a load is byte-exact when its bytes equal the stored bytes of its key, in
this engine or, for vLLM's p2p tier, in the peer engine that stored them.
``kvswap_corrupt_loads`` is the control: the host rows of the next loads are
flipped just before they are copied to the device, which the comparison
must see.
"""

from __future__ import annotations

import os

import torch


def _rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


class KVSwapRecorder:
    """Mixed into vLLM's worker class by ``worker_extension_cls``."""

    def kvswap_track(self) -> int:
        """Wraps this rank's plug-in worker; returns the rank."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        self._kvswap = {"stored": {}, "loaded": [], "corrupt": 0, "flipped": 0}
        if hasattr(connector, "worker_handler"):  # KVSwapSimpleCPUOffloadConnector
            self._kvswap_track_simple(connector.worker_handler)
        else:
            self._kvswap_track_offloading(connector.connector_worker.worker)
        return _rank()

    def kvswap_host_bytes(self) -> int:
        """The bytes of this rank's host buffer (its mirrors, or its slots
        of the shared region)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        if hasattr(connector, "worker_handler"):
            return sum(t.numel() * t.element_size() for t in connector.worker_handler.cpu_kv_caches.values())
        return connector.connector_worker.worker.offloader.host_bytes

    def kvswap_slot_bytes(self) -> int:
        """A rank's slot in each row of vLLM's shared host region (tiering)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().connector_worker.spec.cpu_page_size_per_worker

    def kvswap_corrupt_loads(self, count: int = 1) -> None:
        """The control: the next `count` loads read flipped host rows."""
        self._kvswap["corrupt"] = count

    def kvswap_records(self, path: str) -> str:
        """Saves this rank's records to `path` with the rank's number in
        its name; returns that file's path."""
        out = f"{path}.rank{_rank()}.pt"
        torch.save({"rank": _rank(), "pid": os.getpid(), **self._kvswap}, out)
        return out

    # -- the two plug-in paths --------------------------------------------------

    def _kvswap_track_offloading(self, worker) -> None:
        rec = self._kvswap
        off = worker.offloader
        jobs: dict[int, list] = {}
        submit_store, submit_load, get_finished = worker.submit_store, worker.submit_load, worker.get_finished

        def tensors(g):
            return [off.device_tensors[i] for i in off.groups[g]]

        def places(gpu_spec):
            """(group, device block, position in the request) of each block."""
            out, d = [], 0
            for g, n in enumerate(gpu_spec.group_sizes):
                first = int(gpu_spec.block_indices[g])
                out.extend((g, int(gpu_spec.block_ids[d + i]), (g, first + i)) for i in range(n))
                d += n
            return out

        def store(job_id, src_spec, dst_spec):
            for g, dev, key in places(src_spec):
                rec["stored"][key] = [t[dev].clone() for t in tensors(g)]
            return submit_store(job_id, src_spec, dst_spec)

        def load(job_id, src_spec, dst_spec, *args, **kw):
            jobs[job_id] = places(dst_spec)
            if rec["corrupt"] > 0:
                rec["corrupt"] -= 1
                rec["flipped"] += 1
                for chunk in (int(c) for c in src_spec.block_ids):
                    for t in off.host_tensors:
                        t[chunk].view(torch.uint8).bitwise_not_()
            return submit_load(job_id, src_spec, dst_spec, *args, **kw)

        def finished():
            results = get_finished()
            for r in results:
                for g, dev, key in jobs.pop(r.job_id, []):
                    if r.success:
                        rec["loaded"].append((key, [t[dev].clone() for t in tensors(g)]))
            return results

        worker.submit_store, worker.submit_load, worker.get_finished = store, load, finished

    def _kvswap_track_simple(self, worker) -> None:
        rec = self._kvswap
        backend = worker._backend
        regions = list(worker.gpu_kv_caches.values())
        mirrors = list(worker.cpu_kv_caches.values())
        launch, get_finished = backend.launch_copy, worker.get_finished
        loads: list = []

        def launch_copy(src_blocks, dst_blocks, is_store, event_idx, events_list, wait_event=None):
            if is_store:
                for dev, host in zip(src_blocks, dst_blocks):
                    rec["stored"][int(host)] = [r[int(dev)].clone() for r in regions]
            else:
                if rec["corrupt"] > 0:
                    rec["corrupt"] -= 1
                    rec["flipped"] += 1
                    for host in src_blocks:
                        for m in mirrors:
                            m[int(host)].view(torch.uint8).bitwise_not_()
                loads.append((event_idx, list(zip(src_blocks, dst_blocks))))
            return launch(src_blocks, dst_blocks, is_store, event_idx, events_list, wait_event)

        def finished(finished_req_ids):
            result = get_finished(finished_req_ids)
            while loads and loads[0][0] <= worker._load_hwm:
                for host, dev in loads.pop(0)[1]:
                    rec["loaded"].append((int(host), [r[int(dev)].clone() for r in regions]))
            return result

        backend.launch_copy, worker.get_finished = launch_copy, finished
