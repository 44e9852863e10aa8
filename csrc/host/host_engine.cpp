// The host engine: copies a CopyBatch on torch's intra-op threads, split by
// bytes, with streaming stores for large batches. It serves `kvswap::_submit`
// under the CPU key, so it runs when both sides of a copy are host memory, and
// for the pointer op on a machine with no accelerator. It is synchronous: the
// bytes have arrived on return.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
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
#error "torch's parallel backend is OpenMP: compile the host engine with -fopenmp, or at::parallel_for runs on one thread"
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

// Runs fn(0) .. fn(parts - 1) on the intra-op threads and returns when all
// are done; on the calling thread alone inside another parallel region or in
// a forked child.
template <typename Fn>
void run_parts(int64_t parts, const Fn& fn) {
  if (parts <= 1 || !threads_usable()) {
    for (int64_t p = 0; p < parts; ++p) fn(p);
    return;
  }
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) fn(p);
  });
}

// Below this many bytes one thread copies everything: waking a worker costs
// more than it saves.
constexpr int64_t kParallelThreshold = int64_t{1} << 20;

// How bytes are moved, from KVSWAP_HOST_COPY (read per call, so the benchmark
// can compare the alternatives in one run; docs/performance.md has the
// numbers): `auto` (default) picks `stream` where AVX2 is available for
// batches larger than the last-level cache, else `memcpy` (prefetching the
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

// Batches larger than this do not stay in cache, so writing around the cache
// (non-temporal stores) saves reading every destination line first.
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


#if KVSWAP_HAVE_STREAM_COPY
// Makes streamed stores visible before a part ends.
inline void stream_fence() { _mm_sfence(); }

// memcpy with non-temporal 32-byte stores for the aligned middle part. While
// it copies, it prefetches the next block at the same offset (`next`,
// `next_len`), so the prefetch runs a steady block ahead of the loads across
// the whole block, page boundaries included.
__attribute__((target("avx2"))) void copy_stream(char* d, const char* s, size_t n, const char* next,
                                                 size_t next_len) {
  const size_t head = std::min(n, static_cast<size_t>((32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31));
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t off = 0;
  for (; n >= 128; n -= 128, d += 128, s += 128, off += 128) {
    if (off < next_len) {
      __builtin_prefetch(next + off, 0, 3);
      __builtin_prefetch(next + off + 64, 0, 3);
    }
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 96), e);
  }
  std::memcpy(d, s, n);
}
#else
// No streaming stores on this architecture: copy_batch never selects kStream.
inline void stream_fence() {}
inline void copy_stream(char* d, const char* s, size_t n, const char*, size_t) { std::memcpy(d, s, n); }
#endif

// Copies bytes [offset, offset + bytes) of the batch, counted across all
// descriptors from descriptor `first` on. Splitting by bytes rather than by
// descriptor keeps the threads equally loaded whatever the mix of sizes.
void copy_byte_range(const CopyBatch& b, int64_t first, int64_t offset, int64_t bytes,
                     CopyMode mode) {
  for (int64_t i = first; bytes > 0; ++i) {
    const int64_t n = std::min(b.size[i] - offset, bytes);
    char* d = static_cast<char*>(as_ptr(b.dst[i] + offset));
    const char* s = static_cast<const char*>(as_ptr(b.src[i] + offset));
    // The next block of this part, if any, to prefetch while copying.
    const bool more = n < bytes;
    const char* next = more ? static_cast<const char*>(as_ptr(b.src[i + 1])) : nullptr;
    const size_t next_len = more ? static_cast<size_t>(std::min(b.size[i + 1], bytes - n)) : 0;
    if (mode == CopyMode::kStream) {
      copy_stream(d, s, static_cast<size_t>(n), next, next_len);
    } else {
      if (mode == CopyMode::kPrefetch && more) prefetch_block(next, next_len);
      std::memcpy(d, s, static_cast<size_t>(n));
    }
    bytes -= n;
    offset = 0;
  }
  if (mode == CopyMode::kStream) stream_fence();
}

void copy_batch(const CopyBatch& b) {
  CopyMode mode = configured_mode();
  if (mode == CopyMode::kParallelFor) {
    // The textbook loop, kept as the measured baseline: one descriptor per
    // iteration, split by count.
    auto copy = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memcpy(as_ptr(b.dst[i]), as_ptr(b.src[i]), static_cast<size_t>(b.size[i]));
      }
    };
    if (threads_usable()) {
      at::parallel_for(0, b.count, 1, copy);
    } else {
      copy(0, b.count);
    }
    return;
  }
  if (mode == CopyMode::kAuto) {
    mode = (cpu_has_avx2() && b.total_bytes >= kStreamThreshold) ? CopyMode::kStream
                                                                  : CopyMode::kMemcpy;
  } else if (mode == CopyMode::kStream && !cpu_has_avx2()) {
    mode = CopyMode::kMemcpy;
  }
  const int parts =
      b.total_bytes < kParallelThreshold ? 1 : static_cast<int>(std::min<int64_t>(
                                                   at::get_num_threads(), b.total_bytes / (kParallelThreshold / 2)));
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
  run_parts(parts, [&](int64_t p) { copy_byte_range(b, first[p], offset[p], share[p], mode); });
}

void submit_host(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes,
                 int64_t direction, int64_t total_bytes, c10::Device device) {
  TORCH_CHECK(device.is_cpu(), "host engine asked to copy on ", device);
  copy_batch(batch_from_tensors(src_ptrs, dst_ptrs, sizes, direction, total_bytes));
}

}  // namespace
}  // namespace kvswap

TORCH_LIBRARY_IMPL(kvswap, CPU, m) {
  m.impl("_submit", &kvswap::submit_host);
}
