// Host side of the forward kernel: builds the TMA descriptors, sizes the grid and
// launches (launch_kernel.h). Each instantiation .cu includes this once for one
// (element, head dim, mask).
#pragma once

#include <cuda_runtime.h>

#include "kernel_fwd.h"
#include "launch_kernel.h"
#include "params.h"
#include "traits.h"

namespace flash3 {

template <class Element, int kHeadDim, class Mask>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream) {
  using Kernel = FlashFwdKernel<KernelTraits<Element, kHeadDim, Mask::kIsCausal>, Mask>;
  auto kernel_params = Kernel::to_params(params);
  dim3 const grid = Kernel::Scheduler::grid(kernel_params.scheduler, params.num_sms);
  return launch_with_smem(&flash_fwd_kernel<Kernel>, grid, Kernel::kThreads, Kernel::kSharedStorageSize, stream,
                          kernel_params);
}

}  // namespace flash3

// One explicit instantiation per translation unit (csrc/instantiations/).
#define FLASH3_INSTANTIATE_FWD(ELEMENT, HDIM, MASK) \
  template cudaError_t flash3::run_fwd<ELEMENT, HDIM, flash3::MASK>(flash3::FwdParams const&, cudaStream_t);
