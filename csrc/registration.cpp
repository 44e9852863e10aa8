// Every schema of the `kvswap` namespace, declared once. The core's kernels
// are registered in csrc/core/registration_core.cpp, each engine's (`_submit`,
// ...) in its own file under its own key; fake kernels live in
// torch_kvswap/fake_kernels.py.
#include <torch/library.h>

#include "python_module.h"

KVSWAP_PYTHON_MODULE(_C)

TORCH_LIBRARY(kvswap, m) {
  // Batched copy between raw addresses: copy sizes[i] bytes from src_ptrs[i]
  // to dst_ptrs[i] on the current stream of the current accelerator (with no
  // accelerator: memcpy on the host). The three tensors are 1-D int64 CPU
  // tensors of equal length; direction is 0 host->device, 1 device->host,
  // 2 device->device. Drop-in for the reference design's `swap_blocks_batch`
  // call (same arguments, same direction codes); not for vLLM's cache ops,
  // whose signatures differ. It mutates memory the schema cannot name, so
  // torch_kvswap registers it as an ordered side effect; nothing is marked
  // mutated on purpose (the pointer tensors are only read).
  m.def("swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int direction) -> ()");

  // Tensor form: for every pair i and every j, copy block src_block_ids[j] of
  // src_caches[i] into block dst_block_ids[j] of dst_caches[i]. Dim 0 is the
  // block dimension. The destinations are mutated in place (a!), which is
  // what lets torch.compile order it against other reads and writes.
  m.def(
      "swap_blocks(Tensor[] src_caches, Tensor(a!)[] dst_caches, Tensor src_block_ids, "
      "Tensor dst_block_ids) -> ()");

  // Each id b becomes b*f, b*f+1, ..., b*f+f-1; the first skip_count entries
  // of the result are dropped. Returns a new 1-D int64 tensor.
  m.def("expand_block_ids(Tensor block_ids, int block_size_factor, int skip_count=0) -> Tensor");

  // expand_block_ids' accelerator path (ATen tensor ops) on any device, so
  // that tests compare its values on the CPU too. Not for direct use.
  m.def("_expand_block_ids_aten(Tensor block_ids, int block_size_factor, int skip_count=0) -> Tensor");

  // Name of a direction code; ties torch_kvswap.Direction to the C++ enum.
  m.def("_direction_name(int direction) -> str");

  // Engine entry point: submit validated, merged descriptors built by the
  // core. Each engine registers a kernel for its dispatch key; the core
  // redispatches to it. `device` is where the copies are issued (the current
  // stream of that device). Not for direct use.
  m.def(
      "_submit(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int direction, int total_bytes, "
      "Device device) -> ()");

  // Whether the current stream of `device` is being captured into a graph.
  // Served by the accelerator engines under their key; the core asks before
  // it picks a path, since a capture forbids synchronizing calls. Not for
  // direct use.
  m.def("_stream_capturing(Device device) -> bool");

  // Page-locks (pin=True) or releases (pin=False) an existing contiguous host
  // buffer for DMA by `device`, in place and at its exact size; the pinned
  // allocators round every allocation up to a power of two, which host
  // mirrors of a KV cache cannot afford. Served by the accelerator engines.
  m.def("_host_register(Tensor buffer, Device device, bool pin) -> ()");

  // Whether the host memory `buffer` spans is page-locked for DMA by
  // `device`, as the engine of `device` sees it (what it pinned in place, and
  // the pinned allocator's blocks). The core asks before the Ascend engine copies host
  // caches: CANN copies pageable memory synchronously, refuses it under graph
  // capture, and up to 8.0 corrupts it silently. Not for direct use.
  m.def("_host_pinned(Tensor buffer, Device device) -> bool");

  // What the engine of `device` found on it, as "name=value" lines: the
  // batch copy API, the capture query, in-place pinning. Served by the
  // accelerator engines; read by `python -m torch_kvswap`. Not for direct use.
  m.def("_engine_report(Device device) -> str[]");

  // Whether `device` can address every host (CPU) tensor of `tensors` in
  // place: page-locked and mapped. Served by engines with a kernel path
  // (CUDA); the core asks before it picks a path. Not for direct use.
  m.def("_host_mapped(Tensor[] tensors, Device device) -> bool");

  // Kernel path of swap_blocks, on engines that have one (CUDA): copies with
  // a kernel that reads the block ids from device memory when it runs, so a
  // captured graph copies the ids current at replay. The core validates the
  // caches first and picks this path (see _set_copy_method).
  m.def(
      "_swap_blocks_kernel(Tensor[] src_caches, Tensor(a!)[] dst_caches, Tensor src_block_ids, "
      "Tensor dst_block_ids) -> ()");

  // How swap_blocks copies where an engine offers a choice: "auto" (by block
  // size), "dma" (the batched DMA path) or "kernel" (the kernel path).
  // Process-wide.
  m.def("_set_copy_method(str method) -> ()");
  m.def("_get_copy_method() -> str");

  // Dry run of swap_blocks: validates exactly as swap_blocks does and returns
  // the merged descriptors (src_ptrs, dst_ptrs, sizes) it would submit,
  // copying nothing. For tests and for measuring the host-side cost.
  m.def(
      "_plan_swap_blocks(Tensor[] src_caches, Tensor[] dst_caches, Tensor src_block_ids, "
      "Tensor dst_block_ids) -> (Tensor, Tensor, Tensor)");

  // Dry run of swap_blocks_batch: validates and returns the merged
  // descriptors it would submit.
  m.def(
      "_plan_swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int direction) -> (Tensor, Tensor, Tensor)");

  // How the host engine would copy a batch of `total_bytes` bytes from this
  // thread now: the copy routine (after KVSWAP_HOST_COPY and the CPU's
  // features) and how many parts the bytes are split into for torch's
  // intra-op threads (1: the calling thread alone). For tests. Not for
  // direct use.
  m.def("_host_copy_plan(int total_bytes) -> (str, int)");

  // Checked mode (csrc/core/checked.cpp, docs/checked.md). Process-wide
  // switch; torch_kvswap.checked() and KVSWAP_CHECK drive it. Not for
  // direct use.
  m.def("_set_checked(bool on) -> ()");
  m.def("_get_checked() -> bool");

  // Registers the bytes `region` spans as memory the pointer op may copy
  // from or to on `side` ("host" or "device"), named `label` in errors;
  // returns the region's id. The table holds the storage weakly: a region
  // whose memory was freed is dropped, and one whose storage was resized
  // covers the bytes the storage holds now. Checked mode refuses descriptors
  // outside every region. torch_kvswap.register_region wraps it.
  m.def("_register_region(Tensor region, str side, str label) -> int");

  // Drops a region by id; false when there was none (already dropped).
  m.def("_unregister_region(int id) -> bool");

  // "side:label" of every region that holds bytes, in address order. For tests.
  m.def("_region_labels() -> str[]");

  // Region entries the table has visited since the process started
  // (registering, dropping, checking): linear in the regions. For tests.
  m.def("_region_table_work() -> int");
}
