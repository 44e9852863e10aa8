// The kernels of the copy ops and their dry runs: which engine and which path
// (descriptors and DMA, or an engine's copy kernel) serves a call, and the
// process-wide copy-method choice.
#include <ATen/DeviceAccelerator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>

#include "core.h"
#include "op_kernels.h"

namespace kvswap {
namespace core {

namespace {

// How many devices the accelerator has. CUDA's device guard cannot say: none
// is registered before CUDA is first used, and where CUDA is unavailable
// torch installs a stand-in that claims one device (FakeTensorMode does, via
// torch._C._ensureCUDADeviceGuardSet); the CUDA hooks ask the driver (0
// without one). Other accelerators answer through their device guard.
c10::DeviceIndex accelerator_devices(c10::DeviceType type) {
  if (type == c10::DeviceType::CUDA) return at::detail::getCUDAHooks().deviceCount();
  return at::accelerator::deviceCount();
}

// The device the pointer op's copies are issued on: the current accelerator,
// or the host when there is none. A CUDA build of torch names CUDA its
// accelerator on a machine without a GPU too (vLLM's CUDA wheels run their
// CPU paths so); with no device there, the copies are the host's.
c10::Device pointer_op_device() {
  const auto accelerator = at::getAccelerator(/*checked=*/false);
  if (!accelerator.has_value()) {
    return c10::Device(c10::DeviceType::CPU);
  }
  if (accelerator_devices(*accelerator) == 0) {
    return c10::Device(c10::DeviceType::CPU);
  }
  return c10::Device(*accelerator, at::accelerator::getDeviceIndex());
}

// The pointer op's descriptors, after every check (checked mode's too), and
// the device their copies are issued on; nothing is submitted yet.
struct PointerPlan {
  Descriptors descriptors;
  c10::Device device;
};

PointerPlan plan_pointer_op(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes,
                            int64_t direction) {
  const auto device = pointer_op_device();
  return before_any_copy([&] {
    auto plan = plan_pointer_batch(src_ptrs, dst_ptrs, sizes, direction, device);
    if (checked_mode()) {  // before anything is submitted (docs/checked.md)
      check_pointer_batch(src_ptrs, dst_ptrs, sizes, direction, device, "swap_blocks_batch");
    }
    return PointerPlan{std::move(plan), device};
  });
}

}  // namespace

void swap_blocks_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes,
                       int64_t direction) {
  const auto plan = plan_pointer_op(src_ptrs, dst_ptrs, sizes, direction);
  // An empty plan asks no engine.
  submit(plan.descriptors, static_cast<Direction>(direction), plan.device);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> plan_swap_blocks_batch(const at::Tensor& src_ptrs,
                                                                      const at::Tensor& dst_ptrs,
                                                                      const at::Tensor& sizes,
                                                                      int64_t direction) {
  auto [s, d, z] = plan_pointer_op(src_ptrs, dst_ptrs, sizes, direction).descriptors.rows();
  return {s.clone(), d.clone(), z.clone()};
}

namespace {

// Where a block copy runs, after the checks that need no id values: the
// cache pairs' layouts, the device whose engine copies, and the direction.
struct BlockCopyRoute {
  std::vector<PairLayout> pairs;
  Direction direction;
  c10::Device device;
};

// A host-to-host route has no direction code of its own: the public codes
// (kvswap.h) are the pointer op's three. The host engine copies with memcpy
// whichever it is handed and only checks that it is one of them; this is the
// one it is handed.
constexpr Direction kHostToHostDirection = Direction::kHostToDevice;

BlockCopyRoute route_block_copy(at::TensorList src_caches, at::TensorList dst_caches,
                                const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids) {
  check_ids_tensor(src_block_ids, "src_block_ids");
  check_ids_tensor(dst_block_ids, "dst_block_ids");
  TORCH_CHECK_VALUE(src_block_ids.numel() == dst_block_ids.numel(), "src_block_ids has ",
                    src_block_ids.numel(), " ids but dst_block_ids has ", dst_block_ids.numel(),
                    "; they are matched pairwise");
  auto pairs = layout_pairs(src_caches, dst_caches);
  const auto src_dev = common_device(src_caches, "src_caches").value_or(c10::Device("cpu"));
  const auto dst_dev = common_device(dst_caches, "dst_caches").value_or(c10::Device("cpu"));
  if (src_dev.is_cpu() && dst_dev.is_cpu()) {
    return {std::move(pairs), kHostToHostDirection, src_dev};  // the host engine
  }
  if (src_dev.is_cpu()) return {std::move(pairs), Direction::kHostToDevice, dst_dev};
  if (dst_dev.is_cpu()) return {std::move(pairs), Direction::kDeviceToHost, src_dev};
  TORCH_CHECK_VALUE(src_dev == dst_dev, "src_caches are on ", src_dev, " but dst_caches are on ", dst_dev,
                    "; copies between two accelerators are not supported");
  return {std::move(pairs), Direction::kDeviceToDevice, src_dev};
}

// Checks the id values and builds the descriptors. Ids are read on the host;
// ids on an accelerator are brought over (a synchronizing copy). swap_blocks
// never comes here with device ids during capture (choose_path); the dry run
// `_plan_swap_blocks` can, and is refused.
Descriptors check_ids_and_build_descriptors(const BlockCopyRoute& route, const at::Tensor& src_block_ids,
                                            const at::Tensor& dst_block_ids) {
  TORCH_CHECK_VALUE(
      (src_block_ids.device().is_cpu() && dst_block_ids.device().is_cpu()) || !stream_capturing(route.device),
      "swap_blocks: the current stream of ", route.device,
      " is being captured, and "
      "block ids on ",
      src_block_ids.device().is_cpu() ? dst_block_ids.device() : src_block_ids.device(),
      " would have to be read back to the host, which synchronizes and is illegal "
      "during capture; pass the block ids as CPU tensors");
  const auto sid_t = src_block_ids.to(at::kCPU).contiguous();
  const auto did_t = dst_block_ids.to(at::kCPU).contiguous();
  const int64_t* sid = sid_t.const_data_ptr<int64_t>();
  const int64_t* did = did_t.const_data_ptr<int64_t>();
  const int64_t n = sid_t.numel();
  check_block_ids(sid, did, n, route.pairs);
  if (route.device.is_cpu() && n > 1 && !std::is_sorted(sid, sid + n)) {
    // The host engine reads scattered blocks much faster in address order
    // (2 KiB blocks: 0.69 -> 0.76 of a contiguous copy; docs/performance.md).
    // The copies are independent, so their order is free to choose.
    const auto sorted = sort_by_source(sid, did, n, route.pairs);
    return build_block_descriptors(route.pairs, sorted.data(), sorted.data() + n, n);
  }
  return build_block_descriptors(route.pairs, sid, did, n);
}

// ---------------------------------------------------------------------------
// Copy method: DMA descriptors or an engine's copy kernel
// ---------------------------------------------------------------------------

enum class CopyMethod : int { kAuto = 0, kDma = 1, kKernel = 2 };
std::atomic<int> g_copy_method{static_cast<int>(CopyMethod::kAuto)};

// Below this many bytes per block, "auto" prefers a copy kernel: batched DMA
// pays a per-descriptor cost that dominates small blocks. The threshold is a
// design estimate, not yet measured on a GPU: scripts/gpu_check.sh measures
// both paths at 2, 16 and 256 KiB (docs/performance.md, GPU section).
constexpr int64_t kKernelPathMaxBlockBytes = 32 * 1024;

}  // namespace

void set_copy_method(c10::string_view method) {
  CopyMethod m;
  if (method == "auto") {
    m = CopyMethod::kAuto;
  } else if (method == "dma") {
    m = CopyMethod::kDma;
  } else if (method == "kernel") {
    // Only an engine's copy kernel serves it; the host engine has none.
    bool any_kernel = false;
    for (const auto type : {c10::DeviceType::CUDA, c10::DeviceType::PrivateUse1}) {
      const EngineInterface* engine = engine_of(type);
      any_kernel = any_kernel || (engine != nullptr && engine->copy_blocks != nullptr);
    }
    TORCH_CHECK_NOT_IMPLEMENTED(any_kernel,
                                "copy method 'kernel' needs an engine with a copy kernel (CUDA), and none "
                                "is loaded (torch.ops.kvswap._engines() lists those that are); use 'auto' "
                                "or 'dma'");
    m = CopyMethod::kKernel;
  } else {
    TORCH_CHECK_VALUE(false, "method must be 'auto', 'dma' or 'kernel', got '", method, "'");
  }
  g_copy_method.store(static_cast<int>(m));
}

std::string get_copy_method() {
  switch (static_cast<CopyMethod>(g_copy_method.load())) {
    case CopyMethod::kDma:
      return "dma";
    case CopyMethod::kKernel:
      return "kernel";
    default:
      return "auto";
  }
}

namespace {

// Whether the accelerator can address the host-side caches in place
// (page-locked and mapped), as the engine answers (EngineInterface::
// host_mapped); nullopt where the engine does not answer. The kernel reaches
// host memory only through such a mapping, and a capture may record a DMA
// copy only of page-locked memory.
std::optional<bool> host_side_mapped(const EngineInterface* engine, at::TensorList src_caches,
                                     at::TensorList dst_caches, c10::Device device) {
  if (engine == nullptr || engine->host_mapped == nullptr) return std::nullopt;
  std::vector<at::Tensor> host;
  for (const auto list : {src_caches, dst_caches}) {
    for (const auto& t : list) {
      if (t.device().is_cpu() && t.numel() > 0) host.push_back(t);
    }
  }
  if (host.empty()) return true;
  return engine->host_mapped(host, device);
}

enum class Path { kDescriptors, kKernel };

// Which path serves a block copy on an accelerator. No path may synchronize,
// copy pageable memory or allocate pinned memory while the current stream is
// captured, so under capture:
//   ids on the host    descriptors (captured memcpy nodes) or the kernel with
//                      the ids in its parameters: both repeat the copies of
//                      capture time on replay;
//   ids on the device  only the kernel, which reads them at replay; the
//                      descriptor path would have to read them back (a sync).
// Outside capture `auto` picks by block size: the kernel below
// kKernelPathMaxBlockBytes (host ids go into its parameters, so the call
// never waits for the device), descriptors above; device ids with large
// blocks are read back (a synchronizing copy) for the descriptor path.
Path choose_path(const BlockCopyRoute& route, at::TensorList src_caches, at::TensorList dst_caches,
                 const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids) {
  const auto device = route.device;
  const auto method = static_cast<CopyMethod>(g_copy_method.load());
  const bool host_ids = src_block_ids.device().is_cpu() && dst_block_ids.device().is_cpu();
  const bool capturing = stream_capturing(device);
  const EngineInterface* engine = engine_of(device.type());
  std::optional<std::optional<bool>> mapped_answer;
  auto mapped = [&]() -> std::optional<bool> {
    if (!mapped_answer) mapped_answer = host_side_mapped(engine, src_caches, dst_caches, device);
    return *mapped_answer;
  };
  // A capture may record descriptors only of page-locked host memory.
  auto check_capturable_descriptors = [&] {
    TORCH_CHECK_VALUE(!capturing || mapped().value_or(true), "swap_blocks: the current stream of ", device,
                      " is being captured, and a host-side cache is pageable memory, which "
                      "no copy may touch during capture; pin the host caches (pin_memory=True, or "
                      "KVCacheOffloader's mirrors)");
  };
  const bool kernel_available = engine != nullptr && engine->copy_blocks != nullptr;
  if (method == CopyMethod::kKernel) {
    TORCH_CHECK_NOT_IMPLEMENTED(kernel_available, "copy method 'kernel' was requested but the engine for ",
                                device, " has no kernel path; use 'auto' or 'dma'");
    TORCH_CHECK_VALUE(mapped().value_or(false), "copy method 'kernel': a host-side cache is host memory ",
                      device,
                      " cannot address; the kernel path needs pinned host memory "
                      "(pin_memory=True, or registered); use set_copy_method('dma') otherwise");
    return Path::kKernel;
  }
  if (method == CopyMethod::kDma) {
    TORCH_CHECK_VALUE(
        host_ids || !capturing,
        "swap_blocks: copy method 'dma' reads block ids on the "
        "host, and the ids on ",
        host_ids ? device
                 : (src_block_ids.device().is_cpu() ? dst_block_ids.device() : src_block_ids.device()),
        " would have to be read back, "
        "which synchronizes and is illegal while the stream of ",
        device,
        " is captured; "
        "pass CPU ids, or use copy method 'auto' (device ids then take the kernel path)");
    check_capturable_descriptors();
    return Path::kDescriptors;
  }
  int64_t largest = 0;
  for (const auto& p : route.pairs) largest = std::max(largest, p.block_bytes);
  const bool small = largest < kKernelPathMaxBlockBytes;
  // Under capture the kernel path is taken whatever the block size: the
  // graph then holds one node per launch (each carries hundreds of ids,
  // docs/cuda.md), where per-descriptor DMA records one memcpy node per
  // descriptor, layers x blocks of them.
  if (kernel_available && (small || capturing) && mapped().value_or(false)) {
    return Path::kKernel;
  }
  TORCH_CHECK_VALUE(host_ids || !capturing, "swap_blocks: the current stream of ", device,
                    " is being captured, and block ids on the device can then only be read by a "
                    "copy kernel, which ",
                    kernel_available ? "needs every host-side cache in pinned memory; pin the host caches or "
                                       "pass the block ids as CPU tensors"
                                     : "this engine does not have; pass the block ids as CPU tensors");
  check_capturable_descriptors();
  return Path::kDescriptors;
}

void swap_blocks_by_kernel(at::TensorList src_caches, at::TensorList dst_caches,
                           const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids,
                           const std::vector<PairLayout>& pairs, c10::Device device) {
  // Ids on the host are checked here and handed over as they are: the
  // engine copies them into the kernel's parameters (no transfer, no sync).
  // Ids on the device are not read back (that would synchronize and bake
  // them into a captured graph): the kernel skips any id out of range.
  // Checked mode reads them back and checks them, outside capture.
  const auto sid = src_block_ids.contiguous();
  const auto did = dst_block_ids.contiguous();
  before_any_copy([&] {
    if (sid.device().is_cpu() && did.device().is_cpu()) {
      check_block_ids(sid.const_data_ptr<int64_t>(), did.const_data_ptr<int64_t>(), sid.numel(), pairs);
      return;
    }
    // Any id may name any block, and the kernel only knows size(0).
    check_all_blocks_in_storage(pairs);
    if (checked_mode()) {
      check_device_resident_ids(sid, did, pairs, device);
    } else {
      check_no_aliasing_pairs(pairs, "the block ids are on the device, where they are not read back");
    }
  });
  engine_for(device, "to copy").copy_blocks(src_caches, dst_caches, sid, did);
}

}  // namespace

void swap_blocks(at::TensorList src_caches, at::TensorList dst_caches, const at::Tensor& src_block_ids,
                 const at::Tensor& dst_block_ids) {
  const auto route =
      before_any_copy([&] { return route_block_copy(src_caches, dst_caches, src_block_ids, dst_block_ids); });
  if (!route.device.is_cpu() && before_any_copy([&] {
                                  return choose_path(route, src_caches, dst_caches, src_block_ids,
                                                     dst_block_ids);
                                }) == Path::kKernel) {
    swap_blocks_by_kernel(src_caches, dst_caches, src_block_ids, dst_block_ids, route.pairs, route.device);
    // The kernel reads or writes the mapped host caches when it runs.
    record_host_use(src_caches, dst_caches, route.device);
    return;
  }
  // An engine that answers host_pinned (Ascend) needs pinned host caches
  // (validation.cpp). On an accelerator the pinned allocator learns the
  // copies' stream (engines.cpp), so that a pinned host tensor freed while
  // its copy is queued is not handed out again before the copy has run.
  const bool accelerator = !route.device.is_cpu();
  const auto descriptors = before_any_copy([&] {
    auto d = check_ids_and_build_descriptors(route, src_block_ids, dst_block_ids);
    if (accelerator && d.count > 0) check_host_caches_pinned(src_caches, dst_caches, route.device);
    return d;
  });
  if (descriptors.count == 0) return;  // nothing to copy: no engine is asked anything
  submit(descriptors, route.direction, route.device);
  if (accelerator) record_host_use(src_caches, dst_caches, route.device);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> plan_swap_blocks(at::TensorList src_caches,
                                                                at::TensorList dst_caches,
                                                                const at::Tensor& src_block_ids,
                                                                const at::Tensor& dst_block_ids) {
  return before_any_copy([&] {
    const auto route = route_block_copy(src_caches, dst_caches, src_block_ids, dst_block_ids);
    return check_ids_and_build_descriptors(route, src_block_ids, dst_block_ids).rows();
  });
}

}  // namespace core
}  // namespace kvswap
