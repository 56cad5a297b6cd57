// Host side of the forward kernel: builds the TMA descriptors, sizes the grid and
// launches (launch_kernel.h). Each instantiation .cu includes this once for one
// (element, head dim, mask).
#pragma once

#include <cuda_runtime.h>

#include "kernel_fwd.h"
#include "launch_kernel.h"
#include "params.h"
#include "traits.h"
#include "variant_fwd.h"

namespace flash3 {

// One kernel of (element, head dims, mask): its tile configuration (short-sequence or
// general) and batch layout (dense or packed). kHeadDimV: the head dim of V and O.
template <class Element, int kHeadDim, class Mask, bool kShortSeq, bool kVarlen, int kHeadDimV>
cudaError_t launch_fwd_tiles(FwdParams const& params, cudaStream_t stream) {
  using Kernel =
      FlashFwdKernel<KernelTraits<Element, kHeadDim, kVariableKeys<Mask>, kShortSeq, kHeadDimV>, Mask, kVarlen>;
  auto kernel_params = Kernel::to_params(params);
  dim3 const grid = Kernel::Scheduler::grid(kernel_params.scheduler, params.num_sms);
  if (cudaError_t const status = Kernel::prepare(params, stream); status != cudaSuccess) { return status; }
  // Packed batches usually follow a kernel of ours (the tile table, or the KV cache's
  // query packing) and overlap its end; dense calls launch as usual.
  return launch_with_smem(&flash_fwd_kernel<Kernel>, grid, Kernel::kThreads, Kernel::kSharedStorageSize, stream,
                          kernel_params, /*after_prior_grid=*/kVarlen);
}

template <class Element, int kHeadDim, class Mask, bool kShortSeq, int kHeadDimV>
cudaError_t launch_fwd_layout(FwdParams const& params, cudaStream_t stream) {
  return params.is_varlen() ? launch_fwd_tiles<Element, kHeadDim, Mask, kShortSeq, true, kHeadDimV>(params, stream)
                            : launch_fwd_tiles<Element, kHeadDim, Mask, kShortSeq, false, kHeadDimV>(params, stream);
}

// Whether a causal call keeps the persistent short tile over the longer range
// (traits.h kDenseCausalShortMaxSeqlen): where its grid has at least two tiles per SM,
// for dense batches and for packed batches of self-attention (no split-KV parts, pages
// or packed query heads). Packed batches of unequal lengths walk their tile table there
// with claimed entries (scheduler_packed.h): on long-tailed mixes the static snake over
// the table had run 8-22% below one CTA per entry; the claims run ahead of it
// (docs/performance.md).
inline bool causal_long_range(FwdParams const& params, int block_m) {
  int64_t const tiles = int64_t((params.seqlen_q + block_m - 1) / block_m) * params.nheads * params.batch;
  if (tiles < 2 * int64_t(params.num_sms)) { return false; }
  if (!params.is_varlen()) { return true; }
  return !params.split_keys && params.page_table == nullptr && params.rows_per_query == 1 &&
         params.seqlen_q == params.seqlen_k;
}

// Whether each query tile walks the keys of the causal mask: the causal mask, or a local
// mask (softcap or sinks with causal) whose window reaches back to every key and ends at
// the diagonal (the binding clamps an unbounded side to the longest sequence).
template <class Mask>
bool walks_causal_keys(FwdParams const& params) {
  if constexpr (Mask::kIsCausal) {
    return true;
  } else if constexpr (Mask::kIsLocal) {
    return params.window_right == 0 && params.window_left >= params.seqlen_k;
  } else {
    return false;
  }
}

// The kernel for (element, head dim, mask): the short-sequence tile where one exists and
// both lengths (for packed batches, the longest sequence's) are short enough (for causal
// key ranges, causal_long_range's), or, for the local mask, its window spans few enough
// keys (traits.h); the general one otherwise. The
// choice is variant_fwd.h's, as for the FP8 kernels' variants (dispatch_fp8.cu).
template <class Element, int kHeadDim, class Mask, int kHeadDimV>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream) {
  constexpr bool kHasShortTile = kHeadDimV == kHeadDim && (Mask::kIsLocal ? kHasLocalShortTile<kHeadDim>
                                                                          : kHasShortSeqTile<kHeadDim, Mask::kIsCausal>);
  if constexpr (kHasShortTile) {
    // Softcap at hdim 256 keeps the general tile (traits.h kLocalShortTileTakesSoftcap).
    bool const short_tile_takes_call =
        !(Mask::kIsLocal && !kLocalShortTileTakesSoftcap<kHeadDim> && params.has_softcap());
    constexpr int kMaxSeqlen = kShortSeqMaxSeqlen<kHeadDim, kVariableKeys<Mask>>;
    constexpr int kShortBlockM = KernelTraits<Element, kHeadDim, kVariableKeys<Mask>, true, kHeadDimV>::kBlockM;
    int const max_seqlen = walks_causal_keys<Mask>(params) && causal_long_range(params, kShortBlockM)
                               ? kDenseCausalShortMaxSeqlen<kHeadDim>
                               : kMaxSeqlen;
    // Each side of a window is at most the longest sequence (api.cpp clamps it).
    FwdVariantLengths const lengths =
        Mask::kIsLocal ? local_variant_lengths(params.seqlen_q, params.seqlen_k, params.window_left,
                                               params.window_right, kMaxSeqlen)
                       : FwdVariantLengths{params.seqlen_q, params.seqlen_k};
    // Two variants, the general one serving every length: the short one wherever it serves.
    if (short_tile_takes_call && short_seq_bounds(max_seqlen).serves(lengths.seqlen_q, lengths.seqlen_k)) {
      return launch_fwd_layout<Element, kHeadDim, Mask, true, kHeadDimV>(params, stream);
    }
  }
  return launch_fwd_layout<Element, kHeadDim, Mask, false, kHeadDimV>(params, stream);
}

}  // namespace flash3

// One explicit instantiation per translation unit (csrc/instantiations/): run_fwd with the
// general dense kernel; each other kernel (short-sequence tile, packed batches) in a file
// of its own, so that they compile in parallel. The _HDIMV forms take the head dim of V.
#define FLASH3_FWD_KERNEL(ELEMENT, HDIM, HDIMV, MASK, SHORT, VARLEN) \
  flash3::launch_fwd_tiles<ELEMENT, HDIM, flash3::MASK, SHORT, VARLEN, HDIMV>(flash3::FwdParams const&, cudaStream_t)
#define FLASH3_INSTANTIATE_FWD_HDIMV(ELEMENT, HDIM, HDIMV, MASK)                                \
  extern template cudaError_t FLASH3_FWD_KERNEL(ELEMENT, HDIM, HDIMV, MASK, true, false);      \
  extern template cudaError_t FLASH3_FWD_KERNEL(ELEMENT, HDIM, HDIMV, MASK, true, true);       \
  extern template cudaError_t FLASH3_FWD_KERNEL(ELEMENT, HDIM, HDIMV, MASK, false, true);      \
  template cudaError_t flash3::run_fwd<ELEMENT, HDIM, flash3::MASK, HDIMV>(flash3::FwdParams const&, cudaStream_t);
#define FLASH3_INSTANTIATE_FWD(ELEMENT, HDIM, MASK) FLASH3_INSTANTIATE_FWD_HDIMV(ELEMENT, HDIM, HDIM, MASK)
#define FLASH3_INSTANTIATE_FWD_KERNEL_HDIMV(ELEMENT, HDIM, HDIMV, MASK, SHORT, VARLEN) \
  template cudaError_t FLASH3_FWD_KERNEL(ELEMENT, HDIM, HDIMV, MASK, SHORT, VARLEN);
#define FLASH3_INSTANTIATE_FWD_KERNEL(ELEMENT, HDIM, MASK, SHORT, VARLEN) \
  FLASH3_INSTANTIATE_FWD_KERNEL_HDIMV(ELEMENT, HDIM, HDIM, MASK, SHORT, VARLEN)
