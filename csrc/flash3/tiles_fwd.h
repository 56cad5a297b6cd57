// The forward kernel's tile shapes, the Q K^T MMA and the Q and K shared-memory layouts:
// the same construction for 16-bit and e4m3 inputs, a base of both traits (traits.h,
// traits_fp8.h), which add what differs (the PV MMA and V's layouts).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>

namespace flash3 {

using namespace cute;

template <class Element, int kConsumerWarpgroups, int kBlockN, int kHeadDim, int kHeadDimV, int kStages>
struct FwdTiles {
  // Each consumer warpgroup owns 64 rows of the Q tile (the M of one WGMMA).
  static constexpr int kTileRows = 64 * kConsumerWarpgroups;
  using TileShapeMNK = Shape<Int<kTileRows>, Int<kBlockN>, Int<kHeadDim>>;
  // The P V product: M = query rows, N = V's head dim, K = keys.
  using TileShapePV = Shape<Int<kTileRows>, Int<kHeadDimV>, Int<kBlockN>>;

  // The atom layout stacks the consumer warpgroups along M.
  using AtomLayoutMNK = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;

  // S = Q K^T: both operands K-major (head dim contiguous) in shared memory.
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(), AtomLayoutMNK{}));

  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                 Int<kTileRows>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kTileRows>, Int<kHeadDim>>{}));

  // K as TMA writes it: (keys, head dim, stage), head dim contiguous.
  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                 Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
};

}  // namespace flash3
