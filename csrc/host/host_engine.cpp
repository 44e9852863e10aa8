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
#include <vector>

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

// Copies bytes [begin, end) of the batch, counted across all descriptors in
// order. Splitting by bytes rather than by descriptor keeps the threads
// equally loaded whatever the mix of sizes.
void copy_byte_range(const CopyBatch& b, int64_t first, int64_t offset, int64_t bytes) {
  for (int64_t i = first; bytes > 0; ++i) {
    const int64_t n = std::min(b.size[i] - offset, bytes);
    std::memcpy(as_ptr(b.dst[i] + offset), as_ptr(b.src[i] + offset), static_cast<size_t>(n));
    bytes -= n;
    offset = 0;
  }
}

void copy_batch(const CopyBatch& b) {
  auto& pool = HostCopyPool::instance();
  const int parts =
      b.total_bytes < kParallelThreshold ? 1 : static_cast<int>(std::min<int64_t>(
                                                   pool.threads(), b.total_bytes / (kParallelThreshold / 2)));
  if (parts <= 1) {
    copy_byte_range(b, 0, 0, b.total_bytes);
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
  pool.run(parts, [&](int p) { copy_byte_range(b, first[p], offset[p], share[p]); });
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
