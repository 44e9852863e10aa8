"""``KVSwapSimpleCPUOffloadConnector`` and its worker: vLLM's simple CPU offload classes,
copying with torch_kvswap.

They subclass vLLM's ``SimpleCPUOffloadConnector`` and
``SimpleCPUOffloadWorker``, so importing this module imports vLLM, after
:func:`~.compat.inspect_vllm` has accepted its release's interface (an
:class:`~.compat.UnsupportedVLLM` otherwise). Users name the connector
through the package (``kv_connector_module_path:
"torch_kvswap.integrations.vllm"``), which imports this module on first
lookup; :mod:`.simple_offload` holds the vLLM-free parts.

The worker's one release difference, where a step's copies are launched
(``compat.SIMPLE_DEFERRED`` up to 0.28, ``compat.SIMPLE_STEP`` from 0.29 on),
is an adapter class per era, beside the worker; the worker takes the one of
the installed release's era.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from ...offloader.caches import unregister_mirrors
from .compat import SIMPLE_DEFERRED, SIMPLE_STEP, apply_check_option, inspect_vllm
from .copy_backend import KVSwapCopyBackend
from .simple_offload import _host_mirrors, check_extra_config, copy_streams, kv_regions

_worker_module, _ERA = inspect_vllm("simple")  # vllm.v1.simple_kv_offload.worker

from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (  # noqa: E402
    SimpleCPUOffloadConnector,
)

logger = logging.getLogger("torch_kvswap")

__all__ = ["KVSwapSimpleCPUOffloadWorker", "KVSwapSimpleCPUOffloadConnector"]


class _DeferredLaunch:
    """vLLM 0.27 and 0.28 (:data:`~.compat.SIMPLE_DEFERRED`): ``get_finished``
    launches the step's loads and stores; ``wait_for_save`` is empty."""

    def wait_for_save(self) -> None:
        """Nothing: in this vLLM ``get_finished`` launches the step's copies."""

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        """Launch this step's loads, then its stores (vLLM 0.27/0.28's
        order), then let vLLM's ``get_finished`` report completions.
        The step's metadata stays bound with its copies taken out, so
        neither vLLM's ``get_finished`` nor a second call in the same
        step launches them again."""
        metadata = self._connector_metadata
        if metadata is not None and (metadata.load_cpu_blocks or metadata.store_gpu_blocks):
            if metadata.load_cpu_blocks:
                self._backend.launch_copy(
                    metadata.load_cpu_blocks,
                    metadata.load_gpu_blocks,
                    is_store=False,
                    event_idx=metadata.load_event,
                    events_list=self._load_events,
                )
            if metadata.store_gpu_blocks:
                self._launch_store(metadata)
            launched = copy.copy(metadata)
            launched.load_cpu_blocks, launched.load_gpu_blocks = [], []
            launched.store_gpu_blocks, launched.store_cpu_blocks = [], []
            self._connector_metadata = launched
        return super().get_finished(finished_req_ids)


class _StepLaunch:
    """vLLM 0.29 on (:data:`~.compat.SIMPLE_STEP`): vLLM's ``start_load_kv``
    launches the step's loads, ``wait_for_save`` its store."""

    def wait_for_save(self) -> None:
        """Launch this step's store (vLLM 0.29 on: ``start_load_kv``
        launched its loads)."""
        metadata = self._connector_metadata
        if metadata is None or not metadata.store_gpu_blocks:
            return
        self._launch_store(metadata)


_LAUNCH = {SIMPLE_DEFERRED: _DeferredLaunch, SIMPLE_STEP: _StepLaunch}


class KVSwapSimpleCPUOffloadWorker(_LAUNCH[_ERA], _worker_module.SimpleCPUOffloadWorker):
    """vLLM's simple CPU offload worker, copying through :class:`KVSwapCopyBackend`."""

    _host_buffer: torch.Tensor | None = None
    _registered = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Mirror the KV regions on the host and start the copy backend."""
        if not kv_caches:
            logger.warning("kvswap: no KV caches to offload")
            return
        self.device = next(iter(kv_caches.values())).device
        regions = kv_regions(kv_caches, self.kv_cache_config)
        bytes_per_block = sum(r.shape[1] for r in regions.values())
        # vLLM's own count, so the scheduler's block ids fit: 0.33 aligns
        # it across workers (_resolve_num_cpu_blocks), 0.32 divides.
        resolve = getattr(self, "_resolve_num_cpu_blocks", None)
        self.num_cpu_blocks = (
            resolve(self.cpu_capacity_bytes, bytes_per_block)
            if resolve
            else max(1, self.cpu_capacity_bytes // bytes_per_block)
        )
        if self.device.type != "cpu":
            self.load_stream, self.store_stream = copy_streams(self.device)
        self._host_buffer, self.cpu_kv_caches, self._registered = _host_mirrors(
            regions, self.num_cpu_blocks, self.device
        )
        self.gpu_kv_caches = regions
        logger.info(
            "kvswap: simple CPU offload, %d regions, %d host blocks (%.2f GiB)",
            len(regions),
            self.num_cpu_blocks,
            self.num_cpu_blocks * bytes_per_block / 2**30,
        )
        self._backend = KVSwapCopyBackend()
        self._backend.init(regions, self.cpu_kv_caches, self.device, self.load_stream, self.store_stream)

    def _launch_store(self, metadata: Any) -> None:
        """Launch a step's store after the compute queued so far (on an
        accelerator, an event on the current stream; the host engine's
        compute has finished when this is called)."""
        wait = None
        if self.device.type != "cpu":
            if self._store_compute_done is None:
                self._store_compute_done = torch.Event(device=self.device)
            self._store_compute_done.record(torch.accelerator.current_stream(self.device))
            wait = self._store_compute_done
        self._backend.launch_copy(
            metadata.store_gpu_blocks,
            metadata.store_cpu_blocks,
            is_store=True,
            event_idx=metadata.store_event,
            events_list=self._store_events,
            wait_event=wait,
        )

    def shutdown(self) -> None:
        """Finish the copies in flight, then release the host mirrors; idempotent."""
        if self._backend is not None:
            self._backend.shutdown()
        if self._registered:
            self._registered = False
            # A refusal is logged and the buffer kept for the life of the process.
            unregister_mirrors(self._host_buffer, self.device)
        self._host_buffer = None


class KVSwapSimpleCPUOffloadConnector(SimpleCPUOffloadConnector):
    """vLLM's ``SimpleCPUOffloadConnector`` whose worker copies with torch_kvswap.

    ``kv_connector_extra_config``: vLLM's (``cpu_bytes_to_use``,
    ``cpu_bytes_to_use_per_rank``, ``lazy_offload``, 0.33's
    ``num_cpu_blocks``); ``kv_offload_backend`` must stay ``"cpu"``;
    ``"kvswap_check": true`` turns checked mode on (docs/checked.md). Any
    other key is refused here (:func:`check_extra_config`).
    Needs prefix caching, as vLLM's.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(transfer, "kv_connector_extra_config", None)
        check_extra_config(extra)
        apply_check_option(extra)
        super().__init__(vllm_config, role, kv_cache_config)
        worker = self.worker_handler
        if worker is not None:
            # vLLM builds its worker inline from values it derives from the
            # config (per-rank capacity, 0.33's num_cpu_blocks); taking that
            # object over keeps them vLLM's.
            worker.__class__ = KVSwapSimpleCPUOffloadWorker

    def shutdown(self) -> None:
        if isinstance(self.worker_handler, KVSwapSimpleCPUOffloadWorker):
            self.worker_handler.shutdown()
        super().shutdown()
