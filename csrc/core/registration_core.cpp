// Every kernel of the `kvswap` ops, by dispatch key (the schemas are in
// csrc/registration.cpp; the kernels are declared in op_kernels.h), and the
// test extension's hooks (test_hooks.h). The
// engines register no kernel: the core calls the EngineInterface each one
// installed (engines.cpp).
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

}  // namespace

const CoreTestHooks kTestHooks{
    kEngineInterfaceVersion, &region_labels,          &region_table_work,
    &host_engine::copy_plan, &plan_swap_blocks_batch, &expand_with_tensor_ops,
};

}  // namespace core
}  // namespace kvswap

TORCH_LIBRARY_IMPL(kvswap, CPU, m) {
  kvswap::core::register_device_generic(m);
  // The pointer op takes CPU descriptor tensors only; it copies on the
  // current accelerator (the host without one).
  m.impl("swap_blocks_batch", &kvswap::core::swap_blocks_batch);
  // The buffer is a CPU tensor; the core hands the call to the engine of
  // the device argument.
  m.impl("_host_register", &kvswap::core::host_register);
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
