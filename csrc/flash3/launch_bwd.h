// Host side of the backward pass: preprocess (dPsum, lse in log2), the main kernel,
// postprocess (dQ from its float32 workspace). Each instantiation .cu includes this once
// for one (element, head dim, mask).
#pragma once

#include <cuda_runtime.h>

#include "kernel_bwd.h"
#include "launch_kernel.h"
#include "params.h"
#include "prepost_bwd.h"
#include "traits_bwd.h"

namespace flash3 {

template <class Kernel>
cudaError_t run_bwd_with(BwdParams const& params, cudaStream_t stream) {
  static_assert(Kernel::Traits::kBlockM == bwd_block_m(Kernel::Traits::kHeadDim),
                "the binding sizes the dQ workspace by it");
  static_assert(128 % Kernel::Traits::kBlockM == 0, "seqlen_q_padded is a multiple of 128");
  cudaError_t err = run_bwd_preprocess<typename Kernel::Traits::Element>(params, stream);
  if (err != cudaSuccess) { return err; }

  err = launch_with_smem(&flash_bwd_kernel<Kernel>, Kernel::grid(params), Kernel::kThreads, Kernel::kSharedStorageSize,
                         stream, Kernel::to_params(params));
  if (err != cudaSuccess) { return err; }

  // The workspace's order is the launched kernel's (its dQ tiled MMA).
  return run_bwd_postprocess<typename Kernel::Traits>(params, stream);
}

// kHeadDimV: the head dim of V, O and dO (kHeadDim, or less: traits_bwd.h). hdim 256 takes
// the transposed 80-key kernel, and the 64-key one in deterministic mode (traits_bwd.h).
template <class Element, int kHeadDim, class Mask, int kHeadDimV>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream) {
  using Kernel = FlashBwdKernel<BwdKernelTraits<Element, kHeadDim, kVariableKeys<Mask>, kHeadDimV>, Mask>;
  if constexpr (kHeadDim == 256 && kHeadDimV == kHeadDim) {
    if (!params.deterministic) {
      using KernelTransposed =
          FlashBwdKernel<BwdKernelTraits<Element, kHeadDim, kVariableKeys<Mask>, kHeadDimV, /*kTransposed=*/true>, Mask>;
      return run_bwd_with<KernelTransposed>(params, stream);
    }
  }
  return run_bwd_with<Kernel>(params, stream);
}

}  // namespace flash3

#define FLASH3_INSTANTIATE_BWD_HDIMV(ELEMENT, HDIM, HDIMV, MASK) \
  template cudaError_t flash3::run_bwd<ELEMENT, HDIM, flash3::MASK, HDIMV>(flash3::BwdParams const&, cudaStream_t);
#define FLASH3_INSTANTIATE_BWD(ELEMENT, HDIM, MASK) FLASH3_INSTANTIATE_BWD_HDIMV(ELEMENT, HDIM, HDIM, MASK)
