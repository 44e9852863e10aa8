// The CUDA engine's host logic: its EngineInterface (submit, the copy
// kernel, in-place pinning, the capture and mapping queries, the report)
// works on torch's current stream of the target device with that device
// current. Every runtime call goes through the table
// of cuda_engine.h, so this file is compiled, unchanged, into `_C_cuda`
// (bound to libcudart) and into the tests' `_fake_cuda` (bound to a fake
// runtime on host memory); see docs/cuda.md.
//
// Paths:
//   batch     cudaMemcpyBatchAsync, one call per batch of at most
//             max_batch() descriptors (below), for every direction,
//             outside graph capture, on a stream other than the legacy one;
//             resolved at run time: the runtime and the driver must both be
//             12.8 or newer, and an answer "not supported" / "insufficient
//             driver" / "requires newer driver" turns it off for that device
//             (logged once) and the batch goes per descriptor;
//   fallback  one cudaMemcpyAsync per descriptor: the legacy default stream
//             (the batch API rejects it), a capturing stream (the batch API
//             cannot be captured: it returns cudaErrorStreamCaptureUnsupported),
//             or no batch API;
//   kernel    copy_blocks_kernel (copy_kernel.h/.cu): block ids in device
//             memory are read when the kernel runs; block ids on the host are
//             copied into the kernel's parameters, so neither needs a
//             synchronizing or pageable copy, an allocation or a staging buffer.
//
// What a replayed graph copies (docs/ops.md): fallback memcpy nodes and
// kernels with inline ids repeat the copies of capture time; kernels with
// device ids copy the blocks the id tensors name at replay.
//
// Descriptor lifetime: the batch path reads the core's descriptor table in
// place; the header does not say when the runtime reads the arrays, so the
// table tensors and the attrs entry are held by `in_flight()` until an event
// recorded after the submission has completed, whatever fails after the
// submission (engine_common.h, InFlightArrays::hold).
//
// Kernel parameters: 32,764 bytes where the build, runtime, driver and
// device allow it, 4 KiB otherwise (param_limit below, copy_kernel.h).
#include "cuda_engine.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../engine_common.h"
#include "../kvswap.h"

namespace kvswap {
namespace cuda {

namespace {

const CudaApi* g_api = nullptr;

const CudaApi& api() {
  TORCH_CHECK(g_api != nullptr, "kvswap CUDA engine: no CUDA runtime is bound");
  return *g_api;
}

// A failed call leaves its error as the runtime's last error (per host
// thread) until cudaGetLastError reads it (cuda_runtime_api.h:1119-1121, cudaGetLastError: it
// "Returns the last error that has been produced by any of the runtime calls
// in the same instance of the CUDA Runtime library in the host thread and
// resets it to cudaSuccess"). torch checks that last error after its own
// kernel launches, so every failure this engine sees is cleared here, whether
// it is then handled or reported.
void clear_last_error() { (void)api().get_last_error(); }

std::string describe_error(cudaError_t err) {
  return std::string(api().get_error_name(err)) + " (" + api().get_error_string(err) + ")";
}

// Checks a runtime call's answer; `what` names the call in the message.
#define KVSWAP_CUDA_CHECK_NAMED(answer, what, ...)                                               \
  do {                                                                                           \
    const cudaError_t kvswap_err_ = (answer);                                                    \
    if (kvswap_err_ != cudaSuccess) {                                                            \
      clear_last_error();                                                                        \
      TORCH_CHECK(false, "kvswap CUDA engine: ", what, " failed: ", describe_error(kvswap_err_), \
                  ". ", ##__VA_ARGS__);                                                          \
    }                                                                                            \
  } while (0)
#define KVSWAP_CUDA_CHECK(call, ...) KVSWAP_CUDA_CHECK_NAMED(call, #call, ##__VA_ARGS__)

constexpr int kMaxDevices = 64;

int checked_index(c10::Device device) {
  TORCH_CHECK(device.is_cuda(), "kvswap CUDA engine asked to work on ", device);
  const int index = device.has_index() ? device.index() : 0;
  TORCH_CHECK(index >= 0 && index < kMaxDevices, "kvswap CUDA engine: device index ", index, " out of range");
  return index;
}

// Makes `device` current for the scope, as c10::DeviceGuard does, through the
// table (torch's CUDA guard in `_C_cuda`, which raises when the runtime
// refuses the device). Restoring never throws: a destructor that throws ends
// the process (it is noexcept, and the scope may be unwinding another
// error). As c10's guards do (uncheckedSetDevice), a failed restore clears
// the runtime's error and warns, once per process.
class DeviceScope {
 public:
  explicit DeviceScope(int device) : previous_(api().exchange_device(device)), device_(device) {}
  ~DeviceScope() {
    if (previous_ == device_) return;
    try {
      api().exchange_device(previous_);
    } catch (const std::exception& e) {  // torch's guard raises c10::Error
      const auto* error = dynamic_cast<const c10::Error*>(&e);
      warn_not_restored(error != nullptr ? error->what_without_backtrace() : e.what());
    }
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  // TORCH_WARN hands the warning to torch's handler and does not throw (c10's
  // guards warn from their destructors the same way).
  void warn_not_restored(const char* why) const noexcept {
    clear_last_error();
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      TORCH_WARN("kvswap CUDA engine: could not make cuda:", previous_,
                 " current again after working on cuda:", device_, " (", why, "); cuda:", device_,
                 " stays current");
    }
  }

  int previous_;
  int device_;
};

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  KVSWAP_CUDA_CHECK(api().stream_is_capturing(stream, &status));
  // Active or invalidated: either way the stream is inside a capture.
  return status != cudaStreamCaptureStatusNone;
}

// The legacy default stream: the batch API's stream "Must not be legacy NULL
// stream" (cuda_runtime_api.h:6426).
bool is_legacy(cudaStream_t stream) { return stream == nullptr || stream == cudaStreamLegacy; }

// --- in-flight descriptor arrays ----------------------------------------------

struct TableRuntime {
  using Event = cudaEvent_t;
  using Stream = cudaStream_t;
  // Both run after a batch was queued: the copies will run all the same, and
  // the error says so.
  static Event create_event() {
    cudaEvent_t event = nullptr;
    KVSWAP_CUDA_CHECK(api().event_create_with_flags(&event, cudaEventDisableTiming), kQueuedAnyway);
    return event;
  }
  static void record(Event event, Stream stream) {
    KVSWAP_CUDA_CHECK(api().event_record(event, stream), kQueuedAnyway);
  }
  static constexpr const char* kQueuedAnyway =
      "The batch copy was queued before this failed and will run; its descriptors stay held";
  // cudaEventQuery is one of the "potentially unsafe API calls" that a
  // thread may not make while any other thread captures in global mode; it
  // would fail and invalidate that capture (cuda_runtime_api.h:2536-2544,
  // cudaThreadExchangeStreamCaptureMode). The query is only about this
  // engine's own events, recorded outside any capture, so this thread
  // relaxes its mode around it, as the header's push-pop example shows.
  static bool completed(Event event) {
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    KVSWAP_CUDA_CHECK(api().thread_exchange_stream_capture_mode(&mode));
    const cudaError_t err = api().event_query(event);
    cudaStreamCaptureMode restore = mode;
    const cudaError_t restored = api().thread_exchange_stream_capture_mode(&restore);
    if (err == cudaErrorNotReady) {
      clear_last_error();  // not an error, but the runtime records it as one
    } else {
      KVSWAP_CUDA_CHECK_NAMED(err, "cudaEventQuery (a batch's completion)");
    }
    KVSWAP_CUDA_CHECK_NAMED(restored, "cudaThreadExchangeStreamCaptureMode (restoring the mode)");
    return err == cudaSuccess;
  }
};

InFlightArrays<TableRuntime>& in_flight(int device) {
  static std::array<InFlightArrays<TableRuntime>, kMaxDevices> per_device;
  return per_device[static_cast<size_t>(device)];
}

// --- batch API resolution -------------------------------------------------------

constexpr int kBatchMinVersion = 12080;  // cudaMemcpyBatchAsync is new in CUDA 12.8

// What the engine learns about the runtime on first use; reset by
// set_cuda_api.
struct BatchState {
  std::once_flag resolved;
  bool usable = false;  // runtime and driver both recent enough, entry present
  std::array<std::atomic<bool>, kMaxDevices> off{};
  // Kernel parameter block per device: 0 not asked yet, else its limit in
  // bytes (kSmallParamLimit or kLargeParamLimit).
  std::array<std::atomic<int>, kMaxDevices> param_limit{};
  std::atomic<int64_t> max_batch{0};  // descriptors per batch call; 0: not read yet
};

std::unique_ptr<BatchState>& batch_state_slot() {
  static std::unique_ptr<BatchState> state = std::make_unique<BatchState>();
  return state;
}

BatchState& batch_state() { return *batch_state_slot(); }

// Whether the runtime offers the batch API at all, decided on first use. A
// 12.8+ runtime under an older driver has the entry point but cannot serve
// it, so both versions are asked.
bool batch_resolved() {
  BatchState& state = batch_state();
  std::call_once(state.resolved, [&state] {
    const CudaApi& a = api();
    if (a.memcpy_batch_async == nullptr) return;  // the build's toolkit lacks it
    int runtime = 0;
    int driver = 0;
    const cudaError_t r = a.runtime_get_version(&runtime);
    const cudaError_t d = a.driver_get_version(&driver);
    if (r != cudaSuccess || d != cudaSuccess) clear_last_error();
    state.usable =
        r == cudaSuccess && d == cudaSuccess && runtime >= kBatchMinVersion && driver >= kBatchMinVersion;
    if (!state.usable) {
      TORCH_WARN("kvswap CUDA engine: cudaMemcpyBatchAsync needs CUDA 12.8 in both the runtime (", runtime,
                 ") and the driver (", driver, "); copying one descriptor at a time");
    }
  });
  return state.usable;
}

// Descriptors per cudaMemcpyBatchAsync call. The runtime documents no limit,
// but one call of 51,828 descriptors crashed the process, and repeated large
// calls hung, on CUDA 13.0 with driver 580.159.04 (vLLM issue #49276). vLLM
// splits its batch copies at 8,192 descriptors where the runtime faults above
// that count (ROCm: csrc/libtorch_stable/cache_kernels.cu,
// kRocmDefaultMaxBatchDescriptors; VLLM_KV_OFFLOAD_MAX_BATCH_DESCRIPTORS
// overrides) and leaves CUDA uncapped; this engine splits CUDA calls at the
// same 8,192, six times below the count that crashed. The environment
// variable sets another cap, read when the engine is bound
// (set_max_batch_descriptors overrides it until the next binding).
constexpr int64_t kDefaultMaxBatch = 8192;
constexpr const char* kMaxBatchEnv = "KVSWAP_CUDA_MAX_BATCH_DESCRIPTORS";

int64_t parsed_max_batch(const char* text) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  TORCH_CHECK_VALUE(end != text && *end == '\0' && errno == 0 && value >= 1,
                    "kvswap CUDA engine: ", kMaxBatchEnv, "='", text,
                    "' is not a descriptor count: expected a whole number of at "
                    "least 1 (the default is ",
                    kDefaultMaxBatch, "); set one, or unset the variable");
  return value;
}

int64_t max_batch() {
  std::atomic<int64_t>& slot = batch_state().max_batch;
  int64_t cap = slot.load(std::memory_order_relaxed);
  if (cap != 0) return cap;
  const char* text = std::getenv(kMaxBatchEnv);
  cap = text != nullptr ? parsed_max_batch(text) : kDefaultMaxBatch;
  slot.store(cap, std::memory_order_relaxed);
  return cap;
}

bool batch_enabled(int device) {
  return batch_resolved() && !batch_state().off[static_cast<size_t>(device)].load(std::memory_order_relaxed);
}

// Answers that mean "this runtime or driver cannot serve the batch API", as
// opposed to a bad copy: they turn the batch path off for the device.
bool means_unsupported(cudaError_t err) {
  return err == cudaErrorNotSupported || err == cudaErrorInsufficientDriver ||
         err == cudaErrorCallRequiresNewerDriver;
}

void turn_batch_off(int device, cudaError_t err) {
  if (!batch_state().off[static_cast<size_t>(device)].exchange(true)) {
    TORCH_WARN("kvswap CUDA engine: cudaMemcpyBatchAsync on cuda:", device, " answered ", describe_error(err),
               "; copying one descriptor at a time on that device from now on");
  }
}

// --- DMA paths --------------------------------------------------------------------

cudaMemcpyKind memcpy_kind(Direction direction) {
  switch (direction) {
    case Direction::kHostToDevice:
      return cudaMemcpyHostToDevice;
    case Direction::kDeviceToHost:
      return cudaMemcpyDeviceToHost;
    case Direction::kDeviceToDevice:
      return cudaMemcpyDeviceToDevice;
  }
  TORCH_CHECK(false, "unreachable direction");
}

// Sets `queued` once the first copy is queued; a failure after that says
// which descriptors were queued before it.
void copy_each(const CopyBatch& b, cudaStream_t stream, bool& queued) {
  const CudaApi& a = api();
  const cudaMemcpyKind kind = memcpy_kind(b.direction);
  for (int64_t i = 0; i < b.count; ++i) {
    KVSWAP_CUDA_CHECK(
        a.memcpy_async(as_ptr(b.dst[i]), as_ptr(b.src[i]), static_cast<size_t>(b.size[i]), kind, stream),
        format_descriptor(b, i), i > 0 ? "; " + copies_left_behind(i, b.count) : "");
    queued = true;
  }
}

// The batch call's attributes: one entry, index 0, for every descriptor. The
// API applies attrs[k] "to copies starting from attrsIdxs[k] through
// attrsIdxs[k+1] - 1" and the last entry through count - 1
// (cuda_runtime_api.h:6422-6424). Built per call: the API takes both arrays
// through non-const pointers.
struct BatchAttr {
  cudaMemcpyAttributes attr{};
  size_t index = 0;
};

BatchAttr batch_attr(Direction direction, int device) {
  BatchAttr args;
  // STREAM: the source is read in stream order. ANY would let the copy read
  // the source before earlier work on the stream (the compute that produced
  // a stored block) has finished.
  args.attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  args.attr.flags = cudaMemcpyFlagDefault;
  cudaMemLocation host{};
  host.type = cudaMemLocationTypeHost;
  cudaMemLocation dev{};
  dev.type = cudaMemLocationTypeDevice;
  dev.id = device;
  args.attr.srcLocHint = direction == Direction::kHostToDevice ? host : dev;
  args.attr.dstLocHint = direction == Direction::kDeviceToHost ? host : dev;
  return args;
}

// What a failed batch call leaves behind: the earlier batches of the call
// were queued and will run; any of the failed batch's may have been; the
// later ones were not.
std::string batch_failure(const CopyBatch& b, cudaError_t err, int64_t first, int64_t n, int64_t cap,
                          size_t fail_index) {
  std::ostringstream out;
  out << "kvswap CUDA engine: cudaMemcpyBatchAsync failed: " << describe_error(err) << ". " << n
      << " descriptors (" << direction_name(static_cast<int64_t>(b.direction)) << ")";
  if (n < b.count) {
    out << ", batch " << first / cap + 1 << " of " << (b.count + cap - 1) / cap << " of this call's "
        << b.count << " descriptors (descriptors " << first << ".." << first + n - 1 << ", at most " << cap
        << " a batch)";
  }
  out << "; ";
  if (fail_index < static_cast<size_t>(n)) {
    out << "the runtime names " << format_descriptor(b, first + static_cast<int64_t>(fail_index)) << "; ";
  }
  if (first > 0) {
    out << "descriptors 0.." << first - 1 << " were queued by the earlier batches and will still run; ";
  }
  out << "any of them may have been queued, wholly or in part (the runtime does not say how far it got), "
         "and what was will still run";
  if (first + n < b.count) out << "; descriptors " << first + n << ".." << b.count - 1 << " were not queued";
  return out.str();
}

// Submits the call in batches of at most `cap` descriptors, one
// cudaMemcpyBatchAsync each. Returns false when the batch API turned out to
// be unsupported on `device` at the first batch (nothing was queued; the
// caller copies per descriptor). Once anything may have been queued, the
// table and the attrs entries are held (in_flight), whatever fails.
bool copy_batched(const CopyBatch& b, cudaStream_t stream, int device, int64_t cap,
                  std::vector<at::Tensor> keep_alive) {
  const int64_t calls = (b.count + cap - 1) / cap;
  auto args =
      std::make_shared<std::vector<BatchAttr>>(static_cast<size_t>(calls), batch_attr(b.direction, device));
  const DescriptorArrays arrays = descriptor_arrays(b);
  for (int64_t first = 0; first < b.count; first += cap) {
    const int64_t n = std::min(cap, b.count - first);
    BatchAttr& a = (*args)[static_cast<size_t>(first / cap)];
    size_t fail_index = SIZE_MAX;  // set by CUDA 12.8/12.9 on a failure
    const cudaError_t err = api().memcpy_batch_async(
        arrays.dsts + first, const_cast<const void* const*>(arrays.srcs + first), arrays.sizes + first,
        static_cast<size_t>(n), &a.attr, &a.index, 1, &fail_index, stream);
    if (err == cudaSuccess) continue;
    clear_last_error();
    if (first == 0 && means_unsupported(err)) {
      turn_batch_off(device, err);
      return false;
    }
    try {
      in_flight(device).hold(stream, std::move(keep_alive), args);
    } catch (const c10::Error&) {
      // Held all the same (InFlightArrays::hold); the batch's failure is the error to report.
    }
    TORCH_CHECK(false, batch_failure(b, err, first, n, cap, fail_index));
  }
  in_flight(device).hold(stream, std::move(keep_alive), std::move(args));
  return true;
}

}  // namespace

void submit_cuda(const CopyBatch& batch, c10::Device device) {
  bool queued = false;  // whether a copy of this call may have been queued
  try {
    const int index = checked_index(device);
    DeviceScope scope(index);
    const cudaStream_t stream = api().current_stream(index);
    if (!is_legacy(stream) && batch_enabled(index) && !is_capturing(stream)) {
      const int64_t cap = max_batch();
      queued = true;
      if (copy_batched(batch, stream, index, cap, {batch.owner})) return;
      queued = false;  // the batch API is unsupported here: nothing was queued
    }
    copy_each(batch, stream, queued);
  } catch (c10::Error& e) {
    if (!queued) e.add_context(kNothingCopied);
    throw;
  }
}

// --- kernel path ----------------------------------------------------------------

namespace {

// How a launch's parameter blob is shared between pairs and inline ids.
struct LaunchShape {
  int64_t pairs_per_launch;
  int64_t ids_per_launch;
};

LaunchShape launch_shape(int64_t pairs, int64_t n, int inline_sides, int64_t blob) {
  constexpr int64_t kPair = static_cast<int64_t>(sizeof(KernelPair));
  if (inline_sides == 0) return {std::min(pairs, blob / kPair), n};
  const int64_t per_id = 4 * inline_sides;  // int32 per inline side
  // Up to 16 pairs keep room for ids (384 per launch in 4 KiB, 3,976 in
  // 32 KiB); fewer ids leave the rest of the blob to pairs.
  const int64_t ids = std::min(n, (blob - std::min<int64_t>(pairs, 16) * kPair) / per_id);
  return {std::min(pairs, (blob - ids * per_id) / kPair), ids};
}

// Grid x: enough thread blocks for every work item, capped; the kernel
// strides over the rest.
unsigned grid_x_for(int64_t items) {
  return static_cast<unsigned>(std::min<int64_t>(items, int64_t{1} << 20));
}

constexpr int kLargeParamsMinVersion = 12010;  // large kernel parameters are new in CUDA 12.1
constexpr int kLargeParamsMinMajor = 7;        // ... on Volta (sm_70) and newer

// The kernel parameter block for `device`, asked once per device: 32,764
// bytes where the build has the large kernel, the runtime and the driver are
// both 12.1 or newer (an older driver refuses the launch) and the device is
// sm_70 or newer (the limit stays 4 KiB below Volta); 4 KiB otherwise
// (copy_kernel.h cites the sources). Plain queries, legal under capture.
int param_limit(int device) {
  std::atomic<int>& slot = batch_state().param_limit[static_cast<size_t>(device)];
  int limit = slot.load(std::memory_order_relaxed);
  if (limit != 0) return limit;
  const CudaApi& a = api();
  bool large = false;
  if (a.launch_copy_large != nullptr) {
    int runtime = 0;
    int driver = 0;
    int major = 0;
    const cudaError_t r = a.runtime_get_version(&runtime);
    const cudaError_t d = a.driver_get_version(&driver);
    const cudaError_t c = a.device_get_attribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (r != cudaSuccess || d != cudaSuccess || c != cudaSuccess) clear_last_error();
    large = r == cudaSuccess && d == cudaSuccess && c == cudaSuccess && runtime >= kLargeParamsMinVersion &&
            driver >= kLargeParamsMinVersion && major >= kLargeParamsMinMajor;
  }
  limit = large ? kLargeParamLimit : kSmallParamLimit;
  slot.store(limit, std::memory_order_relaxed);
  return limit;
}

// What every launch of one call shares.
struct KernelCall {
  const std::vector<KernelPair>& pairs;
  const int64_t* sid_host;
  const int64_t* did_host;
  const int64_t* sid_dev;
  const int64_t* did_dev;
  int64_t n;
  int64_t slices;
  cudaStream_t stream;
};

// Splits the call over launches of parameter block P: ids in chunks, and
// within a chunk pairs in chunks, as many as the blob holds.
// What the launches before the one at (first_id, first_pair) queued: they
// will still run.
std::string launched_before(int64_t first_id, int64_t last_id, int64_t first_pair) {
  std::ostringstream out;
  out << "earlier launches of this call were queued and will still run: they copy ";
  if (first_id > 0) out << "ids 0.." << first_id - 1 << " of every pair";
  if (first_id > 0 && first_pair > 0) out << ", and ";
  if (first_pair > 0) out << "ids " << first_id << ".." << last_id << " of pairs 0.." << first_pair - 1;
  out << "; the rest was not queued";
  return out.str();
}

// Sets `queued` once the first launch is queued.
template <class P>
void launch_all(const KernelCall& c, P& params,
                cudaError_t (*launch)(const P*, unsigned, unsigned, cudaStream_t), bool& queued) {
  const int64_t num_pairs = static_cast<int64_t>(c.pairs.size());
  const LaunchShape shape =
      launch_shape(num_pairs, c.n, int(c.sid_host != nullptr) + int(c.did_host != nullptr), P::kBlob);
  for (int64_t first_id = 0; first_id < c.n; first_id += shape.ids_per_launch) {
    const int64_t count = std::min(shape.ids_per_launch, c.n - first_id);
    for (int64_t first_pair = 0; first_pair < num_pairs; first_pair += shape.pairs_per_launch) {
      const int64_t np = std::min(shape.pairs_per_launch, num_pairs - first_pair);
      params.src_ids = c.sid_dev != nullptr ? c.sid_dev + first_id : nullptr;
      params.dst_ids = c.did_dev != nullptr ? c.did_dev + first_id : nullptr;
      params.n = count;
      params.slices = c.slices;
      params.num_pairs = static_cast<int32_t>(np);
      params.reserved = 0;
      std::copy_n(c.pairs.begin() + first_pair, np, reinterpret_cast<KernelPair*>(params.blob));
      auto* ids = reinterpret_cast<int32_t*>(params.blob + np * static_cast<int64_t>(sizeof(KernelPair)));
      if (c.sid_host != nullptr) {
        for (int64_t j = 0; j < count; ++j) *ids++ = static_cast<int32_t>(c.sid_host[first_id + j]);
      }
      if (c.did_host != nullptr) {
        for (int64_t j = 0; j < count; ++j) *ids++ = static_cast<int32_t>(c.did_host[first_id + j]);
      }
      KVSWAP_CUDA_CHECK(launch(&params, grid_x_for(count * c.slices), static_cast<unsigned>(np), c.stream),
                        "launching the block copy kernel (", sizeof(P), "-byte parameters) for ids ",
                        first_id, "..", first_id + count - 1, " of pairs ", first_pair, "..",
                        first_pair + np - 1,
                        queued ? "; " + launched_before(first_id, first_id + count - 1, first_pair) : "");
      queued = true;
    }
  }
}

}  // namespace

namespace {

void copy_by_kernel(at::TensorList src_caches, at::TensorList dst_caches, const at::Tensor& src_block_ids,
                    const at::Tensor& dst_block_ids, bool& queued) {
  // The device: the accelerator side of the copy (the core checked that
  // every accelerator tensor is on one device).
  std::optional<c10::Device> found;
  for (const auto list : {src_caches, dst_caches}) {
    for (const auto& t : list) {
      if (!found && t.device().is_cuda()) found = t.device();
    }
  }
  TORCH_CHECK_VALUE(found.has_value(), "kernel path: no cache tensor is on a CUDA device");
  const c10::Device device = *found;
  const int index = checked_index(device);
  for (const auto* ids : {&src_block_ids, &dst_block_ids}) {
    TORCH_CHECK_VALUE(ids->scalar_type() == at::kLong && ids->dim() == 1 && ids->is_contiguous(),
                      "kernel path: block ids must be contiguous 1-D int64 tensors");
    TORCH_CHECK_VALUE(ids->device().is_cpu() || ids->device() == device, "kernel path: block ids on ",
                      ids->device(), " cannot index caches on ", device, "; pass them on the host or on ",
                      device);
  }
  const int64_t n = src_block_ids.numel();
  TORCH_CHECK_VALUE(dst_block_ids.numel() == n, "kernel path: id tensors differ in length");
  const bool src_inline = src_block_ids.device().is_cpu();
  const bool dst_inline = dst_block_ids.device().is_cpu();

  std::vector<KernelPair> pairs;
  pairs.reserve(src_caches.size());
  int64_t slices = 1;
  for (size_t i = 0; i < src_caches.size(); ++i) {
    const auto& s = src_caches[i];
    const auto& d = dst_caches[i];
    const int64_t es = static_cast<int64_t>(s.element_size());
    const int64_t bb = s.dim() > 0 && s.size(0) > 0 ? s.numel() / s.size(0) * es : 0;
    if (bb == 0 || d.size(0) == 0) continue;
    // Inline ids are int32; the core range-checked host ids, so they fit
    // whenever the caches they index do.
    TORCH_CHECK_VALUE((!src_inline || s.size(0) <= std::numeric_limits<int32_t>::max()) &&
                          (!dst_inline || d.size(0) <= std::numeric_limits<int32_t>::max()),
                      "kernel path: caches of 2^31 blocks or more need their block ids on the device");
    pairs.push_back(KernelPair{static_cast<const char*>(s.const_data_ptr()), static_cast<char*>(d.data_ptr()),
                               s.stride(0) * es, d.stride(0) * es, bb, s.size(0), d.size(0)});
    slices = std::max(slices, (bb + kSliceBytes - 1) / kSliceBytes);
  }
  if (n == 0 || pairs.empty()) return;

  DeviceScope scope(index);
  const KernelCall call{pairs,
                        src_inline ? src_block_ids.const_data_ptr<int64_t>() : nullptr,
                        dst_inline ? dst_block_ids.const_data_ptr<int64_t>() : nullptr,
                        src_inline ? nullptr : src_block_ids.const_data_ptr<int64_t>(),
                        dst_inline ? nullptr : dst_block_ids.const_data_ptr<int64_t>(),
                        n,
                        slices,
                        api().current_stream(index)};
  if (param_limit(index) == kLargeParamLimit) {
    // 32 KiB is too much for the stack of every thread that may call here.
    thread_local std::unique_ptr<CopyParamsLarge> large;
    if (!large) large = std::make_unique<CopyParamsLarge>();
    launch_all(call, *large, api().launch_copy_large, queued);
  } else {
    CopyParams params;
    launch_all(call, params, api().launch_copy, queued);
  }
}

}  // namespace

void swap_blocks_kernel_cuda(at::TensorList src_caches, at::TensorList dst_caches,
                             const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids) {
  bool queued = false;  // whether a launch of this call was queued
  try {
    copy_by_kernel(src_caches, dst_caches, src_block_ids, dst_block_ids, queued);
  } catch (c10::Error& e) {
    if (!queued) e.add_context(kNothingCopied);
    throw;
  }
}

// --- queries the core asks --------------------------------------------------------

bool stream_capturing_cuda(c10::Device device) {
  const int index = checked_index(device);
  DeviceScope scope(index);
  return is_capturing(api().current_stream(index));
}

namespace {

// Host ranges this engine pinned in place (host_register), by start
// address: [start, start + bytes). cudaHostRegister refuses a range "already
// registered" (cudaErrorHostMemoryAlreadyRegistered, driver_types.h:851-855)
// and cudaHostUnregister takes the base address given to it
// (cuda_runtime_api.h:4992), so entries are keyed by start and disjoint;
// adjacent ones may touch.
RegisteredRanges& registrations() {
  static auto* r = new RegisteredRanges();  // process lifetime: deleters may run late
  return *r;
}

// The runtime's answer for `p`: page-locked and mapped at the same address
// for the current device. cudaErrorInvalidValue: memory the runtime does not
// know (before CUDA 11.0 the answer for pageable memory,
// cuda_runtime_api.h:8389-8393). Anything else is a failure of its own (a
// sticky error, say), not an answer about the memory.
bool runtime_says_mapped(const void* p, c10::Device device) {
  cudaPointerAttributes attrs{};
  const cudaError_t err = api().pointer_get_attributes(&attrs, p);
  if (err == cudaErrorInvalidValue) {
    clear_last_error();
    return false;
  }
  KVSWAP_CUDA_CHECK_NAMED(err, "cudaPointerGetAttributes", "asking whether host memory at ", p,
                          " is mapped for ", device);
  return attrs.type == cudaMemoryTypeHost && attrs.devicePointer == p;
}

}  // namespace

// Whether the kernel can address every byte of every host tensor of
// `tensors`: page-locked and mapped, at the same address on the device
// (unified addressing), with `device` current: devicePointer is "the device
// pointer alias through which the memory ... may be accessed on the current
// device" (cuda_runtime_api.h:8419-8421).
//
// The runtime's query answers for one address and says nothing of how far
// the page-locked range reaches, so a tensor's bytes are judged against this
// engine's own registrations first:
//   every byte inside registrations (one, or adjacent ones): mapped if the
//     runtime agrees at the start of each (a second opinion);
//   some bytes inside, some not (a registered prefix, a gap): not mapped;
//   none: memory pinned by someone else, a page-locked allocation
//     (cudaHostAlloc, torch's pinned allocator) is one range that holds its
//     storage whole, so the storage's first byte answers, once per storage.
// The core asks this while the stream may be capturing. The header does not
// list which calls are "potentially unsafe" during capture (cuda_runtime_api.h:
// 2524-2525 names cudaMalloc as an example); this one touches no stream, so it
// runs with the thread's capture mode relaxed, which is always legal.
namespace {

class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { KVSWAP_CUDA_CHECK(api().thread_exchange_stream_capture_mode(&mode_)); }
  ~RelaxedCaptureMode() {
    if (api().thread_exchange_stream_capture_mode(&mode_) != cudaSuccess) clear_last_error();
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace

bool host_mapped_cuda(at::TensorList tensors, c10::Device device) {
  const int index = checked_index(device);
  DeviceScope scope(index);
  std::optional<RelaxedCaptureMode> relaxed;
  std::vector<const void*> asked;  // addresses the runtime answered "mapped" for
  auto mapped_at = [&](const void* p) {
    if (std::find(asked.begin(), asked.end(), p) != asked.end()) return true;
    if (!relaxed) relaxed.emplace();
    if (!runtime_says_mapped(p, device)) return false;
    asked.push_back(p);
    return true;
  };
  for (const auto& t : tensors) {
    if (!t.device().is_cpu() || t.numel() == 0) continue;
    const auto [lo, hi] = byte_range(t);
    std::vector<uintptr_t> starts;
    switch (registrations().coverage(lo, hi, starts)) {
      case Coverage::kPartial:
        return false;
      case Coverage::kFull:
        for (const uintptr_t start : starts) {
          if (!mapped_at(reinterpret_cast<const void*>(start))) return false;
        }
        break;
      case Coverage::kNone:
        if (!mapped_at(t.has_storage() ? t.storage().data() : t.const_data_ptr())) return false;
        break;
    }
  }
  return true;
}

void host_register_cuda(const at::Tensor& buffer, c10::Device device, bool pin) {
  DeviceScope scope(checked_index(device));
  void* ptr = buffer.data_ptr();
  const auto start = reinterpret_cast<uintptr_t>(ptr);
  if (pin) {
    // Mapped, so the kernel path can address it; portable, for every device.
    KVSWAP_CUDA_CHECK(
        api().host_register(ptr, buffer.nbytes(), cudaHostRegisterMapped | cudaHostRegisterPortable),
        "pinning ", buffer.nbytes(), " host bytes");
    registrations().add(start, buffer.nbytes());
  } else {
    KVSWAP_CUDA_CHECK(api().host_unregister(ptr));
    registrations().erase(start);
  }
}

void set_cuda_api(const CudaApi* table) {
  g_api = table;
  batch_state_slot() = std::make_unique<BatchState>();
  for (int d = 0; d < kMaxDevices; ++d) in_flight(d).clear();
}

void set_max_batch_descriptors(int64_t count) {
  TORCH_CHECK_VALUE(count >= 1,
                    "kvswap CUDA engine: descriptors per cudaMemcpyBatchAsync call must be at least 1, got ",
                    count);
  batch_state().max_batch.store(count, std::memory_order_relaxed);
}

int64_t max_batch_descriptors() { return max_batch(); }

size_t batches_in_flight(int device) { return in_flight(device).held(); }

bool batch_api_enabled(int device) { return batch_enabled(device); }

int kernel_param_bytes(int device) { return param_limit(device); }

std::vector<std::string> engine_report_cuda(c10::Device device) {
  const int index = checked_index(device);
  const bool batch = batch_enabled(index);
  return {
      std::string("batch_api=") +
          (batch ? "cudaMemcpyBatchAsync in use"
                 : "not in use (absent, runtime or driver before 12.8, or refused on this device): one "
                   "cudaMemcpyAsync per copy"),
      "batch_cap=" + std::to_string(max_batch()) + " descriptors per cudaMemcpyBatchAsync call",
      "capture_query=cudaStreamIsCapturing (every CUDA release)",
      "pin_in_place=cudaHostRegister (mapped, portable)",
      "kernel_params=" + std::to_string(param_limit(index)) + " bytes per launch",
  };
}

const EngineInterface& engine_interface() {
  static const EngineInterface engine{
      /*name=*/"CUDA engine (torch_kvswap._C_cuda)",
      /*submit=*/&submit_cuda,
      /*stream_capturing=*/&stream_capturing_cuda,
      /*host_register=*/&host_register_cuda,
      /*host_pinned=*/nullptr,  // pageable host memory is copied too (cudaMemcpyAsync stages it)
      /*host_mapped=*/&host_mapped_cuda,
      /*report=*/&engine_report_cuda,
      /*copy_blocks=*/&swap_blocks_kernel_cuda,
  };
  return engine;
}

}  // namespace cuda
}  // namespace kvswap
