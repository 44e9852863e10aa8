// The core of torch_kvswap: validation, descriptor building and merging, and
// the kernels of the public ops. Nothing here copies a byte; a validated
// CopyBatch is handed to the engine registered for the target device's
// dispatch key through `kvswap::_submit` (see kvswap.h).
#include <ATen/ATen.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <c10/util/llvmMathExtras.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <limits>
#include <optional>
#include <vector>

#include "kvswap.h"

namespace kvswap {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVSWAP_CLONE_FOR_AVX512 __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define KVSWAP_CLONE_FOR_AVX512
#endif

// ---------------------------------------------------------------------------
// Engines
// ---------------------------------------------------------------------------

c10::DispatchKey engine_key(c10::DeviceType type) {
  switch (type) {
    case c10::DeviceType::CPU:
      return c10::DispatchKey::CPU;
    case c10::DeviceType::CUDA:
      return c10::DispatchKey::CUDA;
    case c10::DeviceType::PrivateUse1:
      return c10::DispatchKey::PrivateUse1;
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, "kvswap has no engine for device type ", type,
                                  "; supported: cpu (host engine), cuda, and the PrivateUse1 "
                                  "backend (Ascend NPU)");
  }
}

const char* engine_hint(c10::DeviceType type) {
  switch (type) {
    case c10::DeviceType::CUDA:
      return "the CUDA engine (torch_kvswap._C_cuda) is not loaded; reinstall torch_kvswap "
             "with a CUDA toolkit present or KVSWAP_BUILD_CUDA=1";
    case c10::DeviceType::PrivateUse1:
      return "the Ascend engine (torch_kvswap._C_npu) is not loaded; install torch_npu and "
             "CANN, then reinstall torch_kvswap (or force it with KVSWAP_BUILD_NPU=1)";
    default:
      return "the host engine is not loaded; reinstall torch_kvswap";
  }
}

// The dispatch key set that reaches `device`'s engine kernel of `op`, or a
// NotImplementedError saying which engine is missing and how to get it.
c10::DispatchKeySet engine_for(const c10::OperatorHandle& op, c10::Device device,
                               const char* purpose) {
  const auto key = engine_key(device.type());
  TORCH_CHECK_NOT_IMPLEMENTED(op.hasKernelForDispatchKey(key), "kvswap: no engine for ", device,
                              " ", purpose, ": ", engine_hint(device.type()));
  return c10::DispatchKeySet(key);
}

// Descriptor tables are recycled: a table is taken from this pool and goes
// back when its last reference drops (the engine holds one until the copy no
// longer needs it). Reuse keeps the hot path free of fresh page faults, which
// cost more than building the descriptors, and of per-call allocations while
// a stream is captured into a graph.
class TablePool {
 public:
  static TablePool& instance() {
    static TablePool* pool = new TablePool();  // process lifetime; deleters may run late
    return *pool;
  }

  at::Tensor acquire(int64_t capacity) {
    // Round up so nearby sizes share buffers.
    const size_t want = std::max<size_t>(4096, c10::llvm::PowerOf2Ceil(static_cast<uint64_t>(capacity)));
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(want);
      if (it != free_.end() && !it->second.empty()) {
        data = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= bytes_for(want);
      }
    }
    if (data == nullptr) {
      data = std::aligned_alloc(64, bytes_for(want));
      TORCH_CHECK(data != nullptr, "kvswap: out of host memory for ", capacity, " descriptors");
    }
    return at::from_blob(
        data, {3, capacity}, [this, want](void* p) { release(p, want); },
        at::TensorOptions().dtype(at::kLong));
  }

 private:
  static size_t bytes_for(size_t entries) { return 3 * entries * sizeof(int64_t); }

  void release(void* p, size_t entries) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_bytes_ + bytes_for(entries) <= kMaxCachedBytes) {
        free_[entries].push_back(p);
        cached_bytes_ += bytes_for(entries);
        return;
      }
    }
    std::free(p);
  }

  static constexpr size_t kMaxCachedBytes = size_t{256} << 20;
  std::mutex mutex_;
  std::map<size_t, std::vector<void*>> free_;
  size_t cached_bytes_ = 0;
};

// Descriptors in the layout `_submit` takes: one [3, n] int64 CPU tensor whose
// rows are the source addresses, destination addresses and byte counts.
struct Descriptors {
  at::Tensor table;
  int64_t count = 0;
  int64_t total_bytes = 0;

  explicit Descriptors(int64_t capacity)
      : table(TablePool::instance().acquire(capacity)),
        src_(table.data_ptr<int64_t>()),
        dst_(src_ + table.size(1)),
        size_(dst_ + table.size(1)) {}
  int64_t* src() { return src_; }
  int64_t* dst() { return dst_; }
  int64_t* size() { return size_; }

  // Appends one copy, merged into the last one when both of its sides
  // continue that one's. Does not touch total_bytes.
  void append(int64_t s, int64_t d, int64_t bytes) {
    if (count > 0 && src_[count - 1] + size_[count - 1] == s &&
        dst_[count - 1] + size_[count - 1] == d) {
      size_[count - 1] += bytes;
      return;
    }
    src_[count] = s;
    dst_[count] = d;
    size_[count] = bytes;
    ++count;
  }

  // The used part of each row; views, sharing the table's storage.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> rows() const {
    auto used = table.narrow(1, 0, count);
    return {used[0], used[1], used[2]};
  }

 private:
  // Rows of `table` (data_ptr() checks dtype and storage on every call,
  // too slow for a per-descriptor loop).
  int64_t* src_;
  int64_t* dst_;
  int64_t* size_;
};

void submit(const Descriptors& d, Direction direction, c10::Device device) {
  if (d.count == 0) {
    return;  // nothing to copy: no engine is needed, no stream is touched
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvswap::_submit", "")
                             .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         int64_t, int64_t, c10::Device)>();
  auto [src, dst, size] = d.rows();
  op.redispatch(engine_for(op, device, "to copy"), src, dst, size, static_cast<int64_t>(direction),
                d.total_bytes, device);
}

// ---------------------------------------------------------------------------
// swap_blocks_batch: raw descriptors
// ---------------------------------------------------------------------------

void check_descriptor_tensor(const at::Tensor& t, const char* name, int64_t expected_len) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1, name, " must be 1-D, got ", t.dim(), "-D with shape ",
                    t.sizes());
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK_VALUE(t.numel() == expected_len, name, " has ", t.numel(),
                    " entries but src_ptrs has ", expected_len,
                    "; the three descriptor tensors must have the same length");
}

// Below this many bytes per descriptor on average, the pointer op keeps the
// caller's order on the host route: sorting then costs about what the
// ordered reads save (docs/performance.md, attempt 8).
constexpr int64_t kSortMinAverageBytes = 8192;

// For the host engine: reorders descriptors by source address, which reads
// scattered blocks faster (16 KiB blocks: +10 %), and merges the neighbours
// that the caller's order had split. The copies of one call have no set
// order (docs/ops.md), so this changes no result.
Descriptors order_by_source(Descriptors d) {
  const int64_t n = d.count;
  if (n < 2 || d.total_bytes / n < kSortMinAverageBytes) {
    return d;
  }
  const int64_t* src = d.src();
  if (std::is_sorted(src, src + n)) {
    return d;
  }
  // Sort keys: source addresses relative to the lowest, in units of their
  // common power-of-two alignment, packed above the descriptor's index.
  const uint64_t lowest = static_cast<uint64_t>(*std::min_element(src, src + n));
  uint64_t spread = 0;
  uint64_t highest = lowest;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t rel = static_cast<uint64_t>(src[i]) - lowest;
    spread |= rel;
    highest = std::max(highest, static_cast<uint64_t>(src[i]));
  }
  const int shift = spread == 0 ? 0 : __builtin_ctzll(spread);
  const uint64_t range = (highest - lowest) >> shift;
  std::vector<uint64_t> order(static_cast<size_t>(n));
  if (range <= 0xffffffffu && n <= 0xffffffff) {
    // A least-significant-digit radix sort of the key (at most 32 bits), in
    // as few counting passes of at most 16 bits as the key's width allows.
    const int bits = range == 0 ? 1 : 64 - __builtin_clzll(range);
    const int passes = (bits + 15) / 16;
    const int width = (bits + passes - 1) / passes;
    const uint64_t mask = (uint64_t{1} << width) - 1;
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t key = (static_cast<uint64_t>(src[i]) - lowest) >> shift;
      order[static_cast<size_t>(i)] = (key << 32) | static_cast<uint64_t>(i);
    }
    std::vector<uint64_t> scratch(static_cast<size_t>(n));
    std::vector<uint32_t> start((size_t{1} << width) + 1);
    for (int pass = 0; pass < passes; ++pass) {
      const int digit = 32 + pass * width;
      std::fill(start.begin(), start.end(), 0u);
      for (const uint64_t v : order) ++start[((v >> digit) & mask) + 1];
      for (size_t b = 1; b < start.size(); ++b) start[b] += start[b - 1];
      for (const uint64_t v : order) scratch[start[(v >> digit) & mask]++] = v;
      order.swap(scratch);
    }
    for (uint64_t& v : order) v &= 0xffffffffu;  // keep the indices
  } else {
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(i)] = static_cast<uint64_t>(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](uint64_t a, uint64_t b) { return src[a] < src[b]; });
  }
  Descriptors out(n);
  const int64_t* dst = d.dst();
  const int64_t* size = d.size();
  for (const uint64_t i : order) {
    out.append(src[i], dst[i], size[i]);
  }
  out.total_bytes = d.total_bytes;
  return out;
}

// Validates every descriptor before anything is copied, drops zero-byte ones
// and merges neighbours whose source and destination both continue each
// other. For the host engine it then orders them by source address.
Descriptors plan_pointer_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                               const at::Tensor& sizes, int64_t direction, c10::Device device) {
  checked_direction(direction);
  check_descriptor_tensor(src_ptrs, "src_ptrs", src_ptrs.dim() == 1 ? src_ptrs.numel() : -1);
  check_descriptor_tensor(dst_ptrs, "dst_ptrs", src_ptrs.numel());
  check_descriptor_tensor(sizes, "sizes", src_ptrs.numel());

  const auto src_c = src_ptrs.contiguous();
  const auto dst_c = dst_ptrs.contiguous();
  const auto size_c = sizes.contiguous();
  const int64_t* src = src_c.const_data_ptr<int64_t>();
  const int64_t* dst = dst_c.const_data_ptr<int64_t>();
  const int64_t* size = size_c.const_data_ptr<int64_t>();
  const int64_t n = src_ptrs.numel();

  Descriptors out(n);
  int64_t total = 0;
  for (const auto i : c10::irange(n)) {
    const int64_t bytes = size[i];
    if (bytes == 0) {
      continue;
    }
    TORCH_CHECK_VALUE(bytes > 0, "sizes[", i, "] is ", bytes, "; byte counts must be >= 0");
    const uint64_t s = static_cast<uint64_t>(src[i]);
    const uint64_t d = static_cast<uint64_t>(dst[i]);
    TORCH_CHECK_VALUE(s != 0, "src_ptrs[", i, "] is null with sizes[", i, "] = ", bytes);
    TORCH_CHECK_VALUE(d != 0, "dst_ptrs[", i, "] is null with sizes[", i, "] = ", bytes);
    const uint64_t b = static_cast<uint64_t>(bytes);
    TORCH_CHECK_VALUE(s + b > s, "src_ptrs[", i, "] + sizes[", i, "] overflows the address space");
    TORCH_CHECK_VALUE(d + b > d, "dst_ptrs[", i, "] + sizes[", i, "] overflows the address space");
    // Only meaningful when both addresses are in one address space, but a
    // copy onto itself is a caller bug in every direction.
    TORCH_CHECK_VALUE(s + b <= d || d + b <= s, "descriptor ", i, ": source [", src[i], ", +",
                      bytes, ") and destination [", dst[i], ", +", bytes, ") overlap");
    TORCH_CHECK_VALUE(total <= kInt64Max - bytes, "sizes: total byte count overflows int64 at index ", i);
    total += bytes;
    out.append(src[i], dst[i], bytes);
  }
  out.total_bytes = total;
  if (device.is_cpu()) {
    return order_by_source(std::move(out));
  }
  return out;
}

// The device the pointer op's copies are issued on: the current accelerator,
// or the host when there is none.
c10::Device pointer_op_device() {
  const auto accelerator = at::getAccelerator(/*checked=*/false);
  if (!accelerator.has_value()) {
    return c10::Device(c10::DeviceType::CPU);
  }
  // The accelerator's current device (at::accelerator::getDeviceIndex()
  // does the same, but torch 2.6 lacks it).
  return c10::impl::getDeviceGuardImpl(*accelerator)->getDevice();
}

void swap_blocks_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                       const at::Tensor& sizes, int64_t direction) {
  const auto device = pointer_op_device();
  const auto plan = plan_pointer_batch(src_ptrs, dst_ptrs, sizes, direction, device);
  if (plan.count == 0) {
    return;
  }
  submit(plan, static_cast<Direction>(direction), device);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> plan_swap_blocks_batch(const at::Tensor& src_ptrs,
                                                                      const at::Tensor& dst_ptrs,
                                                                      const at::Tensor& sizes,
                                                                      int64_t direction) {
  auto [s, d, z] = plan_pointer_batch(src_ptrs, dst_ptrs, sizes, direction, pointer_op_device()).rows();
  return {s.clone(), d.clone(), z.clone()};
}

// ---------------------------------------------------------------------------
// swap_blocks: tensor form
// ---------------------------------------------------------------------------

// Where the blocks of one cache tensor live: block b starts at
// base + b * stride and spans the pair's block_bytes.
struct CacheLayout {
  int64_t base;
  int64_t stride;
  int64_t num_blocks;
};

struct PairLayout {
  CacheLayout src;
  CacheLayout dst;
  int64_t block_bytes;
};

// Bytes per block of `t` (a cache whose dim 0 indexes blocks) after checking
// that each block is one contiguous run of memory.
int64_t block_bytes_of(const at::Tensor& t, const char* list, size_t i) {
  TORCH_CHECK_VALUE(t.dim() >= 1, list, "[", i, "] must have a block dimension (dim 0), got a ",
                    "0-d tensor");
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK_VALUE(t.size(d) == 1 || t.stride(d) == expected, list, "[", i,
                      "]: each block must be contiguous in memory, but dim ", d, " of shape ",
                      t.sizes(), " has stride ", t.stride(d), " (expected ", expected, ")");
    expected *= t.size(d);
  }
  return expected * static_cast<int64_t>(t.element_size());
}

std::optional<c10::Device> common_device(at::TensorList caches, const char* list) {
  std::optional<c10::Device> device;
  for (const auto i : c10::irange(caches.size())) {
    const auto d = caches[i].device();
    if (!device.has_value()) {
      device = d;
    } else {
      TORCH_CHECK_VALUE(d == *device, list, "[", i, "] is on ", d, " but ", list,
                        "[0] is on ", *device, "; all tensors of one list share a device");
    }
  }
  return device;
}

std::vector<PairLayout> layout_pairs(at::TensorList src_caches, at::TensorList dst_caches) {
  TORCH_CHECK_VALUE(src_caches.size() == dst_caches.size(), "src_caches has ",
                    src_caches.size(), " tensors but dst_caches has ", dst_caches.size(),
                    "; they are matched pairwise");
  std::vector<PairLayout> pairs;
  pairs.reserve(src_caches.size());
  for (const auto i : c10::irange(src_caches.size())) {
    const auto& s = src_caches[i];
    const auto& d = dst_caches[i];
    TORCH_CHECK_TYPE(s.scalar_type() == d.scalar_type(), "src_caches[", i, "] is ",
                     s.scalar_type(), " but dst_caches[", i, "] is ", d.scalar_type());
    const int64_t sb = block_bytes_of(s, "src_caches", i);
    const int64_t db = block_bytes_of(d, "dst_caches", i);
    TORCH_CHECK_VALUE(sb == db, "src_caches[", i, "] has ", sb, " bytes per block (shape ",
                      s.sizes(), ") but dst_caches[", i, "] has ", db, " (shape ", d.sizes(), ")");
    const int64_t es = static_cast<int64_t>(s.element_size());
    const int64_t dstride = d.stride(0) * es;
    TORCH_CHECK_VALUE(d.size(0) <= 1 || db == 0 || dstride >= db, "dst_caches[", i,
                      "]: blocks overlap in memory (stride of dim 0 is ", d.stride(0),
                      " elements for ", db, "-byte blocks); a destination needs distinct blocks");
    pairs.push_back(PairLayout{
        CacheLayout{reinterpret_cast<int64_t>(s.const_data_ptr()), s.stride(0) * es, s.size(0)},
        CacheLayout{reinterpret_cast<int64_t>(d.const_data_ptr()), dstride, d.size(0)},
        sb});
  }
  return pairs;
}

void check_ids_tensor(const at::Tensor& ids, const char* name) {
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kLong, name, " must be int64, got ",
                   ids.scalar_type());
  TORCH_CHECK_VALUE(ids.dim() == 1, name, " must be 1-D, got shape ", ids.sizes());
}

// Range of a cache's bytes, for the aliasing check.
bool ranges_overlap(const CacheLayout& a, const CacheLayout& b, int64_t block_bytes) {
  if (a.num_blocks == 0 || b.num_blocks == 0 || block_bytes == 0) {
    return false;
  }
  const int64_t a_end = a.base + (a.num_blocks - 1) * a.stride + block_bytes;
  const int64_t b_end = b.base + (b.num_blocks - 1) * b.stride + block_bytes;
  return a.base < b_end && b.base < a_end;
}

// Every id in range for every tensor it indexes, no destination block written
// twice, and no block both read and written when a pair shares memory.
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
      TORCH_CHECK_INDEX(ids[j] >= 0 && ids[j] < blocks, name, "[", j, "] = ", ids[j],
                        " is out of range for ", list, "[", i, "], which has ", blocks,
                        " blocks (valid ids: 0..", blocks - 1, ")");
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
      TORCH_CHECK_VALUE(false, "dst_block_ids[", first, "] and dst_block_ids[", j,
                        "] are both ", did[j], "; each destination block may be written once "
                        "per call");
    }
    written[b >> 6] |= bit;
  }
  for (const auto i : c10::irange(pairs.size())) {
    const auto& p = pairs[i];
    if (!ranges_overlap(p.src, p.dst, p.block_bytes)) {
      continue;
    }
    TORCH_CHECK_VALUE(p.src.base == p.dst.base && p.src.stride == p.dst.stride, "src_caches[",
                      i, "] and dst_caches[", i, "] overlap in memory with different layouts");
    for (const auto j : c10::irange(n)) {
      const uint64_t b = static_cast<uint64_t>(sid[j]);
      TORCH_CHECK_VALUE(b >= static_cast<uint64_t>(dst_limit) ||
                            !(written[b >> 6] & (uint64_t{1} << (b & 63))),
                        "src_block_ids[", j, "] = ", sid[j], " is also a destination block, and ",
                        "src_caches[", i, "] and dst_caches[", i, "] are the same memory; a block "
                        "may not be both read and written in one call");
    }
  }
}

// The hot loop of descriptor building, kept free of aliasing doubts (every
// input is a local, the outputs are restrict) so the compiler keeps the
// bases and strides in registers and vectorizes; the x86-64-v4 clone (AVX-512,
// with 64-bit vector multiplies) is picked at load time where the CPU has it
// and halves the cost per descriptor.
KVSWAP_CLONE_FOR_AVX512 void emit_per_block(int64_t* __restrict s, int64_t* __restrict d, int64_t* __restrict z,
                    const int64_t* __restrict sid, const int64_t* __restrict did, int64_t n,
                    int64_t src_base, int64_t src_stride, int64_t dst_base, int64_t dst_stride,
                    int64_t block_bytes) {
  for (int64_t j = 0; j < n; ++j) {
    s[j] = src_base + sid[j] * src_stride;
    d[j] = dst_base + did[j] * dst_stride;
    z[j] = block_bytes;
  }
}

// Builds the descriptors of a block copy. Ids are grouped once into runs
// where both the source and the destination id advance by one; a cache pair
// whose blocks are densely packed on both sides gets one descriptor per run,
// any other pair one per block.
Descriptors build_block_descriptors(const std::vector<PairLayout>& pairs, const int64_t* sid,
                                    const int64_t* did, int64_t n) {
  std::vector<int64_t> run_start;  // index j where each run begins
  run_start.reserve(static_cast<size_t>(n) + 1);
  for (const auto j : c10::irange(n)) {
    if (j == 0 || sid[j] != sid[j - 1] + 1 || did[j] != did[j - 1] + 1) {
      run_start.push_back(j);
    }
  }
  const int64_t runs = static_cast<int64_t>(run_start.size());
  run_start.push_back(n);

  // Each pair's descriptors go to their own slice of the table.
  std::vector<int64_t> start(pairs.size() + 1, 0);
  for (const auto i : c10::irange(pairs.size())) {
    const auto& p = pairs[i];
    const bool dense = p.src.stride == p.block_bytes && p.dst.stride == p.block_bytes;
    start[i + 1] = start[i] + (p.block_bytes == 0 ? 0 : dense ? runs : n);
  }
  Descriptors out(start.back());
  int64_t* osrc = out.src();
  int64_t* odst = out.dst();
  int64_t* osize = out.size();
  auto emit = [&](int64_t i) {
    const auto& p = pairs[static_cast<size_t>(i)];
    const int64_t bb = p.block_bytes;
    int64_t* s = osrc + start[i];
    int64_t* d = odst + start[i];
    int64_t* z = osize + start[i];
    if (start[i + 1] - start[i] == n) {  // one descriptor per block
      emit_per_block(s, d, z, sid, did, n, p.src.base, p.src.stride, p.dst.base, p.dst.stride, bb);
    } else {  // dense on both sides: one descriptor per run
      for (const auto r : c10::irange(start[i + 1] - start[i])) {
        const int64_t j = run_start[r];
        s[r] = p.src.base + sid[j] * bb;
        d[r] = p.dst.base + did[j] * bb;
        z[r] = (run_start[r + 1] - j) * bb;
      }
    }
  };
  // One thread: splitting the pairs over the intra-op pool measured no faster
  // (the loop is bound by writing the table), so it is not done.
  for (const auto i : c10::irange(static_cast<int64_t>(pairs.size()))) emit(i);
  int64_t total = 0;
  for (const auto& p : pairs) total += n * p.block_bytes;
  out.count = start.back();
  out.total_bytes = total;
  return out;
}

// Where a block copy runs, after the checks that need no id values: the
// cache pairs' layouts, the device whose engine copies, and the direction.
struct BlockCopyRoute {
  std::vector<PairLayout> pairs;
  Direction direction;
  c10::Device device;
};

BlockCopyRoute route_block_copy(at::TensorList src_caches, at::TensorList dst_caches,
                                const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids) {
  check_ids_tensor(src_block_ids, "src_block_ids");
  check_ids_tensor(dst_block_ids, "dst_block_ids");
  TORCH_CHECK_VALUE(src_block_ids.numel() == dst_block_ids.numel(), "src_block_ids has ",
                    src_block_ids.numel(), " ids but dst_block_ids has ", dst_block_ids.numel(),
                    "; they are matched pairwise");
  auto pairs = layout_pairs(src_caches, dst_caches);
  const auto src_dev = common_device(src_caches, "src_caches").value_or(c10::Device("cpu"));
  const auto dst_dev = common_device(dst_caches, "dst_caches").value_or(c10::Device("cpu"));
  if (src_dev.is_cpu() && dst_dev.is_cpu()) {
    // The host engine; it does not look at the direction.
    return {std::move(pairs), Direction::kHostToDevice, src_dev};
  }
  if (src_dev.is_cpu()) return {std::move(pairs), Direction::kHostToDevice, dst_dev};
  if (dst_dev.is_cpu()) return {std::move(pairs), Direction::kDeviceToHost, src_dev};
  TORCH_CHECK_VALUE(src_dev == dst_dev, "src_caches are on ", src_dev, " but dst_caches are on ",
                    dst_dev, "; copies between two accelerators are not supported");
  return {std::move(pairs), Direction::kDeviceToDevice, src_dev};
}

// The (src, dst) id pairs ordered by source id, as one array: the sorted
// source ids, then the matching destination ids. A counting sort when the
// ids are dense enough (the usual case: ids index a cache not much larger
// than the batch), else a comparison sort. Ids are already range-checked.
std::vector<int64_t> sort_by_source(const int64_t* sid, const int64_t* did, int64_t n,
                                    const std::vector<PairLayout>& pairs) {
  int64_t limit = kInt64Max;
  for (const auto& p : pairs) limit = std::min(limit, p.src.num_blocks);
  std::vector<int64_t> out(static_cast<size_t>(2 * n));
  int64_t* s = out.data();
  int64_t* d = s + n;
  if (limit <= 8 * n) {
    std::vector<int64_t> start(static_cast<size_t>(limit) + 1, 0);
    for (int64_t j = 0; j < n; ++j) ++start[static_cast<size_t>(sid[j]) + 1];
    for (int64_t b = 0; b < limit; ++b) start[static_cast<size_t>(b) + 1] += start[static_cast<size_t>(b)];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = start[static_cast<size_t>(sid[j])]++;
      s[at] = sid[j];
      d[at] = did[j];
    }
    return out;
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) order[static_cast<size_t>(j)] = j;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return sid[a] < sid[b]; });
  for (int64_t j = 0; j < n; ++j) {
    s[j] = sid[order[static_cast<size_t>(j)]];
    d[j] = did[order[static_cast<size_t>(j)]];
  }
  return out;
}

// Checks the id values and builds the descriptors. Ids are read on the host;
// ids on an accelerator are brought over (a synchronizing copy).
Descriptors describe_block_copy(const BlockCopyRoute& route, const at::Tensor& src_block_ids,
                                const at::Tensor& dst_block_ids) {
  const auto sid_t = src_block_ids.to(at::kCPU).contiguous();
  const auto did_t = dst_block_ids.to(at::kCPU).contiguous();
  const int64_t* sid = sid_t.const_data_ptr<int64_t>();
  const int64_t* did = did_t.const_data_ptr<int64_t>();
  const int64_t n = sid_t.numel();
  check_block_ids(sid, did, n, route.pairs);
  if (route.device.is_cpu() && n > 1 && !std::is_sorted(sid, sid + n)) {
    // The host engine reads scattered blocks much faster in address order
    // (2 KiB blocks: 0.69 -> 0.76 of a contiguous copy; docs/performance.md).
    // The copies are independent, so their order is free to choose.
    const auto sorted = sort_by_source(sid, did, n, route.pairs);
    return build_block_descriptors(route.pairs, sorted.data(), sorted.data() + n, n);
  }
  return build_block_descriptors(route.pairs, sid, did, n);
}

// ---------------------------------------------------------------------------
// Copy method: DMA descriptors or an engine's copy kernel
// ---------------------------------------------------------------------------

enum class CopyMethod : int { kAuto = 0, kDma = 1, kKernel = 2 };
std::atomic<int> g_copy_method{static_cast<int>(CopyMethod::kAuto)};

// Below this many bytes per block, "auto" prefers a copy kernel: batched DMA
// pays a per-descriptor cost that dominates small blocks (measured upstream
// on H100: 4-7 GB/s under 28 KiB, 40-52 GB/s above).
constexpr int64_t kKernelPathMaxBlockBytes = 32 * 1024;

void set_copy_method(c10::string_view method) {
  CopyMethod m;
  if (method == "auto") {
    m = CopyMethod::kAuto;
  } else if (method == "dma") {
    m = CopyMethod::kDma;
  } else if (method == "kernel") {
    m = CopyMethod::kKernel;
  } else {
    TORCH_CHECK_VALUE(false, "method must be 'auto', 'dma' or 'kernel', got '", method, "'");
  }
  g_copy_method.store(static_cast<int>(m));
}

std::string get_copy_method() {
  switch (static_cast<CopyMethod>(g_copy_method.load())) {
    case CopyMethod::kDma:
      return "dma";
    case CopyMethod::kKernel:
      return "kernel";
    default:
      return "auto";
  }
}

const c10::TypedOperatorHandle<void(at::TensorList, at::TensorList, const at::Tensor&,
                                    const at::Tensor&)>&
kernel_path_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvswap::_swap_blocks_kernel", "")
                             .typed<void(at::TensorList, at::TensorList, const at::Tensor&,
                                         const at::Tensor&)>();
  return op;
}

// The kernel reaches host memory through its device mapping, which only
// page-locked memory has.
bool host_side_pinned(at::TensorList caches) {
  for (const auto& t : caches) {
    if (t.device().is_cpu() && t.numel() > 0 && !t.is_pinned()) return false;
  }
  return true;
}

bool use_kernel_path(const std::vector<PairLayout>& pairs, c10::Device device,
                     at::TensorList src_caches, at::TensorList dst_caches) {
  const auto method = static_cast<CopyMethod>(g_copy_method.load());
  if (method == CopyMethod::kDma) return false;
  const bool available = kernel_path_op().hasKernelForDispatchKey(engine_key(device.type()));
  if (method == CopyMethod::kKernel) {
    TORCH_CHECK_NOT_IMPLEMENTED(available, "copy method 'kernel' was requested but the engine for ",
                                device, " has no kernel path; use 'auto' or 'dma'");
    return true;
  }
  int64_t largest = 0;
  for (const auto& p : pairs) largest = std::max(largest, p.block_bytes);
  return available && largest < kKernelPathMaxBlockBytes && host_side_pinned(src_caches) &&
         host_side_pinned(dst_caches);
}

void swap_blocks_by_kernel(at::TensorList src_caches, at::TensorList dst_caches,
                           const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids,
                           const std::vector<PairLayout>& pairs, c10::Device device) {
  // Ids on the host are checked here and moved over; ids already on the
  // device are not read back (that would synchronize and bake them into a
  // captured graph): the kernel skips any id out of range instead.
  auto on_device = [&](const at::Tensor& ids) {
    return ids.device() == device ? ids.contiguous() : ids.to(device, /*non_blocking=*/false).contiguous();
  };
  if (src_block_ids.device().is_cpu() && dst_block_ids.device().is_cpu()) {
    const auto sid = src_block_ids.contiguous();
    const auto did = dst_block_ids.contiguous();
    check_block_ids(sid.const_data_ptr<int64_t>(), did.const_data_ptr<int64_t>(), sid.numel(), pairs);
  }
  kernel_path_op().redispatch(c10::DispatchKeySet(engine_key(device.type())), src_caches, dst_caches,
                              on_device(src_block_ids), on_device(dst_block_ids));
}

void swap_blocks(at::TensorList src_caches, at::TensorList dst_caches,
                 const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids) {
  const auto route = route_block_copy(src_caches, dst_caches, src_block_ids, dst_block_ids);
  if (!route.device.is_cpu() &&
      use_kernel_path(route.pairs, route.device, src_caches, dst_caches)) {
    swap_blocks_by_kernel(src_caches, dst_caches, src_block_ids, dst_block_ids, route.pairs,
                          route.device);
    return;
  }
  submit(describe_block_copy(route, src_block_ids, dst_block_ids), route.direction, route.device);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> plan_swap_blocks(at::TensorList src_caches,
                                                                at::TensorList dst_caches,
                                                                const at::Tensor& src_block_ids,
                                                                const at::Tensor& dst_block_ids) {
  const auto route = route_block_copy(src_caches, dst_caches, src_block_ids, dst_block_ids);
  return describe_block_copy(route, src_block_ids, dst_block_ids).rows();
}

// ---------------------------------------------------------------------------
// expand_block_ids
// ---------------------------------------------------------------------------

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

std::string direction_name_op(int64_t direction) { return direction_name(direction); }

// Host-buffer pinning is the accelerator engine's business; the core only
// checks the buffer and routes the call to the engine of `device`.
void host_register(const at::Tensor& buffer, c10::Device device, bool pin) {
  TORCH_CHECK_VALUE(buffer.device().is_cpu(), "buffer must be a CPU tensor, got one on ",
                    buffer.device());
  TORCH_CHECK_VALUE(buffer.is_contiguous(), "buffer must be contiguous");
  TORCH_CHECK_NOT_IMPLEMENTED(!device.is_cpu(), "device must be an accelerator; host memory ",
                              "needs no pinning for the host engine");
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvswap::_host_register", "")
                             .typed<void(const at::Tensor&, c10::Device, bool)>();
  op.redispatch(engine_for(op, device, "to pin host memory"), buffer, device, pin);
}

}  // namespace
}  // namespace kvswap

TORCH_LIBRARY_IMPL(kvswap, CPU, m) {
  m.impl("swap_blocks_batch", &kvswap::swap_blocks_batch);
  m.impl("_plan_swap_blocks_batch", &kvswap::plan_swap_blocks_batch);
  m.impl("_host_register", &kvswap::host_register);
}

// The tensor op, its dry run and expand_block_ids are device-generic kernels:
// they read the tensors' devices and hand descriptors to that device's
// engine. They are registered for every key an engine may serve, so a mixed
// host/accelerator call, which the dispatcher routes by its accelerator
// tensor, lands here too.
namespace kvswap {
namespace {
void register_device_generic(torch::Library& m) {
  m.impl("swap_blocks", &swap_blocks);
  m.impl("_plan_swap_blocks", &plan_swap_blocks);
  m.impl("expand_block_ids", &expand_block_ids);
}
}  // namespace
}  // namespace kvswap

TORCH_LIBRARY_IMPL(kvswap, CPU, m) { kvswap::register_device_generic(m); }
TORCH_LIBRARY_IMPL(kvswap, CUDA, m) { kvswap::register_device_generic(m); }
TORCH_LIBRARY_IMPL(kvswap, PrivateUse1, m) { kvswap::register_device_generic(m); }

TORCH_LIBRARY_IMPL(kvswap, CompositeExplicitAutograd, m) {
  m.impl("_direction_name", &kvswap::direction_name_op);
  m.impl("_set_copy_method", &kvswap::set_copy_method);
  m.impl("_get_copy_method", &kvswap::get_copy_method);
}
