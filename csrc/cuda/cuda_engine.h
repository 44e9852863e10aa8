// The seam of the CUDA engine: its host logic (cuda_engine.cpp) calls the CUDA
// runtime, and torch's CUDA stream and device state, only through the table
// below. `_C_cuda` binds the table to libcudart and torch (cuda_api_real.cpp);
// the tests bind it to a fake runtime on host memory (tests/fake_cuda/) and
// compile the same cuda_engine.cpp against it. Kernel launch is one entry.
//
// The types are the CUDA runtime's own (cuda_runtime_api.h, plain C: the host
// compiler reads it without nvcc).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../kvswap.h"
#include "copy_kernel.h"

namespace kvswap {
namespace cuda {

// cudaMemcpyBatchAsync as CUDA 13 declares it (cuda_runtime_api.h:6435),
// plus CUDA 12.8/12.9's failIdx output: where the runtime has one it
// receives the index of the copy that failed; CUDA 13 has none and leaves it.
using MemcpyBatchFn = cudaError_t (*)(void* const* dsts, const void* const* srcs, const size_t* sizes,
                                      size_t count, cudaMemcpyAttributes* attrs, size_t* attrs_idxs,
                                      size_t num_attrs, size_t* fail_idx, cudaStream_t stream);

struct CudaApi {
  // torch's state: the current stream of a device (torch's, not the
  // runtime's), and the current device (exchange: set it, return the old).
  cudaStream_t (*current_stream)(int device);
  int (*exchange_device)(int device);

  // The runtime, one entry per function of the same name.
  cudaError_t (*get_last_error)();
  const char* (*get_error_name)(cudaError_t);
  const char* (*get_error_string)(cudaError_t);
  cudaError_t (*runtime_get_version)(int*);
  cudaError_t (*driver_get_version)(int*);
  cudaError_t (*memcpy_async)(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t);
  MemcpyBatchFn memcpy_batch_async;  // null when the build's toolkit lacks it (< 12.8)
  cudaError_t (*stream_is_capturing)(cudaStream_t, cudaStreamCaptureStatus*);
  cudaError_t (*thread_exchange_stream_capture_mode)(cudaStreamCaptureMode*);
  cudaError_t (*event_create_with_flags)(cudaEvent_t*, unsigned int);
  cudaError_t (*event_record)(cudaEvent_t, cudaStream_t);
  cudaError_t (*event_query)(cudaEvent_t);
  cudaError_t (*pointer_get_attributes)(cudaPointerAttributes*, const void*);
  cudaError_t (*host_register)(void*, size_t, unsigned int);
  cudaError_t (*host_unregister)(void*);
  cudaError_t (*device_get_attribute)(int*, cudaDeviceAttr, int);

  // Launches copy_blocks_kernel (copy_kernel.cu) with kCopyThreads threads.
  cudaError_t (*launch_copy)(const CopyParams* params, unsigned grid_x, unsigned grid_y, cudaStream_t stream);
  // The same kernel with the 32,764-byte parameter block (copy_kernel.h);
  // null when the build has none (a toolkit before 12.1, or device code for
  // an architecture before sm_70).
  cudaError_t (*launch_copy_large)(const CopyParamsLarge* params, unsigned grid_x, unsigned grid_y,
                                   cudaStream_t stream);
};

// Binds the engine to a runtime table (kept, not copied). Rebinding resets
// the engine's per-process state (batch API resolution and latches, kernel
// parameter sizes, descriptor tables held in flight).
void set_cuda_api(const CudaApi* api);

// The engine's table for the core (kvswap.h), over the runtime bound last.
const EngineInterface& engine_interface();

// The engine's entries, as engine_interface() lists them.
void submit_cuda(const CopyBatch& batch, c10::Device device);
void swap_blocks_kernel_cuda(at::TensorList src_caches, at::TensorList dst_caches,
                             const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids);
bool stream_capturing_cuda(c10::Device device);
bool host_mapped_cuda(at::TensorList tensors, c10::Device device);
void host_register_cuda(const at::Tensor& buffer, c10::Device device, bool pin);

// Descriptors per cudaMemcpyBatchAsync call (cuda_engine.cpp, max_batch):
// 8,192 unless KVSWAP_CUDA_MAX_BATCH_DESCRIPTORS, read when the engine is
// bound, says otherwise. The setter overrides both until the next binding;
// it refuses a count below 1.
void set_max_batch_descriptors(int64_t count);
int64_t max_batch_descriptors();

// For tests: batches whose descriptor arrays the engine still holds on a
// device, whether the batch API is in use there, and the size of the kernel
// parameter block the engine launches with there.
size_t batches_in_flight(int device);
bool batch_api_enabled(int device);
int kernel_param_bytes(int device);

}  // namespace cuda
}  // namespace kvswap
