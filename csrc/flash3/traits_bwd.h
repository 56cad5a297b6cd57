// Per (element type, head dim) tile shapes, shared-memory layouts and tiled MMAs of the
// backward kernel. Everything here is a compile-time type; no code runs.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

namespace flash3 {

using namespace cute;

// A CTA owns one key tile (kBlockN rows of K and V) and walks the query tiles
// (kBlockM rows of Q and dO) that see it. Per query tile, five GEMMs:
//   S  = Q K^T    dP = dO V^T        (kBlockM x kBlockN): the two consumer warpgroups
//                                     split the keys, kBlockN / 2 columns each
//   dV += P^T dO  dK += dS^T Q       (kBlockN x d)
//   dQ  = dS K                       (kBlockM x d): the warpgroups split the head dim,
//                                     d / 2 columns each
// P and dS go through shared memory (bf16/fp16) between the two halves, since each
// warpgroup's dV, dK and dQ need the columns of both.
//
// Registers per consumer thread (240 with two consumer warpgroups): dK and dV
// accumulators kBlockN * d / 2 / 128 fp32 each, plus S and dP, kBlockM * kBlockN / 2 / 128
// each, plus dQ (kBlockM * d / 2 / 128) once S and dP are dead.
//   hdim  kBlockM kBlockN   dK+dV   S+dP   dQ   smem: K,V + 2 stages of Q,dO + 2 of P,dS
//    64     64     128       64      64    16    32 + 64 + 64 KB
//    96     64     128       96      64    24    48 + 96 + 64 KB
//   128     64     128      128      64    32    64 + 128 + 64 KB
//   192     64      64       96      32    48    48 + 192 + 32 KB  (with 128 keys dK+dV+S+dP
//   256     64      64      128      32    64    64 + 256 + 32 KB   would need 256 registers)
template <int kHeadDim>
struct BwdTileConfig {
  static constexpr int kBlockM = 64;
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kStages = 2;
};

template <class Element_, int kHeadDim_, bool kIsCausal_>
struct BwdKernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kIsCausal = kIsCausal_;

  using Config = BwdTileConfig<kHeadDim>;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kProducerWarpgroups = 1;
  static constexpr int kThreads = (kConsumerWarpgroups + kProducerWarpgroups) * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  // P and dS are double-buffered: a warpgroup may write tile m + 1's while the other still
  // reads tile m's in its dV/dK/dQ GEMMs, so one barrier per tile suffices.
  static constexpr int kPdSStages = 2;
  // dQ of a query tile is summed over the key tiles (CTAs) into a float32 workspace by a
  // warp of the producer warpgroup (the dQ warp) with bulk reductions from shared memory
  // (cp.reduce.async.bulk), so the consumers never wait on atomics. The consumers drop
  // the tile in a buffer of its own (kDqViaSmem: kBlockM * d * 4 bytes), or, where shared
  // memory is short (hdim 256), over the tile's Q and dO stages once their GEMMs are done:
  // each warpgroup's half of dQ, kBlockM * d/2 floats, is exactly the size of one stage
  // (kBlockM * d 16-bit values); the producer then refills a stage only after the dQ
  // warp has read it. (Consumer-side float4 atomics instead were measured 15-20% slower
  // at hdim 64/128 and 2x slower at hdim 256.)
#ifdef FLASH3_BWD_DQ_VIA_SMEM
  static constexpr bool kDqViaSmem = FLASH3_BWD_DQ_VIA_SMEM;
#else
  static constexpr bool kDqViaSmem = kHeadDim != 256;
#endif

  // Both GEMM families split a mode across the two warpgroups.
  using AtomLayoutSplitN = Layout<Shape<_1, Int<kConsumerWarpgroups>, _1>>;

  // S = Q K^T and dP = dO V^T: all operands K-major (head dim contiguous).
  using TileShapeSdP = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockN / 2>, Int<kHeadDim>>>(),
      AtomLayoutSplitN{}));
  // dV = P^T dO and dK = dS^T Q: P^T, dS^T, dO^T and Q^T are transposed views of tiles
  // stored K-major for the other GEMMs, i.e. MN-major operands (fine for 16-bit WGMMA).
  using TileShapedKV = Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>;
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDim / 2>, Int<kBlockM>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      AtomLayoutSplitN{}));
  // dQ = dS K: dS K-major, K^T MN-major.
  using TileShapedQ = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDim / 2>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayoutSplitN{}));

  // Q, dO, K, V: (rows, d) with d contiguous. Each warpgroup reads d / 2 columns of them
  // as MN-major operands (dK, dV, dQ), so a swizzle atom must not straddle the halves:
  // the atom is the widest of 64/32/16 elements that divides d / 2.
  static constexpr int kHalfD = kHeadDim / 2;
  using SmemAtomD = std::conditional_t<
      kHalfD % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
      std::conditional_t<kHalfD % 32 == 0, GMMA::Layout_K_SW64_Atom<Element>, GMMA::Layout_K_SW32_Atom<Element>>>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomD{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutdO = SmemLayoutQ;
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomD{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = SmemLayoutK;
  // Transposed views: (d, rows[, stage]).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutdOt = SmemLayoutQt;
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));

  // P and dS: (kBlockM, kBlockN), keys contiguous. dQ reads dS K-major; dV and dK read
  // P^T and dS^T MN-major in 64-key steps, which the 128-byte swizzle atom (64 elements)
  // matches.
  using SmemLayoutPdS = decltype(tile_to_shape(
      GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kPdSStages>>{}));
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kPdSStages>>{}, Step<_2, _1, _3>{})));

  // The per-row softmax statistics of a query tile: lse (log2 domain) and
  // dPsum = rowsum(dO * O), loaded by TMA beside Q and dO.
  using SmemLayoutRow = Layout<Shape<Int<kBlockM>, Int<kStages>>>;

  // dQ's float32 accumulator tile, kept in the order of the registers that hold it, so
  // that the consumers' stores, the bulk reductions and the global workspace are all
  // contiguous: element i of consumer thread t is float4 number dq_float4_index(i, t)
  // (warpgroup-major, so each warpgroup's half is one contiguous run).
  static constexpr int kDqElements = kBlockM * kHeadDim;
  static constexpr int kDqHalfFloat4s = kDqElements / 2 / 4;
  CUTLASS_HOST_DEVICE static constexpr int dq_float4_index(int i, int t) {
    return (t / cutlass::NumThreadsPerWarpGroup) * kDqHalfFloat4s + (i / 4) * cutlass::NumThreadsPerWarpGroup +
           t % cutlass::NumThreadsPerWarpGroup;
  }
  static_assert(kBlockM * (kHeadDim / 2) * sizeof(float) == kBlockM * kHeadDim * sizeof(Element),
                "a warpgroup's dQ half fills one Q (or dO) stage");

  using PipelineQ = cutlass::PipelineTmaAsync<kStages>;
  using PipelinedO = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element) + kBlockM * sizeof(float);
  static constexpr uint32_t kBytesdO = kBytesQ;
  static constexpr uint32_t kBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);
};

}  // namespace flash3
