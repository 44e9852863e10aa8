// A fake CUDA runtime on host memory (tests only). The CUDA engine's host
// logic, compiled unchanged from csrc/cuda/cuda_engine.cpp, calls it through
// the engine's runtime table; tests/test_cuda_fake.py drives it.
//
// The model, and where each rule comes from (CUDA 13.0, lines of
// /usr/local/cuda/include/cuda_runtime_api.h, cuda.h and driver_types.h,
// or the named documentation page):
//
// * Memory: a registry of device allocations (per device), page-locked host
//   memory (cudaHostAlloc, cudaHostRegister: mapped and portable, "On a system
//   with unified virtual addressing, the memory will be both mapped and
//   portable", cuda_runtime_api.h:4913-4914) and, by elimination, pageable
//   host memory. A copy whose range leaves its allocation, or whose sides do
//   not match its cudaMemcpyKind, fails with cudaErrorInvalidValue.
// * Streams are queues: copies and kernels run only when the stream is
//   synchronized or an event recorded after them is queried, so a missing
//   ordering shows up as stale data. Exceptions as CUDA documents them
//   ("API synchronization behavior" page of the runtime API docs): a copy
//   from pageable memory reads its source during the call (staged), a copy
//   to pageable memory waits for the stream and lands before it returns.
// * Batch copies land in no set order (a permutation per batch; "copies
//   within a batch are not guaranteed to execute in any specific order",
//   cuda_runtime_api.h:6371-6378). cudaMemcpyBatchAsync rejects the legacy
//   stream ("Must not be legacy NULL stream", cuda_runtime_api.h:6426) and a
//   capturing stream
//   (cudaErrorStreamCaptureUnsupported, measured in rapidsai/rmm#2518 and
//   NVIDIA/cuopt#1753: "cudaMemcpyBatchAsync during capture -> 900"; the
//   capture stays valid, as rmm#2518 measured); attrs/attrsIdxs must satisfy
//   cuda_runtime_api.h:6387-6388 (first index 0, increasing, below count,
//   numAttrs <= count) and carry a valid srcAccessOrder (6401-6403). The
//   header does not say when the arrays are read, so the fake models both
//   ends: by default it reads the pointer arrays when the copies run and
//   reports a violation if they changed since the call (an engine that
//   released them early fails); with the `scribble_arrays` fault it copies
//   them during the call and overwrites them after it returns (an engine that
//   read them afterwards fails). attrs and attrsIdxs, which the API takes
//   through non-const pointers (6435), are read during the call and always
//   overwritten after it returns, so reusing them across calls fails.
//   The header documents no limit on `count`, but one call of 51,828
//   descriptors crashed the process (segfault), and repeated large calls hung,
//   on CUDA 13.0 with driver 580.159.04 (vllm-project/vllm issue #49276). A
//   fake cannot crash its test, so it refuses a call of that many descriptors
//   or more with cudaErrorInvalidValue and records a violation: an engine that
//   sends one fails its test however it handles the answer.
// * Capture: record, instantiate, replay. Work on a capturing stream becomes
//   graph nodes (cuda_runtime_api.h:2437-2439). Prohibited, with
//   cudaErrorStreamCaptureUnsupported, and invalidating the capture ("When an
//   invalid operation is attempted during stream capture, any associated
//   capture graphs are invalidated", CUDA Programming Guide, Stream Capture,
//   Invalidation): synchronizing or querying a capturing stream, copies of
//   pageable memory (they synchronize, see above), and the "potentially
//   unsafe" calls (synchronous cudaMemcpy, stream and event sync, event
//   query, host registration, allocation) under the thread's capture mode
//   (cuda_runtime_api.h:2536-2548): global mode prohibits them while this
//   thread captures (not relaxed) or any other thread captures in global
//   mode; thread-local mode only for this thread's own captures; relaxed
//   never. cudaEventQuery on an event recorded in a capture fails with
//   cudaErrorCapturedEvent in every mode (2546-2548, driver_types.h:1054-1058).
//   The legacy stream, while a blocking stream of its device captures,
//   fails with cudaErrorStreamCaptureImplicit (cuda_runtime_api.h:2603-2610;
//   cudaStreamIsCapturing does not invalidate the capture, use does).
//   cudaStreamEndCapture from another thread needs relaxed mode
//   (cudaErrorStreamCaptureWrongThread, driver_types.h:1062-1065). Further
//   work on an invalidated capture answers cudaErrorStreamCaptureInvalidated
//   and records nothing (driver_types.h:1019-1022), and the capture ends with
//   that error. A copy or launch that fails on a capturing stream
//   invalidates the capture too: no source says whether it does, and the
//   fake takes the unkind answer. Whether cudaPointerGetAttributes is
//   "potentially unsafe" no public source says: the `pointer_query_unsafe`
//   fault makes it so.
// * Kernel launch: the parameters are copied at launch ("the actual kernel
//   parameter will be copied", cuda.h:17434-17435); the launch runs the
//   kernel's own body (csrc/cuda/copy_kernel.h) on the host, every thread
//   block and thread in turn. Memory the kernel reaches must be device memory
//   or mapped page-locked memory; anything else is an illegal address,
//   reported by the next synchronization. Parameters: 4,096 bytes
//   everywhere, 32,764 with a 12.1+ runtime and driver on sm_70+ (else
//   cudaErrorNotSupported; copy_kernel.h and param_rule cite the sources).
//   cudaDeviceGetAttribute answers the compute capability.
// * Current stream: per thread, as torch's (c10/cuda/CUDAStream.cpp keeps
//   the current streams thread_local); a thread that set none has the
//   default (legacy) stream.
// * Current device (per thread; torch's exchangeDevice is cudaSetDevice,
//   which refuses an ordinal that is not a device with cudaErrorInvalidDevice,
//   cuda_runtime_api.h:1648). Events belong to the device current when they
//   are created, and kernels run on the current device
//   (cuda_runtime_api.h:1625-1628): a launch on a stream of another device
//   fails, and cudaEventRecord of an event and a stream of different devices
//   fails (2804: "event and stream must be on the same CUDA context"), both
//   with cudaErrorInvalidResourceHandle; the legacy stream is the current
//   device's. A copy on another device's stream succeeds ("A memory copy will
//   succeed even if it is issued to a stream that is not associated to the
//   current device", CUDA Programming Guide, Multi-Device System, Stream and
//   Event Behavior, which also states the two failures above).
// * Last error: every failed call sets the calling thread's last error, which
//   stays until cudaGetLastError reads it (cuda_runtime_api.h:1119-1121);
//   cudaPeekAtLastError reads without clearing. cudaErrorNotReady counts.
// * Sticky errors: after an illegal address "any further CUDA work will
//   return the same error" (driver_types.h:771-772): every later call that
//   touches a stream, an event, memory or the device answers it and does
//   nothing, queued work no longer runs, and cudaGetLastError does not clear
//   it. Only reset() (a new process) does.
// * Faults: the batch entry absent, the batch call answering an error, a
//   failing descriptor k, a failing cudaMemcpyAsync k, a failing host
//   registration, runtime and driver versions, the compute capability, the
//   large-parameter launcher absent, a stalled device, a device that
//   cudaSetDevice refuses, and a batch call that reports failIdx (12.8/12.9).
// The kernel body counts the bytes it copies per word width (host build only).
#define KVSWAP_COPY_KERNEL_STATS 1
#include "fake_cuda_runtime.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

namespace fake_cuda {
namespace {

using kvswap::cuda::CopyParams;
using Op = std::function<void()>;

enum class Kind { kDevice, kPinned };

struct Allocation {
  size_t size;
  Kind kind;
  int device;
  bool owned;  // allocated here (freed here) rather than registered
};

struct Capture;

struct StreamState {
  int device = 0;
  bool blocking = false;  // synchronizes with the legacy stream
  bool legacy = false;
  std::deque<std::pair<uint64_t, Op>> queue;
  uint64_t enqueued = 0;
  uint64_t executed = 0;
  Capture* capture = nullptr;
};

struct Capture {
  StreamState* origin;
  std::thread::id thread;
  cudaStreamCaptureMode mode;
  bool invalidated = false;
  std::vector<Op> nodes;
};

struct EventState {
  int device = 0;  // the device current at creation (cuda_runtime_api.h:1625-1626)
  StreamState* stream = nullptr;
  uint64_t seq = 0;
  bool captured = false;
};

struct Graph {
  std::vector<Op> nodes;
};

struct World {
  std::recursive_mutex mu;
  int devices = 2;
  std::map<uintptr_t, Allocation> allocs;
  std::deque<StreamState> streams;  // never shrinks: handles stay valid
  std::set<const StreamState*> known;
  std::vector<StreamState*> legacy;      // per device
  std::vector<StreamState*> per_thread;  // per device (cudaStreamPerThread)
  std::vector<cudaStream_t> current;     // a thread's current stream until it sets one, per device
  uint64_t generation = 0;               // reset() count: forgets every thread's streams
  std::deque<EventState> events;
  std::deque<Capture> capture_store;
  std::vector<Capture*> active;
  std::deque<Graph> graphs;
  Faults faults;
  int64_t memcpy_calls = 0;
  int64_t launch_calls = 0;
  int64_t host_register_bytes = 0;
  uint64_t batches_run = 0;  // seeds each batch's order
  int64_t batch_calls = 0;
  cudaError_t sticky = cudaSuccess;
  std::vector<std::string> log;
  std::vector<std::string> violations;
  std::vector<LaunchRecord> launches;
  std::vector<BatchRecord> batches;
};

World& world() {
  static World* w = new World();  // process lifetime: deleters may run late
  return *w;
}

thread_local cudaError_t t_last_error = cudaSuccess;
thread_local cudaStreamCaptureMode t_mode = cudaStreamCaptureModeGlobal;
thread_local int t_device = 0;

std::string hex(const void* p) {
  std::ostringstream out;
  out << p;
  return out.str();
}

cudaError_t note(const char* api, const StreamState* s, cudaError_t result) {
  World& w = world();
  std::ostringstream line;
  line << api << " device=" << t_device << " stream=" << hex(s) << " capturing=" << (s && s->capture ? 1 : 0)
       << " -> " << error_name(result);
  w.log.push_back(line.str());
  if (result != cudaSuccess) t_last_error = result;
  return result;
}

// A fault injected for `api` (Faults::fail), or cudaSuccess.
cudaError_t injected(const char* api) {
  const auto& fail = world().faults.fail;
  auto it = fail.find(api);
  return it == fail.end() ? cudaSuccess : it->second;
}

#define KVSWAP_FAKE_INJECT(api, stream)                                                   \
  do {                                                                                    \
    if (const cudaError_t injected_ = injected(api)) return note(api, stream, injected_); \
  } while (0)

// After a sticky error "any further CUDA work will return the same error"
// (driver_types.h:771-772, cudaErrorIllegalAddress; the same words for the
// other context-corrupting errors): every call that touches a stream, an
// event, memory or the device answers it, and does nothing.
#define KVSWAP_FAKE_STICKY(api, stream)                                          \
  do {                                                                           \
    if (world().sticky != cudaSuccess) return note(api, stream, world().sticky); \
  } while (0)

StreamState* resolve(cudaStream_t stream) {
  World& w = world();
  if (stream == nullptr || stream == cudaStreamLegacy) return w.legacy[static_cast<size_t>(t_device)];
  if (stream == cudaStreamPerThread) return w.per_thread[static_cast<size_t>(t_device)];
  auto* s = reinterpret_cast<StreamState*>(stream);
  return w.known.count(s) ? s : nullptr;
}

// --- memory ----------------------------------------------------------------------

enum class Where { kDevice, kPinned, kPageable, kInvalid };

struct Span {
  Where where;
  int device;
};

// Where [p, p + n) lives. A range that starts in an allocation must end in it.
Span classify(const void* p, size_t n) {
  World& w = world();
  const auto addr = reinterpret_cast<uintptr_t>(p);
  auto it = w.allocs.upper_bound(addr);
  if (it != w.allocs.begin()) {
    --it;
    if (addr < it->first + it->second.size) {
      if (addr + n > it->first + it->second.size) return {Where::kInvalid, -1};
      return {it->second.kind == Kind::kDevice ? Where::kDevice : Where::kPinned, it->second.device};
    }
  }
  // Unregistered: host memory, unless it overlaps an allocation.
  auto next = w.allocs.upper_bound(addr);
  if (next != w.allocs.end() && next->first < addr + n) return {Where::kInvalid, -1};
  return {Where::kPageable, -1};
}

bool host_side(const Span& s) { return s.where == Where::kPinned || s.where == Where::kPageable; }

// --- capture rules -------------------------------------------------------------------

void invalidate(Capture* c) { c->invalidated = true; }

// The thread-mode rule of cuda_runtime_api.h:2536-2548 for "potentially
// unsafe" calls; invalidates the captures that forbid the call.
bool unsafe_prohibited() {
  World& w = world();
  if (t_mode == cudaStreamCaptureModeRelaxed) return false;
  bool prohibited = false;
  for (Capture* c : w.active) {
    const bool mine = c->thread == std::this_thread::get_id();
    if ((mine && c->mode != cudaStreamCaptureModeRelaxed) ||
        (!mine && t_mode == cudaStreamCaptureModeGlobal && c->mode == cudaStreamCaptureModeGlobal)) {
      invalidate(c);
      prohibited = true;
    }
  }
  return prohibited;
}

// A blocking stream of `device` capturing: the legacy stream may not be used
// (cuda_runtime_api.h:2603-2610, driver_types.h:1048-1052).
std::vector<Capture*> blocking_captures(int device) {
  std::vector<Capture*> out;
  for (Capture* c : world().active) {
    if (c->origin->blocking && c->origin->device == device) out.push_back(c);
  }
  return out;
}

// Queues `op` on `s`, or records it into the stream's capture.
cudaError_t enqueue(StreamState* s, Op op) {
  if (s->legacy) {
    auto blocking = blocking_captures(s->device);
    if (!blocking.empty()) {
      for (Capture* c : blocking) invalidate(c);
      return cudaErrorStreamCaptureImplicit;
    }
  }
  if (s->capture != nullptr) {
    // "The current capture sequence on the stream has been invalidated due
    // to a previous error" (cudaErrorStreamCaptureInvalidated,
    // driver_types.h:1019-1022): work on it records nothing more.
    if (s->capture->invalidated) return cudaErrorStreamCaptureInvalidated;
    s->capture->nodes.push_back(std::move(op));
    return cudaSuccess;
  }
  s->queue.emplace_back(++s->enqueued, std::move(op));
  return cudaSuccess;
}

void drain(StreamState* s, uint64_t upto) {
  while (!s->queue.empty() && s->queue.front().first <= upto) {
    auto item = std::move(s->queue.front());
    s->queue.pop_front();
    if (world().sticky == cudaSuccess) item.second();  // after a sticky error nothing runs
    s->executed = item.first;
  }
}

void drain_all(StreamState* s) { drain(s, s->enqueued); }

// --- runtime functions --------------------------------------------------------------

// torch's current stream is per thread (c10/cuda/CUDAStream.cpp: the current
// streams are thread_local; a thread that set none has the default stream),
// so a stream one thread makes current is not another thread's.
struct ThreadStreams {
  uint64_t generation = ~uint64_t{0};
  std::map<int, cudaStream_t> set;  // device -> the stream this thread made current
};
thread_local ThreadStreams t_streams;

cudaStream_t f_current_stream(int device) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  const cudaStream_t fallback = w.current.at(static_cast<size_t>(device));
  if (t_streams.generation != w.generation) return fallback;
  auto it = t_streams.set.find(device);
  return it == t_streams.set.end() ? fallback : it->second;
}

// torch's exchangeDevice: cudaSetDevice, raising when it fails (torch's
// C10_CUDA_CHECK reads the error back with cudaGetLastError, so none is
// left). cudaSetDevice answers cudaErrorInvalidDevice for an ordinal that is
// not a device (cuda_runtime_api.h:1648, driver_types.h:533-537); the
// `refuse_device` fault makes one valid device answer
// cudaErrorDevicesUnavailable (driver_types.h:431-440).
int f_exchange_device(int device) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  const int previous = t_device;
  w.log.push_back("exchange_device " + std::to_string(previous) + "->" + std::to_string(device));
  const cudaError_t err = device < 0 || device >= w.devices  ? cudaErrorInvalidDevice
                          : device == w.faults.refuse_device ? cudaErrorDevicesUnavailable
                                                             : cudaSuccess;
  TORCH_CHECK(err == cudaSuccess, "CUDA error: ", error_name(err), " (fake cudaSetDevice(", device, "))");
  t_device = device;
  return previous;
}

// cudaGetLastError returns the last error and resets it to cudaSuccess
// (cuda_runtime_api.h:1119-1121), except a sticky one, which no call clears
// (driver_types.h:771-772: "the process must be terminated and relaunched").
cudaError_t f_get_last_error() {
  const cudaError_t e = t_last_error;
  t_last_error = world().sticky;
  return e;
}

const char* f_error_string(cudaError_t err) { return error_name(err); }

cudaError_t f_runtime_version(int* v) {
  KVSWAP_FAKE_INJECT("cudaRuntimeGetVersion", nullptr);
  *v = world().faults.runtime_version;
  return cudaSuccess;
}

cudaError_t f_driver_version(int* v) {
  KVSWAP_FAKE_INJECT("cudaDriverGetVersion", nullptr);
  *v = world().faults.driver_version;
  return cudaSuccess;
}

// A copy or a launch that fails on a capturing stream invalidates the
// capture. No source says what CUDA does with the capture then; the fake
// takes the unkind answer (the partial graph cannot be instantiated), so an
// engine must not rely on a capture surviving its own failed call.
cudaError_t failed_work(const char* api, StreamState* s, cudaError_t err) {
  if (s->capture != nullptr) invalidate(s->capture);
  return note(api, s, err);
}

cudaError_t f_memcpy_async(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  const int64_t call = w.memcpy_calls++;
  StreamState* s = resolve(stream);
  if (s == nullptr) return note("cudaMemcpyAsync", s, cudaErrorInvalidResourceHandle);
  KVSWAP_FAKE_STICKY("cudaMemcpyAsync", s);
  if (const cudaError_t e = injected("cudaMemcpyAsync")) return failed_work("cudaMemcpyAsync", s, e);
  if (call == w.faults.memcpy_fail_at) return failed_work("cudaMemcpyAsync", s, cudaErrorInvalidValue);
  const Span from = classify(src, n);
  const Span to = classify(dst, n);
  bool ok = false;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      ok = host_side(from) && to.where == Where::kDevice;
      break;
    case cudaMemcpyDeviceToHost:
      ok = from.where == Where::kDevice && host_side(to);
      break;
    case cudaMemcpyDeviceToDevice:
      ok = from.where == Where::kDevice && to.where == Where::kDevice;
      break;
    default:
      ok = from.where != Where::kInvalid && to.where != Where::kInvalid;
  }
  if (!ok) return failed_work("cudaMemcpyAsync", s, cudaErrorInvalidValue);
  const bool pageable = from.where == Where::kPageable || to.where == Where::kPageable;
  if (pageable && s->capture != nullptr) {
    invalidate(s->capture);
    return note("cudaMemcpyAsync", s, cudaErrorStreamCaptureUnsupported);
  }
  if (from.where == Where::kPageable) {
    // Staged during the call; the bytes land in stream order.
    auto staged =
        std::make_shared<std::vector<char>>(static_cast<const char*>(src), static_cast<const char*>(src) + n);
    return note("cudaMemcpyAsync", s,
                enqueue(s, [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); }));
  }
  if (to.where == Where::kPageable) {
    // Returns only once the copy has completed.
    const cudaError_t err = enqueue(s, [dst, src, n] { std::memcpy(dst, src, n); });
    if (err == cudaSuccess) drain_all(s);
    return note("cudaMemcpyAsync", s, err);
  }
  return note("cudaMemcpyAsync", s, enqueue(s, [dst, src, n] { std::memcpy(dst, src, n); }));
}

// The order in which a batch's copies land: "copies within a batch are not
// guaranteed to execute in any specific order" and dependent copies are
// undefined behavior (cuda_runtime_api.h:6371-6378). A permutation drawn from
// a per-reset count (the same on every run), never the submitted order when
// there are two copies or more, so an engine that relied on the order would
// copy wrong bytes.
std::vector<size_t> batch_order(size_t n) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::mt19937_64 draw(0x5eed0000u + ++world().batches_run);
  std::shuffle(order.begin(), order.end(), draw);
  if (n > 1 && std::is_sorted(order.begin(), order.end()))
    std::rotate(order.begin(), order.begin() + 1, order.end());
  return order;
}

// The smallest batch known to crash the runtime (vLLM #49276; see the top).
constexpr size_t kBatchCrashCount = 51828;

// failIdx: CUDA 12.8/12.9 report the failing copy's index there; CUDA 13
// has no such output, and the fake leaves it unless `reports_fail_index`.
cudaError_t f_memcpy_batch(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                           cudaMemcpyAttributes* attrs, size_t* idxs, size_t num_attrs, size_t* fail_idx,
                           cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  StreamState* s = resolve(stream);
  auto done = [&](cudaError_t err) {
    // The API may write what it takes through non-const pointers.
    for (size_t k = 0; k < num_attrs && attrs != nullptr && idxs != nullptr; ++k) {
      std::memset(&attrs[k], 0xA5, sizeof(cudaMemcpyAttributes));
      idxs[k] = SIZE_MAX;
    }
    return note("cudaMemcpyBatchAsync", s, err);
  };
  const int64_t call = w.batch_calls++;
  if (s == nullptr) return done(cudaErrorInvalidResourceHandle);
  if (w.sticky != cudaSuccess) return done(w.sticky);
  if (const cudaError_t e = injected("cudaMemcpyBatchAsync")) return done(e);
  if (call == w.faults.batch_fail_call) return done(cudaErrorInvalidValue);
  if (w.faults.batch_error != cudaSuccess) return done(w.faults.batch_error);
  if (s->legacy) return done(cudaErrorInvalidValue);
  if (s->capture != nullptr && s->capture->invalidated) return done(cudaErrorStreamCaptureInvalidated);
  if (s->capture != nullptr) return done(cudaErrorStreamCaptureUnsupported);  // capture stays valid
  if (count == 0 || num_attrs == 0 || num_attrs > count || attrs == nullptr || idxs == nullptr ||
      idxs[0] != 0) {
    return done(cudaErrorInvalidValue);
  }
  for (size_t k = 0; k < num_attrs; ++k) {
    if ((k > 0 && idxs[k] <= idxs[k - 1]) || idxs[k] >= count) return done(cudaErrorInvalidValue);
    const int order = static_cast<int>(attrs[k].srcAccessOrder);
    if (order != cudaMemcpySrcAccessOrderStream && order != cudaMemcpySrcAccessOrderDuringApiCall &&
        order != cudaMemcpySrcAccessOrderAny) {
      return done(cudaErrorInvalidValue);
    }
  }
  if (count >= kBatchCrashCount) {
    w.violations.push_back("cudaMemcpyBatchAsync: " + std::to_string(count) +
                           " descriptors in one call (51,828 crashed the process: vLLM #49276)");
    return done(cudaErrorInvalidValue);
  }
  if (w.faults.batch_fail_at >= 0 && count > static_cast<size_t>(w.faults.batch_fail_at)) {
    if (w.faults.reports_fail_index && fail_idx != nullptr)
      *fail_idx = static_cast<size_t>(w.faults.batch_fail_at);
    return done(cudaErrorInvalidValue);
  }
  for (size_t i = 0; i < count; ++i) {
    const Span a = classify(srcs[i], sizes[i]);
    const Span b = classify(dsts[i], sizes[i]);
    if (a.where == Where::kInvalid || b.where == Where::kInvalid || sizes[i] == 0) {
      return done(cudaErrorInvalidValue);
    }
  }
  w.batches.push_back(BatchRecord{count, num_attrs, idxs[0], static_cast<int>(attrs[0].srcAccessOrder)});
  auto snap_dst = std::make_shared<std::vector<void*>>(dsts, dsts + count);
  auto snap_src = std::make_shared<std::vector<const void*>>(srcs, srcs + count);
  auto snap_size = std::make_shared<std::vector<size_t>>(sizes, sizes + count);
  const bool scribble = w.faults.scribble_arrays;
  const cudaError_t err = enqueue(s, [=] {
    // The runtime may read the arrays now: they must not have changed.
    if (!scribble && (!std::equal(snap_dst->begin(), snap_dst->end(), dsts) ||
                      !std::equal(snap_src->begin(), snap_src->end(), srcs) ||
                      !std::equal(snap_size->begin(), snap_size->end(), sizes))) {
      world().violations.push_back("cudaMemcpyBatchAsync: descriptor arrays changed before the copies ran");
    }
    for (size_t i : batch_order(snap_dst->size()))
      std::memcpy((*snap_dst)[i], (*snap_src)[i], (*snap_size)[i]);
  });
  if (scribble && err == cudaSuccess) {
    // The other model of the arrays' lifetime: consumed during the call, the
    // caller's copies garbage afterwards. An engine that read its table after
    // a successful submission would copy garbage.
    std::memset(const_cast<void**>(dsts), 0xEE, count * sizeof(void*));
    std::memset(const_cast<void**>(srcs), 0xEE, count * sizeof(void*));
    std::memset(const_cast<size_t*>(sizes), 0xEE, count * sizeof(size_t));
  }
  return done(err);
}

cudaError_t f_stream_is_capturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  StreamState* s = resolve(stream);
  if (s == nullptr) return note("cudaStreamIsCapturing", s, cudaErrorInvalidResourceHandle);
  KVSWAP_FAKE_STICKY("cudaStreamIsCapturing", s);
  KVSWAP_FAKE_INJECT("cudaStreamIsCapturing", s);
  if (s->legacy && !blocking_captures(s->device).empty()) {
    return note("cudaStreamIsCapturing", s, cudaErrorStreamCaptureImplicit);  // not invalidated
  }
  *status = s->capture == nullptr     ? cudaStreamCaptureStatusNone
            : s->capture->invalidated ? cudaStreamCaptureStatusInvalidated
                                      : cudaStreamCaptureStatusActive;
  return note("cudaStreamIsCapturing", s, cudaSuccess);
}

cudaError_t f_exchange_mode(cudaStreamCaptureMode* mode) {
  KVSWAP_FAKE_INJECT("cudaThreadExchangeStreamCaptureMode", nullptr);
  std::swap(*mode, t_mode);
  return cudaSuccess;
}

cudaError_t f_event_create(cudaEvent_t* event, unsigned int) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  KVSWAP_FAKE_STICKY("cudaEventCreateWithFlags", nullptr);
  KVSWAP_FAKE_INJECT("cudaEventCreateWithFlags", nullptr);
  world().events.emplace_back();
  world().events.back().device = t_device;
  *event = reinterpret_cast<cudaEvent_t>(&world().events.back());
  return note("cudaEventCreateWithFlags", nullptr, cudaSuccess);
}

cudaError_t f_event_record(cudaEvent_t event, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  StreamState* s = resolve(stream);
  if (s == nullptr || event == nullptr) return note("cudaEventRecord", s, cudaErrorInvalidResourceHandle);
  KVSWAP_FAKE_STICKY("cudaEventRecord", s);
  KVSWAP_FAKE_INJECT("cudaEventRecord", s);
  auto* e = reinterpret_cast<EventState*>(event);
  // "event and stream must be on the same CUDA context" (cuda_runtime_api.h:2804);
  // "cudaEventRecord() will fail if the input event and input stream are
  // associated to different devices" (CUDA Programming Guide, Multi-Device
  // System, Stream and Event Behavior).
  if (e->device != s->device) return note("cudaEventRecord", s, cudaErrorInvalidResourceHandle);
  if (s->capture != nullptr) {
    e->captured = true;
    return note("cudaEventRecord", s, cudaSuccess);
  }
  const cudaError_t err = enqueue(s, [] {});
  if (err != cudaSuccess) return note("cudaEventRecord", s, err);
  e->captured = false;
  e->stream = s;
  e->seq = s->enqueued;
  return note("cudaEventRecord", s, cudaSuccess);
}

cudaError_t f_event_query(cudaEvent_t event) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  auto* e = reinterpret_cast<EventState*>(event);
  if (e == nullptr) return note("cudaEventQuery", nullptr, cudaErrorInvalidResourceHandle);
  KVSWAP_FAKE_STICKY("cudaEventQuery", e->stream);
  KVSWAP_FAKE_INJECT("cudaEventQuery", e->stream);
  if (e->captured) return note("cudaEventQuery", e->stream, cudaErrorCapturedEvent);
  if (unsafe_prohibited()) return note("cudaEventQuery", e->stream, cudaErrorStreamCaptureUnsupported);
  if (e->stream == nullptr) return note("cudaEventQuery", nullptr, cudaSuccess);
  if (w.faults.stalled && e->stream->executed < e->seq)
    return note("cudaEventQuery", e->stream, cudaErrorNotReady);
  drain(e->stream, e->seq);
  return note("cudaEventQuery", e->stream, w.sticky);
}

cudaError_t f_pointer_attributes(cudaPointerAttributes* attrs, const void* ptr) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  KVSWAP_FAKE_STICKY("cudaPointerGetAttributes", nullptr);
  KVSWAP_FAKE_INJECT("cudaPointerGetAttributes", nullptr);
  // No public source says whether cudaPointerGetAttributes is one of the
  // "potentially unsafe" calls of cuda_runtime_api.h:2536-2548; with this
  // fault it is, so an engine must be safe either way.
  if (w.faults.pointer_query_unsafe && unsafe_prohibited()) {
    return note("cudaPointerGetAttributes", nullptr, cudaErrorStreamCaptureUnsupported);
  }
  *attrs = cudaPointerAttributes{};
  const Span s = classify(ptr, 1);
  switch (s.where) {
    case Where::kDevice:
      attrs->type = cudaMemoryTypeDevice;
      attrs->device = s.device;
      attrs->devicePointer = s.device == t_device ? const_cast<void*>(ptr) : nullptr;
      break;
    case Where::kPinned:
      attrs->type = cudaMemoryTypeHost;
      attrs->device = s.device;
      attrs->devicePointer = const_cast<void*>(ptr);  // mapped, same address under UVA
      attrs->hostPointer = const_cast<void*>(ptr);
      break;
    default:  // "forward passing host pointer will return cudaMemoryTypeUnregistered" (8392-8393)
      attrs->type = cudaMemoryTypeUnregistered;
      attrs->hostPointer = const_cast<void*>(ptr);
  }
  return note("cudaPointerGetAttributes", nullptr, cudaSuccess);
}

cudaError_t f_host_register(void* ptr, size_t size, unsigned int) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  KVSWAP_FAKE_STICKY("cudaHostRegister", nullptr);
  if (unsafe_prohibited()) return note("cudaHostRegister", nullptr, cudaErrorStreamCaptureUnsupported);
  if (w.faults.host_register_error != cudaSuccess)
    return note("cudaHostRegister", nullptr, w.faults.host_register_error);
  if (size == 0 || ptr == nullptr) return note("cudaHostRegister", nullptr, cudaErrorInvalidValue);
  if (w.faults.host_register_max_bytes >= 0 && size > static_cast<size_t>(w.faults.host_register_max_bytes)) {
    return note("cudaHostRegister", nullptr, cudaErrorMemoryAllocation);
  }
  if (classify(ptr, size).where != Where::kPageable) {
    return note("cudaHostRegister", nullptr, cudaErrorHostMemoryAlreadyRegistered);
  }
  w.allocs[reinterpret_cast<uintptr_t>(ptr)] = Allocation{size, Kind::kPinned, t_device, false};
  w.host_register_bytes += static_cast<int64_t>(size);
  return note("cudaHostRegister", nullptr, cudaSuccess);
}

cudaError_t f_host_unregister(void* ptr) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  KVSWAP_FAKE_STICKY("cudaHostUnregister", nullptr);
  if (unsafe_prohibited()) return note("cudaHostUnregister", nullptr, cudaErrorStreamCaptureUnsupported);
  auto it = w.allocs.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == w.allocs.end() || it->second.owned || it->second.kind != Kind::kPinned) {
    return note("cudaHostUnregister", nullptr, cudaErrorHostMemoryNotRegistered);
  }
  w.allocs.erase(it);
  return note("cudaHostUnregister", nullptr, cudaSuccess);
}

// Memory a kernel may touch: every byte in device memory of `device` or in
// mapped host memory; a range may run through adjacent allocations (two
// registrations that touch map every page between them).
bool kernel_reachable(const void* p, size_t n, int device) {
  World& w = world();
  auto at = reinterpret_cast<uintptr_t>(p);
  const uintptr_t end = at + n;
  while (at < end) {
    auto it = w.allocs.upper_bound(at);
    if (it == w.allocs.begin()) return false;
    --it;
    const Allocation& a = it->second;
    if (at >= it->first + a.size) return false;  // a pageable byte
    if (a.kind == Kind::kDevice && a.device != device) return false;
    at = it->first + a.size;
  }
  return true;
}

// Whether a kernel with `bytes` of parameters may launch on the device of
// `s`: 4,096 bytes everywhere; up to 32,764 bytes with a 12.1+ runtime and
// driver on sm_70+ (copy_kernel.h cites the sources). "CUDA will issue the
// CUDA_ERROR_NOT_SUPPORTED error if the launch is attempted on an older
// driver" (NVIDIA technical blog, "CUDA 12.1 Supports Large Kernel
// Parameters", Toolkit and driver compatibility); the fake answers the same
// for an older runtime and a pre-Volta device, where the limit stays 4 KiB.
cudaError_t param_rule(size_t bytes) {
  const Faults& f = world().faults;
  if (bytes <= static_cast<size_t>(kvswap::cuda::kSmallParamLimit)) return cudaSuccess;
  const bool large = f.runtime_version >= 12010 && f.driver_version >= 12010 && f.compute_major >= 7;
  return large ? cudaSuccess : cudaErrorNotSupported;
}

template <class P>
cudaError_t launch_kernel(const P* params, unsigned grid_x, unsigned grid_y, cudaStream_t stream) {
  static_assert(sizeof(P) <= static_cast<size_t>(kvswap::cuda::kLargeParamLimit), "no launch takes more");
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  StreamState* s = resolve(stream);
  if (s == nullptr) return note("cudaLaunchKernel", s, cudaErrorInvalidResourceHandle);
  KVSWAP_FAKE_STICKY("cudaLaunchKernel", s);
  if (const cudaError_t e = injected("cudaLaunchKernel")) return failed_work("cudaLaunchKernel", s, e);
  if (w.launch_calls++ == w.faults.launch_fail_at)
    return failed_work("cudaLaunchKernel", s, cudaErrorInvalidValue);
  // Kernels launched from a thread "will be executed on" its current device
  // (cuda_runtime_api.h:1626-1628); "A kernel launch will fail if it is issued
  // to a stream that is not associated to the current device" (CUDA
  // Programming Guide, Multi-Device System, Stream and Event Behavior). A
  // copy on such a stream succeeds (the same page), so cudaMemcpyAsync has no
  // such rule.
  if (s->device != t_device) return failed_work("cudaLaunchKernel", s, cudaErrorInvalidResourceHandle);
  if (const cudaError_t err = param_rule(sizeof(P))) return failed_work("cudaLaunchKernel", s, err);
  if (grid_x == 0 || grid_y == 0 || grid_y > 65535 || static_cast<int>(grid_y) != params->num_pairs) {
    return failed_work("cudaLaunchKernel", s, cudaErrorInvalidConfiguration);
  }
  const LaunchRecord record{grid_x,
                            grid_y,
                            params->n,
                            params->slices,
                            params->num_pairs,
                            params->src_ids == nullptr,
                            params->dst_ids == nullptr,
                            static_cast<int>(sizeof(P))};
  auto p = std::make_shared<P>(*params);  // copied at launch
  const int device = s->device;
  const cudaError_t err = enqueue(s, [p, grid_x, grid_y, device] {
    World& w = world();
    const P& q = *p;
    bool reachable =
        kernel_reachable(q.src_ids, static_cast<size_t>(q.n) * 8 * (q.src_ids != nullptr), device) &&
        kernel_reachable(q.dst_ids, static_cast<size_t>(q.n) * 8 * (q.dst_ids != nullptr), device);
    for (int i = 0; i < q.num_pairs; ++i) {
      const auto& pair = kvswap::cuda::pair_at(q, i);
      if (pair.src_blocks > 0) {
        reachable =
            reachable &&
            kernel_reachable(pair.src,
                             static_cast<size_t>((pair.src_blocks - 1) * pair.src_stride + pair.block_bytes),
                             device);
      }
      if (pair.dst_blocks > 0) {
        reachable =
            reachable &&
            kernel_reachable(pair.dst,
                             static_cast<size_t>((pair.dst_blocks - 1) * pair.dst_stride + pair.block_bytes),
                             device);
      }
    }
    if (!reachable) {
      w.violations.push_back("kernel: touched memory the device cannot address");
      w.sticky = cudaErrorIllegalAddress;
      return;
    }
    const int64_t items = kvswap::cuda::work_items(q);
    for (unsigned by = 0; by < grid_y; ++by) {
      for (unsigned bx = 0; bx < grid_x; ++bx) {
        for (int64_t item = bx; item < items; item += grid_x) {
          for (int tid = 0; tid < kvswap::cuda::kCopyThreads; ++tid) {
            kvswap::cuda::copy_item(q, static_cast<int>(by), item, tid, kvswap::cuda::kCopyThreads);
          }
        }
      }
    }
  });
  if (err == cudaSuccess) w.launches.push_back(record);
  return note("cudaLaunchKernel", s, err);
}

cudaError_t f_launch_copy(const CopyParams* params, unsigned grid_x, unsigned grid_y, cudaStream_t stream) {
  return launch_kernel(params, grid_x, grid_y, stream);
}

cudaError_t f_launch_copy_large(const kvswap::cuda::CopyParamsLarge* params, unsigned grid_x, unsigned grid_y,
                                cudaStream_t stream) {
  return launch_kernel(params, grid_x, grid_y, stream);
}

// cudaDeviceGetAttribute (cuda_runtime_api.h:1324): the fake answers the
// compute capability; an invalid device is cudaErrorInvalidDevice.
cudaError_t f_device_get_attribute(int* value, cudaDeviceAttr attr, int device) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  KVSWAP_FAKE_STICKY("cudaDeviceGetAttribute", nullptr);
  KVSWAP_FAKE_INJECT("cudaDeviceGetAttribute", nullptr);
  if (device < 0 || device >= world().devices)
    return note("cudaDeviceGetAttribute", nullptr, cudaErrorInvalidDevice);
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor:
      *value = world().faults.compute_major;
      break;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      break;
    default:
      return note("cudaDeviceGetAttribute", nullptr, cudaErrorInvalidValue);
  }
  return note("cudaDeviceGetAttribute", nullptr, cudaSuccess);
}

// --- the no-op runtime ---------------------------------------------------------------

cudaStream_t n_current_stream(int) { return reinterpret_cast<cudaStream_t>(uintptr_t{0x100}); }
int n_exchange_device(int device) { return device; }
cudaError_t n_success() { return cudaSuccess; }
const char* n_name(cudaError_t) { return "cudaSuccess"; }
cudaError_t n_version(int* v) {
  *v = 13000;
  return cudaSuccess;
}
cudaError_t n_memcpy(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t) { return cudaSuccess; }
cudaError_t n_batch(void* const*, const void* const*, const size_t*, size_t, cudaMemcpyAttributes*, size_t*,
                    size_t, size_t*, cudaStream_t) {
  return cudaSuccess;
}
cudaError_t n_capturing(cudaStream_t, cudaStreamCaptureStatus* status) {
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t n_mode(cudaStreamCaptureMode*) { return cudaSuccess; }
cudaError_t n_event_create(cudaEvent_t* e, unsigned int) {
  static char token;
  *e = reinterpret_cast<cudaEvent_t>(&token);
  return cudaSuccess;
}
cudaError_t n_event_record(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t n_event_query(cudaEvent_t) { return cudaSuccess; }
cudaError_t n_pointer(cudaPointerAttributes* a, const void* p) {
  a->type = cudaMemoryTypeHost;
  a->devicePointer = const_cast<void*>(p);
  return cudaSuccess;
}
cudaError_t n_register(void*, size_t, unsigned int) { return cudaSuccess; }
cudaError_t n_unregister(void*) { return cudaSuccess; }
cudaError_t n_launch(const CopyParams*, unsigned, unsigned, cudaStream_t) { return cudaSuccess; }
cudaError_t n_launch_large(const kvswap::cuda::CopyParamsLarge*, unsigned, unsigned, cudaStream_t) {
  return cudaSuccess;
}
cudaError_t n_attribute(int* v, cudaDeviceAttr, int) {
  *v = 9;
  return cudaSuccess;
}

kvswap::cuda::CudaApi g_fake;
kvswap::cuda::CudaApi g_noop;

}  // namespace

const kvswap::cuda::CudaApi* fake_table() {
  auto& t = g_fake;
  t.current_stream = &f_current_stream;
  t.exchange_device = &f_exchange_device;
  t.get_last_error = &f_get_last_error;
  t.get_error_name = &error_name;
  t.get_error_string = &f_error_string;
  t.runtime_get_version = &f_runtime_version;
  t.driver_get_version = &f_driver_version;
  t.memcpy_async = &f_memcpy_async;
  t.memcpy_batch_async = world().faults.batch_absent ? nullptr : &f_memcpy_batch;
  t.stream_is_capturing = &f_stream_is_capturing;
  t.thread_exchange_stream_capture_mode = &f_exchange_mode;
  t.event_create_with_flags = &f_event_create;
  t.event_record = &f_event_record;
  t.event_query = &f_event_query;
  t.pointer_get_attributes = &f_pointer_attributes;
  t.host_register = &f_host_register;
  t.host_unregister = &f_host_unregister;
  t.device_get_attribute = &f_device_get_attribute;
  t.launch_copy = &f_launch_copy;
  t.launch_copy_large = world().faults.large_params_absent ? nullptr : &f_launch_copy_large;
  return &t;
}

const kvswap::cuda::CudaApi* noop_table() {
  auto& t = g_noop;
  t.current_stream = &n_current_stream;
  t.exchange_device = &n_exchange_device;
  t.get_last_error = &n_success;
  t.get_error_name = &n_name;
  t.get_error_string = &n_name;
  t.runtime_get_version = &n_version;
  t.driver_get_version = &n_version;
  t.memcpy_async = &n_memcpy;
  t.memcpy_batch_async = &n_batch;
  t.stream_is_capturing = &n_capturing;
  t.thread_exchange_stream_capture_mode = &n_mode;
  t.event_create_with_flags = &n_event_create;
  t.event_record = &n_event_record;
  t.event_query = &n_event_query;
  t.pointer_get_attributes = &n_pointer;
  t.host_register = &n_register;
  t.host_unregister = &n_unregister;
  t.device_get_attribute = &n_attribute;
  t.launch_copy = &n_launch;
  t.launch_copy_large = &n_launch_large;
  return &t;
}

void reset(int devices) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  w.devices = devices;
  for (auto& s : w.streams) {
    s.queue.clear();
    s.executed = s.enqueued;
    s.capture = nullptr;
  }
  for (auto& e : w.events) {
    e.captured = false;  // every recorded event has completed
  }
  w.active.clear();
  w.legacy.clear();
  w.per_thread.clear();
  w.current.clear();
  ++w.generation;
  for (int d = 0; d < devices; ++d) {
    for (auto* list : {&w.legacy, &w.per_thread}) {
      w.streams.emplace_back();
      StreamState& s = w.streams.back();
      s.device = d;
      s.legacy = list == &w.legacy;
      s.blocking = true;
      w.known.insert(&s);
      list->push_back(&s);
    }
    w.current.push_back(nullptr);  // torch's default: the legacy stream
  }
  w.faults = Faults{};
  w.memcpy_calls = 0;
  w.launch_calls = 0;
  w.host_register_bytes = 0;
  w.batches_run = 0;
  w.batch_calls = 0;
  w.sticky = cudaSuccess;
  w.log.clear();
  w.violations.clear();
  w.launches.clear();
  w.batches.clear();
  kvswap::cuda::copy_stats() = kvswap::cuda::CopyStats{};
  t_last_error = cudaSuccess;
  t_mode = cudaStreamCaptureModeGlobal;
  t_device = 0;
}

void* device_malloc(size_t bytes, int device) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  const size_t rounded = std::max<size_t>(256, (bytes + 255) / 256 * 256);  // cudaMalloc aligns to 256
  void* p = std::aligned_alloc(256, rounded);
  std::memset(p, 0xCD, rounded);
  world().allocs[reinterpret_cast<uintptr_t>(p)] = Allocation{rounded, Kind::kDevice, device, true};
  return p;
}

void device_free(void* ptr) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  world().allocs.erase(reinterpret_cast<uintptr_t>(ptr));
  std::free(ptr);
}

void* host_alloc(size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  const size_t rounded = std::max<size_t>(4096, (bytes + 4095) / 4096 * 4096);
  void* p = std::aligned_alloc(4096, rounded);
  std::memset(p, 0, rounded);
  world().allocs[reinterpret_cast<uintptr_t>(p)] = Allocation{rounded, Kind::kPinned, t_device, true};
  return p;
}

void host_free(void* ptr) { device_free(ptr); }

cudaStream_t stream_create(int device, bool blocking) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  w.streams.emplace_back();
  StreamState& s = w.streams.back();
  s.device = device;
  s.blocking = blocking;
  w.known.insert(&s);
  return reinterpret_cast<cudaStream_t>(&s);
}

void set_current_stream(int device, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  (void)w.current.at(static_cast<size_t>(device));  // a device that exists
  if (t_streams.generation != w.generation) {
    t_streams.set.clear();
    t_streams.generation = w.generation;
  }
  t_streams.set[device] = stream;
}

cudaStream_t current_stream(int device) { return f_current_stream(device); }

int current_device() { return t_device; }

void set_device(int device) { (void)f_exchange_device(device); }

uint64_t stream_position(cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  return resolve(stream)->enqueued;
}

bool stream_reached(cudaStream_t stream, uint64_t position) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  return resolve(stream)->executed >= position;
}

cudaError_t stream_synchronize(cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  StreamState* s = resolve(stream);
  if (s == nullptr) return note("cudaStreamSynchronize", s, cudaErrorInvalidResourceHandle);
  KVSWAP_FAKE_STICKY("cudaStreamSynchronize", s);
  if (s->capture != nullptr) {
    invalidate(s->capture);
    return note("cudaStreamSynchronize", s, cudaErrorStreamCaptureUnsupported);
  }
  if (unsafe_prohibited()) return note("cudaStreamSynchronize", s, cudaErrorStreamCaptureUnsupported);
  if (s->legacy && !blocking_captures(s->device).empty()) {
    for (Capture* c : blocking_captures(s->device)) invalidate(c);
    return note("cudaStreamSynchronize", s, cudaErrorStreamCaptureImplicit);
  }
  drain_all(s);
  return note("cudaStreamSynchronize", s, world().sticky);
}

cudaError_t memcpy_sync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  StreamState* legacy = resolve(nullptr);
  KVSWAP_FAKE_STICKY("cudaMemcpy", legacy);
  if (unsafe_prohibited()) return note("cudaMemcpy", legacy, cudaErrorStreamCaptureUnsupported);
  const cudaError_t err = f_memcpy_async(dst, src, bytes, kind, nullptr);
  if (err != cudaSuccess) return note("cudaMemcpy", legacy, err);
  drain_all(legacy);
  return note("cudaMemcpy", legacy, world().sticky);
}

cudaError_t memcpy_async(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  return f_memcpy_async(dst, src, bytes, kind, stream);
}

cudaError_t begin_capture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  StreamState* s = resolve(stream);
  if (s == nullptr) return note("cudaStreamBeginCapture", s, cudaErrorInvalidResourceHandle);
  KVSWAP_FAKE_STICKY("cudaStreamBeginCapture", s);
  if (s->legacy) return note("cudaStreamBeginCapture", s, cudaErrorStreamCaptureUnsupported);  // 2439-2440
  if (s->capture != nullptr) return note("cudaStreamBeginCapture", s, cudaErrorIllegalState);
  w.capture_store.push_back(Capture{s, std::this_thread::get_id(), mode, false, {}});
  s->capture = &w.capture_store.back();
  w.active.push_back(s->capture);
  return note("cudaStreamBeginCapture", s, cudaSuccess);
}

cudaError_t end_capture(cudaStream_t stream, cudaGraph_t* graph) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  StreamState* s = resolve(stream);
  *graph = nullptr;
  if (s == nullptr) return note("cudaStreamEndCapture", s, cudaErrorInvalidResourceHandle);
  Capture* c = s->capture;
  if (c == nullptr) return note("cudaStreamEndCapture", s, cudaErrorIllegalState);
  if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id()) {
    return note("cudaStreamEndCapture", s, cudaErrorStreamCaptureWrongThread);
  }
  s->capture = nullptr;
  w.active.erase(std::find(w.active.begin(), w.active.end(), c));
  if (c->invalidated) return note("cudaStreamEndCapture", s, cudaErrorStreamCaptureInvalidated);
  w.graphs.push_back(Graph{c->nodes});
  *graph = reinterpret_cast<cudaGraph_t>(&w.graphs.back());
  return note("cudaStreamEndCapture", s, cudaSuccess);
}

size_t graph_node_count(cudaGraphExec_t exec) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  return reinterpret_cast<const Graph*>(exec)->nodes.size();
}

cudaError_t graph_instantiate(cudaGraphExec_t* exec, cudaGraph_t graph) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  World& w = world();
  w.graphs.push_back(*reinterpret_cast<Graph*>(graph));
  *exec = reinterpret_cast<cudaGraphExec_t>(&w.graphs.back());
  return note("cudaGraphInstantiate", nullptr, cudaSuccess);
}

cudaError_t graph_launch(cudaGraphExec_t exec, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  StreamState* s = resolve(stream);
  if (s == nullptr) return note("cudaGraphLaunch", s, cudaErrorInvalidResourceHandle);
  KVSWAP_FAKE_STICKY("cudaGraphLaunch", s);
  for (const Op& op : reinterpret_cast<Graph*>(exec)->nodes) {
    const cudaError_t err = enqueue(s, op);
    if (err != cudaSuccess) return note("cudaGraphLaunch", s, err);
  }
  return note("cudaGraphLaunch", s, cudaSuccess);
}

cudaError_t exchange_capture_mode(cudaStreamCaptureMode* mode) { return f_exchange_mode(mode); }

cudaError_t get_last_error(bool peek) { return peek ? t_last_error : f_get_last_error(); }

const char* error_name(cudaError_t err) {
  switch (err) {
#define KVSWAP_FAKE_NAME(e) \
  case e:                   \
    return #e;
    KVSWAP_FAKE_NAME(cudaSuccess)
    KVSWAP_FAKE_NAME(cudaErrorInvalidValue)
    KVSWAP_FAKE_NAME(cudaErrorInvalidConfiguration)
    KVSWAP_FAKE_NAME(cudaErrorInsufficientDriver)
    KVSWAP_FAKE_NAME(cudaErrorCallRequiresNewerDriver)
    KVSWAP_FAKE_NAME(cudaErrorInvalidResourceHandle)
    KVSWAP_FAKE_NAME(cudaErrorIllegalState)
    KVSWAP_FAKE_NAME(cudaErrorNotReady)
    KVSWAP_FAKE_NAME(cudaErrorIllegalAddress)
    KVSWAP_FAKE_NAME(cudaErrorHostMemoryAlreadyRegistered)
    KVSWAP_FAKE_NAME(cudaErrorHostMemoryNotRegistered)
    KVSWAP_FAKE_NAME(cudaErrorNotSupported)
    KVSWAP_FAKE_NAME(cudaErrorStreamCaptureUnsupported)
    KVSWAP_FAKE_NAME(cudaErrorStreamCaptureInvalidated)
    KVSWAP_FAKE_NAME(cudaErrorStreamCaptureImplicit)
    KVSWAP_FAKE_NAME(cudaErrorCapturedEvent)
    KVSWAP_FAKE_NAME(cudaErrorStreamCaptureWrongThread)
    KVSWAP_FAKE_NAME(cudaErrorMemoryAllocation)
    KVSWAP_FAKE_NAME(cudaErrorInvalidDevice)
    KVSWAP_FAKE_NAME(cudaErrorDevicesUnavailable)
#undef KVSWAP_FAKE_NAME
    default:
      return "cudaErrorUnknown(fake)";
  }
}

Faults& faults() { return world().faults; }

std::vector<std::string> call_log() {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  return world().log;
}

int64_t count_calls(const std::string& api) {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  int64_t n = 0;
  for (const auto& line : world().log) n += line.compare(0, api.size() + 1, api + " ") == 0;
  return n;
}

int64_t host_register_bytes() {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  return world().host_register_bytes;
}

std::vector<std::string> violations() {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  return world().violations;
}

std::vector<LaunchRecord> launches() {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  return world().launches;
}

std::vector<int64_t> copy_widths() {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  const auto& b = kvswap::cuda::copy_stats().bytes;
  return std::vector<int64_t>(b, b + 5);
}

std::vector<BatchRecord> batches() {
  std::lock_guard<std::recursive_mutex> lock(world().mu);
  return world().batches;
}

}  // namespace fake_cuda
