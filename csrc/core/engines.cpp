// The engine registry and the calls into engines: the core's only way to an
// engine is the table it installed (kvswap.h, EngineInterface), one per device
// type; a missing engine, or an entry an engine does not have, is a clear
// error, never a loader failure. After a copy, the host allocator of the
// device learns the stream that uses host memory (record_host_use).
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
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <atomic>
#include <string>
#include <vector>

#include "core.h"

namespace kvswap {
namespace core {

namespace {

// The engines' slots: the host engine (CPU), CUDA, and the PrivateUse1
// backend (Ascend). Read on every call, written when an engine loads.
std::array<std::atomic<const EngineInterface*>, 3> g_engines{};

std::atomic<const EngineInterface*>& slot(c10::DeviceType type) {
  switch (type) {
    case c10::DeviceType::CPU:
      return g_engines[0];
    case c10::DeviceType::CUDA:
      return g_engines[1];
    case c10::DeviceType::PrivateUse1:
      return g_engines[2];
    default:
      TORCH_CHECK_NOT_IMPLEMENTED(false, "kvswap has no engine for device type ", type,
                                  "; supported: cpu (host engine), cuda, and the PrivateUse1 "
                                  "backend (Ascend NPU)");
  }
}

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

const EngineInterface* install(c10::DeviceType type, const EngineInterface* engine) {
  TORCH_CHECK_VALUE(engine == nullptr || engine->submit != nullptr, "kvswap: the engine ", engine->name,
                    " has no submit");
  return slot(type).exchange(engine, std::memory_order_acq_rel);
}

}  // namespace

const EngineInterface* engine_of(c10::DeviceType type) { return slot(type).load(std::memory_order_acquire); }

const EngineRegistry kRegistry{kEngineInterfaceVersion, &install, &engine_of};

}  // namespace core
}  // namespace kvswap

extern "C" const kvswap::EngineRegistry* kvswap_engine_registry() { return &kvswap::core::kRegistry; }

namespace kvswap {
namespace core {

namespace {
[[maybe_unused]] const bool g_host_installed =
    (install(c10::DeviceType::CPU, &host_engine::engine_interface()), true);
}  // namespace

const EngineInterface& engine_for(c10::Device device, const char* purpose) {
  const EngineInterface* engine = engine_of(device.type());
  TORCH_CHECK_NOT_IMPLEMENTED(engine != nullptr, "kvswap: no engine for ", device, " ", purpose, ": ",
                              engine_hint(device.type()));
  return *engine;
}

void submit(const Descriptors& d, Direction direction, c10::Device device) {
  if (d.count == 0) {
    return;  // nothing to copy: no engine is needed, no stream is touched
  }
  engine_for(device, "to copy").submit(d.batch(direction), device);
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
  const EngineInterface* engine = engine_of(device.type());
  return engine != nullptr && engine->stream_capturing != nullptr && engine->stream_capturing(device);
}

// Host-buffer pinning is the accelerator engine's business; the core only
// checks the buffer and hands it to the engine of `device`.
void host_register(const at::Tensor& buffer, c10::Device device, bool pin) {
  TORCH_CHECK_VALUE(buffer.device().is_cpu(), "buffer must be a CPU tensor, got one on ", buffer.device());
  TORCH_CHECK_VALUE(buffer.is_contiguous(), "buffer must be contiguous");
  TORCH_CHECK_NOT_IMPLEMENTED(!device.is_cpu(), "device must be an accelerator; host memory ",
                              "needs no pinning for the host engine");
  const EngineInterface& engine = engine_for(device, "to pin host memory");
  TORCH_CHECK_NOT_IMPLEMENTED(engine.host_register != nullptr, "kvswap: the ", engine.name,
                              " cannot pin host memory in place");
  engine.host_register(buffer, device, pin);
}

// What the engine of `device` reports about it (python -m torch_kvswap).
std::vector<std::string> engine_report_op(c10::Device device) {
  TORCH_CHECK_VALUE(!device.is_cpu(), "device must be an accelerator, got ", device);
  const EngineInterface* engine = engine_of(device.type());
  TORCH_CHECK_NOT_IMPLEMENTED(engine != nullptr, "kvswap: ", device,
                              " has no engine loaded, so there is nothing to report");
  if (engine->report == nullptr) return {};
  return engine->report(device);
}

// The device types an engine serves now, as torch names them ("cpu",
// "cuda", and the PrivateUse1 backend's name, "npu" under torch_npu).
std::vector<std::string> engines_op() {
  std::vector<std::string> out;
  for (const auto type : {c10::DeviceType::CPU, c10::DeviceType::CUDA, c10::DeviceType::PrivateUse1}) {
    if (engine_of(type) != nullptr) out.push_back(c10::DeviceTypeName(type, /*lower_case=*/true));
  }
  return out;
}

}  // namespace core
}  // namespace kvswap
