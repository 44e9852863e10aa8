// The test extension's ops on engines (`torch.ops.kvswap_test`; compiled into
// torch_kvswap._fake_cuda, which no wheel holds):
//
//   * calls of an engine's EngineInterface entries by the engine's device type
//     ("cpu", "cuda", "privateuseone" or its renamed name), exactly as the
//     core makes them, so that tests reach an engine's own checks: `submit`,
//     `stream_capturing`, `host_pinned`, `host_mapped`, `copy_blocks`;
//   * the core's internals that tests read (csrc/core/test_hooks.h):
//     `region_labels`, `region_table_work`, `host_copy_plan`,
//     `plan_swap_blocks_batch`, `expand_block_ids_aten`, and
//     `direction_name`, which names a code by the C++ enum;
//   * how engines are installed: an engine built for another interface,
//     one whose setup fails, one without submit (`import_registry`,
//     `install_failing_engine`, `install_without_submit`);
//   * a recording engine (`spy_install`, `spy_calls`, `spy_uninstall`;
//     tests/fake_device.py, engine_spy): installed for a device type in place
//     of its engine, it records each submit as an engine receives it and,
//     unless told not to, performs the copies with memmove. For an
//     accelerator it also answers that host memory is page-locked.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "../../csrc/python_module.h"
#include "test_extension.h"

namespace kvswap_test {

const kvswap::EngineRegistry* const g_registry = kvswap_engine_registry();
const kvswap::CoreTestHooks* const g_hooks = kvswap_core_test_hooks();

namespace {

using kvswap::EngineInterface;

c10::DeviceType device_type(const std::string& engine) { return c10::Device(engine).type(); }

const EngineInterface& engine_of(const std::string& engine) {
  const EngineInterface* e = g_registry->lookup(device_type(engine));
  TORCH_CHECK_NOT_IMPLEMENTED(e != nullptr, "kvswap_test: no engine serves ", engine);
  return *e;
}

template <class Entry>
Entry entry(const std::string& engine, Entry EngineInterface::* member, const char* what) {
  const EngineInterface& e = engine_of(engine);
  TORCH_CHECK_NOT_IMPLEMENTED(e.*member != nullptr, "kvswap_test: the ", e.name, " has no ", what);
  return e.*member;
}

// An empty tensor whose storage keeps `tensors` alive: the owner of a batch
// whose arrays are those tensors' memory.
at::Tensor holding(std::vector<at::Tensor> tensors) {
  auto kept = std::make_shared<std::vector<at::Tensor>>(std::move(tensors));
  return at::from_blob(kept.get(), {0}, [kept](void*) {}, at::TensorOptions().dtype(at::kByte));
}

// Hands an engine the batch the three descriptor tensors describe, as the
// core hands it one (kvswap.h, CopyBatch): the arrays are the tensors' own
// memory (a test may change them after a capture), held by the batch's
// owner; the direction must be one of the enum's codes.
void submit(const std::string& engine, const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
            const at::Tensor& sizes, int64_t direction, int64_t total_bytes, c10::Device device) {
  for (const at::Tensor* t : {&src_ptrs, &dst_ptrs, &sizes}) {
    TORCH_CHECK(
        t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() && t->is_cpu() &&
            t->numel() == src_ptrs.numel(),
        "kvswap_test.submit: the descriptors are three contiguous 1-D int64 CPU tensors of one length");
  }
  const kvswap::CopyBatch batch{src_ptrs.const_data_ptr<int64_t>(),
                                dst_ptrs.const_data_ptr<int64_t>(),
                                sizes.const_data_ptr<int64_t>(),
                                src_ptrs.numel(),
                                total_bytes,
                                kvswap::checked_direction(direction),
                                holding({src_ptrs, dst_ptrs, sizes})};
  entry(engine, &EngineInterface::submit, "submit")(batch, device);
}

bool stream_capturing(const std::string& engine, c10::Device device) {
  return entry(engine, &EngineInterface::stream_capturing, "capture query")(device);
}

bool host_pinned(const std::string& engine, const at::Tensor& buffer, c10::Device device) {
  return entry(engine, &EngineInterface::host_pinned, "pinning query")(buffer, device);
}

bool host_mapped(const std::string& engine, at::TensorList tensors, c10::Device device) {
  return entry(engine, &EngineInterface::host_mapped, "mapping query")(tensors, device);
}

void copy_blocks(const std::string& engine, at::TensorList src_caches, at::TensorList dst_caches,
                 const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids) {
  entry(engine, &EngineInterface::copy_blocks, "copy kernel")(src_caches, dst_caches, src_block_ids,
                                                              dst_block_ids);
}

// --- the recording engine --------------------------------------------------------

struct Call {
  at::Tensor table;  // [3, n]: source addresses, destination addresses, sizes
  int64_t direction;
  int64_t total_bytes;
  std::string device;
};

struct Spy {
  std::mutex mutex;
  std::vector<Call> calls;
  bool copy = true;
  bool installed = false;
  c10::DeviceType type = c10::DeviceType::CPU;
  const EngineInterface* replaced = nullptr;
};

Spy& spy() {
  static Spy* s = new Spy();  // process lifetime
  return *s;
}

void spy_submit(const kvswap::CopyBatch& b, c10::Device device) {
  // A copy: the core reuses its table.
  const int64_t n = b.count;
  const auto table = at::empty({3, n}, at::kLong);
  int64_t* out = table.data_ptr<int64_t>();
  const auto row_bytes = static_cast<size_t>(n) * sizeof(int64_t);
  std::memcpy(out, b.src, row_bytes);
  std::memcpy(out + n, b.dst, row_bytes);
  std::memcpy(out + 2 * n, b.size, row_bytes);
  bool copy;
  {
    std::lock_guard<std::mutex> lock(spy().mutex);
    spy().calls.push_back(Call{table, static_cast<int64_t>(b.direction), b.total_bytes, device.str()});
    copy = spy().copy;
  }
  if (!copy) return;
  const int64_t* rows = table.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    std::memmove(kvswap::as_ptr(rows[n + i]), kvswap::as_ptr(rows[i]), static_cast<size_t>(rows[2 * n + i]));
  }
}

bool spy_pinned(const at::Tensor&, c10::Device) { return true; }

const EngineInterface kHostSpy{
    "recording engine (tests)", &spy_submit, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
const EngineInterface kAcceleratorSpy{
    "recording engine (tests)", &spy_submit, nullptr, nullptr, &spy_pinned, nullptr, nullptr, nullptr};

void spy_install(const std::string& engine, bool copy) {
  std::lock_guard<std::mutex> lock(spy().mutex);
  TORCH_CHECK(!spy().installed, "kvswap_test: the recording engine is already installed");
  const auto type = device_type(engine);
  spy().calls.clear();
  spy().copy = copy;
  spy().type = type;
  spy().replaced = g_registry->install(type, type == c10::DeviceType::CPU ? &kHostSpy : &kAcceleratorSpy);
  spy().installed = true;
}

void spy_uninstall() {
  std::lock_guard<std::mutex> lock(spy().mutex);
  if (!spy().installed) return;
  g_registry->install(spy().type, spy().replaced);
  spy().installed = false;
}

std::tuple<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<std::string>>
spy_calls() {
  std::lock_guard<std::mutex> lock(spy().mutex);
  std::tuple<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>, std::vector<std::string>>
      out;
  for (const auto& c : spy().calls) {
    std::get<0>(out).push_back(c.table);
    std::get<1>(out).push_back(c.direction);
    std::get<2>(out).push_back(c.total_bytes);
    std::get<3>(out).push_back(c.device);
  }
  return out;
}

// --- how engines are installed ------------------------------------------------------

// What an engine's import would raise when the core's engine interface is
// not `expected` ("" when it is).
std::string import_registry(int64_t expected) {
  return kvswap::registry_mismatch(static_cast<uint32_t>(expected));
}

// Installs, as an engine's library does, an engine whose setup fails;
// returns why the install failed, which that engine's import raises.
std::string install_failing_engine(const std::string& engine) {
  return kvswap::install_engine(device_type(engine), []() -> const EngineInterface& {
    throw std::runtime_error("the engine's setup failed (tests)");
  });
}

// Asks the core to install an engine without submit for `engine`.
void install_without_submit(const std::string& engine) {
  static const EngineInterface incomplete{
      "engine without submit (tests)", nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  g_registry->install(device_type(engine), &incomplete);
}

int64_t interface_version() { return kvswap::kEngineInterfaceVersion; }

// --- the core's internals ----------------------------------------------------------

std::vector<std::string> region_labels() { return g_hooks->region_labels(); }
int64_t region_table_work() { return g_hooks->region_table_work(); }
std::tuple<std::string, int64_t> host_copy_plan(int64_t total_bytes) {
  return g_hooks->host_copy_plan(total_bytes);
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> plan_swap_blocks_batch(const at::Tensor& src_ptrs,
                                                                      const at::Tensor& dst_ptrs,
                                                                      const at::Tensor& sizes,
                                                                      int64_t direction) {
  return g_hooks->plan_swap_blocks_batch(src_ptrs, dst_ptrs, sizes, direction);
}
at::Tensor expand_block_ids_aten(const at::Tensor& block_ids, int64_t factor, int64_t skip_count) {
  return g_hooks->expand_with_tensor_ops(block_ids, factor, skip_count);
}
std::string direction_name(int64_t direction) { return kvswap::direction_name(direction); }

}  // namespace
}  // namespace kvswap_test

// The module: the library links the core, whose registry and test hooks it
// takes while it loads (g_registry, g_hooks).
extern "C" PyMODINIT_FUNC PyInit__fake_cuda(void) {
  KVSWAP_MODULE_DEF(_fake_cuda);
  return kvswap::python::create_module(&module_def);
}

TORCH_LIBRARY(kvswap_test, m) {
  m.def(
      "submit(str engine, Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int direction, int total_bytes, "
      "Device device) -> ()");
  m.def("stream_capturing(str engine, Device device) -> bool");
  m.def("host_pinned(str engine, Tensor buffer, Device device) -> bool");
  m.def("host_mapped(str engine, Tensor[] tensors, Device device) -> bool");
  m.def(
      "copy_blocks(str engine, Tensor[] src_caches, Tensor(a!)[] dst_caches, Tensor src_block_ids, "
      "Tensor dst_block_ids) -> ()");
  m.def("spy_install(str engine, bool copy) -> ()");
  m.def("spy_uninstall() -> ()");
  m.def("spy_calls() -> (Tensor[], int[], int[], str[])");
  m.def("region_labels() -> str[]");
  m.def("region_table_work() -> int");
  m.def("host_copy_plan(int total_bytes) -> (str, int)");
  m.def(
      "plan_swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, int direction) -> "
      "(Tensor, Tensor, Tensor)");
  m.def("expand_block_ids_aten(Tensor block_ids, int block_size_factor, int skip_count=0) -> Tensor");
  m.def("direction_name(int direction) -> str");
  m.def("import_registry(int expected_version) -> str");
  m.def("install_failing_engine(str engine) -> str");
  m.def("install_without_submit(str engine) -> ()");
  m.def("interface_version() -> int");
}

TORCH_LIBRARY_IMPL(kvswap_test, CompositeExplicitAutograd, m) {
  m.impl("submit", &kvswap_test::submit);
  m.impl("stream_capturing", &kvswap_test::stream_capturing);
  m.impl("host_pinned", &kvswap_test::host_pinned);
  m.impl("host_mapped", &kvswap_test::host_mapped);
  m.impl("copy_blocks", &kvswap_test::copy_blocks);
  m.impl("spy_install", &kvswap_test::spy_install);
  m.impl("spy_uninstall", &kvswap_test::spy_uninstall);
  m.impl("spy_calls", &kvswap_test::spy_calls);
  m.impl("region_labels", &kvswap_test::region_labels);
  m.impl("region_table_work", &kvswap_test::region_table_work);
  m.impl("host_copy_plan", &kvswap_test::host_copy_plan);
  m.impl("expand_block_ids_aten", &kvswap_test::expand_block_ids_aten);
  m.impl("direction_name", &kvswap_test::direction_name);
  m.impl("import_registry", &kvswap_test::import_registry);
  m.impl("install_failing_engine", &kvswap_test::install_failing_engine);
  m.impl("install_without_submit", &kvswap_test::install_without_submit);
  m.impl("interface_version", &kvswap_test::interface_version);
}

// As the pointer op (csrc/core/registration_core.cpp): its descriptor tensors
// are CPU tensors, and any other device reaches the fake kernel
// (tests/extension_ops.py), as the op's does.
TORCH_LIBRARY_IMPL(kvswap_test, CPU, m) {
  m.impl("plan_swap_blocks_batch", &kvswap_test::plan_swap_blocks_batch);
}
