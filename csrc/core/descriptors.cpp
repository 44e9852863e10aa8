// Descriptor building, merging and ordering: raw descriptors of the pointer
// op and block copies of the tensor op become one merged table in the layout
// `_submit` takes.
#include <c10/util/irange.h>

#include <algorithm>

#include "core.h"

namespace kvswap {
namespace core {

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVSWAP_CLONE_FOR_AVX512 __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define KVSWAP_CLONE_FOR_AVX512
#endif

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
    std::stable_sort(order.begin(), order.end(), [&](uint64_t a, uint64_t b) { return src[a] < src[b]; });
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

// The hot loop of descriptor building, kept free of aliasing doubts (every
// input is a local, the outputs are restrict) so the compiler keeps the
// bases and strides in registers and vectorizes; the x86-64-v4 clone (AVX-512,
// with 64-bit vector multiplies) is picked at load time where the CPU has it
// and halves the cost per descriptor.
KVSWAP_CLONE_FOR_AVX512 void emit_per_block(int64_t* __restrict s, int64_t* __restrict d,
                                            int64_t* __restrict z, const int64_t* __restrict sid,
                                            const int64_t* __restrict did, int64_t n, int64_t src_base,
                                            int64_t src_stride, int64_t dst_base, int64_t dst_stride,
                                            int64_t block_bytes) {
  for (int64_t j = 0; j < n; ++j) {
    s[j] = src_base + sid[j] * src_stride;
    d[j] = dst_base + did[j] * dst_stride;
    z[j] = block_bytes;
  }
}

}  // namespace

// Validates every descriptor before anything is copied, drops zero-byte ones
// and merges neighbours whose source and destination both continue each
// other. For the host engine it then orders them by source address.
Descriptors plan_pointer_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                               const at::Tensor& sizes, int64_t direction, c10::Device device) {
  checked_direction(direction);
  check_descriptor_tensor(src_ptrs, "src_ptrs", src_ptrs.dim() == 1 ? src_ptrs.numel() : -1);
  check_descriptor_tensor(dst_ptrs, "dst_ptrs", src_ptrs.numel());
  check_descriptor_tensor(sizes, "sizes", src_ptrs.numel());

  const DescriptorArrays arrays(src_ptrs, dst_ptrs, sizes);
  const int64_t* src = arrays.src;
  const int64_t* dst = arrays.dst;
  const int64_t* size = arrays.size;
  const int64_t n = arrays.n;

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
    TORCH_CHECK_VALUE(s + b <= d || d + b <= s, "descriptor ", i, ": source [", src[i], ", +", bytes,
                      ") and destination [", dst[i], ", +", bytes, ") overlap");
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

}  // namespace core
}  // namespace kvswap
