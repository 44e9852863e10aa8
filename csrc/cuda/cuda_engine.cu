// The CUDA engine: serves `kvswap::_submit`, `kvswap::_swap_blocks_kernel`
// and `kvswap::_host_register` under the CUDA key, on the current CUDA stream
// under a device guard. It is written against the CUDA runtime API and c10's
// device-generic stream access (plus c10/cuda's stream header for torch
// releases without c10::Stream::native_handle()), so CI can check it against
// a CPU build of torch.
//
// Paths:
//   batch     cudaMemcpyBatchAsync (CUDA 12.8+), one call per batch, for
//             every direction outside graph capture on a non-legacy stream;
//   fallback  one cudaMemcpyAsync per descriptor: on the legacy default
//             stream (which the batch API rejects), while the stream is being
//             captured (the batch API has no graph-node form), and with
//             toolkits older than 12.8;
//   kernel    `_swap_blocks_kernel`: a copy kernel that reads the block ids
//             from device memory when it runs and moves the bytes through
//             mapped pinned host memory (UVA). The core picks it for small
//             blocks or when asked (torch_kvswap.set_copy_method).
//
// Graph capture (docs/cuda.md): the fallback path records one memcpy node per
// descriptor, so a replay copies the same addresses that were captured; the
// kernel path records one kernel node per launch whose id tensors are read at
// replay, so a replay copies the ids the device tensors hold then.
//
// Descriptor lifetime: the batch path reads the core's descriptor table in
// place; the table tensors and the per-call attrs arrays are held by
// `in_flight()` until an event recorded after the submission has completed.
#include <c10/core/DeviceGuard.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
// CUDA builds of torch ship c10/cuda complete; CPU builds (CI's compile
// check) lack its generated config header. Needed only where c10::Stream
// has no native_handle() (torch 2.6, for one).
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define KVSWAP_HAVE_C10_CUDA 1
#endif
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <sstream>
#include <vector>

#include "../engine_common.h"
#include "../kvswap.h"
#include "../python_module.h"

KVSWAP_PYTHON_MODULE(_C_cuda)

namespace kvswap {
namespace {

#define KVSWAP_CUDA_CHECK(call, ...)                                                         \
  do {                                                                                       \
    const cudaError_t kvswap_err_ = (call);                                                  \
    TORCH_CHECK(kvswap_err_ == cudaSuccess, "kvswap CUDA engine: " #call " failed: ",      \
                cudaGetErrorName(kvswap_err_), " (", cudaGetErrorString(kvswap_err_), "). ", \
                ##__VA_ARGS__);                                                              \
  } while (0)

// The cudaStream_t behind a c10::Stream: c10::Stream::native_handle() where
// torch has it (recent releases); otherwise (torch 2.6, for one) through
// c10_cuda's stream pool.
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

cudaStream_t current_stream(c10::Device device) {
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
  return static_cast<cudaStream_t>(native_stream(stream, 0));
}

struct CudaRuntime {
  using Event = cudaEvent_t;
  using Stream = cudaStream_t;
  static Event create_event() {
    cudaEvent_t event = nullptr;
    KVSWAP_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event;
  }
  static void record(Event event, Stream stream) { KVSWAP_CUDA_CHECK(cudaEventRecord(event, stream)); }
  static bool completed(Event event) {
    const cudaError_t err = cudaEventQuery(event);
    if (err == cudaErrorNotReady) return false;
    KVSWAP_CUDA_CHECK(err);
    return true;
  }
};

constexpr int kMaxDevices = 64;

InFlightArrays<CudaRuntime>& in_flight(c10::DeviceIndex index) {
  static std::array<InFlightArrays<CudaRuntime>, kMaxDevices> per_device;
  TORCH_CHECK(index >= 0 && index < kMaxDevices, "kvswap CUDA engine: device index ", index,
              " out of range");
  return per_device[static_cast<size_t>(index)];
}

cudaMemcpyKind memcpy_kind(Direction direction) {
  switch (direction) {
    case Direction::kHostToDevice:
      return cudaMemcpyHostToDevice;
    case Direction::kDeviceToHost:
      return cudaMemcpyDeviceToHost;
    case Direction::kDeviceToDevice:
      return cudaMemcpyDeviceToDevice;
  }
  TORCH_CHECK(false, "unreachable direction");
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  KVSWAP_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

void copy_each(const CopyBatch& b, cudaStream_t stream) {
  const cudaMemcpyKind kind = memcpy_kind(b.direction);
  for (int64_t i = 0; i < b.count; ++i) {
    KVSWAP_CUDA_CHECK(cudaMemcpyAsync(as_ptr(b.dst[i]), as_ptr(b.src[i]), static_cast<size_t>(b.size[i]),
                                      kind, stream),
                      describe_descriptor(b, i));
  }
}

#if CUDART_VERSION >= 12080
void copy_batched(const CopyBatch& b, cudaStream_t stream, c10::DeviceIndex device,
                  std::vector<at::Tensor> keep_alive) {
  cudaMemcpyAttributes attr{};
  // STREAM: the source is read in stream order. ANY would let the copy read
  // the source before earlier work on the stream (the compute that produced
  // a stored block) has finished.
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagDefault;
  cudaMemLocation host{};
  host.type = cudaMemLocationTypeHost;
  cudaMemLocation dev{};
  dev.type = cudaMemLocationTypeDevice;
  dev.id = device;
  attr.srcLocHint = b.direction == Direction::kHostToDevice ? host : dev;
  attr.dstLocHint = b.direction == Direction::kDeviceToHost ? host : dev;

  auto args = BatchAttrs<cudaMemcpyAttributes>::per_descriptor(b.count, attr);
  const DescriptorArrays arrays = descriptor_arrays(b);
  const std::string what =
      std::to_string(b.count) + " descriptors (" + direction_name(static_cast<int64_t>(b.direction)) + ")";
#if CUDART_VERSION >= 13000
  KVSWAP_CUDA_CHECK(cudaMemcpyBatchAsync(arrays.dsts, const_cast<const void**>(arrays.srcs), arrays.sizes,
                                         static_cast<size_t>(b.count), args->attrs.data(),
                                         args->indexes.data(), args->attrs.size(), stream),
                    what);
#else
  size_t fail_index = SIZE_MAX;
  const cudaError_t err = cudaMemcpyBatchAsync(arrays.dsts, arrays.srcs, arrays.sizes,
                                               static_cast<size_t>(b.count), args->attrs.data(),
                                               args->indexes.data(), args->attrs.size(), &fail_index,
                                               stream);
  KVSWAP_CUDA_CHECK(err, what,
                    fail_index < static_cast<size_t>(b.count)
                        ? "; failed at " + describe_descriptor(b, static_cast<int64_t>(fail_index))
                        : std::string());
#endif
  in_flight(device).hold(stream, std::move(keep_alive), std::move(args));
}
#endif

void submit_cuda(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs, const at::Tensor& sizes,
                 int64_t direction, int64_t total_bytes, c10::Device device) {
  TORCH_CHECK(device.is_cuda(), "CUDA engine asked to copy on ", device);
  const CopyBatch batch = batch_from_tensors(src_ptrs, dst_ptrs, sizes, direction, total_bytes);
  c10::DeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);
#if CUDART_VERSION >= 12080
  const bool legacy_default = stream == nullptr || stream == cudaStreamLegacy;
  if (!legacy_default && !stream_is_capturing(stream)) {
    copy_batched(batch, stream, device.index(), {src_ptrs, dst_ptrs, sizes});
    return;
  }
#endif
  copy_each(batch, stream);
}

// --- kernel path ---------------------------------------------------------------

// One cache pair, as the kernel sees it. Addresses may be device memory or
// mapped pinned host memory (the same pointer under UVA).
struct PairArgs {
  const char* src;
  char* dst;
  int64_t src_stride;
  int64_t dst_stride;
  int64_t block_bytes;
  int64_t src_blocks;
  int64_t dst_blocks;
};

// Pairs per launch: the kernel parameters stay under the 4 KiB limit.
constexpr int kPairsPerLaunch = 48;

struct LaunchArgs {
  PairArgs pairs[kPairsPerLaunch];
};

// blockIdx.y picks the pair, blockIdx.x strides over the ids. The ids are
// read here, at run time, so a replayed graph copies the ids of the replay;
// an id out of range is skipped rather than written out of bounds.
__global__ void copy_blocks_kernel(LaunchArgs args, const int64_t* __restrict__ src_ids,
                                   const int64_t* __restrict__ dst_ids, int64_t n) {
  const PairArgs p = args.pairs[blockIdx.y];
  for (int64_t j = blockIdx.x; j < n; j += gridDim.x) {
    const int64_t s = src_ids[j];
    const int64_t d = dst_ids[j];
    if (s < 0 || s >= p.src_blocks || d < 0 || d >= p.dst_blocks) continue;
    const char* from = p.src + s * p.src_stride;
    char* to = p.dst + d * p.dst_stride;
    const bool aligned = ((reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to) |
                           static_cast<uintptr_t>(p.block_bytes)) & 15) == 0;
    if (aligned) {
      const int64_t words = p.block_bytes / 16;
      const uint4* f = reinterpret_cast<const uint4*>(from);
      uint4* t = reinterpret_cast<uint4*>(to);
      for (int64_t w = threadIdx.x; w < words; w += blockDim.x) t[w] = f[w];
    } else {
      for (int64_t b = threadIdx.x; b < p.block_bytes; b += blockDim.x) to[b] = from[b];
    }
  }
}

bool is_device_or_mapped(const void* ptr) {
  cudaPointerAttributes attrs{};
  KVSWAP_CUDA_CHECK(cudaPointerGetAttributes(&attrs, ptr));
  return attrs.type == cudaMemoryTypeDevice || attrs.type == cudaMemoryTypeManaged ||
         (attrs.type == cudaMemoryTypeHost && attrs.devicePointer == ptr);
}

void swap_blocks_kernel_cuda(at::TensorList src_caches, at::TensorList dst_caches,
                             const at::Tensor& src_block_ids, const at::Tensor& dst_block_ids) {
  const c10::Device device = src_block_ids.device();
  TORCH_CHECK(device.is_cuda() && dst_block_ids.device() == device,
              "kernel path: block ids must be on the CUDA device");
  const int64_t n = src_block_ids.numel();
  std::vector<PairArgs> pairs;
  for (size_t i = 0; i < src_caches.size(); ++i) {
    const auto& s = src_caches[i];
    const auto& d = dst_caches[i];
    const int64_t es = static_cast<int64_t>(s.element_size());
    const int64_t bb = s.dim() > 0 && s.size(0) > 0 ? s[0].numel() * es : 0;
    if (bb == 0) continue;
    for (const auto* t : {&s, &d}) {
      TORCH_CHECK_VALUE(t->numel() == 0 || is_device_or_mapped(t->const_data_ptr()),
                        t == &s ? "src_caches[" : "dst_caches[", i, "] is host memory the GPU cannot "
                        "address; the kernel path needs device memory or pinned host memory "
                        "(pin_memory=True, or registered); use set_copy_method('dma') otherwise");
    }
    pairs.push_back(PairArgs{static_cast<const char*>(s.const_data_ptr()), static_cast<char*>(d.data_ptr()),
                             s.stride(0) * es, d.stride(0) * es, bb, s.size(0), d.size(0)});
  }
  if (n == 0 || pairs.empty()) return;
  c10::DeviceGuard guard(device);
  cudaStream_t stream = current_stream(device);
  const unsigned grid_x = static_cast<unsigned>(std::min<int64_t>(n, 65535));
  for (size_t first = 0; first < pairs.size(); first += kPairsPerLaunch) {
    const size_t count = std::min<size_t>(kPairsPerLaunch, pairs.size() - first);
    LaunchArgs args{};
    std::copy_n(pairs.begin() + static_cast<std::ptrdiff_t>(first), count, args.pairs);
    copy_blocks_kernel<<<dim3(grid_x, static_cast<unsigned>(count)), 256, 0, stream>>>(
        args, src_block_ids.const_data_ptr<int64_t>(), dst_block_ids.const_data_ptr<int64_t>(), n);
    KVSWAP_CUDA_CHECK(cudaGetLastError(), "launching the block copy kernel for pairs ", first, "..",
                      first + count - 1);
  }
}

void host_register_cuda(const at::Tensor& buffer, c10::Device device, bool pin) {
  c10::DeviceGuard guard(device);
  void* ptr = buffer.data_ptr();
  if (pin) {
    // Mapped, so the kernel path can address it; portable, for every device.
    KVSWAP_CUDA_CHECK(cudaHostRegister(ptr, buffer.nbytes(), cudaHostRegisterMapped | cudaHostRegisterPortable),
                      "pinning ", buffer.nbytes(), " host bytes");
  } else {
    KVSWAP_CUDA_CHECK(cudaHostUnregister(ptr));
  }
}

}  // namespace
}  // namespace kvswap

TORCH_LIBRARY_IMPL(kvswap, CUDA, m) {
  m.impl("_submit", &kvswap::submit_cuda);
  m.impl("_swap_blocks_kernel", &kvswap::swap_blocks_kernel_cuda);
  m.impl("_host_register", &kvswap::host_register_cuda);
}
