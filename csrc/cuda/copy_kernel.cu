// The block-copy kernel and its launcher: the only code of the CUDA engine
// that nvcc compiles. The body lives in copy_kernel.h, which the fake
// runtime's kernel launch also runs on the host (tests/fake_cuda/).
#include <cuda_runtime.h>

#include "copy_kernel.h"

namespace kvswap {
namespace cuda {

__global__ void __launch_bounds__(kCopyThreads) copy_blocks_kernel(const CopyParams p) {
  const int64_t items = work_items(p);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    copy_item(p, static_cast<int>(blockIdx.y), item, static_cast<int>(threadIdx.x),
              static_cast<int>(blockDim.x));
  }
}

// The launch entry of the real runtime table (cuda_api_real.cpp). Returns the
// launch's own error; cudaLaunchKernel does not report an earlier call's.
cudaError_t launch_copy_kernel(const CopyParams* params, unsigned grid_x, unsigned grid_y,
                               cudaStream_t stream) {
  void* args[] = {const_cast<CopyParams*>(params)};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&copy_blocks_kernel), dim3(grid_x, grid_y),
                          dim3(kCopyThreads), args, 0, stream);
}

}  // namespace cuda
}  // namespace kvswap
