// Every schema of the `kvswap` namespace, declared once. Their kernels are
// the core's (csrc/core/registration_core.cpp); engines register no op: they
// install an EngineInterface (kvswap.h) in the registry this library exports
// (kvswap_engine_registry). Fake kernels live in torch_kvswap/fake_kernels.py.
#include <torch/library.h>

#include "python_module.h"

// The core's module: importing it loads the library, whose registrations
// below (and the host engine's, csrc/core/engines.cpp) run as it loads.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  KVSWAP_MODULE_DEF(_C);
  return kvswap::python::create_module(&module_def);
}

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

  // Page-locks (pin=True) or releases (pin=False) an existing contiguous host
  // buffer for DMA by `device`, in place and at its exact size; the pinned
  // allocators round every allocation up to a power of two, which host
  // mirrors of a KV cache cannot afford. The engine of `device` does it.
  m.def("_host_register(Tensor buffer, Device device, bool pin) -> ()");

  // What the engine of `device` found on it, as "name=value" lines: the
  // batch copy API, the capture query, in-place pinning. Read by
  // `python -m torch_kvswap`. Not for direct use.
  m.def("_engine_report(Device device) -> str[]");

  // The device types an engine serves now ("cpu", "cuda", "npu"); the
  // loader's torch_kvswap._loader.engine_for reads it. Not for direct use.
  m.def("_engines() -> str[]");

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
}
