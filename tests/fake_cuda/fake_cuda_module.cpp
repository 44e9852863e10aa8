// `torch_kvswap._fake_cuda` (tests only; built when KVSWAP_BUILD_FAKES=1):
// the CUDA engine's host logic (csrc/cuda/cuda_engine.cpp, the same source as
// `_C_cuda`) bound to the fake runtime of fake_cuda_runtime.cpp, and the ops
// that let tests/test_cuda_fake.py drive both through `torch.ops.kvswap_fake_cuda`.
//
// Nothing is registered under the CUDA key until `install()`; `uninstall()`
// removes it again, so the rest of the suite sees a CPU-only torch. While
// installed: the engine's kernels serve `kvswap::_submit` & co. under CUDA,
// and `aten::_to_copy` has a CUDA kernel that copies through the fake runtime
// as torch's copy does (cudaMemcpyAsync on the current stream, then
// cudaStreamSynchronize), so a core path that reads device ids back meets
// the fake's capture rules. "CUDA" tensors are fake device memory wrapped
// with at::from_blob and a CUDA device.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "../../csrc/python_module.h"
#include "fake_cuda_runtime.h"

KVSWAP_PYTHON_MODULE(_fake_cuda)

namespace {

std::unique_ptr<torch::Library> g_engine_lib;
std::unique_ptr<torch::Library> g_aten_lib;

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "fake CUDA: ", what, " failed: ", fake_cuda::error_name(err));
}

at::Tensor wrap_device(void* ptr, at::IntArrayRef shape, at::ScalarType dtype, int64_t device) {
  // An explicit target device: from_blob would otherwise ask CUDA's hooks
  // which device owns the pointer.
  const c10::Device where(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
  return at::for_blob(ptr, shape)
      .deleter([](void* p) { fake_cuda::device_free(p); })
      .options(at::TensorOptions().dtype(dtype).device(where))
      .target_device(where)
      .make_tensor();
}

// aten::_to_copy for fake CUDA tensors, as torch's blocking copy does it.
at::Tensor fake_to_copy(const at::Tensor& self, std::optional<at::ScalarType> dtype,
                        std::optional<at::Layout>, std::optional<at::Device> device,
                        std::optional<bool>, bool, std::optional<at::MemoryFormat>) {
  TORCH_CHECK(!dtype.has_value() || *dtype == self.scalar_type(), "fake CUDA: _to_copy cannot convert dtypes");
  TORCH_CHECK(self.is_contiguous(), "fake CUDA: _to_copy needs a contiguous tensor");
  const auto target = device.value_or(self.device());
  const auto bytes = self.nbytes();
  if (self.is_cuda() && target.is_cpu()) {
    auto out = at::empty(self.sizes(), self.options().device(at::kCPU));
    const cudaStream_t stream = fake_cuda::current_stream(self.device().index());
    check(fake_cuda::memcpy_async(out.data_ptr(), self.const_data_ptr(), bytes, cudaMemcpyDeviceToHost, stream),
          "cudaMemcpyAsync (device to host)");
    check(fake_cuda::stream_synchronize(stream), "cudaStreamSynchronize");
    return out;
  }
  TORCH_CHECK(target.is_cuda(), "fake CUDA: _to_copy from ", self.device(), " to ", target);
  const auto index = target.has_index() ? target.index() : 0;
  auto out = wrap_device(fake_cuda::device_malloc(bytes, index), self.sizes(), self.scalar_type(), index);
  const auto src = self.contiguous();
  const cudaStream_t stream = fake_cuda::current_stream(index);
  check(fake_cuda::memcpy_async(out.data_ptr(), src.const_data_ptr(), bytes,
                                self.is_cuda() ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync (to device)");
  check(fake_cuda::stream_synchronize(stream), "cudaStreamSynchronize");
  return out;
}

void install() {
  if (g_engine_lib) return;
  fake_cuda::reset(2);
  kvswap::cuda::set_cuda_api(fake_cuda::fake_table());
  g_engine_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "kvswap", c10::DispatchKey::CUDA,
                                                  __FILE__, __LINE__);
  kvswap::cuda::register_cuda_engine(*g_engine_lib);
  g_aten_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::CUDA,
                                                __FILE__, __LINE__);
  g_aten_lib->impl("_to_copy", &fake_to_copy);
  // Views touch no data: CPU's kernels serve fake CUDA tensors as they are.
  g_aten_lib->impl("as_strided", [](const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                                    std::optional<c10::SymInt> offset) {
    return at::_ops::as_strided::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), self, size, stride, offset);
  });
  g_aten_lib->impl("view", [](const at::Tensor& self, c10::SymIntArrayRef size) {
    return at::_ops::view::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), self, size);
  });
}

void uninstall() {
  g_engine_lib.reset();
  g_aten_lib.reset();
}

void reset(int64_t devices) {
  fake_cuda::reset(static_cast<int>(devices));
  kvswap::cuda::set_cuda_api(fake_cuda::fake_table());
}

// Rebinds the engine after a change of the batch-entry fault (the engine
// resolves the batch API once per binding).
void rebind() { kvswap::cuda::set_cuda_api(fake_cuda::fake_table()); }

at::Tensor device_copy(const at::Tensor& cpu, int64_t device) {
  const auto src = cpu.contiguous();
  void* p = fake_cuda::device_malloc(src.nbytes(), static_cast<int>(device));
  std::memcpy(p, src.const_data_ptr(), src.nbytes());  // test setup: lands at once
  return wrap_device(p, src.sizes(), src.scalar_type(), device);
}

at::Tensor pinned_copy(const at::Tensor& cpu) {
  const auto src = cpu.contiguous();
  void* p = fake_cuda::host_alloc(src.nbytes());
  std::memcpy(p, src.const_data_ptr(), src.nbytes());
  return at::from_blob(p, src.sizes(), [](void* q) { fake_cuda::host_free(q); }, src.options());
}

// The bytes of a fake device tensor as they are now (stale until the stream
// that writes them has run), as a CPU alias.
at::Tensor host_view(const at::Tensor& t) {
  at::Tensor keep = t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [keep](void*) {}, t.options().device(at::kCPU));
}

int64_t create_stream(int64_t device, bool blocking) {
  return reinterpret_cast<int64_t>(fake_cuda::stream_create(static_cast<int>(device), blocking));
}

cudaStream_t as_stream(int64_t s) { return reinterpret_cast<cudaStream_t>(s); }

void set_stream(int64_t device, int64_t stream) { fake_cuda::set_current_stream(static_cast<int>(device), as_stream(stream)); }

std::string synchronize(int64_t stream) { return fake_cuda::error_name(fake_cuda::stream_synchronize(as_stream(stream))); }

std::string begin_capture(int64_t stream, int64_t mode) {
  return fake_cuda::error_name(fake_cuda::begin_capture(as_stream(stream), static_cast<cudaStreamCaptureMode>(mode)));
}

std::tuple<std::string, int64_t> end_capture(int64_t stream) {
  cudaGraph_t graph = nullptr;
  const cudaError_t err = fake_cuda::end_capture(as_stream(stream), &graph);
  return {fake_cuda::error_name(err), reinterpret_cast<int64_t>(graph)};
}

int64_t instantiate(int64_t graph) {
  cudaGraphExec_t exec = nullptr;
  check(fake_cuda::graph_instantiate(&exec, reinterpret_cast<cudaGraph_t>(graph)), "cudaGraphInstantiate");
  return reinterpret_cast<int64_t>(exec);
}

std::string launch_graph(int64_t exec, int64_t stream) {
  return fake_cuda::error_name(fake_cuda::graph_launch(reinterpret_cast<cudaGraphExec_t>(exec), as_stream(stream)));
}

int64_t exchange_capture_mode(int64_t mode) {
  auto m = static_cast<cudaStreamCaptureMode>(mode);
  check(fake_cuda::exchange_capture_mode(&m), "cudaThreadExchangeStreamCaptureMode");
  return static_cast<int64_t>(m);
}

void set_fault(c10::string_view name, int64_t value) {
  auto& f = fake_cuda::faults();
  const auto err = static_cast<cudaError_t>(value);
  if (name == "batch_absent") {
    f.batch_absent = value != 0;
  } else if (name == "batch_error") {
    f.batch_error = err;
  } else if (name == "batch_fail_at") {
    f.batch_fail_at = value;
  } else if (name == "memcpy_fail_at") {
    f.memcpy_fail_at = value;
  } else if (name == "host_register_error") {
    f.host_register_error = err;
  } else if (name == "runtime_version") {
    f.runtime_version = static_cast<int>(value);
  } else if (name == "driver_version") {
    f.driver_version = static_cast<int>(value);
  } else if (name == "stalled") {
    f.stalled = value != 0;
  } else if (name == "scribble_arrays") {
    f.scribble_arrays = value != 0;
  } else if (name.substr(0, 5) == "fail:") {
    f.fail[std::string(name.substr(5))] = err;
  } else {
    TORCH_CHECK_VALUE(false, "unknown fault ", name);
  }
}

std::string last_error(bool peek) { return fake_cuda::error_name(fake_cuda::get_last_error(peek)); }

int64_t count_calls(c10::string_view api) { return fake_cuda::count_calls(std::string(api)); }

std::vector<int64_t> launches() {
  std::vector<int64_t> out;
  for (const auto& l : fake_cuda::launches()) {
    out.insert(out.end(), {l.grid_x, l.grid_y, l.n, l.slices, l.num_pairs, l.inline_src, l.inline_dst});
  }
  return out;
}

std::vector<int64_t> batches() {
  std::vector<int64_t> out;
  for (const auto& b : fake_cuda::batches()) {
    out.insert(out.end(), {static_cast<int64_t>(b.count), static_cast<int64_t>(b.num_attrs),
                           static_cast<int64_t>(b.first_index), b.src_access_order});
  }
  return out;
}

// --- engine overhead against the no-op runtime ---------------------------------

double seconds_per_call(int64_t iters, const std::function<void()>& fn) {
  for (int i = 0; i < 100; ++i) fn();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / static_cast<double>(iters);
}

// Times the engine's `_submit` kernel (called directly, no dispatcher) and its
// kernel path against the no-op runtime, and the no-op runtime's own calls.
// Returns, in nanoseconds: [batch path per call (1 descriptor), batch path
// with `descriptors`, per-descriptor path per call (1 descriptor), per-
// descriptor path with `descriptors`, one no-op runtime call, kernel path
// with host ids per call (1 id), kernel path with `descriptors` host ids].
std::vector<double> bench_overhead(int64_t descriptors, int64_t iters) {
  kvswap::cuda::set_cuda_api(fake_cuda::noop_table());
  const c10::Device device(c10::kCUDA, 0);
  auto table = [](int64_t n) {
    auto t = at::empty({3, n}, at::kLong);
    t[0].fill_(0x10000);
    t[1].fill_(0x20000);
    t[2].fill_(64);
    return t;
  };
  auto one = table(1);
  auto many = table(descriptors);
  std::vector<double> out;
  // Row views are made outside the timed loop.
  auto r1 = std::vector<at::Tensor>{one[0], one[1], one[2]};
  auto rn = std::vector<at::Tensor>{many[0], many[1], many[2]};
  auto run = [&](const std::vector<at::Tensor>& r) {
    kvswap::cuda::submit_cuda(r[0], r[1], r[2], 0, r[2].numel() * 64, device);
  };
  out.push_back(1e9 * seconds_per_call(iters, [&] { run(r1); }));
  out.push_back(1e9 * seconds_per_call(iters / 16 + 1, [&] { run(rn); }));
  // The no-op table's current stream is not the legacy one; switch the table
  // to the legacy stream for the per-descriptor path.
  kvswap::cuda::CudaApi legacy = *fake_cuda::noop_table();
  legacy.current_stream = [](int) -> cudaStream_t { return nullptr; };
  kvswap::cuda::set_cuda_api(&legacy);
  out.push_back(1e9 * seconds_per_call(iters, [&] { run(r1); }));
  out.push_back(1e9 * seconds_per_call(iters / 16 + 1, [&] { run(rn); }));
  const auto memcpy_fn = legacy.memcpy_async;
  volatile int sink = 0;
  out.push_back(1e9 * seconds_per_call(iters * 16, [&] {
    sink = sink + static_cast<int>(memcpy_fn(reinterpret_cast<void*>(0x10), reinterpret_cast<const void*>(0x20), 64,
                                             cudaMemcpyHostToDevice, nullptr));
  }));
  kvswap::cuda::set_cuda_api(fake_cuda::noop_table());
  // Kernel path: one pair, 2 KiB blocks, host ids (inline parameters).
  auto dev = at::for_blob(reinterpret_cast<void*>(0x100000), {1 << 16, 512})
                 .deleter([](void*) {})
                 .options(at::TensorOptions().dtype(at::kFloat).device(device))
                 .target_device(device)
                 .make_tensor();
  auto host = at::from_blob(reinterpret_cast<void*>(0x200000), {1 << 16, 512}, [](void*) {},
                            at::TensorOptions().dtype(at::kFloat));
  auto ids1 = at::zeros({1}, at::kLong);
  auto idsn = at::arange(descriptors, at::kLong);
  std::vector<at::Tensor> src{dev};
  std::vector<at::Tensor> dst{host};
  out.push_back(1e9 * seconds_per_call(iters, [&] { kvswap::cuda::swap_blocks_kernel_cuda(src, dst, ids1, ids1); }));
  out.push_back(1e9 * seconds_per_call(iters / 16 + 1, [&] { kvswap::cuda::swap_blocks_kernel_cuda(src, dst, idsn, idsn); }));
  kvswap::cuda::set_cuda_api(fake_cuda::fake_table());
  return out;
}

}  // namespace

TORCH_LIBRARY(kvswap_fake_cuda, m) {
  m.def("install() -> ()", &install);
  m.def("uninstall() -> ()", &uninstall);
  m.def("reset(int devices=2) -> ()", &reset);
  m.def("rebind() -> ()", &rebind);
  m.def("device_copy(Tensor cpu, int device=0) -> Tensor", &device_copy);
  m.def("pinned_copy(Tensor cpu) -> Tensor", &pinned_copy);
  m.def("host_view(Tensor t) -> Tensor", &host_view);
  m.def("create_stream(int device=0, bool blocking=False) -> int", &create_stream);
  m.def("set_stream(int device, int stream) -> ()", &set_stream);
  m.def("current_device() -> int", [] { return static_cast<int64_t>(fake_cuda::current_device()); });
  m.def("synchronize(int stream) -> str", &synchronize);
  m.def("begin_capture(int stream, int mode) -> str", &begin_capture);
  m.def("end_capture(int stream) -> (str, int)", &end_capture);
  m.def("instantiate(int graph) -> int", &instantiate);
  m.def("launch_graph(int exec, int stream) -> str", &launch_graph);
  m.def("exchange_capture_mode(int mode) -> int", &exchange_capture_mode);
  m.def("set_fault(str name, int value) -> ()", &set_fault);
  m.def("last_error(bool peek) -> str", &last_error);
  m.def("call_log() -> str[]", [] { return fake_cuda::call_log(); });
  m.def("count_calls(str api) -> int", &count_calls);
  m.def("violations() -> str[]", [] { return fake_cuda::violations(); });
  m.def("launches() -> int[]", &launches);
  m.def("batches() -> int[]", &batches);
  m.def("copy_widths() -> int[]", [] { return fake_cuda::copy_widths(); });
  m.def("in_flight(int device) -> int",
        [](int64_t d) { return static_cast<int64_t>(kvswap::cuda::batches_in_flight(static_cast<int>(d))); });
  m.def("batch_enabled(int device) -> bool",
        [](int64_t d) { return kvswap::cuda::batch_api_enabled(static_cast<int>(d)); });
  m.def("bench_overhead(int descriptors, int iters) -> float[]", &bench_overhead);
}
