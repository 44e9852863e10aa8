// expand_block_ids: host block ids to device sub-block ids.
#include <c10/util/irange.h>
#include <torch/library.h>

#include "core.h"

namespace kvswap {
namespace core {

namespace {

at::Tensor expand_block_ids(const at::Tensor& block_ids, int64_t factor, int64_t skip_count) {
  TORCH_CHECK_TYPE(block_ids.scalar_type() == at::kLong, "block_ids must be int64, got ",
                   block_ids.scalar_type());
  TORCH_CHECK_VALUE(block_ids.dim() == 1, "block_ids must be 1-D, got shape ", block_ids.sizes());
  TORCH_CHECK_VALUE(factor >= 1, "block_size_factor must be >= 1, got ", factor);
  TORCH_CHECK_VALUE(skip_count >= 0 && skip_count < factor, "skip_count must be in [0, ",
                    "block_size_factor) = [0, ", factor, "), got ", skip_count);
  const int64_t n = block_ids.numel();
  TORCH_CHECK_VALUE(n <= kInt64Max / factor, "block_ids has ", n,
                    " entries; times block_size_factor ", factor, " overflows int64");
  const int64_t out_len = n == 0 ? 0 : n * factor - skip_count;
  // The largest id whose last sub-block b*f + f-1 still fits in int64.
  const int64_t max_id = (kInt64Max - (factor - 1)) / factor;

  if (!block_ids.device().is_cpu()) {
    // Accelerator tensors: the same arithmetic with ATen ops; the checks read
    // the ids back to the host (a synchronizing copy).
    if (n > 0) {
      const int64_t lo = block_ids.min().item<int64_t>();
      const int64_t hi = block_ids.max().item<int64_t>();
      TORCH_CHECK_VALUE(lo >= 0, "block_ids contains ", lo, "; block ids must be >= 0");
      TORCH_CHECK_VALUE(hi <= max_id, "block_ids contains ", hi, "; times block_size_factor ",
                        factor, " overflows int64");
    }
    auto offsets = at::arange(factor, block_ids.options());
    auto all = (block_ids.unsqueeze(1) * factor + offsets.unsqueeze(0)).reshape({-1});
    return all.narrow(0, n == 0 ? 0 : skip_count, out_len).contiguous();
  }

  auto out = at::empty({out_len}, block_ids.options());
  int64_t* o = out.data_ptr<int64_t>();
  const auto accessor = block_ids.accessor<int64_t, 1>();  // any stride
  int64_t k = 0;
  for (const auto j : c10::irange(n)) {
    const int64_t b = accessor[j];
    TORCH_CHECK_VALUE(b >= 0, "block_ids[", j, "] is ", b, "; block ids must be >= 0");
    TORCH_CHECK_VALUE(b <= max_id, "block_ids[", j, "] = ", b, " times block_size_factor ",
                      factor, " overflows int64");
    const int64_t first = (j == 0) ? skip_count : 0;
    for (int64_t f = first; f < factor; ++f) {
      o[k++] = b * factor + f;
    }
  }
  return out;
}

}  // namespace

}  // namespace core
}  // namespace kvswap

TORCH_LIBRARY_IMPL(kvswap, CPU, m) { m.impl("expand_block_ids", &kvswap::core::expand_block_ids); }
TORCH_LIBRARY_IMPL(kvswap, CUDA, m) { m.impl("expand_block_ids", &kvswap::core::expand_block_ids); }
TORCH_LIBRARY_IMPL(kvswap, PrivateUse1, m) { m.impl("expand_block_ids", &kvswap::core::expand_block_ids); }
