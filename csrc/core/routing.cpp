// Routing and the kernels of the copy ops: which engine and which path
// (descriptors and DMA, or an engine's copy kernel) serves a call, and the
// process-wide copy-method choice.
#include <ATen/DeviceAccelerator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "core.h"

namespace kvswap {
namespace core {

namespace {

// The device the pointer op's copies are issued on: the current accelerator,
// or the host when there is none.
c10::Device pointer_op_device() {
  const auto accelerator = at::getAccelerator(/*checked=*/false);
  if (!accelerator.has_value()) {
    return c10::Device(c10::DeviceType::CPU);
  }
  // The accelerator's current device (at::accelerator::getDeviceIndex()
  // does the same, but torch 2.6 lacks it).
  return c10::impl::getDeviceGuardImpl(*accelerator)->getDevice();
}

void swap_blocks_batch(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                       const at::Tensor& sizes, int64_t direction) {
  const auto device = pointer_op_device();
  const auto plan = plan_pointer_batch(src_ptrs, dst_ptrs, sizes, direction, device);
  if (plan.count == 0) {
    return;
  }
  submit(plan, static_cast<Direction>(direction), device);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> plan_swap_blocks_batch(const at::Tensor& src_ptrs,
                                                                      const at::Tensor& dst_ptrs,
                                                                      const at::Tensor& sizes,
                                                                      int64_t direction) {
  auto [s, d, z] = plan_pointer_batch(src_ptrs, dst_ptrs, sizes, direction, pointer_op_device()).rows();
  return {s.clone(), d.clone(), z.clone()};
}

// Where a block copy runs, after the checks that need no id values: the
// cache pairs' layouts, the device whose engine copies, and the direction.
struct BlockCopyRoute {
  std::vector<PairLayout> pairs;
  Direction direction;
  c10::Device device;
};

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
    // The host engine; it does not look at the direction.
    return {std::move(pairs), Direction::kHostToDevice, src_dev};
  }
  if (src_dev.is_cpu()) return {std::move(pairs), Direction::kHostToDevice, dst_dev};
  if (dst_dev.is_cpu()) return {std::move(pairs), Direction::kDeviceToHost, src_dev};
  TORCH_CHECK_VALUE(src_dev == dst_dev, "src_caches are on ", src_dev, " but dst_caches are on ",
                    dst_dev, "; copies between two accelerators are not supported");
  return {std::move(pairs), Direction::kDeviceToDevice, src_dev};
}

// Checks the id values and builds the descriptors. Ids are read on the host;
// ids on an accelerator are brought over (a synchronizing copy).
Descriptors describe_block_copy(const BlockCopyRoute& route, const at::Tensor& src_block_ids,
                                const at::Tensor& dst_block_ids) {
  TORCH_CHECK_VALUE((src_block_ids.device().is_cpu() && dst_block_ids.device().is_cpu()) ||
                        !stream_capturing(route.device),
                    "swap_blocks: the current stream of ", route.device, " is being captured, and "
                    "block ids on ", src_block_ids.device().is_cpu() ? dst_block_ids.device()
                                                                      : src_block_ids.device(),
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
// pays a per-descriptor cost that dominates small blocks (measured upstream
// on H100: 4-7 GB/s under 28 KiB, 40-52 GB/s above).
constexpr int64_t kKernelPathMaxBlockBytes = 32 * 1024;

void set_copy_method(c10::string_view method) {
  CopyMethod m;
  if (method == "auto") {
    m = CopyMethod::kAuto;
  } else if (method == "dma") {
    m = CopyMethod::kDma;
  } else if (method == "kernel") {
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

const c10::TypedOperatorHandle<void(at::TensorList, at::TensorList, const at::Tensor&,
                                    const at::Tensor&)>&
kernel_path_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvswap::_swap_blocks_kernel", "")
                             .typed<void(at::TensorList, at::TensorList, const at::Tensor&,
                                         const at::Tensor&)>();
  return op;
}

// The kernel reaches host memory through its device mapping, which only
// page-locked memory has.
bool host_side_pinned(at::TensorList caches) {
  for (const auto& t : caches) {
    if (t.device().is_cpu() && t.numel() > 0 && !t.is_pinned()) return false;
  }
  return true;
}

bool use_kernel_path(const std::vector<PairLayout>& pairs, c10::Device device,
                     at::TensorList src_caches, at::TensorList dst_caches) {
  const auto method = static_cast<CopyMethod>(g_copy_method.load());
  if (method == CopyMethod::kDma) return false;
  const bool available = kernel_path_op().hasKernelForDispatchKey(engine_key(device.type()));
  if (method == CopyMethod::kKernel) {
    TORCH_CHECK_NOT_IMPLEMENTED(available, "copy method 'kernel' was requested but the engine for ",
                                device, " has no kernel path; use 'auto' or 'dma'");
    return true;
  }
  int64_t largest = 0;
  for (const auto& p : pairs) largest = std::max(largest, p.block_bytes);
  return available && largest < kKernelPathMaxBlockBytes && host_side_pinned(src_caches) &&
         host_side_pinned(dst_caches);
}

void swap_blocks_by_kernel(at::TensorList src_caches, at::TensorList dst_caches,
                           const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids,
                           const std::vector<PairLayout>& pairs, c10::Device device) {
  // Ids on the host are checked here and moved over; ids already on the
  // device are not read back (that would synchronize and bake them into a
  // captured graph): the kernel skips any id out of range instead.
  auto on_device = [&](const at::Tensor& ids) {
    return ids.device() == device ? ids.contiguous() : ids.to(device, /*non_blocking=*/false).contiguous();
  };
  if (src_block_ids.device().is_cpu() && dst_block_ids.device().is_cpu()) {
    const auto sid = src_block_ids.contiguous();
    const auto did = dst_block_ids.contiguous();
    check_block_ids(sid.const_data_ptr<int64_t>(), did.const_data_ptr<int64_t>(), sid.numel(), pairs);
  }
  kernel_path_op().redispatch(c10::DispatchKeySet(engine_key(device.type())), src_caches, dst_caches,
                              on_device(src_block_ids), on_device(dst_block_ids));
}

void swap_blocks(at::TensorList src_caches, at::TensorList dst_caches,
                 const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids) {
  const auto route = route_block_copy(src_caches, dst_caches, src_block_ids, dst_block_ids);
  if (!route.device.is_cpu() &&
      use_kernel_path(route.pairs, route.device, src_caches, dst_caches)) {
    swap_blocks_by_kernel(src_caches, dst_caches, src_block_ids, dst_block_ids, route.pairs,
                          route.device);
    return;
  }
  // Ascend (PrivateUse1): host caches must be pinned, and the pinned
  // allocator learns the copies' stream (validation.cpp, engines.cpp).
  const bool ascend = route.device.type() == c10::DeviceType::PrivateUse1;
  if (ascend) check_host_caches_pinned(src_caches, dst_caches, route.device);
  submit(describe_block_copy(route, src_block_ids, dst_block_ids), route.direction, route.device);
  if (ascend) record_host_use(src_caches, dst_caches, route.device);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> plan_swap_blocks(at::TensorList src_caches,
                                                                at::TensorList dst_caches,
                                                                const at::Tensor& src_block_ids,
                                                                const at::Tensor& dst_block_ids) {
  const auto route = route_block_copy(src_caches, dst_caches, src_block_ids, dst_block_ids);
  return describe_block_copy(route, src_block_ids, dst_block_ids).rows();
}

}  // namespace

}  // namespace core
}  // namespace kvswap

TORCH_LIBRARY_IMPL(kvswap, CPU, m) {
  m.impl("swap_blocks_batch", &kvswap::core::swap_blocks_batch);
  m.impl("_plan_swap_blocks_batch", &kvswap::core::plan_swap_blocks_batch);
}

// The tensor op and its dry run are device-generic kernels: they read the
// tensors' devices and hand descriptors to that device's engine. They are
// registered for every key an engine may serve, so a mixed host/accelerator
// call, which the dispatcher routes by its accelerator tensor, lands here too.
namespace kvswap {
namespace core {
namespace {
void register_device_generic(torch::Library& m) {
  m.impl("swap_blocks", &swap_blocks);
  m.impl("_plan_swap_blocks", &plan_swap_blocks);
}
}  // namespace
}  // namespace core
}  // namespace kvswap

TORCH_LIBRARY_IMPL(kvswap, CPU, m) { kvswap::core::register_device_generic(m); }
TORCH_LIBRARY_IMPL(kvswap, CUDA, m) { kvswap::core::register_device_generic(m); }
TORCH_LIBRARY_IMPL(kvswap, PrivateUse1, m) { kvswap::core::register_device_generic(m); }

TORCH_LIBRARY_IMPL(kvswap, CompositeExplicitAutograd, m) {
  m.impl("_set_copy_method", &kvswap::core::set_copy_method);
  m.impl("_get_copy_method", &kvswap::core::get_copy_method);
}
