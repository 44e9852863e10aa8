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

constexpr AclError kInvalidParam = 100000;     // ACL_ERROR_INVALID_PARAM [hdr acl_base_rt.h:67]
constexpr AclError kRtParamInvalid = 107000;   // ACL_ERROR_RT_PARAM_INVALID [hdr error_codes/rt_error_codes.h:21]
constexpr AclError kRtAddrUnaligned = 107008;  // ACL_ERROR_RT_ADDR_UNALIGNED [hdr rt_error_codes.h:29]
constexpr AclError kRtResourceAlloc = 207005;  // ACL_ERROR_RT_RESOURCE_ALLOC_FAIL [hdr rt_error_codes.h:74]
constexpr size_t kMaxBatchCount = 4096;        // DEVMM_MEMCPY_BATCH_MAX_COUNT [rt pkg_inc/driver/ascend_hal_define.h:810]

thread_local std::string recent;

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The location CANN reports for a pointer [rt src/runtime/driver/npu_driver_mem.cc:2055-2074]:
// device memory is DEVICE; host memory registered pinned or mapped is HOST
// (IsRegisteredMemory counts both [rt src/runtime/core/src/common/register_memory.cc:104-115]);
// other host memory is UNREGISTERED (pageable).
MemLocationType location_of(const Region& r) {
  switch (r.kind) {
    case Kind::kDevice:
      return MemLocationType::kDevice;
    case Kind::kPinned:
    case Kind::kMapped:
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
  e->seq = enqueue(s, [e] { e->time_ms = now_ms(); });
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

// A captured stream holds at most JETTY_DEPTH_MAX copy tasks; past it the
// capture fails with EE1023 [rt src/runtime/feature/jetty/stream_jetty_context.h:26,
// stream_jetty_context.cc:62-70]. The fake counts one task per copy (CANN may
// need more for large copies, never fewer).
AclError Runtime::record_into_graph(Stream* s, std::function<void()> task) {
  auto& graph = graphs_.at(static_cast<size_t>(s->graph));
  if (graph.size() >= kGraphTaskCapacity) {
    return error(kRtResourceAlloc,
                 "EE1023: Expanding the capacity failed. There are too many asynchronous copy tasks "
                 "in the ACL Graph (fake ACL)");
  }
  graph.push_back(std::move(task));
  return 0;
}

// --- faults -------------------------------------------------------------------

AclError Runtime::injected(const char* function) {
  const int64_t k = ++calls_[function];
  auto it = faults_.find(function);
  if (it == faults_.end()) return 0;
  const Fault f = it->second;
  if (f.at_call != -1 && f.at_call != k) return 0;
  return error(f.code, std::string("injected fault of ") + function + " (fake ACL)");
}

void Runtime::fail(const std::string& function, AclError code, int64_t at_call) {
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
  // [rt src/runtime/api/impl/api_impl_david.cc:902-906, MemcpyAsync].
  if (handle != nullptr) return static_cast<Stream*>(handle);
  return rt().stream(g_current_device != nullptr ? g_current_device() : 0, 0);
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
    const bool allowed =
        (s_dev || d_dev) ? (kind == real || kind == MemcpyKind::kDeviceToDevice)
                         : true;  // host<->host: every kind is allowed, then H2H is refused below
    if (!allowed) {
      return rt().error(kRtParamInvalid, "aclrtMemcpyAsync: kind does not fit the pageable memory's location");
    }
  }
  // Host-to-host is not supported asynchronously [api_error.cc:2247-2248].
  if (real == MemcpyKind::kHostToHost) {
    return rt().error(ascend::kAclFeatureNotSupported, "aclrtMemcpyAsync: H2H is not supported");
  }
  // Same address: nothing to copy [api_error.cc:2249-2251].
  if (dst == src) return 0;
  // On-chip device-to-device copies need 64-byte-aligned addresses
  // [hdr acl_rt.h:2232-2234]. The header gives no error code; the fake
  // answers ACL_ERROR_RT_ADDR_UNALIGNED.
  if (real == MemcpyKind::kDeviceToDevice &&
      ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 63) != 0) {
    return rt().error(kRtAddrUnaligned, "aclrtMemcpyAsync: device-to-device addresses must be 64-byte aligned");
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
  if (rt().capturing(s)) return rt().record_into_graph(s, copy);
  rt().enqueue(s, copy);
  return 0;
}

// aclrtMemcpyBatchAsync: the ACL layer [rt src/acl/aclrt_impl/memory.cpp:1692-1760, 1837-1847],
// the C entry [rt src/runtime/api/api_c_memory.cc:765-793], the argument
// checks [rt src/runtime/api/impl/api_error.cc:7344-7386] and the per-entry
// checks [rt src/runtime/api/impl/api_impl.cc:8795-8885; api_impl_david.cc:805-871].
AclError memcpy_batch_async(void** dsts, size_t* dest_maxs, void** srcs, size_t* sizes, size_t n,
                            MemcpyBatchAttr* attrs, size_t* attrs_indexes, size_t num_attrs,
                            size_t* fail_index, AclStream handle) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  if (AclError e = rt().injected("aclrtMemcpyBatchAsync")) return e;
  rt().last_batch = BatchCall{n, num_attrs, reinterpret_cast<uintptr_t>(dsts)};
  // failIndex must not be null [memory.cpp:1843]; sizes neither, and
  // numBatches > 0 [memory.cpp:1738-1740].
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
  // [memory.cpp:1692-1732, ValidateMemcpyBatchParams].
  if (dsts == nullptr || dest_maxs == nullptr || srcs == nullptr || attrs == nullptr ||
      attrs_indexes == nullptr) {
    return rt().error(kInvalidParam, "aclrtMemcpyBatchAsync: null array");
  }
  for (size_t i = 0; i < n; ++i) {
    if (dest_maxs[i] < sizes[i]) {
      return rt().error(kInvalidParam, "aclrtMemcpyBatchAsync: destMaxs[" + std::to_string(i) +
                                           "] < sizes[" + std::to_string(i) + "]");
    }
  }
  for (size_t k = 0; k < num_attrs; ++k) {
    for (uint8_t byte : attrs[k].rsv) {
      if (byte != 0) {
        return rt().error(kInvalidParam, "aclrtMemcpyBatchAsync: rsv field of attrs[" +
                                             std::to_string(k) + "] must be 0");
      }
    }
  }
  *fail_index = SIZE_MAX;  // [api_error.cc:7349]
  // attrs index rules [api_error.cc:7357-7381]: numAttrs in [1, count];
  // attrsIndexes[0] == 0; each index above the previous one and below count.
  if (num_attrs == 0 || num_attrs > n || attrs_indexes[0] != 0) {
    return rt().error(kRtParamInvalid, "aclrtMemcpyBatchAsync: numAttrs must be in [1, numBatches] "
                                       "and attrsIndexes[0] must be 0");
  }
  for (size_t k = 1; k < num_attrs; ++k) {
    if (attrs_indexes[k] <= attrs_indexes[k - 1] || attrs_indexes[k] >= n) {
      return rt().error(kRtParamInvalid, "aclrtMemcpyBatchAsync: attrsIndexes[" + std::to_string(k) +
                                             "] must exceed the previous entry and be below numBatches");
    }
  }
  // At most DEVMM_MEMCPY_BATCH_MAX_COUNT entries: the driver's batch copy
  // refuses more [rt pkg_inc/driver/ascend_hal_base.h:2099-2105], and the
  // synchronous batch checks it up front [api_error.cc:7314-7317]. The async
  // entry leaves it to the (closed) driver path; the fake checks it here.
  if (n > kMaxBatchCount) {
    return rt().error(kRtParamInvalid, "aclrtMemcpyBatchAsync: numBatches " + std::to_string(n) +
                                           " exceeds DEVMM_MEMCPY_BATCH_MAX_COUNT (4096)");
  }
  Stream* s = resolve(handle);
  // Per entry, with attrs[k] applying from attrsIndexes[k] to the next index
  // [api_impl.cc:8900-8905; hdr acl_rt.h:4414-4415]: sizes in (0, destMax]
  // and non-null addresses [api_impl.cc:8840-8846]; the attribute's
  // location types must match the real ones (HOST_NUMA read as HOST,
  // UNREGISTERED as HOST) and device ids must match
  // [api_impl.cc:8795-8825, CheckMemCpyAttr]; only host<->device
  // [api_impl.cc:8860-8864]. All entries are checked before any is queued
  // (the UB path [api_impl_david.cc:834-847]); CANN's per-entry emulation
  // queues entries before the one that fails, so the engine's error text
  // allows for both.
  bool pageable = false;
  size_t k = 0;
  for (size_t i = 0; i < n; ++i) {
    if (k + 1 < num_attrs && i >= attrs_indexes[k + 1]) ++k;
    const MemcpyBatchAttr& attr = attrs[k];
    auto fail = [&](const std::string& why) {
      *fail_index = i;
      return rt().error(kRtParamInvalid, "aclrtMemcpyBatchAsync: entry " + std::to_string(i) + ": " + why);
    };
    if (sizes[i] == 0 || sizes[i] > dest_maxs[i]) return fail("size must be in (0, destMax]");
    if (dsts[i] == nullptr || srcs[i] == nullptr) return fail("null address");
    const Region dr = rt().region_of(dsts[i]);
    const Region sr = rt().region_of(srcs[i]);
    const MemLocationType dl = location_of(dr);
    const MemLocationType sl = location_of(sr);
    auto as_host = [](MemLocationType t) {
      return t == MemLocationType::kHostNuma || t == MemLocationType::kUnregistered ? MemLocationType::kHost : t;
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
    pageable = pageable || dl == MemLocationType::kUnregistered || sl == MemLocationType::kUnregistered;
  }
  std::vector<std::function<void()>> copies;
  copies.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    void* d = dsts[i];
    const void* src = srcs[i];
    const size_t bytes = sizes[i];
    copies.emplace_back([d, src, bytes] { std::memcpy(d, src, bytes); });
  }
  if (pageable) {
    // Pageable memory: refused under capture (EE1016), else the stream is
    // synchronized and the batch copied synchronously [api_impl_david.cc:849-858;
    // api_impl.cc:8912-8923].
    if (rt().capturing(s)) {
      return rt().error(kRtParamInvalid,
                        "EE1016: The pageable memory copy task does not support graph capture");
    }
    rt().drain(s);
    for (auto& c : copies) c();
  } else if (rt().capturing(s)) {
    for (auto& c : copies) {
      if (AclError e = rt().record_into_graph(s, c)) return e;
    }
  } else {
    for (auto& c : copies) rt().enqueue(s, c);
  }
  // The runtime keeps no reference to the arrays once the call returns
  // [api_impl_david.cc:860-862 copies them; api_impl.cc:8887-8935 consumes
  // them entry by entry]: overwrite them, so a late read shows.
  for (size_t i = 0; i < n; ++i) {
    dsts[i] = reinterpret_cast<void*>(uintptr_t{0xdead0000});
    srcs[i] = reinterpret_cast<void*>(uintptr_t{0xdead0000});
    sizes[i] = 0x7fffffff;
    dest_maxs[i] = 0;
  }
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

// aclrtHostRegisterV2 [rt src/runtime/api/impl/api_error.cc:2012-2027;
// api_impl.cc:2574-2610; doc 11-02_host_memory_management.md, aclrtHostRegisterV2].
AclError host_register_v2(void* ptr, uint64_t size, uint32_t flag) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  if (AclError e = rt().injected("aclrtHostRegisterV2")) return e;
  constexpr uint32_t kValid = 0x2u | 0x4u | 0x8u | ascend::kHostRegPinned;  // [api_error.cc:2016-2017]
  if (ptr == nullptr || size == 0 || (flag & kValid) == 0 || (flag & ~kValid) != 0) {
    return rt().error(kRtParamInvalid, "aclrtHostRegisterV2: null ptr, zero size or invalid flag");
  }
  // The address must be 4 KiB aligned [doc 11-02, aclrtHostRegisterV2 "ptr"].
  if (reinterpret_cast<uintptr_t>(ptr) % 4096 != 0) {
    return rt().error(kRtParamInvalid, "aclrtHostRegisterV2: ptr must be 4 KiB aligned");
  }
  const Region r = rt().region_of(ptr);
  // Registering a range again fails (EE1018) [api_error.cc:2024-2026];
  // PINNED on memory that is already page-locked fails [doc 11-02, "flag"].
  if (r.kind != Kind::kPageable) {
    return rt().error(kRtParamInvalid, "aclrtHostRegisterV2: memory already registered or not pageable host memory");
  }
  rt().add_region(ptr, size, (flag & ascend::kHostRegPinned) != 0 ? Kind::kPinned : Kind::kMapped, -1,
                  /*in_place=*/true);
  return 0;
}

// aclrtHostUnregister: the pointer must be a registered start (EE1018)
// [rt src/runtime/api/impl/api_error.cc:2029-2037].
AclError host_unregister(void* ptr) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  if (AclError e = rt().injected("aclrtHostUnregister")) return e;
  const Region r = rt().region_of(ptr);
  if ((r.kind != Kind::kPinned && r.kind != Kind::kMapped) || r.start != reinterpret_cast<uintptr_t>(ptr)) {
    return rt().error(kRtParamInvalid, "aclrtHostUnregister: the host pointer has not been registered");
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
  faults_.clear();
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
AclError noop_batch(void**, size_t*, void**, size_t*, size_t, MemcpyBatchAttr*, size_t*, size_t,
                    size_t*, AclStream) {
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

}  // namespace ascend
}  // namespace kvswap
