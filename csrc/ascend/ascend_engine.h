// The Ascend engine's logic over the ACL table of acl_api.h. The same source
// (ascend_engine.cpp) is compiled into torch_kvswap._C_npu, bound to the real
// ACL runtime by acl_real.cpp, and into the test extension, bound to a fake
// runtime (tests/fake_npu/).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "../engine_common.h"
#include "../kvswap.h"
#include "acl_api.h"

namespace kvswap {
namespace ascend {

// Entries per aclrtMemcpyBatchAsync call: DEVMM_MEMCPY_BATCH_MAX_COUNT
// (CANN runtime, pkg_inc/driver/ascend_hal_define.h:810; "Array max size is
// 4096", ascend_hal_base.h:2099). The asynchronous call's own checks have no
// cap (hicann/runtime 681ef7610df1, src/runtime/api/impl/api_error.cc:
// 7344-7386; the synchronous call's refuse more, 7314-7317), but its UB route
// hands a batch with pageable memory to the driver's batch copy, which refuses
// more than this with 207000 (docs/ascend.md). Larger batches are split.
constexpr size_t kMaxBatchEntries = 4096;

// Work entries one captured stream can hold: StreamJettyContext::
// JETTY_DEPTH_MAX (CANN runtime, src/runtime/feature/jetty/stream_jetty_context.h:26);
// past it the capture fails with EE1023 (stream_jetty_context.cc:62-70).
// The count is of work entries, not copies (stream_jetty_handler.cc:133 adds
// each copy's wqeCnt), and each copy takes at least one: more copies than
// this can never fit, fewer may still not.
constexpr int64_t kMaxCapturedCopies = 32768;

// Device-to-device copies need 64-byte-aligned addresses (acl/acl_rt.h:2233,
// aclrtMemcpyAsync). aclrtHostRegisterV2 needs a 4 KiB-aligned pointer (CANN
// API reference, 11-02_host_memory_management.md, aclrtHostRegisterV2 "ptr").
constexpr uint64_t kDeviceToDeviceAlignment = 64;
constexpr uint64_t kHostRegisterAlignment = 4096;

// What the engine knows of a stream's graph capture.
enum class Capture {
  kNone,     // not capturing (or this CANN/chip cannot capture at all)
  kActive,   // being captured (also an invalidated capture: still in capture mode)
  kUnknown,  // the query is missing or failed: anything may be true
};

// What the engine knows of a stream's answer to aclrtMemcpyBatchAsync.
enum class BatchState {
  kUntried,   // not asked yet, or its last answer was an ambiguous 207000
  kAccepted,  // took a batch
  kRefused,   // refused a one-entry batch with 207000: per-descriptor until the next probe
};

// A refused stream is asked again (one entry) after kFirstReprobe calls,
// then after twice as many each time it refuses again, up to kLastReprobe:
// the refusal may have been the probed entry's memory (IPC or shared memory),
// not the stream. A stream that always refuses costs one refused one-entry
// call per kLastReprobe calls at worst.
constexpr uint64_t kFirstReprobe = 64;
constexpr uint64_t kLastReprobe = uint64_t{1} << 16;

class Engine {
 public:
  explicit Engine(const AclApi& api) : api_(api) {}

  // EngineInterface::submit: queues `batch` on the current stream of `device`.
  void submit(const CopyBatch& batch, c10::Device device);
  // EngineInterface::stream_capturing.
  bool stream_capturing(c10::Device device);
  // EngineInterface::host_register: page-locks (or releases) `buffer` in place.
  void host_register(const at::Tensor& buffer, c10::Device device, bool pin);
  // EngineInterface::host_pinned: whether `buffer`'s storage is page-locked.
  bool host_pinned(const at::Tensor& buffer, c10::Device device);
  // EngineInterface::report: which optional ACL functions this CANN has and
  // what the engine does with them on `device` ("name=value" lines).
  std::vector<std::string> report(c10::Device device);

  // The capture state of `stream` (public for tests of the decision table).
  Capture capture_state(AclStream stream);

 private:
  AclStream current_stream(c10::Device device) const;
  // Queues b's descriptors from 0 in batches; returns how many were queued:
  // b.count, or 0 when `stream` refused its first (one-entry) batch with
  // 207000, which latches the per-descriptor path for that stream until its
  // next probe (kFirstReprobe).
  int64_t copy_batched(const CopyBatch& b, AclStream stream, c10::DeviceIndex index);
  void copy_each(const CopyBatch& b, int64_t first, AclStream stream);
  std::string acl_message(AclError err) const;
  BatchState batch_state(AclStream stream);
  void set_batch_state(AclStream stream, BatchState state);
  // Whether this call on `stream` may try the batch API: not refused, or
  // refused and due for its next probe (which makes it kUntried).
  bool batch_allowed(AclStream stream);
  void refuse_batches(AclStream stream, c10::DeviceIndex index);
  // Whether aclrtPointerGetAttributes calls [ptr, ptr + bytes) registered
  // host memory (true when this CANN lacks the query).
  bool registered_host(void* ptr, uint64_t bytes);

  static constexpr int kMaxDevices = 64;
  const AclApi& api_;
  std::mutex batch_mutex_;
  struct StreamBatches {
    BatchState state = BatchState::kUntried;
    uint64_t refusals = 0;     // one-entry probes refused so far
    uint64_t until_probe = 0;  // kRefused: calls left before the next probe
  };
  // Keyed by ACL stream handle. torch_npu's streams come from fixed pools
  // that are never destroyed, so a handle names one stream for the life of
  // the process (docs/ascend.md: a stream created and destroyed elsewhere).
  std::map<AclStream, StreamBatches> batch_states_;
  std::array<std::atomic<bool>, kMaxDevices> warned_refused_{};
  std::atomic<bool> warned_capture_unknown_{false};
  std::atomic<bool> warned_unregistered_pin_{false};
  RegisteredRanges registered_;  // ranges pinned in place by host_register
};

// The engine the kernels call. Defined by the binding: acl_real.cpp in
// _C_npu, the fake runtime in the test extension.
Engine& engine();

// The engine's table for the core (kvswap.h), over engine(). The binding
// installs it when its module is imported.
const EngineInterface& engine_interface();

// The ACL stream behind `stream`, a stream of torch_npu's backend, or null
// when torch_npu gives none. Defined by the binding too: which torch_npu call
// answers depends on the torch release (acl_real.cpp); the test extension
// asks its fake backend's device guard.
AclStream acl_stream_of(const c10::Stream& stream);

}  // namespace ascend
}  // namespace kvswap
