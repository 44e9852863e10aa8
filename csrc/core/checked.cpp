// Checked mode: the checks that catch silent KV-cache corruption which the
// ordinary validation cannot see or cannot afford, run only while the mode is
// on (torch_kvswap.checked(), KVSWAP_CHECK=1; docs/checked.md). Off, the core
// pays one relaxed atomic load per call (checked_mode() in core.h).
//
// The pointer op gets addresses only, so here it learns what they should
// point into: a table of registered regions (the offloader's caches and
// mirrors, and whatever torch_kvswap.register_region names), each on one
// side (host or device). Every descriptor must lie inside one region of the
// side its direction says; destinations must not overlap each other, and
// no descriptor may read what another writes (a chain). Both race: the copies
// of one call run concurrently and in no set order. Block ids that live on
// the device, which the CUDA kernel path never reads back, are brought to the
// host and checked like host ids, except while a graph is being captured.
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "core.h"
#include "op_kernels.h"

namespace kvswap {
namespace core {

std::atomic<bool> g_checked_mode{false};

namespace {

enum class Side : int { kHost = 0, kDevice = 1 };

const char* side_name(Side side) { return side == Side::kHost ? "host" : "device"; }

std::string hex(uint64_t address) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%" PRIx64, address);
  return text;
}

struct Region {
  int64_t id;
  // The bytes, as an offset into the storage and a length: a region follows
  // its storage, whose memory tensor.resize_ or untyped_storage().resize_
  // may reallocate, shrink or free (FSDP's resize_(0)) while it stays alive.
  uint64_t offset;
  uint64_t length;
  Side side;
  std::string label;
  // Weak: a region never keeps its memory alive, and one whose storage was
  // freed is dropped before the next check (its addresses may be reused).
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  // Where the storage holds the bytes now, as of the last look; begin == end
  // when it no longer holds them (shrunk below them, or resized to nothing).
  uint64_t begin = 0;
  uint64_t end = 0;
  // The bytes the region covered before its storage last moved or shrank,
  // to name in a refusal of a copy aimed at them (begin == end: none).
  uint64_t was_begin = 0;
  uint64_t was_end = 0;
};

// Where `storage` holds the bytes [offset, offset + length) of region r now:
// clipped to its current size, empty when it holds none of them.
std::pair<uint64_t, uint64_t> current_bytes(const Region& r, const c10::StorageImpl& storage) {
  const auto base = reinterpret_cast<uint64_t>(storage.data_ptr().get());
  const auto nbytes = static_cast<uint64_t>(storage.nbytes());
  if (base == 0 || r.offset >= nbytes) return {0, 0};
  return {base + r.offset, base + std::min(r.offset + r.length, nbytes)};
}

// The live regions of one side that hold bytes, sorted by begin, with the
// running maximum of their ends: an interval [a, b) lies inside one region
// exactly when, among the regions that begin at or before a, the largest
// end is >= b.
struct SideTable {
  std::vector<uint64_t> begin;
  std::vector<uint64_t> max_end;
};

struct Snapshot {
  std::vector<Region> regions;  // every live region, those that hold bytes by begin first
  SideTable sides[2];
};

// The table: regions by id, and a snapshot of them that checks read without
// the lock. Registering and dropping cost O(1) and mark the snapshot stale;
// the next check rebuilds it once (O(n log n)), so registering n regions
// costs O(n), not a rebuild each. Each check looks at every region's storage
// (O(n)): its memory may have moved since the last one.
class RegionTable {
 public:
  static RegionTable& instance() {
    static RegionTable* table = new RegionTable();  // process lifetime
    return *table;
  }

  int64_t add(Region r) {
    std::lock_guard<std::mutex> lock(mutex_);
    r.id = next_id_++;
    const int64_t id = r.id;
    regions_.emplace(id, std::move(r));
    ++work_;
    stale_ = true;
    return id;
  }

  bool remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++work_;
    if (regions_.erase(id) == 0) return false;
    stale_ = true;
    return true;
  }

  // The current regions: none whose storage was freed, each where its
  // storage holds its bytes now.
  std::shared_ptr<const Snapshot> snapshot() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = regions_.begin(); it != regions_.end();) {
      ++work_;
      Region& r = it->second;
      const auto storage = r.storage.lock();
      if (!storage) {
        it = regions_.erase(it);
        stale_ = true;
        continue;
      }
      const auto now = current_bytes(r, *storage);
      if (now.first != r.begin || now.second != r.end) {
        if (r.begin != r.end) {
          r.was_begin = r.begin;
          r.was_end = r.end;
        }
        r.begin = now.first;
        r.end = now.second;
        stale_ = true;
      }
      ++it;
    }
    if (stale_) publish();
    return snapshot_;
  }

  // Region entries the table has visited since the process started: O(n)
  // for n registrations and one check, whatever their order. For tests.
  int64_t work() {
    std::lock_guard<std::mutex> lock(mutex_);
    return work_;
  }

 private:
  RegionTable() : snapshot_(std::make_shared<Snapshot>()) {}

  void publish() {
    auto next = std::make_shared<Snapshot>();
    next->regions.reserve(regions_.size());
    for (const auto& entry : regions_) next->regions.push_back(entry.second);
    work_ += static_cast<int64_t>(regions_.size());
    // Regions that hold bytes first, by begin; then the others, by id.
    std::sort(next->regions.begin(), next->regions.end(), [](const Region& a, const Region& b) {
      const bool ha = a.begin != a.end, hb = b.begin != b.end;
      if (ha != hb) return ha;
      return ha ? a.begin < b.begin : a.id < b.id;
    });
    for (const auto& r : next->regions) {
      if (r.begin == r.end) break;
      auto& t = next->sides[static_cast<int>(r.side)];
      t.begin.push_back(r.begin);
      t.max_end.push_back(t.max_end.empty() ? r.end : std::max(t.max_end.back(), r.end));
    }
    snapshot_ = std::move(next);
    stale_ = false;
  }

  std::mutex mutex_;
  int64_t next_id_ = 1;
  int64_t work_ = 0;
  bool stale_ = false;
  std::unordered_map<int64_t, Region> regions_;
  std::shared_ptr<const Snapshot> snapshot_;
};

// One side of one descriptor: the bytes [begin, end) of descriptor `index`.
struct Span {
  uint64_t begin;
  uint64_t end;
  int64_t index;
};

// The spans of one side of a call, in the caller's order, and what the sort
// needs to know about them, gathered in one pass.
struct Spans {
  std::vector<Span> spans;
  std::vector<Span> scratch;
  bool sorted = true;
  uint64_t lowest = UINT64_MAX;
  uint64_t highest = 0;
};

// Orders spans by begin. A caller's descriptors are often already in order
// (then nothing is done); otherwise a radix sort of the begins relative to
// the lowest, in units of their common power-of-two alignment, when that
// fits 32 bits (the usual case: blocks of a few caches), else a comparison
// sort. It runs for small calls and for those passes_unsorted cannot pass.
void order_by_address(Spans& s) {
  if (s.sorted) return;
  auto& v = s.spans;
  const size_t n = v.size();
  uint64_t spread = 0;
  for (const auto& x : v) spread |= x.begin - s.lowest;
  const int shift = spread == 0 ? 0 : __builtin_ctzll(spread);
  const uint64_t range = (s.highest - s.lowest) >> shift;
  if (range > 0xffffffffu) {
    std::sort(v.begin(), v.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
    return;
  }
  // Least significant digit first, in as few passes of at most 11 bits as
  // the key's width allows; each pass is stable.
  const int bits = range == 0 ? 1 : 64 - __builtin_clzll(range);
  const int passes = (bits + 10) / 11;
  const int width = (bits + passes - 1) / passes;
  const uint64_t mask = (uint64_t{1} << width) - 1;
  uint32_t start[(1 << 11) + 1];
  s.scratch.resize(n);
  for (int pass = 0; pass < passes; ++pass) {
    const int digit = shift + pass * width;
    std::fill(start, start + (size_t{1} << width) + 1, 0u);
    for (const auto& x : v) ++start[(((x.begin - s.lowest) >> digit) & mask) + 1];
    for (size_t b = 1; b <= (size_t{1} << width); ++b) start[b] += start[b - 1];
    for (const auto& x : v) s.scratch[start[((x.begin - s.lowest) >> digit) & mask]++] = x;
    v.swap(s.scratch);
  }
}

// A note for a descriptor aimed at bytes a region covered before its storage
// moved or shrank (tensor.resize_, untyped_storage().resize_): memory the
// allocator may have handed to another tensor since.
std::string moved_from(uint64_t a, uint64_t bytes, Side side, const Snapshot& snap) {
  for (const auto& r : snap.regions) {
    if (r.side != side || r.was_begin == r.was_end) continue;
    if (a >= r.was_end || a + bytes <= r.was_begin) continue;
    const std::string now = r.begin == r.end ? "it holds none of them now"
                                             : "they are at [" + hex(r.begin) + ", " + hex(r.end) + ") now";
    return "; those bytes were region '" + r.label + "' [" + hex(r.was_begin) + ", " + hex(r.was_end) +
           ") until its storage was reallocated or shrunk (tensor.resize_, "
           "untyped_storage().resize_), which may have freed them: " +
           now + ". Aim the copy at the tensor's current memory (data_ptr() after the resize)";
  }
  return "";
}

void refuse_outside(const char* op, const char* name, int64_t i, uint64_t a, uint64_t bytes, Side side,
                    const Snapshot& snap) {
  const Region* nearest = nullptr;
  uint64_t distance = UINT64_MAX;
  for (const auto& r : snap.regions) {
    if (r.side != side || r.begin == r.end) continue;
    // Bytes of the descriptor that fall outside r.
    const uint64_t below = a < r.begin ? std::min(bytes, r.begin - a) : 0;
    const uint64_t above = a + bytes > r.end ? std::min(bytes, a + bytes - r.end) : 0;
    const uint64_t gap = a >= r.end ? a - r.end : (a + bytes <= r.begin ? r.begin - a - bytes : 0);
    const uint64_t d = gap + below + above;
    if (d < distance) {
      distance = d;
      nearest = &r;
    }
  }
  std::string where;
  if (nearest == nullptr) {
    where = std::string("no ") + side_name(side) + " region is registered";
  } else {
    const auto& r = *nearest;
    std::string how;
    if (a >= r.end) {
      how = std::to_string(a - r.end) + " bytes after its end";
    } else if (a + bytes <= r.begin) {
      how = std::to_string(r.begin - a - bytes) + " bytes before its start";
    } else if (a < r.begin) {
      how = "starting " + std::to_string(r.begin - a) + " bytes before it";
    } else {
      how = "running " + std::to_string(a + bytes - r.end) + " bytes past its end";
    }
    where = std::string("the nearest ") + side_name(side) + " region is '" + r.label + "' [" + hex(r.begin) +
            ", " + hex(r.end) + "), " + how;
  }
  TORCH_CHECK_VALUE(false, op, " (checked mode): ", name, "[", i, "] = ", hex(a), " (+", bytes,
                    " bytes) is not inside any registered ", side_name(side), " region; ", where,
                    moved_from(a, bytes, side, snap),
                    ". Register the buffer with torch_kvswap.register_region(tensor), or fix "
                    "the address (an id off by one, or the wrong buffer?)");
}

// Whether [a, b) lies inside one region of table t: among the regions that
// begin at or before a (the first upper_bound(a) of them), the largest end
// is >= b. It remembers the stretch of addresses [from, to) that share the
// last answer's regions, so descriptors that stay in a few regions (or come
// in address order) search rarely.
class RegionLookup {
 public:
  explicit RegionLookup(const SideTable& t) : t_(t) {}

  bool inside(uint64_t a, uint64_t b) {
    if (a < from_ || a >= to_) {
      const size_t p =
          static_cast<size_t>(std::upper_bound(t_.begin.begin(), t_.begin.end(), a) - t_.begin.begin());
      from_ = p == 0 ? 0 : t_.begin[p - 1];
      to_ = p == t_.begin.size() ? UINT64_MAX : t_.begin[p];
      max_end_ = p == 0 ? 0 : t_.max_end[p - 1];
    }
    return b <= max_end_;
  }

 private:
  const SideTable& t_;
  uint64_t from_ = 1, to_ = 0;  // empty: the first lookup searches
  uint64_t max_end_ = 0;
};

// Every span lies inside one region of `side`; the first that does not, in
// the order given, is refused.
void check_inside_regions(const char* op, const char* name, const std::vector<Span>& spans, Side side,
                          const Snapshot& snap) {
  RegionLookup lookup(snap.sides[static_cast<int>(side)]);
  for (const auto& x : spans) {
    if (!lookup.inside(x.begin, x.end)) {
      refuse_outside(op, name, x.index, x.begin, x.end - x.begin, side, snap);
    }
  }
}

// Calls of at least this many descriptors are first checked without sorting
// (passes_unsorted); smaller calls, and any call that check fails, take the
// sorting walks, which name the offending descriptors.
constexpr int64_t kUnsortedCheckMin = 64;

// The checks of check_pointer_batch for a call in any order, without a sort:
// true when every descriptor lies inside one region of its side, no two
// destinations overlap and (when `chains` is set) no source overlaps a
// destination. Destinations are marked in a bitmap of units, the largest
// power of two that divides every destination's offset from the lowest and
// every size, so each destination covers whole units and two byte ranges
// share a byte exactly when they share a unit. False means "a check may
// fail": also when the bitmap would be large (the caller then sorts).
bool passes_unsorted(const int64_t* src, const int64_t* dst, const int64_t* size, int64_t n, bool chains,
                     const SideTable& src_regions, const SideTable& dst_regions) {
  RegionLookup src_lookup(src_regions), dst_lookup(dst_regions);
  uint64_t lo = UINT64_MAX, end = 0, spread = 0, first = 0;
  int64_t live = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (size[i] == 0) continue;
    const uint64_t d = static_cast<uint64_t>(dst[i]), z = static_cast<uint64_t>(size[i]);
    if (live++ == 0) first = d;
    // ctz(d - first) == ctz(d ^ first): the lowest bit in which they differ.
    spread |= (d ^ first) | z;
    lo = std::min(lo, d);
    end = std::max(end, d + z);
    if (!dst_lookup.inside(d, d + z)) return false;
  }
  if (live == 0) return true;
  const int shift = __builtin_ctzll(spread);  // spread != 0: every live size is > 0
  const uint64_t units = (end - lo) >> shift;
  const uint64_t budget = 8 * static_cast<uint64_t>(live) + 4096;
  if (units > budget) return false;
  thread_local std::vector<uint64_t> marked;
  marked.assign((units + 63) / 64, 0);
  uint64_t work = 0;  // units marked or looked at, bounded by the budget
  for (int64_t i = 0; i < n; ++i) {
    if (size[i] == 0) continue;
    const uint64_t u0 = (static_cast<uint64_t>(dst[i]) - lo) >> shift;
    const uint64_t u1 = u0 + (static_cast<uint64_t>(size[i]) >> shift);
    work += u1 - u0;
    if (work > budget) return false;
    for (uint64_t u = u0; u < u1; ++u) {
      const uint64_t bit = uint64_t{1} << (u & 63);
      if (marked[u >> 6] & bit) return false;  // two destinations share a unit
      marked[u >> 6] |= bit;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (size[i] == 0) continue;
    const uint64_t a = static_cast<uint64_t>(src[i]), b = a + static_cast<uint64_t>(size[i]);
    if (!src_lookup.inside(a, b)) return false;
    if (!chains || b <= lo || a >= end) continue;
    // The units that [a, b) touches, clipped to the destinations' span.
    const uint64_t u0 = (std::max(a, lo) - lo) >> shift;
    const uint64_t u1 = ((std::min(b, end) - lo) + (uint64_t{1} << shift) - 1) >> shift;
    work += u1 - u0;
    if (work > 2 * budget) return false;
    for (uint64_t u = u0; u < u1; ++u) {
      if (marked[u >> 6] & (uint64_t{1} << (u & 63))) return false;  // a source some descriptor writes
    }
  }
  return true;
}

}  // namespace

void set_checked_mode(bool on) { g_checked_mode.store(on, std::memory_order_relaxed); }

void check_pointer_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes,
                         int64_t direction_code, c10::Device device, const char* op) {
  // The tensors passed plan_pointer_batch's checks: int64, 1-D, CPU, equal
  // lengths, sizes >= 0, no range that wraps.
  const DescriptorArrays arrays(src_ptrs, dst_ptrs, sizes);
  const int64_t* src = arrays.src;
  const int64_t* dst = arrays.dst;
  const int64_t* size = arrays.size;
  const int64_t n = arrays.n;
  const auto direction = static_cast<Direction>(direction_code);
  const auto snap = RegionTable::instance().snapshot();
  const Side src_side = direction == Direction::kHostToDevice ? Side::kHost : Side::kDevice;
  const Side dst_side = direction == Direction::kDeviceToHost ? Side::kHost : Side::kDevice;
  // Sources and destinations share an address space, so chains are possible,
  // on the host engine and within one device.
  const bool same_space = device.is_cpu() || direction == Direction::kDeviceToDevice;
  if (n >= kUnsortedCheckMin &&
      passes_unsorted(src, dst, size, n, same_space, snap->sides[static_cast<int>(src_side)],
                      snap->sides[static_cast<int>(dst_side)])) {
    return;
  }
  // Per thread, so that a call allocates nothing once the vectors have grown.
  thread_local Spans tls_src, tls_dst;
  Spans& by_src = tls_src;
  Spans& by_dst = tls_dst;
  by_src.spans.resize(static_cast<size_t>(n));
  by_dst.spans.resize(static_cast<size_t>(n));
  Span* ss = by_src.spans.data();
  Span* ds = by_dst.spans.data();
  bool src_sorted = true, dst_sorted = true;
  uint64_t src_lo = UINT64_MAX, src_hi = 0, dst_lo = UINT64_MAX, dst_hi = 0;
  size_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (size[i] == 0) continue;  // zero-byte descriptors copy nothing
    const uint64_t s = static_cast<uint64_t>(src[i]), d = static_cast<uint64_t>(dst[i]);
    const uint64_t z = static_cast<uint64_t>(size[i]);
    src_sorted &= m == 0 || ss[m - 1].begin <= s;
    dst_sorted &= m == 0 || ds[m - 1].begin <= d;
    src_lo = std::min(src_lo, s);
    src_hi = std::max(src_hi, s);
    dst_lo = std::min(dst_lo, d);
    dst_hi = std::max(dst_hi, d);
    ss[m] = Span{s, s + z, i};
    ds[m] = Span{d, d + z, i};
    ++m;
  }
  by_src.spans.resize(m);
  by_dst.spans.resize(m);
  by_src.sorted = src_sorted;
  by_dst.sorted = dst_sorted;
  by_src.lowest = src_lo;
  by_src.highest = src_hi;
  by_dst.lowest = dst_lo;
  by_dst.highest = dst_hi;
  order_by_address(by_src);
  order_by_address(by_dst);
  const auto& srcs = by_src.spans;
  const auto& dsts = by_dst.spans;

  check_inside_regions(op, "src_ptrs", srcs, src_side, *snap);
  check_inside_regions(op, "dst_ptrs", dsts, dst_side, *snap);

  // Sorted by begin, two destinations overlap only if two neighbours do.
  for (size_t k = 1; k < dsts.size(); ++k) {
    if (dsts[k - 1].end > dsts[k].begin) {
      const int64_t a = dsts[k - 1].index, b = dsts[k].index;
      TORCH_CHECK_VALUE(false, op, " (checked mode): the destinations of descriptors ", std::min(a, b),
                        " and ", std::max(a, b), " overlap: dst_ptrs[", a, "] = ", hex(dst[a]), " (+",
                        size[a], " bytes) and dst_ptrs[", b, "] = ", hex(dst[b]), " (+", size[b],
                        " bytes). The copies of one call run "
                        "concurrently and in no set order, so the bytes they share end up "
                        "from either; write each destination byte once per call");
    }
  }

  // Chains: a source that another descriptor writes (only where sources and
  // destinations share an address space).
  if (!same_space) return;
  size_t p = 0;  // destinations before p end at or before the current source
  for (const auto& x : srcs) {
    while (p < dsts.size() && dsts[p].end <= x.begin) ++p;
    if (p < dsts.size() && dsts[p].begin < x.end) {
      const int64_t i = x.index;
      const int64_t w = dsts[p].index;  // never i: a descriptor's own overlap is refused earlier
      TORCH_CHECK_VALUE(false, op, " (checked mode): descriptor ", i, " reads src_ptrs[", i,
                        "] = ", hex(x.begin), " (+", size[i], " bytes), which descriptor ", w,
                        " writes (dst_ptrs[", w, "] = ", hex(dst[w]), ", +", size[w],
                        " bytes): a chain. The copies of one call run concurrently and in no "
                        "set order, so descriptor ",
                        i,
                        " may read the bytes before or after "
                        "they are written; split the call in two");
    }
  }
}

void check_device_resident_ids(const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids,
                               const std::vector<PairLayout>& pairs, c10::Device device) {
  if (stream_capturing(device)) {
    TORCH_WARN_ONCE(
        "swap_blocks (checked mode): block ids on the device are not checked while "
        "the stream of ",
        device,
        " is being captured: reading them back would "
        "synchronize, which a capture forbids. Run the same calls once uncaptured "
        "in checked mode to check them");
    check_no_aliasing_pairs(pairs, "the block ids are on the device, which a capture cannot read back");
    return;
  }
  // Checked mode allows the synchronizing read-back that the kernel path
  // otherwise avoids.
  const auto sid = src_block_ids.to(at::kCPU).contiguous();
  const auto did = dst_block_ids.to(at::kCPU).contiguous();
  check_block_ids(sid.const_data_ptr<int64_t>(), did.const_data_ptr<int64_t>(), sid.numel(), pairs);
}

int64_t register_region(const at::Tensor& region, c10::string_view side, c10::string_view label) {
  Side s;
  if (side == "host") {
    s = Side::kHost;
  } else if (side == "device") {
    s = Side::kDevice;
  } else {
    TORCH_CHECK_VALUE(false, "side must be 'host' or 'device', got '", side, "'");
  }
  TORCH_CHECK_VALUE(region.numel() > 0, "region '", label, "' is empty; a region needs bytes");
  TORCH_CHECK_VALUE(region.has_storage() && region.storage().data() != nullptr, "region '", label,
                    "' has no memory of its own (", region.device(), ")");
  // The bytes the tensor's elements span (strides are never negative).
  int64_t last = 0;
  for (const auto d : c10::irange(region.dim())) last += (region.size(d) - 1) * region.stride(d);
  const auto base = reinterpret_cast<uint64_t>(region.storage().data());
  const auto begin = reinterpret_cast<uint64_t>(region.const_data_ptr());
  const auto length = static_cast<uint64_t>((last + 1) * region.element_size());
  return RegionTable::instance().add(Region{0, begin - base, length, s, std::string(label),
                                            region.storage().getWeakStorageImpl(), begin, begin + length});
}

bool unregister_region(int64_t id) { return RegionTable::instance().remove(id); }

int64_t region_table_work() { return RegionTable::instance().work(); }

std::vector<std::string> region_labels() {
  std::vector<std::string> out;
  for (const auto& r : RegionTable::instance().snapshot()->regions) {
    if (r.begin == r.end) break;  // the rest hold no bytes
    out.push_back(std::string(side_name(r.side)) + ":" + r.label);
  }
  return out;
}

bool get_checked_mode() { return checked_mode(); }

}  // namespace core
}  // namespace kvswap
