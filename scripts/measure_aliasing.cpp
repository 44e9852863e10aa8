// Cost of the cross-pair aliasing check (csrc/core/aliasing.cpp) per call,
// for 64 cache pairs whose caches are disjoint (the common case), in address
// order, reversed and shuffled: "repeat" calls with the same layouts each
// time (an offloader lane), "new" cycles through three sets of layouts (a
// thread remembers two) so that every call sorts and sweeps the extents. The same run's baseline is a
// pass that only reads every pair's layout once. Built and run by scripts/measure_aliasing.sh;
// docs/performance.md records the figures.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "../csrc/core/core.h"

using kvswap::core::CacheLayout;
using kvswap::core::PairLayout;

namespace {

std::vector<PairLayout> pairs_in_order(int n, const char* order) {
  constexpr int64_t kBlocks = 1024, kBytes = 32768;
  std::vector<int> slot(n);
  std::iota(slot.begin(), slot.end(), 0);
  if (std::string(order) == "reversed") std::reverse(slot.begin(), slot.end());
  if (std::string(order) == "shuffled") std::shuffle(slot.begin(), slot.end(), std::mt19937(0));
  std::vector<PairLayout> pairs;
  for (int i = 0; i < n; ++i) {
    const int64_t device = (int64_t{1} << 40) + slot[i] * kBlocks * kBytes;
    const int64_t host = (int64_t{1} << 44) + slot[(i * 7) % n] * kBlocks * kBytes;
    pairs.push_back(
        PairLayout{CacheLayout{device, kBytes, kBlocks}, CacheLayout{host, kBytes, kBlocks}, kBytes});
  }
  return pairs;
}

template <class F>
double ns_per_call(F&& f, int reps) {
  double best = 1e30;
  for (int round = 0; round < 7; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < reps; ++r) f();
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double, std::nano>(t1 - t0).count() / reps);
  }
  return best;
}

}  // namespace

int main() {
  const int64_t sid[1] = {3}, did[1] = {5};
  volatile int64_t sink = 0;
  for (const char* order : {"in order", "reversed", "shuffled"}) {
    const auto pairs = pairs_in_order(64, order);
    std::vector<PairLayout> sets[3] = {pairs, pairs, pairs};
    for (int k = 1; k < 3; ++k) {
      for (auto& p : sets[k]) p.dst.base += 4096 * k;  // other layouts, still disjoint
    }
    const double base = ns_per_call(
        [&] {
          int64_t s = 0;
          for (const auto& p : pairs) s += p.src.base ^ p.dst.base ^ p.block_bytes;
          sink = sink + s;
        },
        200000);
    const double repeat =
        ns_per_call([&] { kvswap::core::check_cross_pair_aliasing(sid, did, 1, pairs); }, 200000);
    int next = 0;
    const double fresh = ns_per_call(
        [&] {
          kvswap::core::check_cross_pair_aliasing(sid, did, 1, sets[next]);
          next = (next + 1) % 3;
        },
        100000);
    std::printf(
        "{\"pairs\": 64, \"order\": \"%s\", \"repeat_ns\": %.1f, \"new_ns\": %.1f, "
        "\"baseline_ns\": %.1f, \"repeat_ratio\": %.1f, \"new_ratio\": %.1f}\n",
        order, repeat, fresh, base, repeat / base, fresh / base);
  }
  return 0;
}
