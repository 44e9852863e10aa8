// A fake of CANN's ACL runtime on host memory, for running the Ascend
// engine's logic (csrc/ascend/ascend_engine.cpp) in CPU CI. Compiled only
// into the test extension kvswap_fake_npu, never into torch_kvswap.
//
// What it models (each rule cites its source in fake_acl.cpp):
//   - a pointer registry: device memory with its device id, pinned host
//     memory (the pinned allocator, aclrtHostRegisterV2 PINNED), mapped host
//     memory, and pageable host memory (anything else);
//   - the checks of aclrtMemcpyAsync and aclrtMemcpyBatchAsync as CANN's
//     source states them;
//   - streams as queues: a queued copy lands only when its stream is
//     synchronized or an event after it is queried, so a missing ordering
//     shows up as stale data;
//   - graph capture per stream: captured copies go into a graph, replay
//     queues them again; a graph holds a bounded number of work entries;
//   - the two ways CANN implements aclrtMemcpyBatchAsync: entry by entry
//     (queuing the entries before a failure) and in chunks (UB), with a
//     batch's copies run in a scrambled order (CANN does not order them);
//   - unkind answers: 207000 for a device or one stream, 207000 after some
//     entries were queued, a pin that only records the range;
//   - injectable faults: a function absent, an error code at call k, an
//     error at entry i of a batch, a registration that does nothing.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ascend/acl_api.h"

namespace kvswap {
namespace fake {

using ascend::AclError;
using ascend::CaptureStatus;

// kRecorded: "pinned" by aclrtHostRegisterV2 on a driver without
// FEATURE_SVM_MEM_REGISTER_HOST_PINNED: recorded as registered, not locked.
enum class Kind { kPageable, kPinned, kMapped, kRecorded, kDevice };

// Which of CANN's implementations of aclrtMemcpyBatchAsync the fake follows.
enum class BatchRoute {
  kLoop,  // entry by entry (ApiImpl::LoopMemcpyAsync)
  kUb,    // all entries checked, then chunks (ApiImplDavid::BatchMemcpyAsync)
};

// An error at entry `entry` of the aclrtMemcpyBatchAsync call number
// `at_call` (-1: every call): the failed submission of that entry (route
// kLoop) or of the chunk holding it (route kUb).
struct EntryFault {
  size_t entry;
  AclError code;
  int64_t at_call;
};

struct Region {
  uintptr_t start = 0;
  uint64_t bytes = 0;
  Kind kind = Kind::kPageable;
  int device = -1;
  bool in_place = false;  // pinned or mapped by aclrtHostRegisterV2
};

struct Stream {
  int device = 0;
  int64_t id = 0;
  std::deque<std::pair<uint64_t, std::function<void()>>> queue;  // (sequence number, task)
  uint64_t submitted = 0;                                        // sequence number of the last task queued
  uint64_t executed = 0;                                         // sequence number of the last task run
  CaptureStatus capture = CaptureStatus::kNone;
  int graph = -1;  // while capturing
};

struct Event {
  Stream* stream = nullptr;
  uint64_t seq = 0;
  bool recorded = false;
  double time_ms = 0;
  int queued_records = 0;                      // record tasks not yet run
  bool destroyed = false;                      // destroyed while a record was queued: freed by the last one
  static inline std::atomic<int64_t> live{0};  // events not yet freed (tests)
  Event() { ++live; }
  ~Event() { --live; }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

// The last aclrtMemcpyBatchAsync call that reached the fake (for tests).
struct BatchCall {
  size_t num_batches = 0;
  size_t num_attrs = 0;
  uintptr_t dsts = 0;  // address of the caller's dsts array
};

class Runtime {
 public:
  static Runtime& get();
  std::recursive_mutex mutex;

  // Pointer registry.
  void add_region(const void* start, uint64_t bytes, Kind kind, int device, bool in_place = false);
  void remove_region(const void* start);
  Region region_of(const void* p) const;  // kPageable when unknown
  std::string kind_name(const void* p) const;

  // Streams; (device, 0) is each device's default stream.
  Stream* stream(int device, int64_t id);
  int64_t new_stream(int device);
  uint64_t enqueue(Stream* s, std::function<void()> task);
  void drain(Stream* s, uint64_t upto = UINT64_MAX);
  void drain_device(int device);
  size_t pending(int device, int64_t id);

  // Events of the torch side (torch.Event on the fake device).
  Event* record_event(Event* e, Stream* s);
  bool query_event(Event* e);  // lands the copies up to the event

  // Graph capture: copies on a capturing stream are recorded into its graph.
  void capture_begin(Stream* s);
  int capture_end(Stream* s);
  void replay(int graph, Stream* s);
  bool capturing(const Stream* s) const { return s->capture != CaptureStatus::kNone; }
  size_t graph_size(int graph) const { return graphs_.at(static_cast<size_t>(graph)).size(); }
  uint64_t graph_entries(int graph) const { return graph_entries_.at(static_cast<size_t>(graph)); }
  AclError record_into_graph(Stream* s, std::function<void()> task, uint64_t bytes);

  // Faults and call counts.
  AclError injected(const char* function);  // 0, or the code armed for this call
  void fail(const std::string& function, AclError code, int64_t at_call);
  int64_t calls(const std::string& function) const;
  std::set<std::string> absent;
  bool null_stream_next = false;
  BatchCall last_batch;

  // Unkind behaviour (tests set these; reset clears them).
  BatchRoute batch_route = BatchRoute::kLoop;
  size_t ub_chunk = 0;  // entries per UB chunk; 0: the whole batch
  std::vector<EntryFault> entry_faults;
  std::set<int> batch_refused_devices;                      // 207000 for every batch on the device
  std::set<std::pair<int, int64_t>> batch_refused_streams;  // 207000 for one stream
  bool pin_records_only = false;       // driver without FEATURE_SVM_MEM_REGISTER_HOST_PINNED
  bool register_does_nothing = false;  // aclrtHostRegisterV2 succeeds and registers nothing
  // aclrtHostRegisterV2 of more bytes fails (207001): CANN documents no limit,
  // CUDA hosts refuse one registration of 512 GiB or more (vLLM #45850), so the
  // fake lets a test set one. -1: none.
  int64_t register_max_bytes = -1;
  int64_t registered_bytes = 0;        // bytes page-locked since reset: the cost clock
  uint64_t work_entry_bytes = 0;       // bytes per captured work entry; 0: one per copy
  uint64_t scramble_calls = 0;         // batches scrambled so far (seeds the order)
  AclError entry_fault(size_t entry);  // for the current batch call

  // The ACL table handed to the engine (rebuilt by reset from `absent`).
  const ascend::AclApi& table() const { return table_; }
  // Forgets faults, counts, captures and queued copies; rebuilds the table
  // and the engine (its latches start over).
  void reset();
  void rebuild_table();
  AclError error(AclError code, std::string message);  // sets the recent message
  static const char* recent_message();

 private:
  Runtime() { rebuild_table(); }
  std::map<uintptr_t, Region> regions_;
  std::map<std::pair<int, int64_t>, std::unique_ptr<Stream>> streams_;
  std::map<int, int64_t> next_stream_id_;
  std::vector<std::vector<std::function<void()>>> graphs_;
  std::vector<uint64_t> graph_entries_;  // work entries of each graph
  struct Fault {
    AclError code;
    int64_t at_call;  // -1: every call
  };
  std::map<std::string, Fault> faults_;
  std::map<std::string, int64_t> calls_;
  ascend::AclApi table_;
};

// The fake's own ACL functions, for tests of its rules.
const ascend::AclApi& fake_table();

// Where a null stream resolves: the current device of the fake backend.
void set_current_device_source(int (*fn)());

// A table whose functions do nothing and succeed, for measuring what the
// engine itself costs.
const ascend::AclApi& noop_table();

// Work entries one captured stream can hold (EE1023); see fake_acl.cpp.
constexpr uint64_t kGraphWorkEntries = 32768;

}  // namespace fake
}  // namespace kvswap
