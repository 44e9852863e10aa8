// `_C_cuda`: binds the CUDA engine's host logic (cuda_engine.cpp) to libcudart
// and to torch's CUDA device and stream state, and installs it in the core
// for CUDA devices when the module is imported. Compiled by the host compiler; only copy_kernel.cu goes to
// nvcc.
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
// CUDA builds of torch ship c10/cuda complete; CPU builds (CI's compile
// check) lack its generated config header. Needed only where c10::Stream
// has no native_handle(): torch 2.10, the oldest release setup.py accepts,
// lacks it (its c10/core/Stream.h).
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define KVSWAP_HAVE_C10_CUDA 1
#endif

#include <cuda_runtime_api.h>

#include "../python_module.h"
#include "cuda_engine.h"

namespace kvswap {
namespace cuda {

// copy_kernel.cu
cudaError_t launch_copy_kernel(const CopyParams* params, unsigned grid_x, unsigned grid_y,
                               cudaStream_t stream);
cudaError_t launch_copy_kernel_large(const CopyParamsLarge* params, unsigned grid_x, unsigned grid_y,
                                     cudaStream_t stream);
bool large_params_built();

namespace {

// The cudaStream_t behind a c10::Stream: c10::Stream::native_handle() where
// torch has it (recent releases); otherwise through c10_cuda's stream pool.
// Not dead code: torch 2.10, the oldest declared release, has no
// native_handle() (its c10/core/Stream.h), so its CUDA builds take this path.
template <typename S>
auto native_stream(const S& stream, int) -> decltype(stream.native_handle()) {
  return stream.native_handle();
}
#ifdef KVSWAP_HAVE_C10_CUDA
template <typename S>
void* native_stream(const S& stream, long) {
  return c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).stream();
}
#endif

const c10::impl::DeviceGuardImplInterface* guard_impl() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

cudaStream_t current_stream(int device) {
  const c10::Stream stream =
      guard_impl()->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  return static_cast<cudaStream_t>(native_stream(stream, 0));
}

int exchange_device(int device) {
  return guard_impl()
      ->exchangeDevice(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)))
      .index();
}

#if CUDART_VERSION >= 13000
// CUDA 13 dropped failIdx: the table's is left as the caller set it.
cudaError_t batch_13(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                     cudaMemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs, size_t*,
                     cudaStream_t stream) {
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream);
}
MemcpyBatchFn batch_entry() { return &batch_13; }
#elif CUDART_VERSION >= 12080
// CUDA 12.8 and 12.9 declare the batch call with a failIdx output and
// non-const arrays; they are inputs all the same, passed in place (the
// engine holds them until the copies have run). failIdx, where the caller
// passes one, receives the runtime's answer.
cudaError_t batch_12x(void* const* dsts, const void* const* srcs, const size_t* sizes, size_t count,
                      cudaMemcpyAttributes* attrs, size_t* attrs_idxs, size_t num_attrs, size_t* fail_idx,
                      cudaStream_t stream) {
  size_t unused = SIZE_MAX;
  return cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs), const_cast<size_t*>(sizes),
                              count, attrs, attrs_idxs, num_attrs, fail_idx != nullptr ? fail_idx : &unused,
                              stream);
}
MemcpyBatchFn batch_entry() { return &batch_12x; }
#else
MemcpyBatchFn batch_entry() { return nullptr; }
#endif

const CudaApi& real_api() {
  static const CudaApi table = [] {
    CudaApi t{};
    t.current_stream = &current_stream;
    t.exchange_device = &exchange_device;
    t.get_last_error = &cudaGetLastError;
    t.get_error_name = &cudaGetErrorName;
    t.get_error_string = &cudaGetErrorString;
    t.runtime_get_version = &cudaRuntimeGetVersion;
    t.driver_get_version = &cudaDriverGetVersion;
    t.memcpy_async = &cudaMemcpyAsync;
    t.memcpy_batch_async = batch_entry();
    t.stream_is_capturing = &cudaStreamIsCapturing;
    t.thread_exchange_stream_capture_mode = &cudaThreadExchangeStreamCaptureMode;
    t.event_create_with_flags = &cudaEventCreateWithFlags;
    t.event_record = &cudaEventRecord;
    t.event_query = &cudaEventQuery;
    t.pointer_get_attributes = &cudaPointerGetAttributes;
    t.host_register = &cudaHostRegister;
    t.host_unregister = &cudaHostUnregister;
    t.device_get_attribute = &cudaDeviceGetAttribute;
    t.launch_copy = &launch_copy_kernel;
    t.launch_copy_large = large_params_built() ? &launch_copy_kernel_large : nullptr;
    return t;
  }();
  return table;
}

}  // namespace
}  // namespace cuda
}  // namespace kvswap

namespace kvswap {
namespace cuda {
namespace {

const EngineInterface& bound_engine() {
  set_cuda_api(&real_api());
  return engine_interface();
}

}  // namespace
}  // namespace cuda
}  // namespace kvswap

KVSWAP_ENGINE_MODULE(_C_cuda, c10::DeviceType::CUDA, kvswap::cuda::bound_engine())
