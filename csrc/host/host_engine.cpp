// The host engine: copies a CopyBatch on torch's intra-op threads, split by
// bytes, with streaming stores for large batches. The core holds it for the
// CPU from the start, so it runs when both sides of a copy are host memory,
// and for the pointer op on a machine with no accelerator. It is synchronous: the
// bytes have arrived on return.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define KVSWAP_HAVE_STREAM_COPY 1
#else
#define KVSWAP_HAVE_STREAM_COPY 0
#endif

#include <unistd.h>

#include "../kvswap.h"

namespace kvswap {
namespace {

// at::parallel_for is header code: with torch's OpenMP backend it becomes an
// OpenMP parallel region in this file, and without -fopenmp it silently runs
// on one thread. setup.py passes -fopenmp whenever torch's backend is OpenMP.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error \
    "torch's parallel backend is OpenMP: compile the host engine with -fopenmp, or at::parallel_for runs on one thread"
#endif

// The copy threads are torch's intra-op threads. They are the threads that
// just ran the caller's previous torch op, and with OpenMP they keep spinning
// for a while after it: a separate pool of copy threads had to share the CPUs
// with them and lost a third of its speed (docs/performance.md, attempt 9).
//
// Like torch's own OpenMP kernels, the thread pool does not survive fork():
// a process forked from the one that loaded this library copies on the
// calling thread instead of hanging.
const pid_t g_loading_pid = getpid();

bool threads_usable() { return getpid() == g_loading_pid; }

// Runs fn(begin, end) over chunks of [0, n) on the intra-op threads and
// returns when all are done; on the calling thread alone, as fn(0, n), inside
// another parallel region or in a forked child.
template <typename Fn>
void parallel_range(int64_t n, const Fn& fn) {
  if (!threads_usable()) {
    fn(0, n);
    return;
  }
  at::parallel_for(0, n, 1, fn);
}

// Below this many bytes one thread copies everything: waking a worker costs
// more than it saves.
constexpr int64_t kParallelThreshold = int64_t{1} << 20;

// How bytes are moved, from KVSWAP_HOST_COPY (read per call, so the benchmark
// can compare the alternatives in one run; docs/performance.md has the
// numbers): `auto` (default) picks `stream` where AVX2 is available for
// batches of kStreamThreshold bytes or more, else `memcpy` (prefetching the
// next block measured no better with ordinary stores). `parallel_for` is the
// measured baseline.
enum class CopyMode { kAuto, kParallelFor, kMemcpy, kPrefetch, kStream };

CopyMode configured_mode() {
  const char* env = std::getenv("KVSWAP_HOST_COPY");
  if (env == nullptr) return CopyMode::kAuto;
  const std::string v = env;
  if (v == "parallel_for") return CopyMode::kParallelFor;
  if (v == "memcpy") return CopyMode::kMemcpy;
  if (v == "prefetch") return CopyMode::kPrefetch;
  if (v == "stream") return CopyMode::kStream;
  return CopyMode::kAuto;
}

// Batches this large (half this machine's last-level cache) mostly do not
// stay in cache, so writing around the cache (non-temporal stores) saves
// reading every destination line first. Smaller batches use ordinary stores:
// their destination stays in cache for whoever reads it next.
constexpr int64_t kStreamThreshold = int64_t{16} << 20;

bool cpu_has_avx2() {
#if KVSWAP_HAVE_STREAM_COPY
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
#else
  return false;
#endif
}

// Bytes of the next block to prefetch; 16 and 64 KiB measured no better.
constexpr size_t kPrefetchBytes = 4096;

// Prefetches the first bytes of the next source block: the hardware
// prefetcher does not cross into a scattered block by itself, so each small
// block would otherwise start with a run of demand misses.
inline void prefetch_block(const char* p, size_t bytes) {
  const size_t n = std::min<size_t>(bytes, kPrefetchBytes);
  for (size_t off = 0; off < n; off += 64) {
    __builtin_prefetch(p + off, 0, 3);
  }
}

// One contiguous run of bytes of a part: a whole descriptor, or the end of
// one that a part boundary cut.
struct Piece {
  char* dst;
  const char* src;
  size_t bytes;
};

// The pieces of bytes [offset, offset + bytes) of a batch, counted across all
// descriptors from descriptor `first` on. Splitting by bytes rather than by
// descriptor keeps the threads equally loaded whatever the mix of sizes.
class Pieces {
 public:
  Pieces(const CopyBatch& b, int64_t first, int64_t offset, int64_t bytes)
      : b_(b), next_(first), offset_(offset), left_(bytes) {}

  bool next(Piece& p) {
    if (left_ == 0) return false;
    const int64_t n = std::min(b_.size[next_] - offset_, left_);
    p = {static_cast<char*>(as_ptr(b_.dst[next_] + offset_)),
         static_cast<const char*>(as_ptr(b_.src[next_] + offset_)), static_cast<size_t>(n)};
    left_ -= n;
    offset_ = 0;
    ++next_;
    return true;
  }

  // Fills out[0 .. max) with the next pieces; returns how many there were.
  int take(Piece* out, int max) {
    int k = 0;
    while (k < max && next(out[k])) ++k;
    return k;
  }

 private:
  const CopyBatch& b_;
  int64_t next_;
  int64_t offset_;
  int64_t left_;
};

// Ordinary stores (batches that fit in the last-level cache stay there for
// the consumer), optionally prefetching the start of the next piece.
void memcpy_pieces(Pieces pieces, bool prefetch) {
  Piece p, q;
  for (bool have = pieces.next(p); have;) {
    const bool more = pieces.next(q);
    if (prefetch && more) prefetch_block(q.src, q.bytes);
    std::memcpy(p.dst, p.src, p.bytes);
    p = q;
    have = more;
  }
}

// How many pieces one thread copies side by side with streaming stores. Each
// scattered block starts with a round of cache, TLB and DRAM misses; copying
// several blocks line by line in turn overlaps those rounds instead of paying
// them one after another. Measured against one block at a time: 2 blocks
// +8 %, 4 blocks +11-26 % for 2-64 KiB blocks; 8 blocks gained 4 % more at
// 2 KiB but lost at 16 KiB and above (docs/performance.md, attempt 10).
constexpr int kStreams = 4;

#if KVSWAP_HAVE_STREAM_COPY
// Copies one 128-byte chunk; `d` is 32-byte aligned.
__attribute__((target("avx2"), always_inline)) inline void stream_chunk(char* d, const char* s) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
  const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
}

// Copies the n pieces of `group` side by side, 128 bytes of each in turn,
// with non-temporal stores (no read-for-ownership of the destination), while
// prefetching the m pieces of the next group at the same offsets, so the
// prefetch runs a steady group ahead of the loads, page boundaries included.
__attribute__((target("avx2"))) void copy_group_stream(Piece* group, int n, const Piece* next, int m) {
  size_t common = SIZE_MAX;
  for (int k = 0; k < n; ++k) {
    Piece& p = group[k];
    // Bring the destination to a 32-byte boundary for the streaming stores.
    const auto misalign = reinterpret_cast<uintptr_t>(p.dst) & 31;
    const size_t head = std::min(p.bytes, static_cast<size_t>((32 - misalign) & 31));
    std::memcpy(p.dst, p.src, head);
    p.dst += head;
    p.src += head;
    p.bytes -= head;
    common = std::min(common, p.bytes);
  }
  common &= ~size_t{127};
  for (size_t off = 0; off < common; off += 128) {
    for (int j = 0; j < m; ++j) {
      if (off < next[j].bytes) {
        __builtin_prefetch(next[j].src + off, 0, 3);
        __builtin_prefetch(next[j].src + off + 64, 0, 3);
      }
    }
    for (int k = 0; k < n; ++k) stream_chunk(group[k].dst + off, group[k].src + off);
  }
  // What is left of each piece (under 128 bytes when the sizes are equal).
  for (int k = 0; k < n; ++k) {
    char* d = group[k].dst + common;
    const char* s = group[k].src + common;
    size_t left = group[k].bytes - common;
    for (; left >= 128; left -= 128, d += 128, s += 128) stream_chunk(d, s);
    std::memcpy(d, s, left);
  }
}

// Makes streamed stores visible before a part ends.
inline void stream_fence() { _mm_sfence(); }
#else
// No streaming stores on this architecture: copy_batch never selects kStream.
void copy_group_stream(Piece* group, int n, const Piece*, int) {
  for (int k = 0; k < n; ++k) std::memcpy(group[k].dst, group[k].src, group[k].bytes);
}
inline void stream_fence() {}
#endif

void stream_pieces(Pieces pieces) {
  Piece groups[2][kStreams];
  int current = 0;
  int n = pieces.take(groups[current], kStreams);
  while (n > 0) {
    const int m = pieces.take(groups[1 - current], kStreams);
    copy_group_stream(groups[current], n, groups[1 - current], m);
    current = 1 - current;
    n = m;
  }
  stream_fence();
}

// Copies bytes [offset, offset + bytes) of the batch, counted from
// descriptor `first` on.
void copy_byte_range(const CopyBatch& b, int64_t first, int64_t offset, int64_t bytes, CopyMode mode) {
  const Pieces pieces(b, first, offset, bytes);
  if (mode == CopyMode::kStream) {
    stream_pieces(pieces);
  } else {
    memcpy_pieces(pieces, mode == CopyMode::kPrefetch);
  }
}

// The routine `mode` resolves to for a batch of `total_bytes` bytes: `auto`
// streams batches of kStreamThreshold bytes and more where AVX2 exists
// (tests/test_swap_blocks_batch.py::test_auto_streams_from_16_mib_on), and
// `stream` falls back to memcpy without AVX2.
CopyMode resolve_mode(CopyMode mode, int64_t total_bytes) {
  if (mode == CopyMode::kAuto) {
    return (cpu_has_avx2() && total_bytes >= kStreamThreshold) ? CopyMode::kStream : CopyMode::kMemcpy;
  }
  if (mode == CopyMode::kStream && !cpu_has_avx2()) return CopyMode::kMemcpy;
  return mode;
}

// How many byte ranges a batch is split into for the intra-op threads: at
// most one per thread and one per half kParallelThreshold; 1 (the calling
// thread alone) below kParallelThreshold and in a forked child
// (tests/test_swap_blocks_batch.py::test_batches_from_1_mib_on_are_split_across_the_threads).
int split_parts(int64_t total_bytes) {
  if (total_bytes < kParallelThreshold || !threads_usable()) return 1;
  return static_cast<int>(std::min<int64_t>(at::get_num_threads(), total_bytes / (kParallelThreshold / 2)));
}

void copy_batch(const CopyBatch& b) {
  const CopyMode mode = resolve_mode(configured_mode(), b.total_bytes);
  if (mode == CopyMode::kParallelFor) {
    // The textbook loop, kept as the measured baseline: one descriptor per
    // iteration, split by count.
    parallel_range(b.count, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memcpy(as_ptr(b.dst[i]), as_ptr(b.src[i]), static_cast<size_t>(b.size[i]));
      }
    });
    return;
  }
  const int parts = split_parts(b.total_bytes);
  if (parts <= 1) {
    copy_byte_range(b, 0, 0, b.total_bytes, mode);
    return;
  }
  // Where each part starts: (descriptor, offset into it).
  std::vector<int64_t> first(parts), offset(parts), share(parts);
  int64_t i = 0, consumed = 0;  // bytes before descriptor i
  for (int p = 0; p < parts; ++p) {
    const int64_t begin = b.total_bytes * p / parts;
    const int64_t end = b.total_bytes * (p + 1) / parts;
    while (consumed + b.size[i] <= begin) {
      consumed += b.size[i];
      ++i;
    }
    first[p] = i;
    offset[p] = begin - consumed;
    share[p] = end - begin;
  }
  parallel_range(parts, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) copy_byte_range(b, first[p], offset[p], share[p], mode);
  });
}

const char* mode_name(CopyMode mode) {
  switch (mode) {
    case CopyMode::kParallelFor:
      return "parallel_for";
    case CopyMode::kPrefetch:
      return "prefetch";
    case CopyMode::kStream:
      return "stream";
    default:
      return "memcpy";
  }
}

// What copy_batch would do with a batch of `total_bytes` bytes from this
// thread now (host_engine::copy_plan). For tests.
std::tuple<std::string, int64_t> host_copy_plan(int64_t total_bytes) {
  TORCH_CHECK_VALUE(total_bytes >= 0, "total_bytes must be >= 0, got ", total_bytes);
  const CopyMode mode = resolve_mode(configured_mode(), total_bytes);
  if (mode == CopyMode::kParallelFor) {
    return {mode_name(mode), threads_usable() ? at::get_num_threads() : 1};
  }
  return {mode_name(mode), split_parts(total_bytes)};
}

void submit_host(const CopyBatch& batch, c10::Device device) {
  before_any_copy([&] { TORCH_CHECK(device.is_cpu(), "host engine asked to copy on ", device); });
  copy_batch(batch);  // plain memory copies: nothing here fails once started
}

const EngineInterface kHostEngine{
    /*name=*/"host engine (torch_kvswap._C)",
    /*submit=*/&submit_host,
    // Host memory is never captured, pinned or mapped for the host itself,
    // and the host has nothing to report nor a copy kernel.
    /*stream_capturing=*/nullptr,
    /*host_register=*/nullptr,
    /*host_pinned=*/nullptr,
    /*host_mapped=*/nullptr,
    /*report=*/nullptr,
    /*copy_blocks=*/nullptr,
};

}  // namespace

namespace host_engine {
const EngineInterface& engine_interface() { return kHostEngine; }
std::tuple<std::string, int64_t> copy_plan(int64_t total_bytes) { return host_copy_plan(total_bytes); }
}  // namespace host_engine

}  // namespace kvswap
