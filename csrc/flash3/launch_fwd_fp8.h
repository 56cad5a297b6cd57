// Host side of the forward kernel for e4m3 inputs (kernel_fwd.h with traits_fp8.h); each
// instantiation .cu includes this once for one (head dim, mask, variant).
#pragma once

#include <cuda_runtime.h>

#include "kernel_fwd.h"
#include "launch_kernel.h"
#include "params_fp8.h"
#include "traits_fp8.h"

namespace flash3 {

// kBlockN: 0 for the tile of TileConfigFp8, else another key tile. kPersistent: a
// persistent grid where the default is one CTA per tile (traits_fp8.h). kWarpgroups: 0
// for TileConfigFp8's number of consumer warpgroups, else another. The local mask
// (windows, softcap, sinks) takes the causal kernels' tiles, as in the 16-bit forward.
template <int kHeadDim, class Mask, int kBlockN, bool kPersistent = false, int kWarpgroups = 0>
cudaError_t run_fwd_fp8(FwdFp8Params const& params, cudaStream_t stream) {
  using Kernel =
      FlashFwdKernel<KernelTraitsFp8<kHeadDim, kVariableKeys<Mask>, kBlockN, kPersistent, kWarpgroups>, Mask>;
  auto kernel_params = Kernel::to_params(params);
  dim3 const grid = Kernel::Scheduler::grid(kernel_params.scheduler, params.num_sms);
  return launch_with_smem(&flash_fwd_kernel<Kernel>, grid, Kernel::kThreads, Kernel::kSharedStorageSize, stream,
                          kernel_params);
}

}  // namespace flash3

#define FLASH3_INSTANTIATE_FWD_FP8(HDIM, MASK, BLOCK_N) \
  template cudaError_t flash3::run_fwd_fp8<HDIM, flash3::MASK, BLOCK_N>(flash3::FwdFp8Params const&, cudaStream_t);
#define FLASH3_INSTANTIATE_FWD_FP8_PERSISTENT(HDIM, MASK, BLOCK_N, WARPGROUPS)                             \
  template cudaError_t flash3::run_fwd_fp8<HDIM, flash3::MASK, BLOCK_N, true, WARPGROUPS>(flash3::FwdFp8Params const&, \
                                                                                         cudaStream_t);
