// The Ascend engine: serves `kvswap::_submit` and `kvswap::_host_register`
// under the PrivateUse1 key (torch_npu's backend), copying on the current NPU
// stream under a device guard.
//
// Paths:
//   batch     aclrtMemcpyBatchAsync (CANN 8.5+, detected at build time), one
//             call per batch, for host<->device copies outside graph capture;
//   fallback  one aclrtMemcpyAsync per descriptor: when the batch API is
//             absent, for device->device copies (the batch API takes only
//             host<->device), and while the stream is being captured into a
//             graph (aclmdlRICaptureGetInfo), where the batch API has no
//             recorded form.
//
// Graph capture: the fallback path makes no synchronous ACL call and no host
// allocation, so it records cleanly into an aclgraph; a replay repeats the
// same copies between the same addresses with the same sizes (block ids are
// baked in at capture).
//
// Descriptor lifetime: the batch path reads the core's descriptor table in
// place (int64 addresses and sizes are the same bytes as void* and size_t
// here). The table tensors, plus the attrs arrays built per call, are owned
// by `in_flight()` until an event recorded right after the submission has
// completed, then the table returns to the core's pool.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <acl/acl_rt.h>
#include <torch_npu/csrc/core/npu/NPUStream.h>

#include <array>
#include <cstdint>
#include <memory>
#include <sstream>
#include <vector>

#include "../engine_common.h"
#include "../kvswap.h"
#include "../python_module.h"

#ifndef KVSWAP_HAVE_ACL_BATCH_MEMCPY
#define KVSWAP_HAVE_ACL_BATCH_MEMCPY 0
#endif

KVSWAP_PYTHON_MODULE(_C_npu)

namespace kvswap {
namespace {

std::string acl_message(aclError err) {
  std::ostringstream msg;
  msg << "ACL error " << err;
  if (const char* recent = aclGetRecentErrMsg()) {
    msg << " (" << recent << ")";
  }
  return msg.str();
}

#define KVSWAP_ACL_CHECK(call, ...)                                                        \
  do {                                                                                     \
    const aclError kvswap_err_ = (call);                                                   \
    TORCH_CHECK(kvswap_err_ == ACL_SUCCESS, "kvswap Ascend engine: " #call " failed: ", \
                acl_message(kvswap_err_), ". ", ##__VA_ARGS__);                            \
  } while (0)

aclrtMemcpyKind memcpy_kind(Direction direction) {
  switch (direction) {
    case Direction::kHostToDevice:
      return ACL_MEMCPY_HOST_TO_DEVICE;
    case Direction::kDeviceToHost:
      return ACL_MEMCPY_DEVICE_TO_HOST;
    case Direction::kDeviceToDevice:
      return ACL_MEMCPY_DEVICE_TO_DEVICE;
  }
  TORCH_CHECK(false, "unreachable direction");
}

void copy_each(const CopyBatch& b, aclrtStream stream) {
  const aclrtMemcpyKind kind = memcpy_kind(b.direction);
  for (int64_t i = 0; i < b.count; ++i) {
    const size_t n = static_cast<size_t>(b.size[i]);
    KVSWAP_ACL_CHECK(aclrtMemcpyAsync(as_ptr(b.dst[i]), n, as_ptr(b.src[i]), n, kind, stream),
                     describe_descriptor(b, i));
  }
}

#if KVSWAP_HAVE_ACL_BATCH_MEMCPY
struct AclRuntime {
  using Event = aclrtEvent;
  using Stream = aclrtStream;
  static Event create_event() {
    aclrtEvent event = nullptr;
    KVSWAP_ACL_CHECK(aclrtCreateEvent(&event));
    return event;
  }
  static void record(Event event, Stream stream) { KVSWAP_ACL_CHECK(aclrtRecordEvent(event, stream)); }
  static bool completed(Event event) {
    aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
    KVSWAP_ACL_CHECK(aclrtQueryEventStatus(event, &status));
    return status == ACL_EVENT_RECORDED_STATUS_COMPLETE;
  }
};

constexpr int kMaxDevices = 64;

InFlightArrays<AclRuntime>& in_flight(c10::DeviceIndex index) {
  static std::array<InFlightArrays<AclRuntime>, kMaxDevices> per_device;
  TORCH_CHECK(index >= 0 && index < kMaxDevices, "kvswap Ascend engine: device index ", index,
              " out of range");
  return per_device[static_cast<size_t>(index)];
}

bool stream_is_capturing(aclrtStream stream) {
  aclmdlRICaptureStatus status = ACL_MODEL_RI_CAPTURE_STATUS_NONE;
  aclmdlRI model = nullptr;
  KVSWAP_ACL_CHECK(aclmdlRICaptureGetInfo(stream, &status, &model));
  return status != ACL_MODEL_RI_CAPTURE_STATUS_NONE;
}

void copy_batched(const CopyBatch& b, aclrtStream stream, c10::DeviceIndex device,
                  std::vector<at::Tensor> keep_alive) {
  aclrtMemLocation host{};
  host.id = 0;
  host.type = ACL_MEM_LOCATION_TYPE_HOST;
  aclrtMemLocation dev{};
  dev.id = static_cast<uint32_t>(device);
  dev.type = ACL_MEM_LOCATION_TYPE_DEVICE;
  aclrtMemcpyBatchAttr attr{};
  attr.srcLoc = b.direction == Direction::kHostToDevice ? host : dev;
  attr.dstLoc = b.direction == Direction::kHostToDevice ? dev : host;

  auto args = BatchAttrs<aclrtMemcpyBatchAttr>::per_descriptor(b.count, attr);
  const DescriptorArrays arrays = descriptor_arrays(b);
  size_t fail_index = SIZE_MAX;
  const aclError err = aclrtMemcpyBatchAsync(arrays.dsts, arrays.sizes, arrays.srcs, arrays.sizes,
                                             static_cast<size_t>(b.count), args->attrs.data(),
                                             args->indexes.data(), args->attrs.size(), &fail_index,
                                             stream);
  if (err != ACL_SUCCESS) {
    const bool known = fail_index < static_cast<size_t>(b.count);
    TORCH_CHECK(false, "kvswap Ascend engine: aclrtMemcpyBatchAsync of ", b.count,
                " descriptors failed: ", acl_message(err), "; ",
                known ? "failed at " + describe_descriptor(b, static_cast<int64_t>(fail_index))
                      : "no failing descriptor reported (fail index " + std::to_string(fail_index) + ")");
  }
  in_flight(device).hold(stream, std::move(keep_alive), std::move(args));
}
#endif

void submit_npu(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes,
                int64_t direction, int64_t total_bytes, c10::Device device) {
  TORCH_CHECK(device.type() == c10::DeviceType::PrivateUse1, "Ascend engine asked to copy on ", device);
  const CopyBatch batch = batch_from_tensors(src_ptrs, dst_ptrs, sizes, direction, total_bytes);
  c10::DeviceGuard guard(device);
  // stream() waits for torch_npu's task queue to drain, so these copies are
  // ordered after every op already queued on this stream.
  aclrtStream stream = c10_npu::getCurrentNPUStream(device.index()).stream();
#if KVSWAP_HAVE_ACL_BATCH_MEMCPY
  if (batch.direction != Direction::kDeviceToDevice && !stream_is_capturing(stream)) {
    copy_batched(batch, stream, device.index(), {src_ptrs, dst_ptrs, sizes});
    return;
  }
#endif
  copy_each(batch, stream);
}

void host_register_npu(const at::Tensor& buffer, c10::Device device, bool pin) {
  c10::DeviceGuard guard(device);
  void* ptr = buffer.data_ptr();
  if (pin) {
    void* device_ptr = nullptr;
    KVSWAP_ACL_CHECK(aclrtHostRegister(ptr, static_cast<uint64_t>(buffer.nbytes()),
                                       ACL_HOST_REGISTER_MAPPED, &device_ptr),
                     "pinning ", buffer.nbytes(), " host bytes");
  } else {
    KVSWAP_ACL_CHECK(aclrtHostUnregister(ptr));
  }
}

}  // namespace
}  // namespace kvswap

TORCH_LIBRARY_IMPL(kvswap, PrivateUse1, m) {
  m.impl("_submit", &kvswap::submit_npu);
  m.impl("_host_register", &kvswap::host_register_npu);
}
