// Per (element type, head dim, head dim of V) tile shapes, shared-memory layouts and tiled
// MMAs of the backward kernel. Everything here is a compile-time type; no code runs.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "params.h"

namespace flash3 {

using namespace cute;

// A CTA owns one key tile (kBlockN rows of K and V) and walks the query tiles
// (kBlockM rows of Q and dO) that see it. Per query tile, five GEMMs:
//   S  = Q K^T    dP = dO V^T        (kBlockM x kBlockN)
//   dV += P^T dO                     (kBlockN x dv)
//   dK += dS^T Q                     (kBlockN x d)
//   dQ  = dS K                       (kBlockM x d): the warpgroups split the rows
//                                     (hdim 64 non-causal) or the head dim
// d is the head dim of Q and K, dv that of V, O and dO (d, or less: DeepSeek-V3-style
// 192 / 128, lockstep schedule only).
// hdim <= 128 (kSplitKeys, 128 keys): each consumer warpgroup owns 64 keys for the first
// four GEMMs. It computes S^T and dP^T, so P^T and dS^T stay in registers as the A
// operands of dV and dK; only dS goes through shared memory, for dQ, which needs the
// keys of both warpgroups.
// hdim 192/256 (64 keys, one WGMMA's M): the warpgroups split the keys for S and dP but
// the head dim for dV and dK, so P and dS both go through shared memory, a barrier each.
//
// Registers per consumer thread (240 with two consumer warpgroups), fp32 accumulators:
//   hdim  kBlockM kBlockN   dK+dV   S+dP   dQ     split keys
//    64    128     128       64     128    32        yes
//    96     64     128       96      64    24        yes
//   128     64     128      128      64    32        yes
//   192     64      64       96      32    48        no   (with 128 keys dK+dV+S+dP
//   256     64      64      128      32    64        no    would need 256 registers)
//   192/128 64      64       80      32    48        no   (dV: 64 x 128)
//   256     64      80      160      40    32        transposed (dQ^T in two slices)
//
// kTransposed (hdim 256, not deterministic): 80-key tiles, which cut the Q and dO loads
// and the dQ reductions per FLOP by a fifth, fit only with one dO stage, one P and one
// dS buffer and no dQ in shared memory. dV^T = dO^T P, dK^T = Q^T dS and dQ^T = K^T dS^T
// then put the head dim in the WGMMAs' M (80 keys are not a multiple of 64); each
// warpgroup owns 128 of its rows and issues them as two 64-row slices, and adds each
// 64-row slice of dQ^T to the float32 workspace with float4 atomics straight from
// registers while the next slice's GEMM runs, so only one slice's 32 registers are live.
// Deterministic mode keeps the 64-key kernel, whose dQ warp adds in a fixed order.
template <int kHeadDim>
struct BwdTileConfig {
  static constexpr int kBlockM = bwd_block_m(kHeadDim);
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kStages = 2;
};

template <class Element_, int kHeadDim_, bool kIsCausal_, int kHeadDimV_ = kHeadDim_, bool kTransposed_ = false>
struct BwdKernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static_assert(kHeadDimV % 32 == 0, "each warpgroup's half of dV is whole 16-column swizzle atoms");
  static constexpr bool kIsCausal = kIsCausal_;

  using Config = BwdTileConfig<kHeadDim>;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kProducerWarpgroups = 1;
  static constexpr int kThreads = (kConsumerWarpgroups + kProducerWarpgroups) * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr bool kTransposed = kTransposed_;
  static_assert(!kTransposed || (kHeadDim_ == 256 && kHeadDimV_ == kHeadDim_),
                "the transposed layout is built for hdim 256 (its shared memory is sized for it)");
  static constexpr int kBlockN = kTransposed ? 80 : Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  // dO's stages: one in the transposed layout (its shared memory), else Q's.
  static constexpr int kStagesdO = kTransposed ? 1 : kStages;
  // P and dS buffers. Lockstep (hdim 192/256): double-buffered, a warpgroup may write tile
  // m + 1's while the other still reads tile m's in its dV/dK/dQ GEMMs, so one barrier per
  // tile suffices. Split keys (pingpong, dQ two tiles late): three dS^T buffers
  // (mainloop_bwd_split_keys.h, issue_dq).
  // (kTransposed: one buffer each, so every tile waits for both warpgroups' last reads.)
  static constexpr int kPdSStages = kTransposed ? 1 : kHeadDim <= 128 ? 3 : 2;
  // dQ of a query tile is summed over the key tiles (CTAs) into a float32 workspace by a
  // warp of the producer warpgroup (the dQ warp) with bulk reductions from shared memory
  // (cp.reduce.async.bulk), so the consumers never wait on atomics. The consumers drop
  // the tile in a buffer of its own (kDqViaSmem: kBlockM * d * 4 bytes), or, where shared
  // memory is short (hdim 256 in deterministic mode, kDqOverStages), over the tile's Q and
  // dO stages once their GEMMs are done: each warpgroup's half of dQ, kBlockM * d/2
  // floats, is exactly the size of one stage (kBlockM * d 16-bit values); the producer
  // then refills a stage only after the dQ warp has read it. (Consumer-side float4 atomics
  // instead were measured 15-20% slower at hdim 64/128 and 2x slower at hdim 256 in the
  // 64-key layout; the transposed one issues them per 64-row slice under the next GEMM.)
  static constexpr bool kDqViaSmem = kHeadDim != 256;
  static constexpr bool kDqOverStages = kHeadDim == 256 && !kTransposed;
  // kTransposed: the consumers add dQ^T with float4 atomics (no dQ warp).
  static constexpr bool kDqAtomics = kTransposed;

  // kSplitKeys (hdim <= 128): each consumer warpgroup owns kBlockN / 2 keys for all five
  // GEMMs but dQ. It computes S^T = K Q^T and dP^T = V dO^T for its keys (rows), so P^T
  // and dS^T come out of the accumulators already shaped as the register A operand of
  // dV += P^T dO and dK += dS^T Q: P never goes to shared memory, and dV and dK need no
  // barrier with the other warpgroup. Only dQ = dS K needs both halves of dS, which go
  // through shared memory as before. (Without it, as at hdim 192/256, the warpgroups
  // split the keys for S and dP but the head dim for dV and dK, so P and dS both go
  // through shared memory with a barrier each: the two warpgroups run in lockstep.)
  // Registers at hdim 128: dK + dV 128, S^T + dP^T 64, dQ 32.
  static constexpr bool kSplitKeys = kHeadDim <= 128;
  // The causal and unmasked split-keys loop in two copies, the masked query tiles (the
  // diagonal's, a partial last key tile's) with the mask's code and the others without it
  // (mainloop_bwd_split_keys.h), as FlashAttention-3 does at hdim 64. Measured on an H100
  // (docs/performance.md): hdim 64 1.00-1.05x with 17 and 5 LDL + STL in the causal and
  // non-causal kernels (scripts/check_sass.py), hdim 128 0.57-0.69x (128-152 B of spills).
  static constexpr bool kSeparateMaskedTiles = kSplitKeys && kHeadDim <= 64;
  // GQA outside deterministic mode: the whole key tiles' float32 dK and dV added to their
  // K/V head's rows by bulk reductions from shared memory, one per row, rather than float4
  // atomics (epilogue_bwd.h store_through_smem). H100, 16 / 4 heads, 4 x 4096 and 3 x
  // 3000, four passes over two runs: hdim 128 +1.3..+2.1%; at hdim 256 (80-key tiles, 160
  // rows over 256 threads) 0.96-1.01 in the first run, so the other kernels keep the
  // atomics (docs/performance.md).
  static constexpr bool kDkvBulkReduce = kSplitKeys;
  static_assert(!kSplitKeys || kDqViaSmem, "dQ over the Q/dO stages assumes the lockstep schedule");
  static_assert(!kTransposed || !kSplitKeys);
  static_assert(!kSplitKeys || kHeadDimV == kHeadDim,
                "a head dim of V other than Q's and K's is built for the lockstep schedule only (hdim > 128): "
                "mma_split_keys issues dK and dV with one tiled MMA");
  static_assert(!kDqOverStages || kHeadDimV == kHeadDim,
                "dQ over the Q/dO stages needs dO stages as large as Q's (kHeadDimV == kHeadDim)");

  // dK and dV leave through shared memory and TMA stores (epilogue_bwd.h): at hdim 64,
  // against direct stores from registers, +1..+7% (docs/performance.md). One CTA per key
  // tile: clusters of two sharing each query tile's loads were 0.90-1.00 of it at hdim
  // 192/256 (docs/performance.md), and that code is gone.

  // Both GEMM families split a mode across the two warpgroups.
  using AtomLayoutSplitN = Layout<Shape<_1, Int<kConsumerWarpgroups>, _1>>;
  using AtomLayoutSplitM = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;

  // S = Q K^T and dP = dO V^T: all operands K-major (head dim contiguous). The loads
  // tile by TileShapeSdP (Q, K) and TileShapedP (dO, V); with kSplitKeys the MMA computes
  // the transposes (TileShapeSdPt, A = K or V, B = Q or dO), each warpgroup 64 of the keys.
  // One tiled MMA serves both: a 16-bit WGMMA atom is 16 deep whatever the head dim.
  using TileShapeSdP = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TileShapedP = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDimV>>;
  using TileShapeSdPt = Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>;
  using TiledMmaSdP = std::conditional_t<kSplitKeys,
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>(),
          AtomLayoutSplitM{})),
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockN / 2>, Int<kHeadDim>>>(),
          AtomLayoutSplitN{}))>;
  // dV = P^T dO and dK = dS^T Q: dO^T and Q^T are transposed views of tiles stored
  // K-major for the other GEMMs, i.e. MN-major operands (fine for 16-bit WGMMA). With
  // kSplitKeys, P^T and dS^T come from registers and each warpgroup covers its keys and
  // the whole head dim; otherwise they are MN-major views of shared memory and each
  // warpgroup covers all keys and half the head dim (of V for dV, of K for dK).
  // kTransposed: dV^T = dO^T P and dK^T = Q^T dS, (d, kBlockN, kBlockM): A = dO^T or Q^T
  // (MN-major views of dO and Q), B = P or dS as (keys, queries) (MN-major: keys are
  // contiguous in sP and sdS); the warpgroups take alternate 64-row atoms of the head dim.
  template <int kCols>
  using TiledMmadKVTransposedOf = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockN>, Int<kBlockM>>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      AtomLayoutSplitM{}));
  template <int kCols>
  using TiledMmadKVUntransposedOf = std::conditional_t<kSplitKeys,
      decltype(make_tiled_mma(
          GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kCols>, Int<kBlockM>>,
                               GMMA::Major::K, GMMA::Major::MN>(),
          AtomLayoutSplitM{})),
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kCols / 2>, Int<kBlockM>>,
                               GMMA::Major::MN, GMMA::Major::MN>(),
          AtomLayoutSplitN{}))>;
  template <int kCols>
  using TiledMmadKVOf = std::conditional_t<kTransposed, TiledMmadKVTransposedOf<kCols>, TiledMmadKVUntransposedOf<kCols>>;
  // (rows, columns, depth) of the dK and dV GEMMs: (keys, d, queries), or (d, keys,
  // queries) transposed.
  using TileShapedK = std::conditional_t<kTransposed, Shape<Int<kHeadDim>, Int<kBlockN>, Int<kBlockM>>,
                                         Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>>;
  using TileShapedV = std::conditional_t<kTransposed, Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kBlockM>>,
                                         Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kBlockM>>>;
  using TiledMmadK = TiledMmadKVOf<kHeadDim>;
  using TiledMmadV = TiledMmadKVOf<kHeadDimV>;
  // dQ = dS K: K^T MN-major; dS K-major, or MN-major with kSplitKeys (stored as dS^T).
  // With 128-row query tiles (hdim 64) the warpgroups split the rows, 64 each, so every
  // WGMMA has N = d = 64. Split by head dim its N is 32, and a WGMMA that narrow is bound
  // by reading its A operand (dS) from shared memory: 3 KB per 16-deep step against 4 KB
  // for twice the math at N = 64. Measured (A/B, bf16 bwd): non-causal +2..+4% from 2k
  // keys. Causal was 1-3% slower with the lockstep loop but is +1.5..+4% with the
  // pingpong one (mainloop_bwd_split_keys.h). 64-row tiles split the head dim.
  // kTransposed: dQ^T = K^T dS^T, (d, kBlockM, kBlockN): A = K^T (MN-major view of K),
  // B = dS as (queries, keys), K-major; the warpgroups take alternate 64-row atoms of d.
  static constexpr bool kDqSplitRows = kBlockM == 2 * 64;
  using TileShapedQ = std::conditional_t<kTransposed, Shape<Int<kHeadDim>, Int<kBlockM>, Int<kBlockN>>,
                                         Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>>;
  using TiledMmadQUntransposed = std::conditional_t<kDqSplitRows,
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                               kSplitKeys ? GMMA::Major::MN : GMMA::Major::K, GMMA::Major::MN>(),
          AtomLayoutSplitM{})),
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDim / 2>, Int<kBlockN>>,
                               kSplitKeys ? GMMA::Major::MN : GMMA::Major::K, GMMA::Major::MN>(),
          AtomLayoutSplitN{}))>;
  using TiledMmadQ = std::conditional_t<kTransposed,
      decltype(make_tiled_mma(
          GMMA::ss_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kBlockM>, Int<kBlockN>>,
                               GMMA::Major::MN, GMMA::Major::K>(),
          AtomLayoutSplitM{})),
      TiledMmadQUntransposed>;

  // Q, dO, K, V: (rows, d) with d contiguous (dv for dO and V). Where a GEMM splits the
  // head dim (dV and dK without kSplitKeys, dQ without kDqSplitRows) each warpgroup reads
  // d / 2 columns of them as MN-major operands, so a swizzle atom must not straddle the
  // halves: the atom is the widest of 64/32/16 elements that divides the columns a
  // warpgroup reads. dO and V get theirs from dv (dV splits dO's columns as dK splits
  // Q's): at 192 / 128, 64-element atoms for dO and V, 32-element ones for Q and K.
  template <int kColumns>
  using SmemAtomOf = std::conditional_t<
      kColumns % 64 == 0, GMMA::Layout_K_SW128_Atom<Element>,
      std::conditional_t<kColumns % 32 == 0, GMMA::Layout_K_SW64_Atom<Element>,
                         GMMA::Layout_K_SW32_Atom<Element>>>;
  static constexpr int kOperandColumns = kSplitKeys && kDqSplitRows ? kHeadDim : kHeadDim / 2;
  static constexpr int kOperandColumnsV = kSplitKeys && kDqSplitRows ? kHeadDimV : kHeadDimV / 2;
  using SmemAtomD = SmemAtomOf<kOperandColumns>;
  using SmemAtomDv = SmemAtomOf<kOperandColumnsV>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomD{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutdO = decltype(tile_to_shape(SmemAtomDv{}, Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kStagesdO>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomD{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = decltype(tile_to_shape(SmemAtomDv{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  static_assert(kHeadDimV != kHeadDim || ((kStagesdO != kStages || std::is_same_v<SmemLayoutdO, SmemLayoutQ>) &&
                                          std::is_same_v<SmemLayoutV, SmemLayoutK>),
                "equal head dims: dO and V are laid out as Q and K");
  // Transposed views: (d, rows[, stage]).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockM>, Int<kStagesdO>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));

  // P and dS: (kBlockM, kBlockN), keys contiguous. dQ reads dS K-major; dV and dK read
  // P^T and dS^T MN-major in 64-key steps, which the 128-byte swizzle atom (64 elements)
  // matches.
  // kTransposed: 80 keys, 40 per warpgroup's S, are whole 8-element atoms only: no
  // swizzle (each 8 x 8 block is 128 contiguous bytes, so STSM is conflict-free).
  using SmemAtomPdS = std::conditional_t<kTransposed, GMMA::Layout_K_INTER_Atom<Element>,
                                         GMMA::Layout_K_SW128_Atom<Element>>;
  using SmemLayoutPdS = decltype(tile_to_shape(
      SmemAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>, Int<kPdSStages>>{}));
  // P and dS leave the S accumulators with STSM, four 8 x 8 blocks per instruction, or
  // two where a warpgroup's columns are an odd number of 8-column blocks (kTransposed).
  using SmemCopyAtomPdS = Copy_Atom<std::conditional_t<(kBlockN / 2) % 16 == 0, SM90_U32x4_STSM_N, SM90_U32x2_STSM_N>,
                                    Element>;
  using SmemLayoutPdSt = decltype(composition(
      SmemLayoutPdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kPdSStages>>{}, Step<_2, _1, _3>{})));
  // kSplitKeys: only dS goes through shared memory, written from dS^T accumulators as
  // (kBlockN, kBlockM) with queries contiguous (STSM of 8x8 blocks, as any C tile), and
  // read by dQ as its (kBlockM, kBlockN) MN-major A operand.
  using SmemLayoutdSt = decltype(tile_to_shape(
      GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kBlockN>, Int<kBlockM>, Int<kPdSStages>>{}));
  using SmemLayoutdSForDq = decltype(composition(
      SmemLayoutdSt{}, make_ordered_layout(Shape<Int<kBlockM>, Int<kBlockN>, Int<kPdSStages>>{}, Step<_2, _1, _3>{})));
  static_assert(!kSplitKeys || kBlockM % 64 == 0, "dS^T rows are whole 128-byte swizzle atoms");

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
  using PipelinedO = cutlass::PipelineTmaAsync<kStagesdO>;
  using PipelineState = cutlass::PipelineState<kStages>;
  using PipelineStatedO = cutlass::PipelineState<kStagesdO>;

  // Per pipeline stage: the tile and its row statistic (lse beside Q, dPsum beside dO).
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element) + kBlockM * sizeof(float);
  static constexpr uint32_t kBytesdO = kBlockM * kHeadDimV * sizeof(Element) + kBlockM * sizeof(float);
  static constexpr uint32_t kBytesKV = kBlockN * (kHeadDim + kHeadDimV) * sizeof(Element);
};

}  // namespace flash3
