// The fake ACL runtime (see fake_acl.h). Every rule names its source:
//   [rt FILE:LINE]   CANN's runtime source, github.com/hicann/runtime at
//                    commit 681ef7610df13c8128982901142a2c869ddbb53e;
//   [hdr FILE:LINE]  torch-npu 2.13.0's copy of CANN's headers
//                    (torch_npu/include/acl/...);
//   [doc PAGE]       CANN's API reference in the same runtime repository
//                    (docs/zh/api_ref/PAGE).
// A rule is never more lenient than its source. Where the source leaves a
// choice, the stricter reading is taken and says so.
#include "fake_acl.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "ascend/ascend_engine.h"

namespace kvswap {
namespace fake {

using ascend::AclApi;
using ascend::AclStream;
using ascend::MemcpyBatchAttr;
using ascend::MemcpyKind;
using ascend::MemLocationType;

namespace {

constexpr AclError kInvalidParam = 100000;  // ACL_ERROR_INVALID_PARAM [hdr acl_base_rt.h:67]
constexpr AclError kRtStreamContext =
    107003;  // ACL_ERROR_RT_STREAM_CONTEXT [hdr error_codes/rt_error_codes.h:24]
constexpr AclError kRtMemoryAllocation = 207001;  // ACL_ERROR_RT_MEMORY_ALLOCATION [hdr rt_error_codes.h]
constexpr AclError kRtParamInvalid =
    107000;  // ACL_ERROR_RT_PARAM_INVALID [hdr error_codes/rt_error_codes.h:21]
constexpr AclError kRtAddrUnaligned = 107008;  // ACL_ERROR_RT_ADDR_UNALIGNED [hdr rt_error_codes.h:29]
// ACL_ERROR_RT_NO_STREAM_RESOURCE [hdr rt_error_codes.h:77]: what EE1023's
// RT_ERROR_JETTY_LIMIT becomes [rt src/runtime/core/src/common/errcode_manage.cc:96].
constexpr AclError kRtNoStreamResource = 207008;
// ACL_ERROR_HOST_MEMORY_ALREADY_REGISTERED / _NOT_REGISTERED [hdr rt_error_codes.h:160-161],
// what RT_ERROR_HOST_MEMORY_ALREADY_REGISTERED / _NOT_REGISTERED become [errcode_manage.cc:553-556].
constexpr AclError kHostMemoryAlreadyRegistered = 507910;
constexpr AclError kHostMemoryNotRegistered = 507911;
constexpr size_t kMaxBatchCount =
    4096;  // DEVMM_MEMCPY_BATCH_MAX_COUNT [rt pkg_inc/driver/ascend_hal_define.h:810]

thread_local std::string recent;

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The location CANN reports for a pointer [rt src/runtime/driver/npu_driver_mem.cc:2055-2074]:
// device memory is DEVICE; host memory registered pinned or mapped is HOST
// (IsRegisteredMemory counts both [rt src/runtime/core/src/common/register_memory.cc:104-115]),
// and so is a range only recorded as pinned (DV_MEM_USER_MALLOC, then
// IsRegisteredMemory [npu_driver_mem.cc:2073-2074]); other host memory is
// UNREGISTERED (pageable).
MemLocationType location_of(const Region& r) {
  switch (r.kind) {
    case Kind::kDevice:
      return MemLocationType::kDevice;
    case Kind::kPinned:
    case Kind::kMapped:
    case Kind::kRecorded:
      return MemLocationType::kHost;
    case Kind::kPageable:
      break;
  }
  return MemLocationType::kUnregistered;
}

const char* location_name(MemLocationType t) {
  switch (t) {
    case MemLocationType::kHost:
      return "HOST";
    case MemLocationType::kDevice:
      return "DEVICE";
    case MemLocationType::kUnregistered:
      return "UNREGISTERED";
    case MemLocationType::kHostNuma:
      return "HOST_NUMA";
  }
  return "?";
}

}  // namespace

Runtime& Runtime::get() {
  static Runtime* runtime = new Runtime();  // process lifetime: torch may free memory late
  return *runtime;
}

const char* Runtime::recent_message() { return recent.c_str(); }

AclError Runtime::error(AclError code, std::string message) {
  recent = std::move(message);
  return code;
}

// --- registry -------------------------------------------------------------

void Runtime::add_region(const void* start, uint64_t bytes, Kind kind, int device, bool in_place) {
  const auto s = reinterpret_cast<uintptr_t>(start);
  regions_[s] = Region{s, bytes, kind, device, in_place};
}

void Runtime::remove_region(const void* start) { regions_.erase(reinterpret_cast<uintptr_t>(start)); }

Region Runtime::region_of(const void* p) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = regions_.upper_bound(a);
  if (it != regions_.begin()) {
    --it;
    if (a < it->second.start + it->second.bytes) return it->second;
  }
  return Region{a, 0, Kind::kPageable, -1};
}

std::string Runtime::kind_name(const void* p) const {
  const Region r = region_of(p);
  switch (r.kind) {
    case Kind::kDevice:
      return "device:" + std::to_string(r.device);
    case Kind::kPinned:
      return "pinned";
    case Kind::kMapped:
      return "mapped";
    case Kind::kRecorded:
      return "recorded";
    case Kind::kPageable:
      break;
  }
  return "pageable";
}

// --- streams and events ---------------------------------------------------

Stream* Runtime::stream(int device, int64_t id) {
  auto& slot = streams_[{device, id}];
  if (!slot) {
    slot = std::make_unique<Stream>();
    slot->device = device;
    slot->id = id;
  }
  return slot.get();
}

int64_t Runtime::new_stream(int device) {
  const int64_t id = ++next_stream_id_[device];
  stream(device, id);
  return id;
}

uint64_t Runtime::enqueue(Stream* s, std::function<void()> task) {
  s->queue.emplace_back(++s->submitted, std::move(task));
  return s->submitted;
}

void Runtime::drain(Stream* s, uint64_t upto) {
  while (!s->queue.empty() && s->queue.front().first <= upto) {
    auto task = std::move(s->queue.front());
    s->queue.pop_front();
    s->executed = task.first;
    task.second();
  }
}

void Runtime::drain_device(int device) {
  for (auto& [key, s] : streams_) {
    if (key.first == device) drain(s.get());
  }
}

size_t Runtime::pending(int device, int64_t id) { return stream(device, id)->queue.size(); }

Event* Runtime::record_event(Event* e, Stream* s) {
  e->stream = s;
  e->recorded = true;
  ++e->queued_records;
  e->seq = enqueue(s, [e] {
    e->time_ms = now_ms();
    if (--e->queued_records == 0 && e->destroyed) delete e;
  });
  return e;
}

bool Runtime::query_event(Event* e) {
  if (!e->recorded) return true;
  drain(e->stream, e->seq);  // copies land when something asks whether they have
  return true;
}

// --- capture ----------------------------------------------------------------

void Runtime::capture_begin(Stream* s) {
  TORCH_CHECK(s->capture == CaptureStatus::kNone, "fake ACL: stream is already capturing");
  s->capture = CaptureStatus::kActive;
  s->graph = static_cast<int>(graphs_.size());
  graphs_.emplace_back();
  graph_entries_.push_back(0);
}

int Runtime::capture_end(Stream* s) {
  TORCH_CHECK(s->capture != CaptureStatus::kNone, "fake ACL: stream is not capturing");
  const int graph = s->graph;
  s->capture = CaptureStatus::kNone;
  s->graph = -1;
  return graph;
}

void Runtime::replay(int graph, Stream* s) {
  for (const auto& task : graphs_.at(static_cast<size_t>(graph))) enqueue(s, task);
}

// A captured stream holds at most JETTY_DEPTH_MAX work entries; past it
// the capture fails with EE1023, error RT_ERROR_JETTY_LIMIT
// [rt src/runtime/feature/jetty/stream_jetty_context.h:26, stream_jetty_context.cc:62-70],
// which ACL answers as 207008 [errcode_manage.cc:96]. Entries are counted, not
// copies: each copy adds the entries the driver made of it
// [rt src/runtime/feature/jetty/stream_jetty_handler.cc:133]. The driver's
// split is closed source; the fake takes one entry per copy, or one per
// `work_entry_bytes` when a test sets it, and refuses a copy whose entries
// would pass the limit (CANN checks only before appending: stricter).
AclError Runtime::record_into_graph(Stream* s, std::function<void()> task, uint64_t bytes) {
  auto& graph = graphs_.at(static_cast<size_t>(s->graph));
  uint64_t& entries = graph_entries_.at(static_cast<size_t>(s->graph));
  const uint64_t need =
      work_entry_bytes == 0 ? 1 : std::max<uint64_t>(1, (bytes + work_entry_bytes - 1) / work_entry_bytes);
  // Only the UB (v200) chips have the jetty limit: their memcpy tasks go
  // through it [memory_task_v200_base.cc:260, :839; stream_jetty_handler.cc:
  // 110-133]; the loop route's chips have no such cap.
  if (batch_route == BatchRoute::kUb && entries + need > kGraphWorkEntries) {
    return error(kRtNoStreamResource,
                 "EE1023: Expanding the capacity failed. There are too many asynchronous copy tasks "
                 "in the ACL Graph (fake ACL)");
  }
  entries += need;
  graph.push_back(std::move(task));
  return 0;
}

// --- faults -------------------------------------------------------------------

AclError Runtime::entry_fault(size_t entry) {
  const int64_t k = calls("aclrtMemcpyBatchAsync");
  for (const EntryFault& f : entry_faults) {
    if (f.entry == entry && (f.at_call == -1 || f.at_call == k)) {
      return error(f.code, "injected fault at batch entry " + std::to_string(entry) + " (fake ACL)");
    }
  }
  return 0;
}

AclError Runtime::injected(const char* function) {
  const int64_t k = ++calls_[function];
  auto it = faults_.find(function);
  if (it == faults_.end()) return 0;
  const Fault f = it->second;
  if (f.at_call != -1 && f.at_call != k) return 0;
  return error(f.code, std::string("injected fault of ") + function + " (fake ACL)");
}

void Runtime::fail(const std::string& function, AclError code, int64_t at_call) {
  if (code == 0) {
    faults_.erase(function);  // code 0: the function answers again
    return;
  }
  faults_[function] = Fault{code, at_call};
}

int64_t Runtime::calls(const std::string& function) const {
  auto it = calls_.find(function);
  return it == calls_.end() ? 0 : it->second;
}

// --- the ACL functions ------------------------------------------------------------

namespace {

Runtime& rt() { return Runtime::get(); }

int (*g_current_device)() = nullptr;

Stream* resolve(AclStream handle) {
  // A null stream means the current context's default stream
  // [rt src/runtime/api/impl/api_impl_david.cc:919-923, MemcpyAsync].
  if (handle != nullptr) return static_cast<Stream*>(handle);
  return rt().stream(g_current_device != nullptr ? g_current_device() : 0, 0);
}

// A stream belongs to the context (device) it was created in: a copy on a
// stream of another device than the current one is refused with
// ACL_ERROR_RT_STREAM_CONTEXT [rt src/runtime/api/impl/api_impl.cc:2882-2883;
// api_impl_david.cc:818-820 (batch), :924-925 (MemcpyAsync);
// errcode_manage.cc:126].
AclError check_context(const Stream* s, const char* api) {
  const int current = g_current_device != nullptr ? g_current_device() : 0;
  if (s->device == current) return 0;
  return rt().error(kRtStreamContext, std::string(api) + ": stream of device " + std::to_string(s->device) +
                                          " is not in the current context (device " +
                                          std::to_string(current) + ")");
}

// aclrtMemcpyAsync, as ApiErrorDecorator::MemcpyAsync checks it
// [rt src/runtime/api/impl/api_error.cc:2176-2273].
AclError memcpy_async(void* dst, size_t dest_max, const void* src, size_t count, MemcpyKind kind,
                      AclStream handle) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  if (AclError e = rt().injected("aclrtMemcpyAsync")) return e;
  // Null addresses, zero bytes and count > destMax are errors [api_error.cc:2181-2185].
  if (dst == nullptr || src == nullptr || count == 0 || count > dest_max) {
    return rt().error(kRtParamInvalid, "aclrtMemcpyAsync: null address, zero count or count > destMax");
  }
  Stream* s = resolve(handle);
  if (AclError e = check_context(s, "aclrtMemcpyAsync")) return e;
  const Region sr = rt().region_of(src);
  const Region dr = rt().region_of(dst);
  const MemLocationType sl = location_of(sr);
  const MemLocationType dl = location_of(dr);
  // The kind follows the real locations: known pairs are forced to their
  // kind, pairs with pageable memory accept only the kinds listed
  // [api_error.cc:2690-2735, MemcpyKindReviseMap; 2774-2800, MemcpyKindAutoCorrect].
  const bool s_dev = sl == MemLocationType::kDevice;
  const bool d_dev = dl == MemLocationType::kDevice;
  const bool pageable = sl == MemLocationType::kUnregistered || dl == MemLocationType::kUnregistered;
  MemcpyKind real = s_dev ? (d_dev ? MemcpyKind::kDeviceToDevice : MemcpyKind::kDeviceToHost)
                          : (d_dev ? MemcpyKind::kHostToDevice : MemcpyKind::kHostToHost);
  if (pageable) {
    const bool allowed = (s_dev || d_dev)
                             ? (kind == real || kind == MemcpyKind::kDeviceToDevice)
                             : true;  // host<->host: every kind is allowed, then H2H is refused below
    if (!allowed) {
      return rt().error(kRtParamInvalid,
                        "aclrtMemcpyAsync: kind does not fit the pageable memory's location");
    }
  }
  // Host-to-host is not supported asynchronously [api_error.cc:2247-2248].
  if (real == MemcpyKind::kHostToHost) {
    return rt().error(ascend::kAclFeatureNotSupported, "aclrtMemcpyAsync: H2H is not supported");
  }
  // Same address: nothing to copy [api_error.cc:2249-2251].
  if (dst == src) return 0;
  // A stream in a sub ACL graph capture refuses host<->device (UB DMA)
  // copies with 207000 [api_error.cc:2253-2255; capture_model_utils.cc:421-470],
  // as it refuses batches (memcpy_batch_async).
  if (rt().batch_refused_streams.count({s->device, s->id}) != 0 && rt().capturing(s) &&
      real != MemcpyKind::kDeviceToDevice) {
    return rt().error(
        ascend::kAclFeatureNotSupported,
        "aclrtMemcpyAsync: stream belongs to sub ACL Graph, does not support asynchronous memory copy");
  }
  // On-chip device-to-device copies need 64-byte-aligned addresses
  // [hdr acl_rt.h:2232-2234]. The header gives no error code; the fake
  // answers ACL_ERROR_RT_ADDR_UNALIGNED.
  if (real == MemcpyKind::kDeviceToDevice &&
      ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 63) != 0) {
    return rt().error(kRtAddrUnaligned,
                      "aclrtMemcpyAsync: device-to-device addresses must be 64-byte aligned");
  }
  auto copy = [dst, src, count] { std::memcpy(dst, src, count); };
  if (pageable) {
    // Pageable host memory: refused while capturing (EE1016), otherwise the
    // stream is synchronized and the copy is done synchronously
    // [api_error.cc:2256-2263].
    if (rt().capturing(s)) {
      return rt().error(kRtParamInvalid,
                        "EE1016: The pageable memory copy task does not support graph capture");
    }
    rt().drain(s);
    copy();
    return 0;
  }
  if (rt().capturing(s)) return rt().record_into_graph(s, copy, count);
  rt().enqueue(s, copy);
  return 0;
}

// The order a batch's copies run in: CANN's API reference documents batch
// copies as unordered [doc 11-03_memory_copy.md, aclrtMemcpyBatchAsync], so
// the fake runs them in a scrambled order (never the submitted one for two
// or more copies), and any ordering assumption shows as wrong data.
std::vector<size_t> scrambled(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  uint64_t x = 0x9e3779b97f4a7c15ull * ++rt().scramble_calls;
  for (size_t i = n; i > 1; --i) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    std::swap(order[i - 1], order[(x * 0x2545f4914f6cdd1dull >> 33) % i]);
  }
  bool identity = true;
  for (size_t i = 0; i < n; ++i) identity = identity && order[i] == i;
  if (identity) std::reverse(order.begin(), order.end());
  return order;
}

struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
  void operator()() const { std::memcpy(dst, src, bytes); }
};

// Queues `copies` on s (or records them into its graph) in a scrambled order.
AclError queue_unordered(Stream* s, const std::vector<Copy>& copies) {
  for (size_t i : scrambled(copies.size())) {
    const Copy& c = copies[i];
    if (rt().capturing(s)) {
      if (AclError e = rt().record_into_graph(s, c, c.bytes)) return e;
    } else {
      rt().enqueue(s, c);
    }
  }
  return 0;
}

// The checks of one entry, with attrs[k] applying from attrsIndexes[k] to
// the next index [api_impl.cc:8900-8903; hdr acl_rt.h:4414-4415]: sizes in
// (0, destMax] and non-null addresses [api_impl.cc:8840-8847]; the
// attribute's location types must match the real ones (HOST_NUMA read as
// HOST, UNREGISTERED as HOST) and device ids must match [api_impl.cc:8794-8830,
// CheckMemCpyAttr]; only host<->device [api_impl.cc:8859-8864].
AclError check_entry(size_t i, void* dst, size_t dest_max, const void* src, size_t size,
                     const MemcpyBatchAttr& attr, bool* pageable) {
  auto fail = [&](const std::string& why) {
    return rt().error(kRtParamInvalid, "aclrtMemcpyBatchAsync: entry " + std::to_string(i) + ": " + why);
  };
  if (size == 0 || size > dest_max) return fail("size must be in (0, destMax]");
  if (dst == nullptr || src == nullptr) return fail("null address");
  const Region dr = rt().region_of(dst);
  const Region sr = rt().region_of(src);
  const MemLocationType dl = location_of(dr);
  const MemLocationType sl = location_of(sr);
  auto as_host = [](MemLocationType t) {
    return t == MemLocationType::kHostNuma || t == MemLocationType::kUnregistered ? MemLocationType::kHost
                                                                                  : t;
  };
  if (as_host(dl) != as_host(attr.dstLoc.type) ||
      (dl == MemLocationType::kDevice && static_cast<int>(attr.dstLoc.id) != dr.device)) {
    return fail(std::string("dst is ") + location_name(dl) + " memory of device " +
                std::to_string(dr.device) + " but the attribute says " + location_name(attr.dstLoc.type) +
                " id " + std::to_string(attr.dstLoc.id));
  }
  if (as_host(sl) != as_host(attr.srcLoc.type) ||
      (sl == MemLocationType::kDevice && static_cast<int>(attr.srcLoc.id) != sr.device)) {
    return fail(std::string("src is ") + location_name(sl) + " memory of device " +
                std::to_string(sr.device) + " but the attribute says " + location_name(attr.srcLoc.type) +
                " id " + std::to_string(attr.srcLoc.id));
  }
  if (as_host(dl) == as_host(sl)) return fail("only H2D and D2H copy directions are supported");
  *pageable = dl == MemLocationType::kUnregistered || sl == MemLocationType::kUnregistered;
  return 0;
}

// Pageable memory under capture: EE1016 [api_impl_david.cc:849-852]; the
// entry-by-entry route synchronizes the stream instead [api_impl.cc:8912-8924],
// which a capturing stream refuses: the fake answers the same for both.
AclError pageable_under_capture() {
  return rt().error(kRtParamInvalid, "EE1016: The pageable memory copy task does not support graph capture");
}

// ApiImpl::LoopMemcpyAsync [api_impl.cc:8887-8939]: each entry is checked,
// then copied (pageable: stream synchronized, copy synchronous) or queued,
// one at a time. A failed check sets the failing index and returns, with
// the entries before it queued [8905-8910]; a failed submission returns
// without a failing index, the entries before it queued [8932-8935]; a
// submission the driver does not support (207000 once ACL maps it
// [api_c_memory.cc:791]) is skipped, the loop goes on, and the call answers
// with the last entry's code [8932-8938].
AclError batch_loop(void** dsts, size_t* dest_maxs, void** srcs, size_t* sizes, size_t n,
                    MemcpyBatchAttr* attrs, size_t* attrs_indexes, size_t num_attrs, size_t* fail_index,
                    Stream* s) {
  std::vector<Copy> queued;
  AclError last = 0;
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    if (k + 1 < num_attrs && i >= attrs_indexes[k + 1]) ++k;
    bool pageable = false;
    if (AclError e = check_entry(i, dsts[i], dest_maxs[i], srcs[i], sizes[i], attrs[k], &pageable)) {
      *fail_index = i;
      if (AclError q = queue_unordered(s, queued)) return q;
      return e;
    }
    const Copy copy{dsts[i], srcs[i], sizes[i]};
    if (pageable) {
      if (AclError q = queue_unordered(s, queued)) return q;
      queued.clear();
      if (rt().capturing(s)) return pageable_under_capture();
      rt().drain(s);
      copy();
      last = 0;
      continue;
    }
    last = rt().entry_fault(i);
    if (last == ascend::kAclFeatureNotSupported) continue;
    if (last != 0) {
      if (AclError q = queue_unordered(s, queued)) return q;
      return last;
    }
    queued.push_back(copy);
  }
  if (AclError q = queue_unordered(s, queued)) return q;
  return last;
}

// ApiImplDavid::BatchMemcpyAsync, the UB route [api_impl_david.cc:806-879]:
// every entry is checked first, a failure setting the failing index with
// nothing queued [834-847]. Pageable memory: refused under capture, else
// the stream is synchronized and the driver copies the batch synchronously
// [849-858], refusing more than DEVMM_MEMCPY_BATCH_MAX_COUNT entries with
// DRV_ERROR_NOT_SUPPORT [rt pkg_inc/driver/ascend_hal_base.h:2099-2105],
// which ACL answers as 207000 [api_c_memory.cc:791; errcode_manage.cc:100].
// Otherwise the batch goes in chunks, the stream synchronized between
// chunks when not capturing; a chunk that fails returns its error with the
// earlier chunks queued and no failing index [863-876].
AclError batch_ub(void** dsts, size_t* dest_maxs, void** srcs, size_t* sizes, size_t n,
                  MemcpyBatchAttr* attrs, size_t* attrs_indexes, size_t num_attrs, size_t* fail_index,
                  Stream* s) {
  bool any_pageable = false;
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    if (k + 1 < num_attrs && i >= attrs_indexes[k + 1]) ++k;
    bool pageable = false;
    if (AclError e = check_entry(i, dsts[i], dest_maxs[i], srcs[i], sizes[i], attrs[k], &pageable)) {
      *fail_index = i;
      return e;
    }
    any_pageable = any_pageable || pageable;
  }
  if (any_pageable) {
    if (rt().capturing(s)) return pageable_under_capture();
    rt().drain(s);
    if (n > kMaxBatchCount) {
      return rt().error(ascend::kAclFeatureNotSupported,
                        "aclrtMemcpyBatchAsync: the driver's batch copy takes at most 4096 entries");
    }
    for (size_t i : scrambled(n)) Copy{dsts[i], srcs[i], sizes[i]}();
    return 0;
  }
  const size_t chunk = rt().ub_chunk == 0 ? n : rt().ub_chunk;
  for (size_t first = 0; first < n; first += chunk) {
    const size_t end = std::min(n, first + chunk);
    std::vector<Copy> copies;
    for (size_t i = first; i < end; ++i) {
      if (AclError e = rt().entry_fault(i)) return e;
      copies.push_back(Copy{dsts[i], srcs[i], sizes[i]});
    }
    if (AclError e = queue_unordered(s, copies)) return e;
    if (end < n && !rt().capturing(s)) rt().drain(s);
  }
  return 0;
}

// aclrtMemcpyBatchAsync: the ACL layer [rt src/acl/aclrt_impl/memory.cpp:1735-1762, 1837-1847],
// the C entry [rt src/runtime/api/api_c_memory.cc:765-794], the argument
// checks [rt src/runtime/api/impl/api_error.cc:7344-7386], then one of the
// two routes above.
AclError memcpy_batch_async(void** dsts, size_t* dest_maxs, void** srcs, size_t* sizes, size_t n,
                            MemcpyBatchAttr* attrs, size_t* attrs_indexes, size_t num_attrs,
                            size_t* fail_index, AclStream handle) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  if (AclError e = rt().injected("aclrtMemcpyBatchAsync")) return e;
  rt().last_batch = BatchCall{n, num_attrs, reinterpret_cast<uintptr_t>(dsts)};
  // failIndex must not be null [memory.cpp:1843]; sizes neither, and
  // numBatches > 0 [memory.cpp:1740-1741].
  if (fail_index == nullptr || sizes == nullptr || n == 0) {
    return rt().error(kInvalidParam, "aclrtMemcpyBatchAsync: null failIndex or sizes, or numBatches 0");
  }
  // A batch of zero-byte copies succeeds without any other check [memory.cpp:1743-1748].
  bool all_zero = true;
  for (size_t i = 0; i < n; ++i) all_zero = all_zero && sizes[i] == 0;
  if (all_zero) {
    *fail_index = SIZE_MAX;
    return 0;
  }
  // Null arrays, destMaxs[i] < sizes[i] and nonzero reserved bytes
  // [memory.cpp:1750-1754, ValidateMemcpyBatchParams].
  if (dsts == nullptr || dest_maxs == nullptr || srcs == nullptr || attrs == nullptr ||
      attrs_indexes == nullptr) {
    return rt().error(kInvalidParam, "aclrtMemcpyBatchAsync: null array");
  }
  for (size_t i = 0; i < n; ++i) {
    if (dest_maxs[i] < sizes[i]) {
      return rt().error(kInvalidParam, "aclrtMemcpyBatchAsync: destMaxs[" + std::to_string(i) + "] < sizes[" +
                                           std::to_string(i) + "]");
    }
  }
  for (size_t k = 0; k < num_attrs; ++k) {
    for (uint8_t byte : attrs[k].rsv) {
      if (byte != 0) {
        return rt().error(kInvalidParam,
                          "aclrtMemcpyBatchAsync: rsv field of attrs[" + std::to_string(k) + "] must be 0");
      }
    }
  }
  Stream* s = resolve(handle);
  // A chip without the feature [api_c_memory.cc:780-783], or a device whose
  // driver has FEATURE_MEMCPY_BATCH_ASYNC [api_impl.cc:8950-8953;
  // api_impl_david.cc:896-904]: 207000 for every batch, nothing queued.
  if (rt().batch_refused_devices.count(s->device) != 0) {
    return rt().error(ascend::kAclFeatureNotSupported, "aclrtMemcpyBatchAsync: not supported on this device");
  }
  *fail_index = SIZE_MAX;  // [api_error.cc:7349]
  // attrs index rules [api_error.cc:7357-7381]: numAttrs in [1, count];
  // attrsIndexes[0] == 0; each index above the previous one and below count.
  // No cap on the entry count here [api_error.cc:7344-7386]: only the UB
  // route's pageable copy has one (batch_ub).
  if (num_attrs == 0 || num_attrs > n || attrs_indexes[0] != 0) {
    return rt().error(kRtParamInvalid,
                      "aclrtMemcpyBatchAsync: numAttrs must be in [1, numBatches] "
                      "and attrsIndexes[0] must be 0");
  }
  for (size_t k = 1; k < num_attrs; ++k) {
    if (attrs_indexes[k] <= attrs_indexes[k - 1] || attrs_indexes[k] >= n) {
      return rt().error(kRtParamInvalid, "aclrtMemcpyBatchAsync: attrsIndexes[" + std::to_string(k) +
                                             "] must exceed the previous entry and be below numBatches");
    }
  }
  // A stream bound to a sub ACL graph (a capture into one,
  // capture_model_utils.cc:421-441) on a UB runtime: 207000 for that stream
  // only, and only while it captures [api_error.cc:7382-7384].
  if (rt().batch_refused_streams.count({s->device, s->id}) != 0 && rt().capturing(s)) {
    return rt().error(ascend::kAclFeatureNotSupported,
                      "aclrtMemcpyBatchAsync: stream belongs to sub ACL Graph, does not support "
                      "asynchronous memory copy");
  }
  if (AclError e = check_context(s, "aclrtMemcpyBatchAsync")) return e;  // nothing queued
  const AclError err =
      rt().batch_route == BatchRoute::kLoop
          ? batch_loop(dsts, dest_maxs, srcs, sizes, n, attrs, attrs_indexes, num_attrs, fail_index, s)
          : batch_ub(dsts, dest_maxs, srcs, sizes, n, attrs, attrs_indexes, num_attrs, fail_index, s);
  // The runtime keeps no reference to the arrays once the call returns
  // [api_impl_david.cc:860-862 copies them; api_impl.cc:8887-8939 consumes
  // them entry by entry]: after a successful call, overwrite them, so a late
  // read shows. Never after a failed one: CANN only reads the arrays, and the
  // caller may read them again (to name the failed copy, or to copy per
  // descriptor after a refusal).
  if (err != 0) return err;
  for (size_t i = 0; i < n; ++i) {
    dsts[i] = reinterpret_cast<void*>(uintptr_t{0xdead0000});
    srcs[i] = reinterpret_cast<void*>(uintptr_t{0xdead0000});
    sizes[i] = 0x7fffffff;
    dest_maxs[i] = 0;
  }
  return err;
}

// aclrtPointerGetAttributes [hdr acl_rt.h:1937]: null arguments are refused
// [rt src/runtime/api/impl/api_error.cc:3216-3222]; the location is the
// driver's [npu_driver_mem.cc:2040-2086, location_of above], a device id
// only for device memory [2082].
AclError pointer_get_attributes(const void* ptr, ascend::PtrAttributes* attributes) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  if (AclError e = rt().injected("aclrtPointerGetAttributes")) return e;
  if (ptr == nullptr || attributes == nullptr) {
    return rt().error(kRtParamInvalid, "aclrtPointerGetAttributes: null pointer");
  }
  const Region r = rt().region_of(ptr);
  *attributes = ascend::PtrAttributes{};
  attributes->location.type = location_of(r);
  attributes->location.id = r.kind == Kind::kDevice ? static_cast<uint32_t>(r.device) : 0;
  attributes->pageSize = 4096;
  return 0;
}

// aclmdlRICaptureGetInfo [hdr acl_rt.h:4595]: the stream's capture status
// and its model (invalid when not capturing [doc 15_model_running_instance__management.md,
// aclmdlRICaptureGetInfo "modelRI"]).
AclError capture_get_info(AclStream handle, CaptureStatus* status, void** model) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  if (AclError e = rt().injected("aclmdlRICaptureGetInfo")) return e;
  if (status == nullptr || model == nullptr) return rt().error(kInvalidParam, "null output");
  Stream* s = resolve(handle);
  *status = s->capture;
  *model = s->capture == CaptureStatus::kNone ? nullptr
                                              : reinterpret_cast<void*>(static_cast<uintptr_t>(s->graph + 1));
  return 0;
}

// aclrtHostRegisterV2 [rt src/runtime/api/impl/api_error.cc:2012-2030;
// api_impl.cc:2574-2612; doc 11-02_host_memory_management.md, aclrtHostRegisterV2].
AclError host_register_v2(void* ptr, uint64_t size, uint32_t flag) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  if (AclError e = rt().injected("aclrtHostRegisterV2")) return e;
  constexpr uint32_t kValid = 0x2u | 0x4u | 0x8u | ascend::kHostRegPinned;  // [api_error.cc:2016-2018]
  if (ptr == nullptr || size == 0 || (flag & kValid) == 0 || (flag & ~kValid) != 0) {
    return rt().error(kRtParamInvalid, "aclrtHostRegisterV2: null ptr, zero size or invalid flag");
  }
  // The address must be 4 KiB aligned [doc 11-02, aclrtHostRegisterV2 "ptr"].
  if (reinterpret_cast<uintptr_t>(ptr) % 4096 != 0) {
    return rt().error(kRtParamInvalid, "aclrtHostRegisterV2: ptr must be 4 KiB aligned");
  }
  if (rt().register_max_bytes >= 0 && size > static_cast<uint64_t>(rt().register_max_bytes)) {
    return rt().error(kRtMemoryAllocation, "aclrtHostRegisterV2: more bytes than the fake's per-call limit");
  }
  // A range overlapping a registered one fails (EE1018) [api_error.cc:2025-2027;
  // register_memory.cc:61-76, CheckMemoryRangeRegistered]; PINNED on memory
  // that is already page-locked fails [doc 11-02, "flag"].
  const auto start = reinterpret_cast<uintptr_t>(ptr);
  for (uintptr_t at = start; at < start + size; at += 4096) {
    const Region r = rt().region_of(reinterpret_cast<const void*>(at));
    if (r.in_place) {
      return rt().error(kHostMemoryAlreadyRegistered,
                        "EE1018: aclrtHostRegisterV2: the memory range has already been registered");
    }
    if (r.kind != Kind::kPageable) {
      return rt().error(kRtParamInvalid, "aclrtHostRegisterV2: not pageable host memory");
    }
  }
  // Injected: the call succeeds and registers nothing.
  if (rt().register_does_nothing) return 0;
  // Without FEATURE_SVM_MEM_REGISTER_HOST_PINNED in the driver, PINNED alone
  // only records the range [api_impl.cc:2589-2609]: nothing is locked.
  const bool pinned = (flag & ascend::kHostRegPinned) != 0;
  const Kind kind = !pinned ? Kind::kMapped : rt().pin_records_only ? Kind::kRecorded : Kind::kPinned;
  rt().add_region(ptr, size, kind, -1, /*in_place=*/true);
  rt().registered_bytes += static_cast<int64_t>(size);
  return 0;
}

// aclrtHostUnregister: the pointer must be the start of a registered range,
// else EE1018 with ACL_ERROR_HOST_MEMORY_NOT_REGISTERED
// [rt src/runtime/api/impl/api_error.cc:2032-2040; api_impl.cc:2614-2640].
AclError host_unregister(void* ptr) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  if (AclError e = rt().injected("aclrtHostUnregister")) return e;
  if (ptr == nullptr) return rt().error(kRtParamInvalid, "aclrtHostUnregister: null pointer");
  const Region r = rt().region_of(ptr);
  if (!r.in_place || r.start != reinterpret_cast<uintptr_t>(ptr)) {
    return rt().error(kHostMemoryNotRegistered,
                      "EE1018: aclrtHostUnregister: the host pointer has not been registered");
  }
  rt().remove_region(ptr);
  return 0;
}

const char* get_recent_err_msg() { return Runtime::recent_message(); }

std::unique_ptr<ascend::Engine>& engine_slot() {
  static std::unique_ptr<ascend::Engine> slot;
  return slot;
}

}  // namespace

void set_current_device_source(int (*fn)()) { g_current_device = fn; }

const AclApi& fake_table() {
  static const AclApi table = [] {
    AclApi t;
    t.memcpy_async = &memcpy_async;
    t.memcpy_batch_async = &memcpy_batch_async;
    return t;
  }();
  return table;
}

void Runtime::rebuild_table() {
  auto present = [this](const char* name) { return absent.count(name) == 0; };
  table_ = AclApi{};
  table_.memcpy_async = &memcpy_async;
  table_.host_unregister = &host_unregister;
  if (present("aclGetRecentErrMsg")) table_.get_recent_err_msg = &get_recent_err_msg;
  if (present("aclrtMemcpyBatchAsync")) table_.memcpy_batch_async = &memcpy_batch_async;
  if (present("aclmdlRICaptureGetInfo")) table_.capture_get_info = &capture_get_info;
  table_.capture_begin_present = present("aclmdlRICaptureBegin");
  if (present("aclrtHostRegisterV2")) table_.host_register_v2 = &host_register_v2;
  if (present("aclrtPointerGetAttributes")) table_.pointer_get_attributes = &pointer_get_attributes;
}

void Runtime::reset() {
  std::lock_guard<std::recursive_mutex> lock(mutex);
  for (auto& [key, s] : streams_) {
    s->queue.clear();
    s->executed = s->submitted;
    s->capture = CaptureStatus::kNone;
    s->graph = -1;
  }
  graphs_.clear();
  graph_entries_.clear();
  faults_.clear();
  batch_route = BatchRoute::kLoop;
  ub_chunk = 0;
  entry_faults.clear();
  batch_refused_devices.clear();
  batch_refused_streams.clear();
  pin_records_only = false;
  register_does_nothing = false;
  register_max_bytes = -1;
  registered_bytes = 0;
  work_entry_bytes = 0;
  scramble_calls = 0;
  calls_.clear();
  absent.clear();
  null_stream_next = false;
  last_batch = BatchCall{};
  for (auto it = regions_.begin(); it != regions_.end();) {
    // Ranges pinned in place belong to buffers of earlier tests.
    it = it->second.in_place ? regions_.erase(it) : std::next(it);
  }
  rebuild_table();
  engine_slot().reset();
}

namespace {

AclError noop_memcpy_async(void*, size_t, const void*, size_t, MemcpyKind, AclStream) { return 0; }
AclError noop_host_unregister(void*) { return 0; }
AclError noop_batch(void**, size_t*, void**, size_t*, size_t, MemcpyBatchAttr*, size_t*, size_t, size_t*,
                    AclStream) {
  return 0;
}
AclError noop_capture(AclStream, CaptureStatus* status, void** model) {
  *status = CaptureStatus::kNone;
  *model = nullptr;
  return 0;
}

}  // namespace

const AclApi& noop_table() {
  static const AclApi table = [] {
    AclApi t;
    t.memcpy_async = &noop_memcpy_async;
    t.host_unregister = &noop_host_unregister;
    t.memcpy_batch_async = &noop_batch;
    t.capture_get_info = &noop_capture;
    t.capture_begin_present = true;
    return t;
  }();
  return table;
}

}  // namespace fake

namespace ascend {

// The test extension's binding of the engine: the fake runtime's table.
Engine& engine() {
  auto& slot = fake::engine_slot();
  if (!slot) slot = std::make_unique<Engine>(fake::Runtime::get().table());
  return *slot;
}

// And of the stream handle: the fake backend's device guard answers
// (fake_backend.cpp, FakeGuardImpl::getStreamNativeHandle, which can answer
// null as torch_npu does when draining its task queue fails).
AclStream acl_stream_of(const c10::Stream& stream) { return stream.native_handle(); }

}  // namespace ascend
}  // namespace kvswap
