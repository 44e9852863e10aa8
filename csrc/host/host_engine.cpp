// The host engine: copies a CopyBatch with memcpy on a small persistent
// thread pool. It serves `kvswap::_submit` under the CPU key, so it runs when
// both sides of a copy are host memory, and for the pointer op on a machine
// with no accelerator. It is synchronous: the bytes have arrived on return.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
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

// A fixed set of worker threads that each run one part of a job. The caller
// runs part 0 itself. Jobs are serialized: the handler's worker thread and a
// model thread may both submit. After fork() the child builds a new pool (the
// parent's threads do not exist there).
class HostCopyPool {
 public:
  static HostCopyPool& instance() {
    static std::mutex creation;
    static HostCopyPool* pool = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> lock(creation);
    if (pool == nullptr || owner != getpid()) {
      pool = new HostCopyPool(configured_threads());  // never freed: process lifetime
      owner = getpid();
    }
    return *pool;
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(0) .. fn(parts - 1), fn(0) on the calling thread; returns when
  // all parts are done. parts <= threads().
  void run(int parts, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> serial(submit_);
    if (parts <= 1) {
      fn(0);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      parts_ = parts;
      pending_.store(parts - 1, std::memory_order_relaxed);
      ++generation_;
    }
    wake_.notify_all();
    fn(0);
    // Parts are short (one share of one batch); spin rather than sleep so a
    // small batch does not pay a futex round trip at the end.
    while (pending_.load(std::memory_order_acquire) != 0) {
      std::this_thread::yield();
    }
  }

 private:
  explicit HostCopyPool(int threads) {
    for (int i = 1; i < threads; ++i) {
      workers_.emplace_back([this, i] { work(i); });
      workers_.back().detach();
    }
  }

  static int configured_threads() {
    if (const char* env = std::getenv("KVSWAP_HOST_THREADS")) {
      const int n = std::atoi(env);
      if (n >= 1) return n;
    }
    return std::max(1, at::get_num_threads());
  }

  void work(int index) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index < parts_) job = job_;
      }
      if (job != nullptr) {
        (*job)(index);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::mutex submit_;
  std::mutex mutex_;
  std::condition_variable wake_;
  const std::function<void(int)>* job_ = nullptr;
  int parts_ = 0;
  uint64_t generation_ = 0;
  std::atomic<int> pending_{0};
  std::vector<std::thread> workers_;
};

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
    at::parallel_for(0, b.count, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memcpy(as_ptr(b.dst[i]), as_ptr(b.src[i]), static_cast<size_t>(b.size[i]));
      }
    });
    return;
  }
  if (mode == CopyMode::kAuto) {
    mode = (cpu_has_avx2() && b.total_bytes >= kStreamThreshold) ? CopyMode::kStream
                                                                  : CopyMode::kMemcpy;
  } else if (mode == CopyMode::kStream && !cpu_has_avx2()) {
    mode = CopyMode::kMemcpy;
  }
  auto& pool = HostCopyPool::instance();
  const int parts =
      b.total_bytes < kParallelThreshold ? 1 : static_cast<int>(std::min<int64_t>(
                                                   pool.threads(), b.total_bytes / (kParallelThreshold / 2)));
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
  pool.run(parts, [&](int p) { copy_byte_range(b, first[p], offset[p], share[p], mode); });
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
