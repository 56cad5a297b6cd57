// Programmatic dependent launch: a kernel of flash3 may start while the kernel before it on
// the stream is still running, so that its launch, its shared-memory set-up and its
// barrier initialisation overlap the previous kernel's end instead of following it. Used
// where a call is a chain of our kernels: the packed-batch forward after its tile table,
// a KV-cache decode step (query packing, attention, split merge). Dense calls and the
// backward launch as usual: with every kernel launched this way, triggering at its
// start, a dense 2 x 1024 forward ran 5% slower back to back and batch-1 decoding at 8k
// keys 1-6% slower after a foreign kernel (H100, docs/performance.md).
//
// The contract, for every kernel launched through launch_after_prior_grid:
// - it calls wait_for_prior_grids() before it reads or writes global memory (the wait
//   returns once the previous grid has completed and its writes are visible; without the
//   launch attribute it returns at once);
// - it calls allow_dependent_grids() when the next kernel may be scheduled: the next
//   kernel on the stream, if launched with the attribute, is scheduled once every CTA of
//   this grid has triggered or exited (a CTA's first trigger counts, from any thread), and
//   waits for this grid's completion in its own wait. The small kernels trigger at their
//   start; the attention kernel at its CTAs' last tile (kernel_fwd.h), so that the merge's
//   CTAs do not take SMs while attention tiles still wait for one.
// Kernels launched the ordinary way (PyTorch's, or ours without the attribute) are not
// overlapped: the next kernel then starts after them as usual.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace flash3 {

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launch kernel with the programmatic-serialisation attribute; kernel must honour the
// contract above.
template <class... KernelArgs, class... Args>
cudaError_t launch_after_prior_grid(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, int smem_bytes,
                                    cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem_bytes);
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace flash3
