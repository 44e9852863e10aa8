// Engine lookup and submission: the core's only way to an engine is the
// dispatcher. Each engine registers `kvswap::_submit` (and the optional
// `_stream_capturing`, `_host_register`, `_host_pinned`, `_swap_blocks_kernel`)
// under its own dispatch key; a missing engine is a clear error, never a
// loader failure. After a copy, the host allocator of the device learns the
// stream that uses host memory (record_host_use).
// GCC warns that the header's alignas(hardware_destructive_interference_size)
// may change between compilers (-Winterference-size); the engines only call
// the allocator's virtual interface.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#endif
#include <ATen/core/CachingHostAllocator.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <string>
#include <vector>

#include "core.h"

namespace kvswap {
namespace core {

c10::DispatchKey engine_key(c10::DeviceType type) {
  switch (type) {
    case c10::DeviceType::CPU:
      return c10::DispatchKey::CPU;
    case c10::DeviceType::CUDA:
      return c10::DispatchKey::CUDA;
    case c10::DeviceType::PrivateUse1:
      return c10::DispatchKey::PrivateUse1;
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, "kvswap has no engine for device type ", type,
                                  "; supported: cpu (host engine), cuda, and the PrivateUse1 "
                                  "backend (Ascend NPU)");
  }
}

namespace {
const char* engine_hint(c10::DeviceType type) {
  switch (type) {
    case c10::DeviceType::CUDA:
      return "the CUDA engine (torch_kvswap._C_cuda) is not loaded; reinstall torch_kvswap "
             "with a CUDA toolkit present or KVSWAP_BUILD_CUDA=1";
    case c10::DeviceType::PrivateUse1:
      return "the Ascend engine (torch_kvswap._C_npu) is not loaded; install torch_npu and "
             "CANN, then reinstall torch_kvswap (or force it with KVSWAP_BUILD_NPU=1)";
    default:
      return "the host engine is not loaded; reinstall torch_kvswap";
  }
}

}  // namespace

c10::DispatchKeySet engine_for(const c10::OperatorHandle& op, c10::Device device, const char* purpose) {
  const auto key = engine_key(device.type());
  TORCH_CHECK_NOT_IMPLEMENTED(op.hasKernelForDispatchKey(key), "kvswap: no engine for ", device, " ", purpose,
                              ": ", engine_hint(device.type()));
  return c10::DispatchKeySet(key);
}

void submit(const Descriptors& d, Direction direction, c10::Device device) {
  if (d.count == 0) {
    return;  // nothing to copy: no engine is needed, no stream is touched
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvswap::_submit", "")
                             .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                         int64_t, c10::Device)>();
  auto [src, dst, size] = d.rows();
  op.redispatch(engine_for(op, device, "to copy"), src, dst, size, static_cast<int64_t>(direction),
                d.total_bytes, device);
}

void record_host_use(at::TensorList src_caches, at::TensorList dst_caches, c10::Device device) {
  at::HostAllocator* allocator = at::getHostAllocator(device.type());
  if (allocator == nullptr) return;
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  const void* recorded = nullptr;
  for (const at::TensorList caches : {src_caches, dst_caches}) {
    for (const auto& t : caches) {
      if (!t.device().is_cpu() || t.numel() == 0) continue;
      const c10::DataPtr& data = t.storage().data_ptr();
      if (data.get() == recorded) continue;
      // False for memory the allocator does not own (pinned in place): nothing to do.
      allocator->record_event(data.get(), data.get_context(), stream);
      recorded = data.get();
    }
  }
}

bool stream_capturing(c10::Device device) {
  if (device.is_cpu()) return false;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvswap::_stream_capturing", "")
                             .typed<bool(c10::Device)>();
  const auto key = engine_key(device.type());
  if (!op.hasKernelForDispatchKey(key)) return false;
  return op.redispatch(c10::DispatchKeySet(key), device);
}

std::string direction_name_op(int64_t direction) { return direction_name(direction); }

// Host-buffer pinning is the accelerator engine's business; the core only
// checks the buffer and routes the call to the engine of `device`.
void host_register(const at::Tensor& buffer, c10::Device device, bool pin) {
  TORCH_CHECK_VALUE(buffer.device().is_cpu(), "buffer must be a CPU tensor, got one on ", buffer.device());
  TORCH_CHECK_VALUE(buffer.is_contiguous(), "buffer must be contiguous");
  TORCH_CHECK_NOT_IMPLEMENTED(!device.is_cpu(), "device must be an accelerator; host memory ",
                              "needs no pinning for the host engine");
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvswap::_host_register", "")
                             .typed<void(const at::Tensor&, c10::Device, bool)>();
  op.redispatch(engine_for(op, device, "to pin host memory"), buffer, device, pin);
}

bool stream_capturing_op(c10::Device device) { return stream_capturing(device); }

// What the engine of `device` reports about it (python -m torch_kvswap); an
// op with no tensor argument reaches the engine's key only through here.
std::vector<std::string> engine_report_op(c10::Device device) {
  TORCH_CHECK_VALUE(!device.is_cpu(), "device must be an accelerator, got ", device);
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvswap::_engine_report", "")
                             .typed<std::vector<std::string>(c10::Device)>();
  const auto key = engine_key(device.type());
  TORCH_CHECK_NOT_IMPLEMENTED(op.hasKernelForDispatchKey(key), "kvswap: ", device,
                              " has no engine loaded, so there is nothing to report");
  return op.redispatch(c10::DispatchKeySet(key), device);
}

}  // namespace core
}  // namespace kvswap
