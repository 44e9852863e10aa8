// Internal declarations shared by the core's files (csrc/core/). Nothing
// here is part of an engine's interface: engines see only kvswap.h.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/util/llvmMathExtras.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "../kvswap.h"

namespace kvswap {

// The host engine (csrc/host/host_engine.cpp), part of the core's library:
// it serves the CPU from the start.
namespace host_engine {
const EngineInterface& engine_interface();
// How it would copy a batch of `total_bytes` bytes from this thread now: the
// copy routine and how many parts the bytes are split into (test hook).
std::tuple<std::string, int64_t> copy_plan(int64_t total_bytes);
}  // namespace host_engine

namespace core {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// --- engines.cpp: engine lookup, descriptor tables, submission ---------------

// The registry the core module exports to engines (python_module.h).
extern const EngineRegistry kRegistry;

// The engine that serves `type` now, or null.
const EngineInterface* engine_of(c10::DeviceType type);

// The engine of `device`, or a NotImplementedError saying which engine is
// missing for `purpose` and how to get it.
const EngineInterface& engine_for(c10::Device device, const char* purpose);

// Whether the current stream of `device` is being captured into a graph, as
// its engine reports. The host, and an engine without the query, never capture.
bool stream_capturing(c10::Device device);

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

// Descriptors in the layout EngineInterface::submit takes: one [3, n] int64 CPU tensor whose
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
    if (count > 0 && src_[count - 1] + size_[count - 1] == s && dst_[count - 1] + size_[count - 1] == d) {
      size_[count - 1] += bytes;
      return;
    }
    src_[count] = s;
    dst_[count] = d;
    size_[count] = bytes;
    ++count;
  }

  // The batch an engine receives (kvswap.h): this table's rows, held by it.
  CopyBatch batch(Direction direction) const {
    return CopyBatch{src_, dst_, size_, count, total_bytes, direction, table};
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

// Hands `d` to the engine of `device`; an empty batch touches nothing.
void submit(const Descriptors& d, Direction direction, c10::Device device);

// After a copy between `caches` on the host and `device` was queued: tells
// the pinned allocator of `device` the stream that uses each host storage,
// so that a pinned tensor freed right after the call is not reused before
// the copy has run (torch_npu's own copies do the same).
void record_host_use(at::TensorList src_caches, at::TensorList dst_caches, c10::Device device);

// --- validation.cpp ---------------------------------------------------------

// torch's Python name of a dtype ("torch.int32", not C++'s "Int"), for errors
// that users read next to their Python code.
std::string dtype_name(c10::ScalarType type);

// Where the blocks of one cache tensor live: block b starts at
// base + b * stride and spans the pair's block_bytes. A storage resized or
// freed after the tensor was made (untyped_storage().resize_) leaves its
// sizes as they were: only the first in_storage blocks lie within the
// storage's storage_bytes bytes now (block b begins storage_begin +
// b * stride bytes into it). A tensor without storage counts all its blocks.
struct CacheLayout {
  int64_t base;
  int64_t stride;
  int64_t num_blocks;
  int64_t in_storage;
  int64_t storage_begin;
  int64_t storage_bytes;
};

struct PairLayout {
  CacheLayout src;
  CacheLayout dst;
  int64_t block_bytes;
};

// Every element of `t` lies within its storage as it is now (a storage
// resized or freed after the view was made keeps the view's sizes); a
// RuntimeError in torch's words names `name` otherwise.
void check_elements_in_storage(const at::Tensor& t, const char* name);

// One of the pointer op's three descriptor tensors: int64, 1-D, CPU,
// `expected_len` entries, all within its storage.
void check_descriptor_tensor(const at::Tensor& t, const char* name, int64_t expected_len);

// The three descriptor tensors of a pointer-op call that passed
// check_descriptor_tensor, as contiguous int64 arrays of n entries (kept
// alive here) for the loops that read them.
class DescriptorArrays {
  at::Tensor src_t_, dst_t_, size_t_;  // first: the pointers below read them

 public:
  DescriptorArrays(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes)
      : src_t_(src_ptrs.contiguous()),
        dst_t_(dst_ptrs.contiguous()),
        size_t_(sizes.contiguous()),
        src(src_t_.const_data_ptr<int64_t>()),
        dst(dst_t_.const_data_ptr<int64_t>()),
        size(size_t_.const_data_ptr<int64_t>()),
        n(src_t_.numel()) {}

  const int64_t* src;
  const int64_t* dst;
  const int64_t* size;
  int64_t n;
};

// The device shared by every tensor of `caches` (none for an empty list).
std::optional<c10::Device> common_device(at::TensorList caches, const char* list);

// Checks the cache pairs of a block copy and returns their layouts.
std::vector<PairLayout> layout_pairs(at::TensorList src_caches, at::TensorList dst_caches);

// Every host tensor of `src_caches` and `dst_caches` lies in page-locked
// memory, as the engine of `device` sees it (EngineInterface::host_pinned); a
// ValueError names the first that does not and says how to pin it.
void check_host_caches_pinned(at::TensorList src_caches, at::TensorList dst_caches, c10::Device device);

// A block-id tensor: int64, 1-D, all within its storage.
void check_ids_tensor(const at::Tensor& ids, const char* name);

// Every block of every cache lies within its storage as it is now; for
// block ids that are not read (the kernel path's device ids), where each
// id could name any block.
void check_all_blocks_in_storage(const std::vector<PairLayout>& pairs);

// Every id in range for every tensor it indexes, no destination block written
// twice, no block both read and written when a pair shares memory, and no
// pair writing what another pair reads or writes (check_cross_pair_aliasing).
void check_block_ids(const int64_t* sid, const int64_t* did, int64_t n, const std::vector<PairLayout>& pairs);

// --- aliasing.cpp: one pair's writes against the other pairs ---------------

// For ids that passed check_block_ids' range checks: no block that one pair
// writes shares a byte with a block that another pair of the call reads or
// writes. A ValueError names both blocks and the shared bytes.
void check_cross_pair_aliasing(const int64_t* sid, const int64_t* did, int64_t n,
                               const std::vector<PairLayout>& pairs);

// For ids in range, where pair `i`'s source and destination share memory
// with different layouts: no block it reads shares a byte with a block it
// writes (blocks interleaved on one stride without sharing bytes are apart).
void check_pair_aliasing(const int64_t* sid, const int64_t* did, int64_t n,
                         const std::vector<PairLayout>& pairs, size_t i);

// Without the ids (block ids on the device, which are not read back): no
// pair's written cache may share memory with another pair's caches at all,
// unless their blocks interleave on one stride. `why` says why the ids are
// not looked at.
void check_no_aliasing_pairs(const std::vector<PairLayout>& pairs, const char* why);

// --- descriptors.cpp: building, merging and ordering ------------------------

// Validates every raw descriptor before anything is copied, drops zero-byte
// ones and merges neighbours; for the host engine orders them by source.
Descriptors plan_pointer_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                               const at::Tensor& sizes, int64_t direction, c10::Device device);

// The descriptors of a block copy over `pairs` for ids that are valid.
Descriptors build_block_descriptors(const std::vector<PairLayout>& pairs, const int64_t* sid,
                                    const int64_t* did, int64_t n);

// The (src, dst) id pairs ordered by source id: sorted source ids, then the
// matching destination ids.
std::vector<int64_t> sort_by_source(const int64_t* sid, const int64_t* did, int64_t n,
                                    const std::vector<PairLayout>& pairs);

// --- checked.cpp: checked mode (docs/checked.md) ----------------------------

// Whether checked mode is on (process-wide; torch_kvswap.checked() and
// KVSWAP_CHECK set it through kvswap::_set_checked). Off, this load is all
// that checked mode costs a call.
extern std::atomic<bool> g_checked_mode;
inline bool checked_mode() { return g_checked_mode.load(std::memory_order_relaxed); }

// For a pointer-op call that passed plan_pointer_batch: every descriptor lies
// inside one registered region of the side its direction says, no two
// destinations overlap, and (where sources and destinations share an address
// space) no descriptor reads what another writes. `op` names the call in
// the error.
void check_pointer_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes,
                         int64_t direction, c10::Device device, const char* op);

// Block ids on the device, which the kernel path never reads on the host:
// read back (a synchronization) and checked like host ids; skipped with one
// warning while the stream of `device` is being captured.
void check_device_resident_ids(const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids,
                               const std::vector<PairLayout>& pairs, c10::Device device);

}  // namespace core
}  // namespace kvswap
