// The Ascend engine: its EngineInterface (submit, the capture and pinning
// queries, in-place pinning, the report) serves the PrivateUse1 backend
// (torch_npu's), copying on the current NPU stream under a device guard. All ACL
// calls go through the table of acl_api.h; this file includes no ACL header
// and links nothing of torch_npu.
//
// Paths (docs/ascend.md has the table per CANN version):
//   batch           aclrtMemcpyBatchAsync, up to kMaxBatchEntries descriptors
//                   a call (a stream's first batch: one): host<->device
//                   copies, stream known not to be captured, batch API
//                   present and this stream's first batch not refused with
//                   207000;
//   per-descriptor  one aclrtMemcpyAsync per descriptor: device->device (the
//                   batch API takes host<->device only), a stream that is or
//                   may be captured (the path legal in and out of capture),
//                   and CANN or chips without the batch API.
//
// Descriptor arrays: both paths pass the core's descriptor table in place
// (int64 addresses and sizes are the bytes of void* and size_t here) and
// hold nothing once the call returns: CANN consumes the arrays during the
// call. Its batch emulation submits one copy per entry while looping over
// them (src/runtime/api/impl/api_impl.cc:8887, LoopMemcpyAsync), and its
// UB path copies them first (src/runtime/api/impl/api_impl_david.cc:860,
// `std::vector<void*> localDsts(dsts, dsts + count)`); the fake runtime
// overwrites the arrays as soon as a call returns to keep it that way.
#include "ascend_engine.h"

#include <ATen/Context.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "../engine_common.h"

namespace kvswap {
namespace ascend {

namespace {

MemcpyKind memcpy_kind(Direction direction) {
  switch (direction) {
    case Direction::kHostToDevice:
      return MemcpyKind::kHostToDevice;
    case Direction::kDeviceToHost:
      return MemcpyKind::kDeviceToHost;
    case Direction::kDeviceToDevice:
      break;
  }
  return MemcpyKind::kDeviceToDevice;
}

// What an error leaves behind on the stream: copies [0, queued) were queued
// and will still run; copies [queued, maybe) may have been queued, wholly or
// in part, and any part that was will still run. Nothing is claimed beyond
// what CANN guarantees (docs/ascend.md, "What the engine relies on").
std::string left_behind(int64_t queued, int64_t maybe) {
  if (maybe == 0) return std::string(kNothingCopied) + ": no copy of this call was queued";
  std::string text;
  if (queued > 0) {
    text = "copies 0.." + std::to_string(queued - 1) +
           " of this call were already queued on the stream and will still run";
  }
  if (maybe > queued) {
    if (!text.empty()) text += "; ";
    text += "copies " + std::to_string(queued) + ".." + std::to_string(maybe - 1) +
            " may have been queued, wholly or in part (CANN does not say how far it got), and "
            "what was will still run";
  }
  return text;
}

// Device-to-device copies need 64-byte-aligned source and destination
// addresses: acl/acl_rt.h:2232-2234 (torch-npu 2.13.0's copy of CANN's
// header), aclrtMemcpyAsync, "@par Restriction ... For on-chip
// Device-to-Device memory copy, both the source and destination addresses
// must be 64-byte aligned". Checked before anything is queued.
void check_device_to_device_alignment(const CopyBatch& b) {
  uint64_t bits = 0;
  for (int64_t i = 0; i < b.count; ++i) {
    bits |= static_cast<uint64_t>(b.src[i]) | static_cast<uint64_t>(b.dst[i]);
  }
  if ((bits & (kDeviceToDeviceAlignment - 1)) == 0) return;
  int64_t i = 0;
  while (((static_cast<uint64_t>(b.src[i]) | static_cast<uint64_t>(b.dst[i])) &
          (kDeviceToDeviceAlignment - 1)) == 0) {
    ++i;
  }
  TORCH_CHECK_VALUE(false, "kvswap Ascend engine: ", format_descriptor(b, i),
                    ": device-to-device copies need 64-byte-aligned source and destination "
                    "addresses (CANN acl_rt.h, aclrtMemcpyAsync); ",
                    left_behind(0, 0));
}

}  // namespace

std::string Engine::acl_message(AclError err) const {
  std::ostringstream msg;
  msg << "ACL error " << err;
  if (err == kAclFeatureNotSupported) msg << " (ACL_ERROR_RT_FEATURE_NOT_SUPPORT)";
  if (api_.get_recent_err_msg != nullptr) {
    if (const char* recent = api_.get_recent_err_msg()) {
      if (*recent != '\0') msg << ": " << recent;
    }
  }
  return msg.str();
}

// The current stream of `device`, reached through torch's PrivateUse1 device
// guard; its ACL handle comes from torch_npu's NPUStream::stream()
// (acl_stream_of, acl_real.cpp), which first drains torch_npu's task queue
// (so these copies follow every op already queued) and returns nullptr when
// that fails.
AclStream Engine::current_stream(c10::Device device) const {
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getStream(device);
  const AclStream handle = acl_stream_of(stream);
  TORCH_CHECK(handle != nullptr, "kvswap Ascend engine: the current stream of ", device,
              " has a null ACL handle (torch_npu returns one when draining its task queue fails); "
              "nothing was copied: nothing was queued, since ACL would run the copies on the default stream, "
              "unordered with the work they depend on");
  return handle;
}

// The decision table for a stream's capture state:
//  - query present and answers: its answer (an invalidated capture is still
//    a capture);
//  - query answers 207000 (not supported on this chip): not capturing. CANN
//    lists the same products for aclmdlRICaptureBegin and
//    aclmdlRICaptureGetInfo (API reference, 15_model_running_instance__
//    management.md, "产品支持情况" of both), so no capture can be running;
//  - query absent and aclmdlRICaptureBegin absent: not capturing, this CANN
//    has no capture API at all;
//  - otherwise (query absent but capture present, or any other error):
//    unknown, and callers take what is legal in and out of capture.
Capture Engine::capture_state(AclStream stream) {
  if (api_.capture_get_info == nullptr) {
    return api_.capture_begin_present ? Capture::kUnknown : Capture::kNone;
  }
  CaptureStatus status = CaptureStatus::kNone;
  void* model = nullptr;
  const AclError err = api_.capture_get_info(stream, &status, &model);
  if (err == kAclSuccess) return status == CaptureStatus::kNone ? Capture::kNone : Capture::kActive;
  if (err == kAclFeatureNotSupported) return Capture::kNone;
  if (!warned_capture_unknown_.exchange(true)) {
    TORCH_WARN("kvswap Ascend engine: aclmdlRICaptureGetInfo failed (", acl_message(err),
               "); while a stream's capture state is unknown, copies take the per-descriptor "
               "path, which is legal in and out of graph capture");
  }
  return Capture::kUnknown;
}

BatchState Engine::batch_state(AclStream stream) {
  std::lock_guard<std::mutex> lock(batch_mutex_);
  auto it = batch_states_.find(stream);
  return it == batch_states_.end() ? BatchState::kUntried : it->second.state;
}

void Engine::set_batch_state(AclStream stream, BatchState state) {
  std::lock_guard<std::mutex> lock(batch_mutex_);
  StreamBatches& s = batch_states_[stream];
  s.state = state;
  if (state == BatchState::kRefused) {
    const uint64_t shift = std::min<uint64_t>(s.refusals, 10);
    s.until_probe = std::min(kFirstReprobe << shift, kLastReprobe);
    ++s.refusals;
  }
}

bool Engine::batch_allowed(AclStream stream) {
  std::lock_guard<std::mutex> lock(batch_mutex_);
  auto it = batch_states_.find(stream);
  if (it == batch_states_.end() || it->second.state != BatchState::kRefused) return true;
  if (--it->second.until_probe > 0) return false;
  it->second.state = BatchState::kUntried;  // due: probe with one entry again
  return true;
}

// The latch is per stream: CANN refuses the batch API for a whole chip
// (src/runtime/api/api_c_memory.cc:780-783), a whole device
// (api_impl.cc:8950-8953, api_impl_david.cc:896-904) or one stream bound to
// a sub-graph (api_error.cc:7382-7384), all with the same 207000 and no
// failing index, so the narrowest scope is the one always right. A refusing
// device costs one refused one-entry call per stream.
void Engine::refuse_batches(AclStream stream, c10::DeviceIndex index) {
  set_batch_state(stream, BatchState::kRefused);
  if (!warned_refused_[static_cast<size_t>(index)].exchange(true)) {
    TORCH_WARN(
        "kvswap Ascend engine: aclrtMemcpyBatchAsync answered 207000 "
        "(ACL_ERROR_RT_FEATURE_NOT_SUPPORT) on npu:",
        static_cast<int>(index),
        "; copies on that stream take the per-descriptor path (one aclrtMemcpyAsync each) "
        "from now on, as do those of any other stream of this device that is refused; "
        "the stream is asked again after ",
        kFirstReprobe,
        " calls, then twice as many "
        "each time it refuses (logged once per device)");
  }
}

void Engine::submit(const CopyBatch& b, c10::Device device) {
  TORCH_CHECK(
      device.type() == c10::DeviceType::PrivateUse1 && device.index() >= 0 && device.index() < kMaxDevices,
      "kvswap Ascend engine asked to copy on ", device);
  c10::DeviceGuard guard(device);
  const AclStream stream = current_stream(device);
  const Capture capture = capture_state(stream);
  if (b.direction == Direction::kDeviceToDevice) check_device_to_device_alignment(b);
  TORCH_CHECK(capture != Capture::kActive || b.count <= kMaxCapturedCopies,
              "kvswap Ascend engine: refusing to capture ", b.count, " copies into one graph on ", device,
              ": a captured stream holds at most ", kMaxCapturedCopies,
              " copy tasks (CANN's task-capacity limit, error EE1023); split the call, or run it "
              "outside the capture; ",
              left_behind(0, 0));
  int64_t queued = 0;
  if (b.direction != Direction::kDeviceToDevice && capture == Capture::kNone &&
      api_.memcpy_batch_async != nullptr && batch_allowed(stream)) {
    queued = copy_batched(b, stream, device.index());
  }
  copy_each(b, queued, stream);
}

int64_t Engine::copy_batched(const CopyBatch& b, AclStream stream, c10::DeviceIndex index) {
  const MemLocation host{0, MemLocationType::kHost};
  const MemLocation dev{static_cast<uint32_t>(index), MemLocationType::kDevice};
  const DescriptorArrays arrays = descriptor_arrays(b);
  // Until a stream has taken a batch, its first batch holds one entry: a
  // 207000 for it means that entry was not queued, however CANN came to the
  // answer, and the per-descriptor path takes over from descriptor 0. For a
  // longer batch 207000 proves nothing: CANN's entry-by-entry loop carries on
  // past an entry the driver does not support and answers with the last
  // entry's code (src/runtime/api/impl/api_impl.cc:8929-8938).
  bool probing = batch_state(stream) == BatchState::kUntried;
  for (int64_t first = 0; first < b.count;) {
    const size_t n = probing ? 1 : std::min(kMaxBatchEntries, static_cast<size_t>(b.count - first));
    // One attrs entry with index 0 covers every descriptor: attrs[k] applies
    // from attrsIndexes[k] to the next index (acl/acl_rt.h:4414), and CANN's
    // own C++ wrapper passes exactly this (acl/acl_rt_api.h:145-148).
    MemcpyBatchAttr attr{};
    attr.srcLoc = b.direction == Direction::kHostToDevice ? host : dev;
    attr.dstLoc = b.direction == Direction::kHostToDevice ? dev : host;
    size_t attr_index = 0;
    size_t fail_index = SIZE_MAX;
    const AclError err =
        api_.memcpy_batch_async(arrays.dsts + first, arrays.sizes + first, arrays.srcs + first,
                                arrays.sizes + first, n, &attr, &attr_index, 1, &fail_index, stream);
    if (err == kAclSuccess) {
      if (probing) set_batch_state(stream, BatchState::kAccepted);
      probing = false;
      first += static_cast<int64_t>(n);
      continue;
    }
    if (err == kAclFeatureNotSupported && probing) {
      refuse_batches(stream, index);
      return 0;  // the probe is descriptor 0 alone: nothing of this call was queued
    }
    // A 207000 after the stream took batches may be a partial batch: fail
    // the call with what is known, and ask with one entry again next time.
    if (err == kAclFeatureNotSupported) set_batch_state(stream, BatchState::kUntried);
    // With a failing index, CANN's entry-by-entry loop has queued the entries
    // before it (api_impl.cc:8905-8910) and its UB path none of the batch
    // (api_impl_david.cc:834-841). Without one, part of the batch may be
    // queued: the loop stops at a failed submission (api_impl.cc:8932-8935),
    // the UB path after earlier chunks (api_impl_david.cc:863-867).
    const bool known = fail_index < n;
    const int64_t failed = first + static_cast<int64_t>(fail_index);
    TORCH_CHECK(false, "kvswap Ascend engine: aclrtMemcpyBatchAsync of descriptors ", first, "..",
                first + static_cast<int64_t>(n) - 1, " failed: ", acl_message(err), "; ",
                known ? "failed at " + format_descriptor(b, failed) : "no failing descriptor reported", "; ",
                left_behind(first, known ? failed : first + static_cast<int64_t>(n)),
                "; nothing was re-issued");
  }
  return b.count;
}

void Engine::copy_each(const CopyBatch& b, int64_t first, AclStream stream) {
  const MemcpyKind kind = memcpy_kind(b.direction);
  for (int64_t i = first; i < b.count; ++i) {
    const size_t n = static_cast<size_t>(b.size[i]);
    const AclError err = api_.memcpy_async(as_ptr(b.dst[i]), n, as_ptr(b.src[i]), n, kind, stream);
    // A failed copy may have queued its first pieces: CANN splits a large
    // copy into several tasks (src/runtime/api/impl/api_impl_david.cc:941-950).
    TORCH_CHECK(err == kAclSuccess, "kvswap Ascend engine: aclrtMemcpyAsync failed at ",
                format_descriptor(b, i), ": ", acl_message(err), "; ", left_behind(i, i + 1));
  }
}

bool Engine::stream_capturing(c10::Device device) {
  TORCH_CHECK(device.type() == c10::DeviceType::PrivateUse1, "kvswap Ascend engine asked about a stream of ",
              device);
  c10::DeviceGuard guard(device);
  // Unknown counts as capturing: the core then does only what a capture
  // allows (it refuses to read device-resident block ids back).
  return capture_state(current_stream(device)) != Capture::kNone;
}

void Engine::host_register(const at::Tensor& buffer, c10::Device device, bool pin) {
  c10::DeviceGuard guard(device);
  void* ptr = buffer.data_ptr();
  const auto start = reinterpret_cast<uintptr_t>(ptr);
  const auto bytes = static_cast<uint64_t>(buffer.nbytes());
  if (!pin) {
    const AclError err = api_.host_unregister(ptr);
    TORCH_CHECK(err == kAclSuccess, "kvswap Ascend engine: aclrtHostUnregister of 0x", std::hex, start,
                std::dec, " failed: ", acl_message(err));
    registered_.erase(start);
    return;
  }
  // aclrtHostRegister(ACL_HOST_REGISTER_MAPPED), the older call, maps host
  // memory for the device; it does not page-lock it. Without V2 there is no
  // in-place pinning: KVCacheOffloader then refuses, naming the size (it
  // never takes the pinned allocator's rounded memory).
  TORCH_CHECK_NOT_IMPLEMENTED(
      api_.host_register_v2 != nullptr,
      "kvswap Ascend engine: this CANN has no aclrtHostRegisterV2, so host memory cannot be "
      "page-locked in place (aclrtHostRegister only maps it for the device); allocate the buffer "
      "with pin_memory=True instead");
  TORCH_CHECK(start % kHostRegisterAlignment == 0, "kvswap Ascend engine: cannot pin ", bytes,
              " host bytes at 0x", std::hex, start, std::dec,
              " in place: aclrtHostRegisterV2 needs a 4 KiB-aligned start address");
  const AclError err = api_.host_register_v2(ptr, bytes, kHostRegPinned);
  TORCH_CHECK(err == kAclSuccess, "kvswap Ascend engine: aclrtHostRegisterV2(ACL_HOST_REG_PINNED) of ", bytes,
              " host bytes failed: ", acl_message(err));
  if (!registered_host(ptr, bytes)) {
    const AclError undo = api_.host_unregister(ptr);
    if (!warned_unregistered_pin_.exchange(true)) {
      TORCH_WARN(
          "kvswap Ascend engine: aclrtHostRegisterV2(ACL_HOST_REG_PINNED) succeeded but "
          "aclrtPointerGetAttributes does not report the range as registered host memory; "
          "host buffers fall back to the pinned allocator (logged once)");
    }
    TORCH_CHECK_NOT_IMPLEMENTED(
        false, "kvswap Ascend engine: ", bytes, " host bytes at 0x", std::hex, start, std::dec,
        " were registered with aclrtHostRegisterV2(ACL_HOST_REG_PINNED), but aclrtPointerGetAttributes "
        "does not report the whole range as registered host memory; ",
        undo == kAclSuccess ? std::string("the registration was undone")
        : undo == kAclHostMemoryNotRegistered
            ? "undoing it answered that nothing is registered (" + acl_message(undo) + ")"
            // The caller must keep the memory: freed, the allocator would
            // hand out pages CANN still counts as registered.
            : "undoing the registration failed too (" + acl_message(undo) +
                  "): the range may still be registered with CANN, so its memory must not be freed",
        "; allocate the buffer with pin_memory=True instead");
  }
  registered_.add(start, bytes);
}

// CANN reports registered host memory as ACL_MEM_LOCATION_TYPE_HOST and
// other pageable memory as UNREGISTERED (src/runtime/driver/npu_driver_mem.cc:
// 2071-2074). A registration is one range (register_memory.cc:78-102), so its
// first and last bytes stand for all of it. What the query cannot tell: a
// range CANN only recorded, because the driver lacks
// FEATURE_SVM_MEM_REGISTER_HOST_PINNED (api_impl.cc:2589-2609), is reported
// as HOST too (npu_driver_mem.cc:2073-2074); docs/ascend.md says what
// follows. Without the query the registration's answer stands.
bool Engine::registered_host(void* ptr, uint64_t bytes) {
  if (api_.pointer_get_attributes == nullptr) return true;
  const auto start = reinterpret_cast<uintptr_t>(ptr);
  for (const uintptr_t at : {start, start + bytes - 1}) {
    PtrAttributes attributes{};
    const AclError err = api_.pointer_get_attributes(reinterpret_cast<const void*>(at), &attributes);
    if (err != kAclSuccess || attributes.location.type != MemLocationType::kHost) return false;
  }
  return true;
}

// Pinned means every byte. CANN judges a copy's location by its start
// address (src/runtime/api/impl/api_impl.cc:8799, :8814), so a tensor with a
// pageable page inside would be copied as if pinned. Its bytes are judged
// against this engine's own registrations first:
//   every byte inside them (one, or adjacent ones): pinned if the runtime
//     agrees at the start of each (a second opinion);
//   some bytes inside, some not (a registered prefix, a gap): not pinned;
//   none: the pinned allocator's memory, whose hooks answer (torch_npu asks
//     aclrtPointerGetAttributes) once the backend is initialized. A tensor
//     lies within one storage, and a storage of that allocator within one
//     block, so pinned first and last bytes mean a pinned range. Memory
//     registered by someone else is judged the same way; docs/ascend.md says
//     what that cannot see.
bool Engine::host_pinned(const at::Tensor& buffer, c10::Device device) {
  const auto [lo, hi] = byte_range(buffer);
  std::vector<uintptr_t> starts;
  switch (registered_.coverage(lo, hi, starts)) {
    case Coverage::kPartial:
      return false;
    case Coverage::kFull:
      return std::all_of(starts.begin(), starts.end(), [this](uintptr_t start) {
        return registered_host(reinterpret_cast<void*>(start), 1);
      });
    case Coverage::kNone:
      break;
  }
  at::globalContext().lazyInitDevice(c10::DeviceType::PrivateUse1);
  return at::globalContext().isPinnedPtr(reinterpret_cast<const void*>(lo), c10::DeviceType::PrivateUse1) &&
         at::globalContext().isPinnedPtr(reinterpret_cast<const void*>(hi - 1), c10::DeviceType::PrivateUse1);
}

std::vector<std::string> Engine::report(c10::Device device) {
  // As in submit: the stream is looked up with its device current (torch_npu
  // drains that device's task queue to hand out the handle).
  c10::DeviceGuard guard(device);
  const bool batch = api_.memcpy_batch_async != nullptr;
  const bool refused = batch && batch_state(current_stream(device)) == BatchState::kRefused;
  return {
      std::string("batch_api=") +
          (!batch    ? "absent (aclrtMemcpyBatchAsync): one aclrtMemcpyAsync per copy"
           : refused ? "aclrtMemcpyBatchAsync found, refused on the current stream (207000): one "
                       "aclrtMemcpyAsync per copy there"
                     : "aclrtMemcpyBatchAsync found"),
      std::string("capture_query=") + (api_.capture_get_info != nullptr
                                           ? "aclmdlRICaptureGetInfo found"
                                           : "absent (aclmdlRICaptureGetInfo): copies take the "
                                             "per-descriptor path, legal in and out of capture"),
      std::string("pin_in_place=") + (api_.host_register_v2 != nullptr
                                          ? "aclrtHostRegisterV2(ACL_HOST_REG_PINNED) found"
                                          : "absent (aclrtHostRegisterV2): host mirrors use the "
                                            "pinned allocator"),
      std::string("pin_check=") + (api_.pointer_get_attributes != nullptr
                                       ? "aclrtPointerGetAttributes found"
                                       : "absent (aclrtPointerGetAttributes): a pin in "
                                         "place is not verified"),
  };
}

namespace {

void submit_kernel(const CopyBatch& batch, c10::Device device) { engine().submit(batch, device); }

bool stream_capturing_kernel(c10::Device device) { return engine().stream_capturing(device); }

void host_register_kernel(const at::Tensor& buffer, c10::Device device, bool pin) {
  engine().host_register(buffer, device, pin);
}

bool host_pinned_kernel(const at::Tensor& buffer, c10::Device device) {
  return engine().host_pinned(buffer, device);
}

std::vector<std::string> engine_report_kernel(c10::Device device) { return engine().report(device); }

}  // namespace

const EngineInterface& engine_interface() {
  static const EngineInterface table{
      /*name=*/"Ascend engine (torch_kvswap._C_npu)",
      /*submit=*/&submit_kernel,
      /*stream_capturing=*/&stream_capturing_kernel,
      /*host_register=*/&host_register_kernel,
      /*host_pinned=*/&host_pinned_kernel,
      /*host_mapped=*/nullptr,  // no copy kernel: nothing needs host memory mapped
      /*report=*/&engine_report_kernel,
      /*copy_blocks=*/nullptr,
  };
  return table;
}

}  // namespace ascend
}  // namespace kvswap
