// What the core exports for the test extension (tests/fake_cuda/
// test_extension.cpp), and nothing else uses: internals that tests read,
// through kvswap_core_test_hooks (the test extension links the core). No op of the
// `kvswap` namespace serves them, so a release build's ops are the public
// ones and those its Python calls; the test extension declares them as
// `kvswap_test` ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace kvswap {

struct CoreTestHooks {
  uint32_t version;  // kEngineInterfaceVersion (kvswap.h)
  // "side:label" of every region of checked mode's table that holds bytes,
  // in address order.
  std::vector<std::string> (*region_labels)();
  // Region entries the table has visited since the process started
  // (registering, dropping, checking): linear in the regions.
  int64_t (*region_table_work)();
  // How the host engine would copy a batch of `total_bytes` bytes from this
  // thread now: the copy routine (after KVSWAP_HOST_COPY and the CPU's
  // features) and how many parts the bytes are split into for torch's
  // intra-op threads (1: the calling thread alone).
  std::tuple<std::string, int64_t> (*host_copy_plan)(int64_t total_bytes);
  // Dry run of swap_blocks_batch: validates exactly as the op does and
  // returns the merged descriptors it would submit, copying nothing.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> (*plan_swap_blocks_batch)(const at::Tensor& src_ptrs,
                                                                           const at::Tensor& dst_ptrs,
                                                                           const at::Tensor& sizes,
                                                                           int64_t direction);
  // expand_block_ids' accelerator path (ATen tensor ops), on any device.
  at::Tensor (*expand_with_tensor_ops)(const at::Tensor& block_ids, int64_t factor, int64_t skip_count);
};

namespace core {
extern const CoreTestHooks kTestHooks;  // registration_core.cpp
}  // namespace core

}  // namespace kvswap

// The hooks above; exported by the core's library (registration_core.cpp).
extern "C" __attribute__((visibility("default"))) const kvswap::CoreTestHooks* kvswap_core_test_hooks();
