// The launch every main kernel shares: opt in to its dynamic shared memory, launch after
// the previous kernel on the stream (grid_dependency.h: the kernels wait for it before
// they touch global memory), and return the launch status.
#pragma once

#include <cuda_runtime.h>

#include "grid_dependency.h"

namespace flash3 {

// kernel takes its Params by value (a __grid_constant__ parameter).
template <class Params>
cudaError_t launch_with_smem(void (*kernel)(Params), dim3 grid, dim3 block, int smem_bytes, cudaStream_t stream,
                             Params const& params) {
  // Above 48 KB a kernel must opt in to dynamic shared memory; the attribute is per
  // function and per device, cheap enough to set on every launch.
  cudaError_t const err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) { return err; }
  return launch_after_prior_grid(kernel, grid, block, smem_bytes, stream, params);
}

}  // namespace flash3
