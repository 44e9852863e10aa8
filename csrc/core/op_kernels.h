// The core's kernels of the `kvswap` ops, as csrc/core/registration_core.cpp
// registers them (the schemas are in csrc/registration.cpp). Each is defined
// in the file that owns its concern; nothing else calls them.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace kvswap {
namespace core {

// --- ops.cpp: the copy ops and their dry runs, the copy method --------------
void swap_blocks_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes,
                       int64_t direction);
std::tuple<at::Tensor, at::Tensor, at::Tensor> plan_swap_blocks_batch(const at::Tensor& src_ptrs,
                                                                      const at::Tensor& dst_ptrs,
                                                                      const at::Tensor& sizes,
                                                                      int64_t direction);
void swap_blocks(at::TensorList src_caches, at::TensorList dst_caches, const at::Tensor& src_block_ids,
                 const at::Tensor& dst_block_ids);
std::tuple<at::Tensor, at::Tensor, at::Tensor> plan_swap_blocks(at::TensorList src_caches,
                                                                at::TensorList dst_caches,
                                                                const at::Tensor& src_block_ids,
                                                                const at::Tensor& dst_block_ids);
void set_copy_method(c10::string_view method);
std::string get_copy_method();

// --- expand_block_ids.cpp ------------------------------------------------------
at::Tensor expand_block_ids(const at::Tensor& block_ids, int64_t factor, int64_t skip_count);
// The ATen path of expand_block_ids on any device (a test hook).
at::Tensor expand_with_tensor_ops(const at::Tensor& block_ids, int64_t factor, int64_t skip_count);

// --- engines.cpp: the queries the core routes to an engine ---------------------
void host_register(const at::Tensor& buffer, c10::Device device, bool pin);
std::vector<std::string> engine_report_op(c10::Device device);
std::vector<std::string> engines_op();

// --- checked.cpp: checked mode's switch and its region table -------------------
void set_checked_mode(bool on);
bool get_checked_mode();
int64_t register_region(const at::Tensor& region, c10::string_view side, c10::string_view label);
bool unregister_region(int64_t id);
std::vector<std::string> region_labels();
int64_t region_table_work();

}  // namespace core
}  // namespace kvswap
