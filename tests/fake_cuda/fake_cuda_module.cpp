// `torch_kvswap._fake_cuda` (tests only; built when KVSWAP_BUILD_FAKES=1):
// the CUDA engine's host logic (csrc/cuda/cuda_engine.cpp, the same source as
// `_C_cuda`) bound to the fake runtime of fake_cuda_runtime.cpp, and the ops
// that let tests/test_cuda_fake.py drive both through `torch.ops.kvswap_fake_cuda`.
//
// Nothing serves CUDA devices until `install()`; `uninstall()`
// removes it again, so the rest of the suite sees a CPU-only torch. While
// installed: the engine's table serves CUDA devices in the core,
// and `aten::_to_copy` has a CUDA kernel that copies through the fake runtime
// as torch's copy does (cudaMemcpyAsync on the current stream, then
// cudaStreamSynchronize), so a core path that reads device ids back meets
// the fake's capture rules. "CUDA" tensors are fake device memory wrapped
// with at::from_blob and a CUDA device.
#include <ATen/ATen.h>
// GCC warns that the header's alignas(hardware_destructive_interference_size)
// may change between compilers; only the allocator's interface is used.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"
#endif
#include <ATen/core/CachingHostAllocator.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/strides.h>
#include <torch/library.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../../csrc/python_module.h"
#include "fake_cuda_runtime.h"
#include "test_extension.h"

namespace {

// Whether the engine is installed in the core's registry, and the CUDA
// engine it replaced.
bool g_installed = false;
const kvswap::EngineInterface* g_replaced = nullptr;
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
                        std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>,
                        bool, std::optional<at::MemoryFormat>) {
  TORCH_CHECK(!dtype.has_value() || *dtype == self.scalar_type(),
              "fake CUDA: _to_copy cannot convert dtypes");
  TORCH_CHECK(self.is_contiguous(), "fake CUDA: _to_copy needs a contiguous tensor");
  const auto target = device.value_or(self.device());
  const auto bytes = self.nbytes();
  if (self.is_cuda() && target.is_cpu()) {
    auto out = at::empty(self.sizes(), self.options().device(at::kCPU));
    const cudaStream_t stream = fake_cuda::current_stream(self.device().index());
    check(
        fake_cuda::memcpy_async(out.data_ptr(), self.const_data_ptr(), bytes, cudaMemcpyDeviceToHost, stream),
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

// --- torch's CUDA device guard and pinned host allocator, as the core uses them ---

// The core asks the guard for the current stream of a device (to tell the
// pinned allocator which stream uses a host block): torch's current stream
// here is the fake runtime's (fake_cuda::current_stream).
struct FakeGuard final : c10::impl::DeviceGuardImplInterface {
  static thread_local c10::DeviceIndex device;
  c10::DeviceType type() const override { return c10::kCUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old(c10::kCUDA, device);
    device = d.index();
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(c10::kCUDA, device); }
  void setDevice(c10::Device d) const override { device = d.index(); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { device = d.index(); }
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(
        c10::Stream::UNSAFE, d,
        static_cast<c10::StreamId>(reinterpret_cast<intptr_t>(fake_cuda::current_stream(d.index()))));
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::Stream old = getStream(s.device());
    fake_cuda::set_current_stream(s.device_index(),
                                  reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(s.id())));
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 2; }
};
thread_local c10::DeviceIndex FakeGuard::device = 0;
FakeGuard g_guard;

// What torch's pinned host allocator does for tensor.pin_memory(): a freed
// block is handed out again only once every stream it was recorded on
// (record_event) has run past the recording; a block freed without a record
// is handed out at once, so a copy still queued reads its next owner's data.
struct FakePinnedAllocator final : at::HostAllocator {
  struct Block {
    size_t bytes;
    std::vector<std::pair<cudaStream_t, uint64_t>> uses;
  };
  std::mutex mu;
  std::map<void*, Block> blocks;
  std::vector<void*> free_list;
  int64_t recorded = 0;

  static void deleter(void* ctx);

  at::DataPtr allocate(size_t n) override {
    std::lock_guard<std::mutex> lock(mu);
    const size_t bytes = (std::max<size_t>(n, 1) + 4095) / 4096 * 4096;
    for (auto it = free_list.begin(); it != free_list.end(); ++it) {
      Block& b = blocks.at(*it);
      bool idle = b.bytes == bytes;
      for (const auto& [s, at] : b.uses) idle = idle && fake_cuda::stream_reached(s, at);
      if (idle) {
        void* p = *it;
        free_list.erase(it);
        b.uses.clear();
        return {p, p, &deleter, c10::Device(c10::kCPU)};
      }
    }
    void* p = fake_cuda::host_alloc(bytes);
    blocks[p] = Block{bytes, {}};
    return {p, p, &deleter, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &deleter; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    std::lock_guard<std::mutex> lock(mu);
    auto it = blocks.find(ctx);
    if (it == blocks.end()) return false;
    const auto s = reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(stream.id()));
    it->second.uses.emplace_back(s, fake_cuda::stream_position(s));
    ++recorded;
    return true;
  }
  void empty_cache() override {}
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};
FakePinnedAllocator g_pinned;

void FakePinnedAllocator::deleter(void* ctx) {
  std::lock_guard<std::mutex> lock(g_pinned.mu);
  g_pinned.free_list.push_back(ctx);
}

// A pinned host tensor from the fake allocator (tensor.pin_memory()'s kind).
at::Tensor pinned_empty(at::IntArrayRef shape) {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  const auto bytes = static_cast<size_t>(n);
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, g_pinned.allocate(bytes), nullptr, false);
  return at::empty({0}, at::kByte).set_(storage, 0, shape, c10::contiguous_strides(shape));
}

void install() {
  if (g_installed) return;
  c10::impl::registerDeviceGuard(c10::kCUDA, &g_guard);
  at::setHostAllocator(c10::kCUDA, &g_pinned, 255);
  fake_cuda::reset(2);
  kvswap::cuda::set_cuda_api(fake_cuda::fake_table());
  g_replaced = kvswap_test::g_registry->install(c10::DeviceType::CUDA, &kvswap::cuda::engine_interface());
  g_installed = true;
  g_aten_lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::CUDA,
                                                __FILE__, __LINE__);
  g_aten_lib->impl("_to_copy", &fake_to_copy);
  // Views touch no data: CPU's kernels serve fake CUDA tensors as they are.
  g_aten_lib->impl("as_strided", [](const at::Tensor& self, c10::SymIntArrayRef size,
                                    c10::SymIntArrayRef stride, std::optional<c10::SymInt> offset) {
    return at::_ops::as_strided::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), self, size, stride,
                                            offset);
  });
  g_aten_lib->impl("view", [](const at::Tensor& self, c10::SymIntArrayRef size) {
    return at::_ops::view::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), self, size);
  });
}

void uninstall() {
  if (g_installed) kvswap_test::g_registry->install(c10::DeviceType::CUDA, g_replaced);
  g_installed = false;
  g_aten_lib.reset();
  // The rest of the suite sees a CPU-only torch again.
  at::setHostAllocator(c10::kCUDA, nullptr, 255);
  c10::impl::registerDeviceGuard(c10::kCUDA, nullptr);
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

void set_stream(int64_t device, int64_t stream) {
  fake_cuda::set_current_stream(static_cast<int>(device), as_stream(stream));
}

std::string synchronize(int64_t stream) {
  return fake_cuda::error_name(fake_cuda::stream_synchronize(as_stream(stream)));
}

std::string begin_capture(int64_t stream, int64_t mode) {
  return fake_cuda::error_name(
      fake_cuda::begin_capture(as_stream(stream), static_cast<cudaStreamCaptureMode>(mode)));
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
  return fake_cuda::error_name(
      fake_cuda::graph_launch(reinterpret_cast<cudaGraphExec_t>(exec), as_stream(stream)));
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
  } else if (name == "batch_fail_call") {
    f.batch_fail_call = value;
  } else if (name == "memcpy_fail_at") {
    f.memcpy_fail_at = value;
  } else if (name == "launch_fail_at") {
    f.launch_fail_at = value;
  } else if (name == "host_register_error") {
    f.host_register_error = err;
  } else if (name == "host_register_max_bytes") {
    f.host_register_max_bytes = value;
  } else if (name == "runtime_version") {
    f.runtime_version = static_cast<int>(value);
  } else if (name == "driver_version") {
    f.driver_version = static_cast<int>(value);
  } else if (name == "stalled") {
    f.stalled = value != 0;
  } else if (name == "scribble_arrays") {
    f.scribble_arrays = value != 0;
  } else if (name == "compute_major") {
    f.compute_major = static_cast<int>(value);
  } else if (name == "large_params_absent") {
    f.large_params_absent = value != 0;
  } else if (name == "reports_fail_index") {
    f.reports_fail_index = value != 0;
  } else if (name == "refuse_device") {
    f.refuse_device = static_cast<int>(value);
  } else if (name == "pointer_query_unsafe") {
    f.pointer_query_unsafe = value != 0;
  } else if (name.substr(0, 5) == "fail:") {
    f.fail[std::string(name.substr(5))] = err;
  } else {
    TORCH_CHECK_VALUE(false, "unknown fault ", name);
  }
}

// Direct runtime calls, for tests of the fake's own rules.
std::string pointer_query(int64_t ptr) {
  cudaPointerAttributes attrs{};
  return fake_cuda::error_name(
      fake_cuda::fake_table()->pointer_get_attributes(&attrs, reinterpret_cast<void*>(ptr)));
}

std::string memcpy_sync(int64_t dst, int64_t src, int64_t bytes, int64_t kind) {
  return fake_cuda::error_name(
      fake_cuda::memcpy_sync(reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src),
                             static_cast<size_t>(bytes), static_cast<cudaMemcpyKind>(kind)));
}

std::string memcpy_on(int64_t dst, int64_t src, int64_t bytes, int64_t kind, int64_t stream) {
  return fake_cuda::error_name(fake_cuda::memcpy_async(
      reinterpret_cast<void*>(dst), reinterpret_cast<void*>(src), static_cast<size_t>(bytes),
      static_cast<cudaMemcpyKind>(kind), as_stream(stream)));
}

// cudaMemcpyBatchAsync with the rows of `table` ([3, n] int64: dst, src,
// size) as its arrays, in place, as the engine passes the core's table; one
// attrs entry. Changing `table` before the copies run is what the fake's
// lifetime rule reports.
std::string batch_copy(const at::Tensor& table, int64_t stream, int64_t order, int64_t num_attrs,
                       int64_t first_index) {
  const int64_t n = table.size(1);
  auto* rows = table.data_ptr<int64_t>();
  std::vector<cudaMemcpyAttributes> attrs(static_cast<size_t>(std::max<int64_t>(num_attrs, 1)));
  std::vector<size_t> idxs(attrs.size());
  for (size_t k = 0; k < attrs.size(); ++k) {
    attrs[k].srcAccessOrder = static_cast<cudaMemcpySrcAccessOrder>(order);
    idxs[k] = static_cast<size_t>(first_index) + k;
  }
  return fake_cuda::error_name(fake_cuda::fake_table()->memcpy_batch_async(
      reinterpret_cast<void* const*>(rows), reinterpret_cast<const void* const*>(rows + n),
      reinterpret_cast<const size_t*>(rows + 2 * n), static_cast<size_t>(n), attrs.data(), idxs.data(),
      static_cast<size_t>(num_attrs), nullptr, as_stream(stream)));
}

// The large-parameter launch entry, with no pair and no id: the fake's
// parameter-size rule alone decides.
std::string launch_large_empty(int64_t stream) {
  auto params = std::make_unique<kvswap::cuda::CopyParamsLarge>();
  params->num_pairs = 1;
  return fake_cuda::error_name(
      fake_cuda::fake_table()->launch_copy_large(params.get(), 1, 1, as_stream(stream)));
}

// Events through the table, as the engine uses them: handles as ints.
std::tuple<std::string, int64_t> event_create() {
  cudaEvent_t e = nullptr;
  const cudaError_t err = fake_cuda::fake_table()->event_create_with_flags(&e, cudaEventDisableTiming);
  return {fake_cuda::error_name(err), reinterpret_cast<int64_t>(e)};
}

std::string event_record(int64_t event, int64_t stream) {
  return fake_cuda::error_name(
      fake_cuda::fake_table()->event_record(reinterpret_cast<cudaEvent_t>(event), as_stream(stream)));
}

std::string event_query(int64_t event) {
  return fake_cuda::error_name(fake_cuda::fake_table()->event_query(reinterpret_cast<cudaEvent_t>(event)));
}

std::tuple<std::string, int64_t> stream_capture_status(int64_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = fake_cuda::fake_table()->stream_is_capturing(as_stream(stream), &status);
  return {fake_cuda::error_name(err), static_cast<int64_t>(status)};
}

std::tuple<std::string, int64_t> device_attribute(int64_t attr, int64_t device) {
  int value = -1;
  const cudaError_t err = fake_cuda::fake_table()->device_get_attribute(
      &value, static_cast<cudaDeviceAttr>(attr), static_cast<int>(device));
  return {fake_cuda::error_name(err), value};
}

// The small-parameter launch entry with no pair and no id, and a grid of
// the caller's choosing: the fake's configuration rules alone decide.
std::string launch_empty(int64_t stream, int64_t grid_x, int64_t grid_y, int64_t num_pairs) {
  kvswap::cuda::CopyParams params{};
  params.num_pairs = static_cast<int32_t>(num_pairs);
  return fake_cuda::error_name(fake_cuda::fake_table()->launch_copy(
      &params, static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y), as_stream(stream)));
}

std::string host_register_raw(int64_t ptr, int64_t bytes, bool pin) {
  const auto* t = fake_cuda::fake_table();
  return fake_cuda::error_name(
      pin ? t->host_register(reinterpret_cast<void*>(ptr), static_cast<size_t>(bytes), 0)
          : t->host_unregister(reinterpret_cast<void*>(ptr)));
}

// Every entry of the no-op table once (the overhead bench uses a few).
int64_t noop_calls() {
  const auto* t = fake_cuda::noop_table();
  int64_t failures = 0;
  int v = 0;
  cudaPointerAttributes attrs{};
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaEvent_t e = nullptr;
  failures += t->host_register(nullptr, 0, 0) != cudaSuccess;
  failures += t->host_unregister(nullptr) != cudaSuccess;
  failures += t->pointer_get_attributes(&attrs, &v) != cudaSuccess;
  failures += t->thread_exchange_stream_capture_mode(&mode) != cudaSuccess;
  failures += t->event_create_with_flags(&e, 0) != cudaSuccess;
  failures += t->event_record(e, nullptr) != cudaSuccess;
  failures += t->event_query(e) != cudaSuccess;
  failures += t->device_get_attribute(&v, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess;
  failures += t->launch_copy_large(nullptr, 1, 1, nullptr) != cudaSuccess;
  failures += t->get_last_error() != cudaSuccess;
  failures += std::string(t->get_error_string(cudaSuccess)) != "cudaSuccess";
  return failures;
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

std::vector<int64_t> launch_param_bytes() {
  std::vector<int64_t> out;
  for (const auto& l : fake_cuda::launches()) out.push_back(l.param_bytes);
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
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
         static_cast<double>(iters);
}

// Times the engine's submit entry (called directly, no dispatcher) and its
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
  // The batches the core would hand over, made outside the timed loop.
  auto batch_of = [](const at::Tensor& t) {
    const int64_t n = t.size(1);
    const int64_t* rows = t.const_data_ptr<int64_t>();
    return kvswap::CopyBatch{rows, rows + n, rows + 2 * n, n, n * 64, kvswap::Direction::kHostToDevice, t};
  };
  const auto r1 = batch_of(one);
  const auto rn = batch_of(many);
  auto run = [&](const kvswap::CopyBatch& b) { kvswap::cuda::submit_cuda(b, device); };
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
                  sink = sink + static_cast<int>(memcpy_fn(reinterpret_cast<void*>(0x10),
                                                           reinterpret_cast<const void*>(0x20), 64,
                                                           cudaMemcpyHostToDevice, nullptr));
                }));
  kvswap::cuda::set_cuda_api(fake_cuda::noop_table());
  // Kernel path: one pair, 2 KiB blocks, host ids (inline parameters).
  auto dev = at::for_blob(reinterpret_cast<void*>(0x100000), {1 << 16, 512})
                 .deleter([](void*) {})
                 .options(at::TensorOptions().dtype(at::kFloat).device(device))
                 .target_device(device)
                 .make_tensor();
  auto host = at::from_blob(
      reinterpret_cast<void*>(0x200000), {1 << 16, 512}, [](void*) {}, at::TensorOptions().dtype(at::kFloat));
  auto ids1 = at::zeros({1}, at::kLong);
  auto idsn = at::arange(descriptors, at::kLong);
  std::vector<at::Tensor> src{dev};
  std::vector<at::Tensor> dst{host};
  out.push_back(
      1e9 * seconds_per_call(iters, [&] { kvswap::cuda::swap_blocks_kernel_cuda(src, dst, ids1, ids1); }));
  out.push_back(1e9 * seconds_per_call(iters / 16 + 1,
                                       [&] { kvswap::cuda::swap_blocks_kernel_cuda(src, dst, idsn, idsn); }));
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
  m.def("current_stream(int device) -> int",
        [](int64_t d) { return reinterpret_cast<int64_t>(fake_cuda::current_stream(static_cast<int>(d))); });
  m.def("current_device() -> int", [] { return static_cast<int64_t>(fake_cuda::current_device()); });
  m.def("set_device(int device) -> ()", [](int64_t d) { fake_cuda::set_device(static_cast<int>(d)); });
  m.def("synchronize(int stream) -> str", &synchronize);
  m.def("begin_capture(int stream, int mode) -> str", &begin_capture);
  m.def("end_capture(int stream) -> (str, int)", &end_capture);
  m.def("instantiate(int graph) -> int", &instantiate);
  m.def("launch_graph(int exec, int stream) -> str", &launch_graph);
  m.def("graph_nodes(int exec) -> int", [](int64_t exec) {
    return static_cast<int64_t>(fake_cuda::graph_node_count(reinterpret_cast<cudaGraphExec_t>(exec)));
  });
  m.def("exchange_capture_mode(int mode) -> int", &exchange_capture_mode);
  m.def("set_fault(str name, int value) -> ()", &set_fault);
  m.def("last_error(bool peek) -> str", &last_error);
  m.def("call_log() -> str[]", [] { return fake_cuda::call_log(); });
  m.def("count_calls(str api) -> int", &count_calls);
  m.def("host_register_bytes() -> int", [] { return fake_cuda::host_register_bytes(); });
  m.def("violations() -> str[]", [] { return fake_cuda::violations(); });
  m.def("launches() -> int[]", &launches);
  m.def("batches() -> int[]", &batches);
  m.def("launch_param_bytes() -> int[]", &launch_param_bytes);
  m.def("pinned_empty(int[] shape) -> Tensor", &pinned_empty);
  m.def("pointer_query(int ptr) -> str", &pointer_query);
  m.def("memcpy_sync(int dst, int src, int bytes, int kind) -> str", &memcpy_sync);
  m.def("memcpy_on(int dst, int src, int bytes, int kind, int stream) -> str", &memcpy_on);
  m.def("batch_copy(Tensor table, int stream, int order=1, int num_attrs=1, int first_index=0) -> str",
        &batch_copy);
  m.def("launch_large_empty(int stream) -> str", &launch_large_empty);
  m.def("event_create() -> (str, int)", &event_create);
  m.def("event_record(int event, int stream) -> str", &event_record);
  m.def("event_query(int event) -> str", &event_query);
  m.def("stream_capture_status(int stream) -> (str, int)", &stream_capture_status);
  m.def("device_attribute(int attr, int device) -> (str, int)", &device_attribute);
  m.def("launch_empty(int stream, int grid_x, int grid_y, int num_pairs) -> str", &launch_empty);
  m.def("host_register_raw(int ptr, int bytes, bool pin) -> str", &host_register_raw);
  m.def("noop_calls() -> int", &noop_calls);
  m.def("pinned_records() -> int", [] { return g_pinned.recorded; });
  m.def("kernel_param_bytes(int device) -> int", [](int64_t d) {
    return static_cast<int64_t>(kvswap::cuda::kernel_param_bytes(static_cast<int>(d)));
  });
  m.def("copy_widths() -> int[]", [] { return fake_cuda::copy_widths(); });
  m.def("in_flight(int device) -> int",
        [](int64_t d) { return static_cast<int64_t>(kvswap::cuda::batches_in_flight(static_cast<int>(d))); });
  m.def("set_max_batch(int count) -> ()", [](int64_t n) { kvswap::cuda::set_max_batch_descriptors(n); });
  m.def("max_batch() -> int", [] { return kvswap::cuda::max_batch_descriptors(); });
  m.def("batch_enabled(int device) -> bool",
        [](int64_t d) { return kvswap::cuda::batch_api_enabled(static_cast<int>(d)); });
  m.def("bench_overhead(int descriptors, int iters) -> float[]", &bench_overhead);
}
