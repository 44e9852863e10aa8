// The block-copy kernel and its launchers: the only code of the CUDA engine
// that nvcc compiles. The body lives in copy_kernel.h, which the fake
// runtime's kernel launch also runs on the host (tests/fake_cuda/).
#include <cuda_runtime.h>

#include <type_traits>

#include "copy_kernel.h"

namespace kvswap {
namespace cuda {

namespace {

// The large parameter block needs a 12.1+ toolkit and device code for sm_70
// or newer only: below Volta the limit stays 4 KiB, so a kernel taking more
// does not compile for those architectures. __CUDA_ARCH_LIST__ (nvcc 11.5+)
// lists every architecture of the build, alike in the host and the device
// passes, so the kernel's signature below does not depend on the pass
// (a __global__ function's type may not depend on __CUDA_ARCH__: CUDA C++
// Programming Guide, "__CUDA_ARCH__").
constexpr int min_arch() {
#if defined(__CUDA_ARCH_LIST__)
  constexpr int archs[] = {__CUDA_ARCH_LIST__};
  int low = archs[0];
  for (int a : archs) low = a < low ? a : low;
  return low;
#else
  return 0;
#endif
}
constexpr bool kLargeBuilt = CUDART_VERSION >= 12010 && min_arch() >= 700;
// Without large parameters the second kernel takes the small block and is
// never launched (the launcher below is null).
using LargeOrSmall = std::conditional_t<kLargeBuilt, CopyParamsLarge, CopyParams>;

template <class P>
__device__ __forceinline__ void run(const P& p) {
  const int64_t items = work_items(p);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    copy_item(p, static_cast<int>(blockIdx.y), item, static_cast<int>(threadIdx.x),
              static_cast<int>(blockDim.x));
  }
}

}  // namespace

__global__ void __launch_bounds__(kCopyThreads) copy_blocks_kernel(const CopyParams p) { run(p); }

__global__ void __launch_bounds__(kCopyThreads) copy_blocks_kernel_large(const LargeOrSmall p) { run(p); }

// The launch entries of the real runtime table (cuda_api_real.cpp). Each
// returns cudaLaunchKernel's answer, which may be an error of an earlier
// asynchronous launch rather than this one's (cuda_runtime_api.h:3757,
// \notefnerr, which the runtime API reference renders as "this function may
// also return error codes from previous, asynchronous launches"); the engine
// reports it as this launch's failure and says which launches were queued
// before it.
cudaError_t launch_copy_kernel(const CopyParams* params, unsigned grid_x, unsigned grid_y,
                               cudaStream_t stream) {
  void* args[] = {const_cast<CopyParams*>(params)};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&copy_blocks_kernel), dim3(grid_x, grid_y),
                          dim3(kCopyThreads), args, 0, stream);
}

cudaError_t launch_copy_kernel_large(const CopyParamsLarge* params, unsigned grid_x, unsigned grid_y,
                                     cudaStream_t stream) {
  void* args[] = {const_cast<CopyParamsLarge*>(params)};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&copy_blocks_kernel_large), dim3(grid_x, grid_y),
                          dim3(kCopyThreads), args, 0, stream);
}

// Whether copy_blocks_kernel_large takes the large block (else the table has
// no large launcher).
bool large_params_built() { return kLargeBuilt; }

}  // namespace cuda
}  // namespace kvswap
