// A minimal PrivateUse1 backend, renamed to "npu" by tests/fake_npu/fake_npu.py,
// so that swap_blocks, swap_blocks_batch and KVCacheOffloader reach the
// Ascend engine exactly as they do under torch_npu: through the dispatcher
// and torch's device guard. Written after PyTorch's open-registration test
// backend (test/cpp_extensions/open_registration_extension): device memory
// is host memory registered as device memory in the fake ACL registry.
//
// Ordering model: the fake ACL streams (fake_acl.h) are the backend's
// streams. A copy the engine queues lands only at a synchronization or an
// event query. Every other op on a device tensor runs at once, after the
// current stream of its device has drained, as if it were queued on that
// stream; a synchronizing op on a capturing stream fails, as in CANN.
#include <ATen/EmptyTensor.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <chrono>
#include <cstdlib>

#include "ascend/ascend_engine.h"
#include "fake_acl.h"
#include "python_module.h"

namespace kvswap {
namespace fake {
namespace {

constexpr c10::DeviceIndex kDevices = 2;
constexpr c10::DeviceType kNpu = c10::DeviceType::PrivateUse1;

Runtime& rt() { return Runtime::get(); }

thread_local c10::DeviceIndex tl_device = 0;
thread_local int64_t tl_stream[kDevices] = {0, 0};

int current_device() { return tl_device; }

c10::DeviceIndex index_of(c10::Device d) { return d.has_index() ? d.index() : tl_device; }

Stream* stream_of(const c10::Stream& s) { return rt().stream(s.device_index(), s.id()); }

Stream* current_stream(c10::DeviceIndex d) { return rt().stream(d, tl_stream[d]); }

// Before an op that runs at once on device `d`: what is queued on the
// current stream runs first. A synchronizing op is illegal while capturing
// (ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT, acl/error_codes/rt_error_codes.h:51).
void sync_current(c10::DeviceIndex d) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  Stream* s = current_stream(d);
  TORCH_CHECK(!rt().capturing(s), "fake NPU: synchronous operation on npu:", static_cast<int>(d),
              " while its current stream is being captured (ACL error 107030, "
              "ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT)");
  rt().drain(s);
}

// --- device guard -------------------------------------------------------------

struct FakeGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old(kNpu, tl_device);
    tl_device = index_of(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kNpu, tl_device); }
  void setDevice(c10::Device d) const override { tl_device = index_of(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override { tl_device = index_of(d); }
  c10::Stream getStream(c10::Device d) const override {
    const auto i = index_of(d);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNpu, i), tl_stream[i]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNpu, index_of(d)), 0);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    const auto i = index_of(d);
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNpu, i), rt().new_stream(i));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override { return getNewStream(d, 0); }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const c10::Stream old = getStream(s.device());
    tl_stream[s.device_index()] = s.id();
    return old;
  }
  // torch_npu returns NPUStream::stream(), null when draining its task queue
  // fails; null_stream_next models that once.
  void* getStreamNativeHandle(const c10::Stream s) const override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    if (rt().null_stream_next) {
      rt().null_stream_next = false;
      return nullptr;
    }
    return stream_of(s);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }
  // An event may be destroyed before its record has run; its resources go
  // when it completes [doc aclcppdevg_03_0082, aclrtDestroyEvent, CANN 8.0:
  // "支持在Event未完成前调用本接口销毁Event ... Event相关资源会在Event完成时被自动释放"].
  // torch's Stream.wait_stream does exactly that with its temporary event.
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    auto* e = static_cast<Event*>(event);
    if (e == nullptr) return;
    if (e->queued_records > 0) {
      e->destroyed = true;  // the last queued record frees it (a reset() drops it: a test-only leak)
    } else {
      delete e;
    }
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    if (*event == nullptr) *event = new Event();
    rt().record_event(static_cast<Event*>(*event), stream_of(stream));
  }
  void block(void* event, const c10::Stream& stream) const override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    auto* e = static_cast<Event*>(event);
    if (e == nullptr || !e->recorded) return;
    Stream* waited = e->stream;
    const uint64_t seq = e->seq;
    rt().enqueue(stream_of(stream), [waited, seq] { Runtime::get().drain(waited, seq); });
  }
  bool queryEvent(void* event) const override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    return event == nullptr || rt().query_event(static_cast<Event*>(event));
  }
  void synchronizeEvent(void* event) const override { queryEvent(event); }
  bool queryStream(const c10::Stream& stream) const override {
    synchronizeStream(stream);
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    rt().drain(stream_of(stream));
  }
  void synchronizeDevice(const c10::DeviceIndex d) const override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    rt().drain_device(d < 0 ? tl_device : d);
  }
  bool isStreamCapturing(const c10::Stream& stream) const override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    return rt().capturing(stream_of(stream));
  }
  double elapsedTime(void* a, void* b, const c10::DeviceIndex) const override {
    queryEvent(a);
    queryEvent(b);
    return static_cast<Event*>(b)->time_ms - static_cast<Event*>(a)->time_ms;
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeGuardImpl);

// --- memory -------------------------------------------------------------------------

// Device memory: host memory registered as device memory of the current
// device, 512-byte aligned like the NPU caching allocator's blocks. Freed
// memory is quarantined until reset(), so a copy still queued never writes
// into memory given back to the system.
std::vector<void*>& quarantine() {
  static auto* q = new std::vector<void*>();
  return *q;
}

void free_device(void* p) {
  if (p == nullptr) return;
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  rt().remove_region(p);
  quarantine().push_back(p);
}

struct FakeDeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    const size_t bytes = (std::max<size_t>(n, 1) + 511) / 512 * 512;
    void* p = std::aligned_alloc(512, bytes);
    TORCH_CHECK(p != nullptr, "fake NPU: out of memory");
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    rt().add_region(p, bytes, Kind::kDevice, tl_device);
    return {p, p, &free_device, c10::Device(kNpu, tl_device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_device; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};
FakeDeviceAllocator g_device_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_device_allocator);

// The pinned host allocator (what torch_npu's caching host allocator is to
// tensor.pin_memory()). A freed block is reused only once every stream it
// was recorded on (record_event) has run past that point; a block freed with
// no record is reused at once, so a copy still queued reads the next
// owner's data.
struct HostBlock {
  void* ptr;
  size_t bytes;
  std::vector<std::pair<Stream*, uint64_t>> uses;
};

struct FakeHostAllocator final : at::HostAllocator {
  std::map<void*, HostBlock> blocks;
  std::vector<void*> free_list;

  static void deleter(void* ctx);

  at::DataPtr allocate(size_t n) override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    const size_t bytes = (std::max<size_t>(n, 1) + 4095) / 4096 * 4096;
    for (auto it = free_list.begin(); it != free_list.end(); ++it) {
      HostBlock& b = blocks.at(*it);
      bool idle = b.bytes == bytes;
      for (const auto& [s, seq] : b.uses) idle = idle && s->executed >= seq;
      if (idle) {
        void* p = *it;
        free_list.erase(it);
        b.uses.clear();
        return {p, p, &deleter, c10::Device(c10::kCPU)};
      }
    }
    void* p = std::aligned_alloc(4096, bytes);
    TORCH_CHECK(p != nullptr, "fake NPU: out of pinned memory");
    blocks[p] = HostBlock{p, bytes, {}};
    rt().add_region(p, bytes, Kind::kPinned, -1);
    return {p, p, &deleter, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &deleter; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    auto it = blocks.find(ctx);
    if (it == blocks.end()) return false;
    Stream* s = stream_of(stream);
    it->second.uses.emplace_back(s, s->submitted);
    return true;
  }
  void empty_cache() override {}
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};
FakeHostAllocator g_host_allocator;

void FakeHostAllocator::deleter(void* ctx) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  g_host_allocator.free_list.push_back(ctx);
}

struct FakeHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    static const at::Generator generator = at::make_generator<at::CPUGeneratorImpl>();
    return generator;
  }
  at::Device getDeviceFromPtr(void* data) const override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    return c10::Device(kNpu, static_cast<c10::DeviceIndex>(std::max(0, rt().region_of(data).device)));
  }
  // As torch_npu answers through aclrtPointerGetAttributes: HOST for memory
  // pinned by the allocator or registered in place (pinned, mapped, or only
  // recorded: CANN reports all three as HOST, fake_acl.cpp location_of).
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::recursive_mutex> lock(rt().mutex);
    const Kind k = rt().region_of(data).kind;
    return k == Kind::kPinned || k == Kind::kMapped || k == Kind::kRecorded;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_host_allocator; }
  c10::DeviceIndex deviceCount() const override { return kDevices; }
  c10::DeviceIndex getCurrentDevice() const override { return tl_device; }
  void setCurrentDevice(c10::DeviceIndex d) const override { tl_device = d; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    const auto old = tl_device;
    tl_device = d;
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
};

// --- ATen kernels ---------------------------------------------------------------

struct AllocateOn {
  c10::DeviceIndex saved = tl_device;
  explicit AllocateOn(std::optional<c10::Device> d) {
    if (d.has_value() && d->has_index()) tl_device = d->index();
  }
  ~AllocateOn() { tl_device = saved; }
};

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device,
                               std::optional<bool>, std::optional<at::MemoryFormat> memory_format) {
  AllocateOn on(device);
  return at::detail::empty_generic(size, &g_device_allocator,
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout>, std::optional<at::Device> device, std::optional<bool>) {
  AllocateOn on(device);
  return at::detail::empty_strided_generic(size, stride, &g_device_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// A CPU tensor over the same memory as device tensor `t`.
at::Tensor cpu_alias(const at::Tensor& t) {
  if (t.device().type() != kNpu) return t;
  const size_t bytes =
      at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.element_size(), t.storage_offset());
  c10::Storage storage(c10::Storage::use_byte_size_t{}, bytes,
                       c10::DataPtr(t.storage().mutable_data(), c10::Device(c10::kCPU)), nullptr, false);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides());
  out.unsafeGetTensorImpl()->set_storage_offset(t.storage_offset());
  return out;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  if (self.device().type() == kNpu) sync_current(self.device().index());
  if (dst.device().type() == kNpu) sync_current(dst.device().index());
  cpu_alias(dst).copy_(cpu_alias(self));
  return dst;
}

const at::Tensor& resize_npu(const at::Tensor& self, c10::IntArrayRef size,
                             std::optional<at::MemoryFormat> format) {
  auto* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  at::native::maybe_resize_storage_cpu(impl, at::detail::computeStorageNbytesContiguous(
                                                 size, impl->dtype().itemsize(), impl->storage_offset()));
  if (format.has_value() && *format != at::MemoryFormat::Preserve) impl->empty_tensor_restride(*format);
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_npu(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Tensor& fill_scalar(at::Tensor& self, const at::Scalar& value) {
  sync_current(self.device().index());
  cpu_alias(self).fill_(value);
  return self;
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  sync_current(self.device().index());
  return cpu_alias(self).item();
}

at::Tensor& set_storage(at::Tensor& result, c10::Storage src) {
  const int64_t n = static_cast<int64_t>(src.nbytes() / result.dtype().itemsize());
  result.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(src));
  result.unsafeGetTensorImpl()->set_storage_offset(0);
  result.unsafeGetTensorImpl()->set_sizes_contiguous({n});
  return result;
}

at::Tensor& set_storage_offset(at::Tensor& result, c10::Storage storage, int64_t offset,
                               c10::IntArrayRef size, c10::IntArrayRef stride) {
  result.unsafeGetTensorImpl()->set_storage_keep_dtype(std::move(storage));
  result.unsafeGetTensorImpl()->set_storage_offset(offset);
  result.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride);
  return result;
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return set_storage_offset(self, source.storage(), source.storage_offset(), source.sizes(),
                            source.strides());
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

}  // namespace

}  // namespace fake
}  // namespace kvswap

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace kvswap::fake;
  m.impl("empty.memory_format", &empty_memory_format);
  m.impl("empty_strided", &empty_strided);
  m.impl("as_strided", &at::native::as_strided_tensorimpl);
  m.impl("view", &at::native::view);
  m.impl("_reshape_alias", &at::native::_reshape_alias);
  m.impl("resize_", &resize_npu);
  m.impl("_copy_from", &copy_from);
  m.impl("_copy_from_and_resize", &copy_from_and_resize);
  m.impl("fill_.Scalar", &fill_scalar);
  m.impl("_local_scalar_dense", &local_scalar_dense);
  m.impl("set_.source_Storage", &set_storage);
  m.impl("set_.source_Storage_storage_offset", &set_storage_offset);
  m.impl("set_.source_Tensor", &set_tensor);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&kvswap::fake::cpu_fallback>());
}

namespace kvswap {
namespace fake {
namespace {

FakeHooks g_hooks;

void install() {
  at::RegisterPrivateUse1HooksInterface(&g_hooks);
  at::setHostAllocator(kNpu, &g_host_allocator);
  set_current_device_source(&current_device);
}

void reset() {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  rt().reset();
  for (void* p : quarantine()) std::free(p);
  quarantine().clear();
  tl_device = 0;
  tl_stream[0] = tl_stream[1] = 0;
}

void set_absent(const std::vector<std::string>& names) {
  std::lock_guard<std::recursive_mutex> lock(rt().mutex);
  rt().absent = std::set<std::string>(names.begin(), names.end());
  rt().rebuild_table();
}

Stream* stream_at(int device, int64_t id) { return rt().stream(device, id); }

// Nanoseconds per Engine::submit of `n` descriptors (`direction` code) with
// the no-op ACL table (with or without the batch API), over `iters` calls.
double bench_submit(int64_t n, int64_t iters, int64_t direction, bool batch) {
  ascend::AclApi api = noop_table();
  if (!batch) api.memcpy_batch_async = nullptr;
  ascend::Engine engine(api);
  std::vector<int64_t> src(static_cast<size_t>(n)), dst(static_cast<size_t>(n)),
      size(static_cast<size_t>(n), 4096);
  for (int64_t i = 0; i < n; ++i) {
    src[static_cast<size_t>(i)] = 0x10000000 + i * 8192;
    dst[static_cast<size_t>(i)] = 0x40000000 + i * 8192;
  }
  CopyBatch b;
  b.src = src.data();
  b.dst = dst.data();
  b.size = size.data();
  b.count = n;
  b.total_bytes = n * 4096;
  b.direction = checked_direction(direction);
  const c10::Device device(kNpu, 0);
  for (int i = 0; i < 100; ++i) engine.submit(b, device);  // warm up
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) engine.submit(b, device);
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(iters);
}

// Nanoseconds per call of a no-op ACL function through the table: what the
// ACL calls themselves cost in bench_submit.
double bench_acl_call(int64_t iters) {
  const ascend::AclApi& api = noop_table();
  auto* volatile fn = api.memcpy_async;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    (void)fn(nullptr, 0, nullptr, 0, ascend::MemcpyKind::kHostToDevice, nullptr);
  }
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(iters);
}

// Calls the fake aclrtMemcpyBatchAsync directly. attrs: (dst type, dst id,
// src type, src id, rsv byte). Returns (error, failIndex).
py::tuple raw_batch(std::vector<int64_t> dsts, std::vector<size_t> dest_maxs, std::vector<int64_t> srcs,
                    std::vector<size_t> sizes, const std::vector<std::tuple<int, int, int, int, int>>& attrs,
                    std::vector<size_t> indexes, size_t num_attrs) {
  std::vector<ascend::MemcpyBatchAttr> a(attrs.size());
  for (size_t k = 0; k < attrs.size(); ++k) {
    const auto& [dt, di, st, si, rsv] = attrs[k];
    a[k] = ascend::MemcpyBatchAttr{};
    a[k].dstLoc = {static_cast<uint32_t>(di), static_cast<ascend::MemLocationType>(dt)};
    a[k].srcLoc = {static_cast<uint32_t>(si), static_cast<ascend::MemLocationType>(st)};
    a[k].rsv[3] = static_cast<uint8_t>(rsv);
  }
  size_t fail = 12345;
  const AclError err = fake_table().memcpy_batch_async(
      reinterpret_cast<void**>(dsts.data()), dest_maxs.data(), reinterpret_cast<void**>(srcs.data()),
      sizes.data(), sizes.size(), a.data(), indexes.data(), num_attrs, &fail, current_stream(0));
  return py::make_tuple(err, fail == SIZE_MAX ? -1 : static_cast<int64_t>(fail));
}

AclError raw_memcpy(int64_t dst, size_t dest_max, int64_t src, size_t count, int kind) {
  return fake_table().memcpy_async(reinterpret_cast<void*>(dst), dest_max, reinterpret_cast<const void*>(src),
                                   count, static_cast<ascend::MemcpyKind>(kind), current_stream(0));
}

}  // namespace
}  // namespace fake
}  // namespace kvswap

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace kvswap::fake;
  m.doc() = "Fake ACL runtime and fake 'npu' PrivateUse1 backend for testing the Ascend engine";
  install();
  // The engine's own table goes into the core, as _C_npu's import does.
  const std::string refused =
      kvswap::install_engine(c10::DeviceType::PrivateUse1, &kvswap::ascend::engine_interface);
  if (!refused.empty()) throw py::import_error(refused);
  m.def("reset", &reset, "forget faults, counts, captures, queued copies; new engine state");
  m.def("set_absent", &set_absent, "ACL functions missing from the engine's table from now on");
  m.def(
      "fail", [](const std::string& fn, int code, int64_t at_call) { rt().fail(fn, code, at_call); },
      py::arg("function"), py::arg("code"), py::arg("at_call") = -1);
  m.def("calls", [](const std::string& fn) { return rt().calls(fn); });
  m.def("null_stream_next", [] { rt().null_stream_next = true; });
  m.def("capture_begin", [](int d, int64_t s) { rt().capture_begin(stream_at(d, s)); });
  m.def("capture_end", [](int d, int64_t s) { return rt().capture_end(stream_at(d, s)); });
  m.def("set_capture_status",
        [](int d, int64_t s, int status) { stream_at(d, s)->capture = static_cast<CaptureStatus>(status); });
  m.def("replay", [](int graph, int d, int64_t s) { rt().replay(graph, stream_at(d, s)); });
  m.def("graph_size", [](int graph) { return rt().graph_size(graph); });
  m.def("pending", [](int d, int64_t s) { return rt().pending(d, s); });
  m.def("live_events", [] { return Event::live.load(); }, "events created and not yet freed");
  m.def("kind", [](int64_t ptr) { return rt().kind_name(reinterpret_cast<const void*>(ptr)); });
  m.def("last_batch", [] {
    const BatchCall& b = rt().last_batch;
    return py::make_tuple(b.num_batches, b.num_attrs, static_cast<int64_t>(b.dsts));
  });
  m.def("capture_state", [](int d, int64_t s) {
    return static_cast<int>(kvswap::ascend::engine().capture_state(stream_at(d, s)));
  });
  m.def("raw_batch", &raw_batch);
  m.def(
      "set_batch_route",
      [](const std::string& route, size_t ub_chunk) {
        TORCH_CHECK(route == "loop" || route == "ub", "route must be 'loop' or 'ub'");
        rt().batch_route = route == "loop" ? BatchRoute::kLoop : BatchRoute::kUb;
        rt().ub_chunk = ub_chunk;
      },
      py::arg("route"), py::arg("ub_chunk") = 0);
  m.def(
      "fail_entry",
      [](size_t entry, int code, int64_t at_call) {
        rt().entry_faults.push_back(EntryFault{entry, code, at_call});
      },
      py::arg("entry"), py::arg("code"), py::arg("at_call") = -1);
  m.def("refuse_batches_on_device", [](int d) { rt().batch_refused_devices.insert(d); });
  m.def(
      "refuse_batches_on_stream", [](int d, int64_t s) { rt().batch_refused_streams.insert({d, s}); },
      "the stream's captures are into a sub ACL graph: while capturing it refuses batches and "
      "host<->device copies with 207000");
  m.def("set_pin_records_only", [](bool on) { rt().pin_records_only = on; });
  m.def("set_register_does_nothing", [](bool on) { rt().register_does_nothing = on; });
  m.def("set_register_max_bytes", [](int64_t bytes) { rt().register_max_bytes = bytes; });
  m.def("registered_bytes", [] { return rt().registered_bytes; });
  m.def("set_work_entry_bytes", [](uint64_t bytes) { rt().work_entry_bytes = bytes; });
  m.def("graph_entries", [](int graph) { return rt().graph_entries(graph); });
  m.def("raw_pointer_attributes", [](int64_t ptr) {
    kvswap::ascend::PtrAttributes a{};
    const AclError err = rt().table().pointer_get_attributes(reinterpret_cast<const void*>(ptr), &a);
    return py::make_tuple(err, static_cast<int>(a.location.type), a.location.id);
  });
  m.def("raw_memcpy", &raw_memcpy);
  m.def(
      "raw_register",
      [](int64_t ptr, uint64_t bytes, bool pin) {
        void* p = reinterpret_cast<void*>(ptr);
        return pin ? rt().table().host_register_v2(p, bytes, kvswap::ascend::kHostRegPinned)
                   : rt().table().host_unregister(p);
      },
      "aclrtHostRegisterV2(ACL_HOST_REG_PINNED) or aclrtHostUnregister, not through the engine");
  m.def("bench_submit", &bench_submit);
  m.def("bench_acl_call", &bench_acl_call);
}
