// expand_block_ids: host block ids to device sub-block ids.
#include <c10/util/irange.h>
#include "core.h"
#include "op_kernels.h"

namespace kvswap {
namespace core {

namespace {

struct ExpandShape {
  int64_t n;        // input ids
  int64_t out_len;  // n * factor - skip_count, 0 for no ids
  int64_t max_id;   // the largest id whose last sub-block b*f + f-1 fits in int64
};

// The checks that need no id values.
ExpandShape check_expand_args(const at::Tensor& block_ids, int64_t factor, int64_t skip_count) {
  TORCH_CHECK_TYPE(block_ids.scalar_type() == at::kLong, "block_ids must be int64, got ",
                   dtype_name(block_ids.scalar_type()));
  TORCH_CHECK_VALUE(block_ids.dim() == 1, "block_ids must be 1-D, got shape ", block_ids.sizes());
  check_elements_in_storage(block_ids, "block_ids");
  TORCH_CHECK_VALUE(factor >= 1, "block_size_factor must be >= 1, got ", factor);
  TORCH_CHECK_VALUE(skip_count >= 0 && skip_count < factor, "skip_count must be in [0, ",
                    "block_size_factor) = [0, ", factor, "), got ", skip_count);
  const int64_t n = block_ids.numel();
  TORCH_CHECK_VALUE(n <= kInt64Max / factor, "block_ids has ", n, " entries; times block_size_factor ",
                    factor, " overflows int64");
  return {n, n == 0 ? 0 : n * factor - skip_count, (kInt64Max - (factor - 1)) / factor};
}

}  // namespace

// The accelerator path: the same arithmetic with ATen ops, on the ids'
// device; the checks read the ids back to the host (a synchronizing copy).
// Also served on the CPU as `kvswap::_expand_block_ids_aten`, so that tests
// compare its values with the reference on any machine
// (tests/test_expand_block_ids.py).
at::Tensor expand_with_tensor_ops(const at::Tensor& block_ids, int64_t factor, int64_t skip_count) {
  const auto shape = check_expand_args(block_ids, factor, skip_count);
  if (shape.n == 0) {
    // As the CPU path: no ids, no sub-blocks, whatever the factor (arange(factor)
    // would allocate factor entries for nothing).
    return at::empty({0}, block_ids.options());
  }
  {
    const int64_t lo = block_ids.min().item<int64_t>();
    const int64_t hi = block_ids.max().item<int64_t>();
    TORCH_CHECK_VALUE(lo >= 0, "block_ids contains ", lo, "; block ids must be >= 0");
    TORCH_CHECK_VALUE(hi <= shape.max_id, "block_ids contains ", hi, "; times block_size_factor ", factor,
                      " overflows int64");
  }
  auto offsets = at::arange(factor, block_ids.options());
  auto all = (block_ids.unsqueeze(1) * factor + offsets.unsqueeze(0)).reshape({-1});
  return all.narrow(0, skip_count, shape.out_len).contiguous();
}

at::Tensor expand_block_ids(const at::Tensor& block_ids, int64_t factor, int64_t skip_count) {
  if (!block_ids.device().is_cpu()) {
    return expand_with_tensor_ops(block_ids, factor, skip_count);
  }
  const auto shape = check_expand_args(block_ids, factor, skip_count);
  auto out = at::empty({shape.out_len}, block_ids.options());
  int64_t* o = out.data_ptr<int64_t>();
  const auto accessor = block_ids.accessor<int64_t, 1>();  // any stride
  int64_t k = 0;
  for (const auto j : c10::irange(shape.n)) {
    const int64_t b = accessor[j];
    TORCH_CHECK_VALUE(b >= 0, "block_ids[", j, "] is ", b, "; block ids must be >= 0");
    TORCH_CHECK_VALUE(b <= shape.max_id, "block_ids[", j, "] = ", b, " times block_size_factor ", factor,
                      " overflows int64");
    const int64_t first = (j == 0) ? skip_count : 0;
    for (int64_t f = first; f < factor; ++f) {
      o[k++] = b * factor + f;
    }
  }
  return out;
}

}  // namespace core
}  // namespace kvswap
