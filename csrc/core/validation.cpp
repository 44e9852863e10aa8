// Validation: every check that a call's tensors and ids must pass before
// any descriptor is built. Errors name the argument, the index and the
// tensor; nothing is copied unless every check passed.
#include <c10/util/irange.h>

#include <algorithm>
#include <cctype>
#include <string>

#include "core.h"

namespace kvswap {
namespace core {

std::string dtype_name(c10::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return "torch.float32";
    case at::kDouble:
      return "torch.float64";
    case at::kHalf:
      return "torch.float16";
    case at::kInt:
      return "torch.int32";
    case at::kLong:
      return "torch.int64";
    case at::kShort:
      return "torch.int16";
    case at::kChar:
      return "torch.int8";
    case at::kByte:
      return "torch.uint8";
    case at::kComplexHalf:
      return "torch.complex32";
    case at::kComplexFloat:
      return "torch.complex64";
    case at::kComplexDouble:
      return "torch.complex128";
    default: {
      // The rest are named alike in both (BFloat16, Bool, Float8_e4m3fn,
      // UInt16, QInt8, ...), up to case.
      std::string name = c10::toString(type);
      std::transform(name.begin(), name.end(), name.begin(),
                     [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
      return "torch." + name;
    }
  }
}

void check_elements_in_storage(const at::Tensor& t, const char* name) {
  if (!t.has_storage() || t.numel() == 0) return;
  int64_t first = t.storage_offset(), last = t.storage_offset();
  for (const auto d : c10::irange(t.dim())) {
    (t.stride(d) < 0 ? first : last) += (t.size(d) - 1) * t.stride(d);
  }
  const int64_t es = static_cast<int64_t>(t.element_size());
  const int64_t bytes = static_cast<int64_t>(t.storage().nbytes());
  TORCH_CHECK(first >= 0 && (last + 1) * es <= bytes, name, " (shape ", t.sizes(), ", storage offset ",
              t.storage_offset(), ") needs bytes ", first * es, "..", (last + 1) * es - 1,
              " of its storage, out of bounds for storage of size ", bytes,
              ": the storage was resized or freed after the tensor was made (nothing was copied)");
}

void check_descriptor_tensor(const at::Tensor& t, const char* name, int64_t expected_len) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, name, " must be int64, got ", dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 1, name, " must be 1-D, got ", t.dim(), "-D with shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK_VALUE(t.numel() == expected_len, name, " has ", t.numel(), " entries but src_ptrs has ",
                    expected_len, "; the three descriptor tensors must have the same length");
  check_elements_in_storage(t, name);
}

namespace {

// Bytes per block of `t` (a cache whose dim 0 indexes blocks) after checking
// that each block is one contiguous run of memory.
int64_t block_bytes_of(const at::Tensor& t, const char* list, size_t i) {
  TORCH_CHECK_VALUE(t.dim() >= 1, list, "[", i, "] must have a block dimension (dim 0), got a ",
                    "0-d tensor");
  // A block without elements is contiguous whatever its strides say.
  for (int64_t d = 1; d < t.dim(); ++d) {
    if (t.size(d) == 0) return 0;
  }
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK_VALUE(t.size(d) == 1 || t.stride(d) == expected, list, "[", i,
                      "]: each block must be contiguous in memory, but dim ", d, " of shape ", t.sizes(),
                      " has stride ", t.stride(d), " (expected ", expected, ")");
    expected *= t.size(d);
  }
  return expected * static_cast<int64_t>(t.element_size());
}

// The layout of `t`'s blocks, and how many of its leading blocks lie within
// its storage as it is now. torch checks a view against its storage only when
// the view is made (setStorage); a storage resized or freed afterwards
// (untyped_storage().resize_) keeps the view's sizes, and copying a block past
// the storage's end would read or write memory the storage no longer owns.
CacheLayout layout_of(const at::Tensor& t, int64_t block_bytes) {
  const int64_t es = static_cast<int64_t>(t.element_size());
  const int64_t stride = t.stride(0) * es;
  const int64_t blocks = t.size(0);
  if (!t.has_storage()) {
    return {reinterpret_cast<int64_t>(t.const_data_ptr()), stride, blocks, blocks, 0, -1};
  }
  const auto& storage = t.storage();
  const int64_t bytes = static_cast<int64_t>(storage.nbytes());
  const int64_t begin = t.storage_offset() * es;
  int64_t fit = blocks;
  if (block_bytes > 0 && blocks > 0) {
    if (begin < 0 || begin > bytes - block_bytes) {
      fit = 0;  // block 0 is already past the end
    } else if (stride > 0) {
      fit = std::min(blocks, (bytes - block_bytes - begin) / stride + 1);
    } else if (stride < 0) {
      fit = std::min(blocks, begin / -stride + 1);
    }
  }
  // A freed storage has no data pointer; data_ptr() would refuse the tensor
  // before the ids say whether a block of it is read.
  const auto* data = static_cast<const char*>(storage.data());
  const int64_t base = data == nullptr ? 0 : reinterpret_cast<int64_t>(data + begin);
  return {base, stride, blocks, fit, begin, bytes};
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
    TORCH_CHECK_TYPE(s.scalar_type() == d.scalar_type(), "src_caches[", i, "] is ",
                     dtype_name(s.scalar_type()), " but dst_caches[", i, "] is ",
                     dtype_name(d.scalar_type()));
    const int64_t sb = block_bytes_of(s, "src_caches", i);
    const int64_t db = block_bytes_of(d, "dst_caches", i);
    TORCH_CHECK_VALUE(sb == db, "src_caches[", i, "] has ", sb, " bytes per block (shape ", s.sizes(),
                      ") but dst_caches[", i, "] has ", db, " (shape ", d.sizes(), ")");
    const int64_t es = static_cast<int64_t>(s.element_size());
    const int64_t dstride = d.stride(0) * es;
    TORCH_CHECK_VALUE(d.size(0) <= 1 || db == 0 || dstride >= db, "dst_caches[", i,
                      "]: blocks overlap in memory (stride of dim 0 is ", d.stride(0), " elements for ", db,
                      "-byte blocks); a destination needs distinct blocks");
    pairs.push_back(PairLayout{layout_of(s, sb), layout_of(d, db), sb});
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
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong, name, " must be int64, got ",
                   dtype_name(ids.scalar_type()));
  TORCH_CHECK_VALUE(ids.dim() == 1, name, " must be 1-D, got shape ", ids.sizes());
  check_elements_in_storage(ids, name);
}

namespace {

// `what` names the block ("src_block_ids[3] = 1000", "block 64").
[[noreturn]] void report_outside_storage(const CacheLayout& c, int64_t block_bytes, const char* list,
                                         size_t i, int64_t block, const std::string& what) {
  const int64_t first = c.storage_begin + block * c.stride;
  TORCH_CHECK(false, what, ": block ", block, " of ", list, "[", i, "] needs bytes ", first, "..",
              first + block_bytes - 1, " of its storage, out of bounds for storage of size ", c.storage_bytes,
              ": the storage was resized or freed after the tensor was made, and ", c.in_storage, " of the ",
              c.num_blocks, " blocks lie within it now");
}

}  // namespace

void check_all_blocks_in_storage(const std::vector<PairLayout>& pairs) {
  for (const auto i : c10::irange(pairs.size())) {
    const auto& p = pairs[i];
    if (p.src.in_storage < p.src.num_blocks) {
      report_outside_storage(p.src, p.block_bytes, "src_caches", i, p.src.in_storage,
                             "src_caches[" + std::to_string(i) + "]");
    }
    if (p.dst.in_storage < p.dst.num_blocks) {
      report_outside_storage(p.dst, p.block_bytes, "dst_caches", i, p.dst.in_storage,
                             "dst_caches[" + std::to_string(i) + "]");
    }
  }
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
  // A block past its storage's end is out of range too (layout_of).
  for (const auto& p : pairs) {
    src_limit = std::min(src_limit, p.src.in_storage);
    dst_limit = std::min(dst_limit, p.dst.in_storage);
  }
  auto report_range = [&](const int64_t* ids, int64_t j, bool is_src) {
    const char* name = is_src ? "src_block_ids" : "dst_block_ids";
    const char* list = is_src ? "src_caches" : "dst_caches";
    for (const auto i : c10::irange(pairs.size())) {
      const int64_t blocks = is_src ? pairs[i].src.num_blocks : pairs[i].dst.num_blocks;
      TORCH_CHECK_INDEX(ids[j] >= 0 && ids[j] < blocks, name, "[", j, "] = ", ids[j], " is out of range for ",
                        list, "[", i, "], which has ", blocks, " blocks (valid ids: 0..", blocks - 1, ")");
      const auto& c = is_src ? pairs[i].src : pairs[i].dst;
      if (ids[j] >= c.in_storage) {
        report_outside_storage(c, pairs[i].block_bytes, list, i, ids[j],
                               std::string(name) + "[" + std::to_string(j) + "] = " + std::to_string(ids[j]));
      }
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
    if (p.src.base != p.dst.base || p.src.stride != p.dst.stride) {
      check_pair_aliasing(sid, did, n, pairs, i);  // compares the blocks copied
      continue;
    }
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
