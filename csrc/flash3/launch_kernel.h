// The launch every main kernel shares: opt in to its dynamic shared memory, launch, and
// return the launch status. Host code, free of torch.
#pragma once

#include <cuda_runtime.h>

#include "grid_dependency.h"

namespace flash3 {

// kernel takes its Params by value (a __grid_constant__ parameter). With
// after_prior_grid the kernel may start while the previous kernel on the stream runs
// (grid_dependency.h); the kernel must then honour that contract.
template <class Params>
cudaError_t launch_with_smem(void (*kernel)(Params), dim3 grid, dim3 block, int smem_bytes, cudaStream_t stream,
                             Params const& params, bool after_prior_grid = false) {
  // Above 48 KB a kernel must opt in to dynamic shared memory; the attribute is per
  // function and per device, cheap enough to set on every launch.
  cudaError_t const err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) { return err; }
  if (after_prior_grid) { return launch_after_prior_grid(kernel, grid, block, smem_bytes, stream, params); }
  kernel<<<grid, block, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flash3
