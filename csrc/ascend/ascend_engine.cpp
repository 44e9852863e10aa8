// The Ascend engine: serves `kvswap::_submit`, `_stream_capturing`,
// `_host_register` and `_host_pinned` under the PrivateUse1 key (torch_npu's
// backend), copying on the current NPU stream under a device guard. All ACL
// calls go through the table of acl_api.h; this file includes no ACL header
// and links nothing of torch_npu.
//
// Paths (docs/ascend.md has the table per CANN version):
//   batch           aclrtMemcpyBatchAsync, up to kMaxBatchEntries descriptors
//                   a call: host<->device copies, stream known not to be
//                   captured, batch API present and not refused with 207000
//                   on this device;
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
#include <torch/library.h>

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

// What an error leaves behind: copies before the failing one are on the
// stream and will still run.
std::string queued_before(int64_t first_not_queued) {
  if (first_not_queued == 0) return "no copy of this call was queued";
  return "copies 0.." + std::to_string(first_not_queued - 1) +
         " of this call were already queued on the stream and will still run";
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
  TORCH_CHECK_VALUE(false, "kvswap Ascend engine: ", describe_descriptor(b, i),
                    ": device-to-device copies need 64-byte-aligned source and destination "
                    "addresses (CANN acl_rt.h, aclrtMemcpyAsync); ", queued_before(0));
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
// guard: torch 2.13's c10::Stream::native_handle() asks the guard impl, and
// torch_npu 2.13's NPUGuardImpl::getStreamNativeHandle returns
// NPUStream::stream(), which first drains torch_npu's task queue (so these
// copies follow every op already queued) and returns nullptr when that fails.
AclStream Engine::current_stream(c10::Device device) const {
  const c10::Stream stream =
      c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->getStream(device);
  AclStream handle = stream.native_handle();
  TORCH_CHECK(handle != nullptr, "kvswap Ascend engine: the current stream of ", device,
              " has a null ACL handle (torch_npu returns one when draining its task queue fails); "
              "nothing was queued, since ACL would run the copies on the default stream, "
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

bool Engine::batch_unsupported(c10::DeviceIndex index) const {
  return per_descriptor_only_[static_cast<size_t>(index)].load(std::memory_order_relaxed);
}

void Engine::latch_per_descriptor(c10::DeviceIndex index) {
  if (!per_descriptor_only_[static_cast<size_t>(index)].exchange(true)) {
    TORCH_WARN("kvswap Ascend engine: aclrtMemcpyBatchAsync answered 207000 "
               "(ACL_ERROR_RT_FEATURE_NOT_SUPPORT) on npu:", static_cast<int>(index),
               "; this device's copies take the per-descriptor path (one aclrtMemcpyAsync each) "
               "from now on");
  }
}

void Engine::submit(const CopyBatch& b, c10::Device device) {
  TORCH_CHECK(device.type() == c10::DeviceType::PrivateUse1 && device.index() >= 0 &&
                  device.index() < kMaxDevices,
              "kvswap Ascend engine asked to copy on ", device);
  c10::DeviceGuard guard(device);
  const AclStream stream = current_stream(device);
  const Capture capture = capture_state(stream);
  if (b.direction == Direction::kDeviceToDevice) check_device_to_device_alignment(b);
  TORCH_CHECK(capture != Capture::kActive || b.count <= kMaxCapturedCopies,
              "kvswap Ascend engine: refusing to capture ", b.count, " copies into one graph on ",
              device, ": a captured stream holds at most ", kMaxCapturedCopies,
              " copy tasks (CANN's task-capacity limit, error EE1023); split the call, or run it "
              "outside the capture; ", queued_before(0));
  int64_t queued = 0;
  if (b.direction != Direction::kDeviceToDevice && capture == Capture::kNone &&
      api_.memcpy_batch_async != nullptr && !batch_unsupported(device.index())) {
    queued = copy_batched(b, stream, device.index());
  }
  copy_each(b, queued, stream);
}

int64_t Engine::copy_batched(const CopyBatch& b, AclStream stream, c10::DeviceIndex index) {
  const MemLocation host{0, MemLocationType::kHost};
  const MemLocation dev{static_cast<uint32_t>(index), MemLocationType::kDevice};
  const DescriptorArrays arrays = descriptor_arrays(b);
  for (int64_t first = 0; first < b.count; first += static_cast<int64_t>(kMaxBatchEntries)) {
    const size_t n = std::min(kMaxBatchEntries, static_cast<size_t>(b.count - first));
    // One attrs entry with index 0 covers every descriptor: attrs[k] applies
    // from attrsIndexes[k] to the next index (acl/acl_rt.h:4414), and CANN's
    // own C++ wrapper passes exactly this (acl/acl_rt_api.h:145-148).
    MemcpyBatchAttr attr{};
    attr.srcLoc = b.direction == Direction::kHostToDevice ? host : dev;
    attr.dstLoc = b.direction == Direction::kHostToDevice ? dev : host;
    size_t attr_index = 0;
    size_t fail_index = SIZE_MAX;
    const AclError err = api_.memcpy_batch_async(
        arrays.dsts + first, arrays.sizes + first, arrays.srcs + first, arrays.sizes + first, n,
        &attr, &attr_index, 1, &fail_index, stream);
    if (err == kAclSuccess) continue;
    if (err == kAclFeatureNotSupported) {
      // Refused before anything of this batch was queued: the runtime checks
      // the chip's feature first (src/runtime/api/api_c_memory.cc:779-783).
      latch_per_descriptor(index);
      return first;
    }
    const bool known = fail_index < n;
    const int64_t failed = first + static_cast<int64_t>(fail_index);
    TORCH_CHECK(false, "kvswap Ascend engine: aclrtMemcpyBatchAsync of descriptors ", first, "..",
                first + static_cast<int64_t>(n) - 1, " failed: ", acl_message(err), "; ",
                known ? "failed at " + describe_descriptor(b, failed) : "no failing descriptor reported",
                "; ", queued_before(first),
                known && fail_index > 0
                    ? "; copies " + std::to_string(first) + ".." + std::to_string(failed - 1) +
                          " may have been queued too (CANN may submit a batch one copy at a time)"
                    : "");
  }
  return b.count;
}

void Engine::copy_each(const CopyBatch& b, int64_t first, AclStream stream) {
  const MemcpyKind kind = memcpy_kind(b.direction);
  for (int64_t i = first; i < b.count; ++i) {
    const size_t n = static_cast<size_t>(b.size[i]);
    const AclError err = api_.memcpy_async(as_ptr(b.dst[i]), n, as_ptr(b.src[i]), n, kind, stream);
    TORCH_CHECK(err == kAclSuccess, "kvswap Ascend engine: aclrtMemcpyAsync failed at ",
                describe_descriptor(b, i), ": ", acl_message(err), "; ", queued_before(i));
  }
}

bool Engine::stream_capturing(c10::Device device) {
  TORCH_CHECK(device.type() == c10::DeviceType::PrivateUse1,
              "kvswap Ascend engine asked about a stream of ", device);
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
    TORCH_CHECK(err == kAclSuccess, "kvswap Ascend engine: aclrtHostUnregister of 0x", std::hex,
                start, std::dec, " failed: ", acl_message(err));
    std::lock_guard<std::mutex> lock(registered_mutex_);
    registered_.erase(start);
    return;
  }
  // aclrtHostRegister(ACL_HOST_REGISTER_MAPPED), the older call, maps host
  // memory for the device; it does not page-lock it. Without V2 there is no
  // in-place pinning: the caller falls back to the pinned allocator
  // (KVCacheOffloader does).
  TORCH_CHECK_NOT_IMPLEMENTED(
      api_.host_register_v2 != nullptr,
      "kvswap Ascend engine: this CANN has no aclrtHostRegisterV2, so host memory cannot be "
      "page-locked in place (aclrtHostRegister only maps it for the device); allocate the buffer "
      "with pin_memory=True instead");
  TORCH_CHECK(start % kHostRegisterAlignment == 0, "kvswap Ascend engine: cannot pin ", bytes,
              " host bytes at 0x", std::hex, start, std::dec,
              " in place: aclrtHostRegisterV2 needs a 4 KiB-aligned start address");
  const AclError err = api_.host_register_v2(ptr, bytes, kHostRegPinned);
  TORCH_CHECK(err == kAclSuccess, "kvswap Ascend engine: aclrtHostRegisterV2(ACL_HOST_REG_PINNED) of ",
              bytes, " host bytes failed: ", acl_message(err));
  std::lock_guard<std::mutex> lock(registered_mutex_);
  registered_[start] = bytes;
}

bool Engine::host_pinned(const at::Tensor& buffer, c10::Device device) {
  // The bytes the tensor spans (a view may lie in a larger allocation, e.g.
  // a page-aligned mirror carved out of one).
  uint64_t extent = 1;
  for (int64_t d = 0; d < buffer.dim(); ++d) {
    extent += static_cast<uint64_t>(buffer.size(d) - 1) * static_cast<uint64_t>(buffer.stride(d));
  }
  const auto start = reinterpret_cast<uintptr_t>(buffer.data_ptr());
  const uint64_t bytes = extent * static_cast<uint64_t>(buffer.element_size());
  {
    std::lock_guard<std::mutex> lock(registered_mutex_);
    auto it = registered_.upper_bound(start);
    if (it != registered_.begin()) {
      --it;
      if (start + bytes <= it->first + it->second) return true;  // pinned in place by us
    }
  }
  // The pinned allocator's blocks: torch_npu answers through its hooks
  // (aclrtPointerGetAttributes), once the backend is initialized.
  at::globalContext().lazyInitDevice(c10::DeviceType::PrivateUse1);
  return at::globalContext().isPinnedPtr(buffer.data_ptr(), c10::DeviceType::PrivateUse1);
}

namespace {

void submit_kernel(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes,
                   int64_t direction, int64_t total_bytes, c10::Device device) {
  engine().submit(batch_from_tensors(src_ptrs, dst_ptrs, sizes, direction, total_bytes), device);
}

bool stream_capturing_kernel(c10::Device device) { return engine().stream_capturing(device); }

void host_register_kernel(const at::Tensor& buffer, c10::Device device, bool pin) {
  engine().host_register(buffer, device, pin);
}

bool host_pinned_kernel(const at::Tensor& buffer, c10::Device device) {
  return engine().host_pinned(buffer, device);
}

}  // namespace
}  // namespace ascend
}  // namespace kvswap

TORCH_LIBRARY_IMPL(kvswap, PrivateUse1, m) {
  m.impl("_submit", &kvswap::ascend::submit_kernel);
  m.impl("_stream_capturing", &kvswap::ascend::stream_capturing_kernel);
  m.impl("_host_register", &kvswap::ascend::host_register_kernel);
  m.impl("_host_pinned", &kvswap::ascend::host_pinned_kernel);
}
