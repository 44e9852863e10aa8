// Validation: every check that a call's tensors and ids must pass before
// any descriptor is built. Errors name the argument, the index and the
// tensor; nothing is copied unless every check passed.
#include <c10/util/irange.h>

#include <algorithm>

#include "core.h"

namespace kvswap {
namespace core {

void check_descriptor_tensor(const at::Tensor& t, const char* name, int64_t expected_len) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, name, " must be 1-D, got ", t.dim(), "-D with shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK_VALUE(t.numel() == expected_len, name, " has ", t.numel(), " entries but src_ptrs has ",
                    expected_len, "; the three descriptor tensors must have the same length");
}

namespace {

// Bytes per block of `t` (a cache whose dim 0 indexes blocks) after checking
// that each block is one contiguous run of memory.
int64_t block_bytes_of(const at::Tensor& t, const char* list, size_t i) {
  TORCH_CHECK_VALUE(t.dim() >= 1, list, "[", i, "] must have a block dimension (dim 0), got a ",
                    "0-d tensor");
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK_VALUE(t.size(d) == 1 || t.stride(d) == expected, list, "[", i,
                      "]: each block must be contiguous in memory, but dim ", d, " of shape ", t.sizes(),
                      " has stride ", t.stride(d), " (expected ", expected, ")");
    expected *= t.size(d);
  }
  return expected * static_cast<int64_t>(t.element_size());
}

}  // namespace

std::optional<c10::Device> common_device(at::TensorList caches, const char* list) {
  std::optional<c10::Device> device;
  for (const auto i : c10::irange(caches.size())) {
    const auto d = caches[i].device();
    if (!device.has_value()) {
      device = d;
    } else {
      TORCH_CHECK_VALUE(d == *device, list, "[", i, "] is on ", d, " but ", list, "[0] is on ", *device,
                        "; all tensors of one list share a device");
    }
  }
  return device;
}

std::vector<PairLayout> layout_pairs(at::TensorList src_caches, at::TensorList dst_caches) {
  TORCH_CHECK_VALUE(src_caches.size() == dst_caches.size(), "src_caches has ", src_caches.size(),
                    " tensors but dst_caches has ", dst_caches.size(), "; they are matched pairwise");
  std::vector<PairLayout> pairs;
  pairs.reserve(src_caches.size());
  for (const auto i : c10::irange(src_caches.size())) {
    const auto& s = src_caches[i];
    const auto& d = dst_caches[i];
    TORCH_CHECK_TYPE(s.scalar_type() == d.scalar_type(), "src_caches[", i, "] is ", s.scalar_type(),
                     " but dst_caches[", i, "] is ", d.scalar_type());
    const int64_t sb = block_bytes_of(s, "src_caches", i);
    const int64_t db = block_bytes_of(d, "dst_caches", i);
    TORCH_CHECK_VALUE(sb == db, "src_caches[", i, "] has ", sb, " bytes per block (shape ", s.sizes(),
                      ") but dst_caches[", i, "] has ", db, " (shape ", d.sizes(), ")");
    const int64_t es = static_cast<int64_t>(s.element_size());
    const int64_t dstride = d.stride(0) * es;
    TORCH_CHECK_VALUE(d.size(0) <= 1 || db == 0 || dstride >= db, "dst_caches[", i,
                      "]: blocks overlap in memory (stride of dim 0 is ", d.stride(0), " elements for ", db,
                      "-byte blocks); a destination needs distinct blocks");
    pairs.push_back(
        PairLayout{CacheLayout{reinterpret_cast<int64_t>(s.const_data_ptr()), s.stride(0) * es, s.size(0)},
                   CacheLayout{reinterpret_cast<int64_t>(d.const_data_ptr()), dstride, d.size(0)}, sb});
  }
  return pairs;
}

namespace {

void check_pinned(at::TensorList caches, const char* list, const EngineInterface& engine,
                  c10::Device device) {
  for (const auto i : c10::irange(caches.size())) {
    const auto& t = caches[i];
    if (!t.device().is_cpu() || t.numel() == 0) continue;
    TORCH_CHECK_VALUE(engine.host_pinned(t, device), list, "[", i,
                      "] is in pageable host memory, but copies between the host and ", device,
                      " need page-locked (pinned) host memory: CANN copies pageable memory "
                      "synchronously, refuses it under graph capture, and up to CANN 8.0 corrupts "
                      "it silently. Allocate it with pin_memory=True (or call .pin_memory()), or "
                      "pin a 4 KiB-aligned buffer in place with "
                      "torch.ops.kvswap._host_register(buffer, device, True)");
  }
}

}  // namespace

void check_host_caches_pinned(at::TensorList src_caches, at::TensorList dst_caches, c10::Device device) {
  const EngineInterface& engine = engine_for(device, "to copy");
  if (engine.host_pinned == nullptr) return;  // the engine copies pageable memory as well
  check_pinned(src_caches, "src_caches", engine, device);
  check_pinned(dst_caches, "dst_caches", engine, device);
}

void check_ids_tensor(const at::Tensor& ids, const char* name) {
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong, name, " must be int64, got ", ids.scalar_type());
  TORCH_CHECK_VALUE(ids.dim() == 1, name, " must be 1-D, got shape ", ids.sizes());
}

namespace {

// Range of a cache's bytes, for the aliasing check.
bool ranges_overlap(const CacheLayout& a, const CacheLayout& b, int64_t block_bytes) {
  if (a.num_blocks == 0 || b.num_blocks == 0 || block_bytes == 0) {
    return false;
  }
  const int64_t a_end = a.base + (a.num_blocks - 1) * a.stride + block_bytes;
  const int64_t b_end = b.base + (b.num_blocks - 1) * b.stride + block_bytes;
  return a.base < b_end && b.base < a_end;
}

}  // namespace

// Every id in range for every tensor it indexes, no destination block written
// twice, no block both read and written when a pair shares memory, and no
// pair writing what another pair reads or writes.
void check_block_ids(const int64_t* sid, const int64_t* did, int64_t n,
                     const std::vector<PairLayout>& pairs) {
  if (n == 0 || pairs.empty()) {
    return;
  }
  int64_t src_limit = kInt64Max, dst_limit = kInt64Max;
  for (const auto& p : pairs) {
    src_limit = std::min(src_limit, p.src.num_blocks);
    dst_limit = std::min(dst_limit, p.dst.num_blocks);
  }
  auto report_range = [&](const int64_t* ids, int64_t j, bool is_src) {
    const char* name = is_src ? "src_block_ids" : "dst_block_ids";
    const char* list = is_src ? "src_caches" : "dst_caches";
    for (const auto i : c10::irange(pairs.size())) {
      const int64_t blocks = is_src ? pairs[i].src.num_blocks : pairs[i].dst.num_blocks;
      TORCH_CHECK_INDEX(ids[j] >= 0 && ids[j] < blocks, name, "[", j, "] = ", ids[j], " is out of range for ",
                        list, "[", i, "], which has ", blocks, " blocks (valid ids: 0..", blocks - 1, ")");
    }
  };
  for (const auto j : c10::irange(n)) {
    // Unsigned compare folds the negative check into the range check.
    if (static_cast<uint64_t>(sid[j]) >= static_cast<uint64_t>(src_limit)) {
      report_range(sid, j, true);
    }
    if (static_cast<uint64_t>(did[j]) >= static_cast<uint64_t>(dst_limit)) {
      report_range(did, j, false);
    }
  }
  // One bit per destination block: a block written twice would race.
  std::vector<uint64_t> written(static_cast<size_t>((dst_limit + 63) / 64), 0);
  for (const auto j : c10::irange(n)) {
    const uint64_t b = static_cast<uint64_t>(did[j]);
    const uint64_t bit = uint64_t{1} << (b & 63);
    if (written[b >> 6] & bit) {
      const int64_t first = std::find(did, did + j, did[j]) - did;
      TORCH_CHECK_VALUE(false, "dst_block_ids[", first, "] and dst_block_ids[", j, "] are both ", did[j],
                        "; each destination block may be written once "
                        "per call");
    }
    written[b >> 6] |= bit;
  }
  for (const auto i : c10::irange(pairs.size())) {
    const auto& p = pairs[i];
    if (!ranges_overlap(p.src, p.dst, p.block_bytes)) {
      continue;
    }
    TORCH_CHECK_VALUE(p.src.base == p.dst.base && p.src.stride == p.dst.stride, "src_caches[", i,
                      "] and dst_caches[", i, "] overlap in memory with different layouts");
    for (const auto j : c10::irange(n)) {
      const uint64_t b = static_cast<uint64_t>(sid[j]);
      TORCH_CHECK_VALUE(
          b >= static_cast<uint64_t>(dst_limit) || !(written[b >> 6] & (uint64_t{1} << (b & 63))),
          "src_block_ids[", j, "] = ", sid[j], " is also a destination block, and ", "src_caches[", i,
          "] and dst_caches[", i,
          "] are the same memory; a block "
          "may not be both read and written in one call");
    }
  }
  check_cross_pair_aliasing(sid, did, n, pairs);
}

}  // namespace core
}  // namespace kvswap
