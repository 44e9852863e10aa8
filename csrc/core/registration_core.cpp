// Every kernel of the `kvswap` ops, by dispatch key (the schemas are in
// csrc/registration.cpp; the kernels are declared in op_kernels.h), and the
// test extension's hooks (test_hooks.h). The
// engines register no kernel: the core calls the EngineInterface each one
// installed (engines.cpp).
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "core.h"
#include "op_kernels.h"
#include "test_hooks.h"

namespace kvswap {
namespace core {
namespace {

// The tensor op, its dry run and expand_block_ids are device-generic kernels:
// they read the tensors' devices and hand the work to that device's engine
// (or to ATen ops). They are registered for every key an engine may serve,
// so a mixed host/accelerator call, which the dispatcher routes by its
// accelerator tensor, lands here too.
void register_device_generic(torch::Library& m) {
  m.impl("swap_blocks", &swap_blocks);
  m.impl("_plan_swap_blocks", &plan_swap_blocks);
  m.impl("expand_block_ids", &expand_block_ids);
}

// swap_blocks' ADInplaceOrView kernel, as copy_'s: the destinations' version
// counters go up, so that autograd refuses a backward that needs values the
// copy overwrote. At this key (above functionalization) the bump is seen by
// torch.compile's tracing too, not only in eager mode. Inference tensors have
// no version counter.
void swap_blocks_inplace_or_view(c10::DispatchKeySet keys, at::TensorList src_caches,
                                 at::TensorList dst_caches, const at::Tensor& src_block_ids,
                                 const at::Tensor& dst_block_ids) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvswap::swap_blocks", "")
          .typed<void(at::TensorList, at::TensorList, const at::Tensor&, const at::Tensor&)>();
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatch(keys & c10::after_ADInplaceOrView_keyset, src_caches, dst_caches, src_block_ids,
                  dst_block_ids);
  }
  for (const auto& t : dst_caches) {
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace

const CoreTestHooks kTestHooks{
    kEngineInterfaceVersion, &region_labels,          &region_table_work,
    &host_engine::copy_plan, &plan_swap_blocks_batch, &expand_with_tensor_ops,
};

}  // namespace core
}  // namespace kvswap

extern "C" const kvswap::CoreTestHooks* kvswap_core_test_hooks() { return &kvswap::core::kTestHooks; }

TORCH_LIBRARY_IMPL(kvswap, CPU, m) {
  kvswap::core::register_device_generic(m);
  // The pointer op takes CPU descriptor tensors only; it copies on the
  // current accelerator (the host without one).
  m.impl("swap_blocks_batch", &kvswap::core::swap_blocks_batch);
  // The buffer is a CPU tensor; the core hands the call to the engine of
  // the device argument.
  m.impl("_host_register", &kvswap::core::host_register);
}
TORCH_LIBRARY_IMPL(kvswap, ADInplaceOrView, m) {
  m.impl("swap_blocks", &kvswap::core::swap_blocks_inplace_or_view);
}
TORCH_LIBRARY_IMPL(kvswap, CUDA, m) { kvswap::core::register_device_generic(m); }
TORCH_LIBRARY_IMPL(kvswap, PrivateUse1, m) { kvswap::core::register_device_generic(m); }

// Ops with no tensor argument, or whose tensors say nothing about the engine.
TORCH_LIBRARY_IMPL(kvswap, CompositeExplicitAutograd, m) {
  m.impl("_set_copy_method", &kvswap::core::set_copy_method);
  m.impl("_get_copy_method", &kvswap::core::get_copy_method);
  m.impl("_engine_report", &kvswap::core::engine_report_op);
  m.impl("_engines", &kvswap::core::engines_op);
  m.impl("_register_region", &kvswap::core::register_region);
  m.impl("_unregister_region", &kvswap::core::unregister_region);
  m.impl("_set_checked", &kvswap::core::set_checked_mode);
  m.impl("_get_checked", &kvswap::core::get_checked_mode);
}
