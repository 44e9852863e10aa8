// Aliasing across the cache pairs of one block copy: the bytes that one
// pair writes may not be read or written by another pair of the same call.
// The pairs of a call run concurrently (the host engine's threads, an
// accelerator's unordered batch, the kernel's grid-y blocks), so such a call
// would have a timing-dependent result. A pair against itself is
// check_block_ids' business (validation.cpp).
//
// Cost: the pairs' extents (first byte of block 0 to the last byte of the
// last block) are sorted and swept, which is all a call whose caches are
// disjoint pays; and a thread that calls again with the same layouts (an
// offloader's lane, a copy backend) only compares them with the last two
// found disjoint (docs/performance.md, "Aliasing check"). Only caches whose
// extents overlap, and whose blocks are not interleaved on a common stride
// (K and V views of one [num_blocks, 2, ...] allocation), have their copied
// blocks compared.
#include <c10/util/irange.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "core.h"

namespace kvswap {
namespace core {

namespace {

// One side of one pair: the bytes that can be touched.
struct Extent {
  int64_t begin;
  int64_t end;
  int32_t pair;
  bool is_dst;
};

bool by_begin(const Extent& a, const Extent& b) { return a.begin < b.begin; }

Extent extent_of(const CacheLayout& c, int64_t block_bytes, int32_t pair, bool is_dst) {
  return {c.base, c.base + (c.num_blocks - 1) * c.stride + block_bytes, pair, is_dst};
}

const CacheLayout& side(const std::vector<PairLayout>& pairs, const Extent& e) {
  return e.is_dst ? pairs[e.pair].dst : pairs[e.pair].src;
}

// Whether some block of `a` can share a byte with some block of `b`, given
// that their extents overlap: false only where both step by one stride and
// every block of one lies in the gaps between the blocks of the other.
bool blocks_can_meet(const CacheLayout& a, const CacheLayout& b, int64_t a_bytes, int64_t b_bytes) {
  const int64_t s = a.stride;
  if (s <= 0 || s != b.stride) return true;
  const int64_t delta = ((b.base - a.base) % s + s) % s;  // b's blocks start here within a's stride
  return !(delta >= a_bytes && delta + b_bytes <= s);
}

// Sorts `v` by begin; already-ordered input (caches allocated in order) costs
// one pass.
void sort_extents(std::vector<Extent>& v) {
  if (std::is_sorted(v.begin(), v.end(), by_begin)) return;
  std::reverse(v.begin(), v.end());
  if (std::is_sorted(v.begin(), v.end(), by_begin)) return;
  std::sort(v.begin(), v.end(), by_begin);
}

// A block touched by the call, for the exact comparison.
struct Touch {
  int64_t begin;
  int64_t end;
  int32_t pair;
  bool is_dst;
  int64_t j;  // index into the id tensor of its side
};

[[noreturn]] void report(const Touch& a, const Touch& b, const int64_t* sid, const int64_t* did) {
  // `a` is the earlier-starting block, so the shared bytes begin at b.begin.
  auto name = [&](const Touch& t) {
    std::ostringstream s;
    s << (t.is_dst ? "dst_caches[" : "src_caches[") << t.pair << "] block "
      << (t.is_dst ? did[t.j] : sid[t.j]) << " (" << (t.is_dst ? "dst_block_ids[" : "src_block_ids[") << t.j
      << "], " << (t.is_dst ? "written" : "read") << ")";
    return s.str();
  };
  TORCH_CHECK_VALUE(false, name(a), " and ", name(b), " share the bytes ", std::hex, "0x", b.begin, "..0x",
                    std::min(a.end, b.end) - 1, std::dec, " (", std::min(a.end, b.end) - b.begin, " bytes): ",
                    a.pair == b.pair
                        ? "a byte may not be both read and written in one call, whose copies run "
                          "concurrently"
                        : "in one call, the bytes that one cache pair writes may not be read or "
                          "written by another pair, whose copies run concurrently");
}

// The exact comparison over the blocks the call copies on the `suspect`
// sides: sorted by start, a block that overlaps an earlier one with a write
// on either side is a conflict.
void compare_touched_blocks(const int64_t* sid, const int64_t* did, int64_t n,
                            const std::vector<PairLayout>& pairs, const std::vector<Extent>& suspects) {
  std::vector<Touch> touched;
  touched.reserve(suspects.size() * static_cast<size_t>(n));
  for (const auto& e : suspects) {
    const CacheLayout& c = side(pairs, e);
    const int64_t bytes = pairs[e.pair].block_bytes;
    const int64_t* ids = e.is_dst ? did : sid;
    for (const auto j : c10::irange(n)) {
      const int64_t begin = c.base + ids[j] * c.stride;
      touched.push_back({begin, begin + bytes, e.pair, e.is_dst, j});
    }
  }
  std::sort(touched.begin(), touched.end(), [](const Touch& a, const Touch& b) { return a.begin < b.begin; });
  // The earlier blocks reaching furthest: any one, and any written one.
  const Touch* reach_any = nullptr;
  const Touch* reach_write = nullptr;
  for (const auto& t : touched) {
    if (t.is_dst && reach_any != nullptr && reach_any->end > t.begin) report(*reach_any, t, sid, did);
    if (!t.is_dst && reach_write != nullptr && reach_write->end > t.begin) report(*reach_write, t, sid, did);
    if (reach_any == nullptr || t.end > reach_any->end) reach_any = &t;
    if (t.is_dst && (reach_write == nullptr || t.end > reach_write->end)) reach_write = &t;
  }
}

// Sides (2 * pair + is_dst) whose blocks may meet another pair's, with the
// first such meeting (a written side first).
struct Suspects {
  std::vector<int32_t> sides;
  std::pair<Extent, Extent> first{};
};

// The last two layouts this thread found free of suspects. The verdict
// depends on the layouts alone, so the same layouts need no second look.
static_assert(sizeof(PairLayout) == 13 * sizeof(int64_t), "PairLayout is compared bytewise");
// Two entries: a thread that alternates stores and loads (an offloader on an
// accelerator launches both from the caller's thread) passes two layouts,
// the same caches with source and destination swapped.
thread_local std::vector<PairLayout> t_clean[2];
thread_local int t_clean_next = 0;

bool same_layouts(const std::vector<PairLayout>& a, const std::vector<PairLayout>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(PairLayout)) == 0;
}

bool known_clean(const std::vector<PairLayout>& pairs) {
  return same_layouts(pairs, t_clean[0]) || same_layouts(pairs, t_clean[1]);
}

Suspects aliasing_suspects(const std::vector<PairLayout>& pairs) {
  Suspects out;
  if (pairs.size() < 2 || known_clean(pairs)) return out;
  std::vector<Extent> srcs, dsts, all;
  srcs.reserve(pairs.size());
  dsts.reserve(pairs.size());
  for (const auto i : c10::irange(pairs.size())) {
    const auto& p = pairs[i];
    if (p.block_bytes == 0) continue;
    const auto pair = static_cast<int32_t>(i);
    if (p.src.num_blocks > 0) srcs.push_back(extent_of(p.src, p.block_bytes, pair, false));
    if (p.dst.num_blocks > 0) dsts.push_back(extent_of(p.dst, p.block_bytes, pair, true));
  }
  sort_extents(srcs);
  sort_extents(dsts);
  all.resize(srcs.size() + dsts.size());
  std::merge(srcs.begin(), srcs.end(), dsts.begin(), dsts.end(), all.begin(), by_begin);
  for (size_t a = 0; a < all.size(); ++a) {
    for (size_t b = a + 1; b < all.size() && all[b].begin < all[a].end; ++b) {
      const Extent& x = all[a];
      const Extent& y = all[b];
      if (x.pair == y.pair || (!x.is_dst && !y.is_dst) || x.begin >= y.end) continue;
      if (!blocks_can_meet(side(pairs, x), side(pairs, y), pairs[x.pair].block_bytes,
                           pairs[y.pair].block_bytes)) {
        continue;
      }
      if (out.sides.empty()) out.first = {x.is_dst ? x : y, x.is_dst ? y : x};
      out.sides.push_back(2 * x.pair + int32_t(x.is_dst));
      out.sides.push_back(2 * y.pair + int32_t(y.is_dst));
    }
  }
  if (out.sides.empty()) {
    t_clean[t_clean_next] = pairs;
    t_clean_next ^= 1;
    return out;
  }
  std::sort(out.sides.begin(), out.sides.end());
  out.sides.erase(std::unique(out.sides.begin(), out.sides.end()), out.sides.end());
  return out;
}

}  // namespace

void check_cross_pair_aliasing(const int64_t* sid, const int64_t* did, int64_t n,
                               const std::vector<PairLayout>& pairs) {
  if (n == 0) return;
  const auto found = aliasing_suspects(pairs);
  if (found.sides.empty()) return;
  std::vector<Extent> suspects;
  suspects.reserve(found.sides.size());
  for (const int32_t m : found.sides) {
    const int32_t pair = m / 2;
    const bool is_dst = (m % 2) != 0;
    suspects.push_back(
        extent_of(is_dst ? pairs[pair].dst : pairs[pair].src, pairs[pair].block_bytes, pair, is_dst));
  }
  compare_touched_blocks(sid, did, n, pairs, suspects);
}

void check_pair_aliasing(const int64_t* sid, const int64_t* did, int64_t n,
                         const std::vector<PairLayout>& pairs, size_t i) {
  const auto& p = pairs[i];
  if (n == 0 || !blocks_can_meet(p.src, p.dst, p.block_bytes, p.block_bytes)) return;
  const auto pair = static_cast<int32_t>(i);
  compare_touched_blocks(
      sid, did, n, pairs,
      {extent_of(p.src, p.block_bytes, pair, false), extent_of(p.dst, p.block_bytes, pair, true)});
}

void check_no_aliasing_pairs(const std::vector<PairLayout>& pairs, const char* why) {
  const auto found = aliasing_suspects(pairs);
  if (found.sides.empty()) return;
  auto name = [](const Extent& e) {
    return std::string(e.is_dst ? "dst_caches[" : "src_caches[") + std::to_string(e.pair) + "]";
  };
  const auto& [written, other] = found.first;
  TORCH_CHECK_VALUE(false, name(written), " and ", name(other), " share the bytes 0x", std::hex,
                    std::max(written.begin, other.begin), "..0x", std::min(written.end, other.end) - 1,
                    std::dec, " of their extents, and ", why,
                    ", so the blocks that one pair writes "
                    "cannot be told apart from those another pair reads or writes; pass the block ids "
                    "as CPU tensors, or turn on checked mode (KVSWAP_CHECK=1), which reads them back "
                    "and checks each block");
}

}  // namespace core
}  // namespace kvswap
