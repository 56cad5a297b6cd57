// The FP8 (e4m3) forward kernel's traits: what the forward kernel (kernel_fwd.h,
// mainloop_fwd.h) runs with for e4m3 inputs, beside traits.h's for 16-bit ones. Output
// is bf16; both GEMMs are FP8 WGMMAs (QGMMA), whose operands must be K-major in shared
// memory: Q and K are (head dim contiguous), V is not, so V lands in a raw buffer and the
// producer warpgroup transposes it into V^T (kTransposeV, transpose_v_fp8.h); the block
// scales (block_scales.h) enter the softmax (softmax_fp8.h).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "barriers.h"
#include "block_scales.h"
#include "params_fp8.h"
#include "softmax_fp8.h"
#include "tiles_fwd.h"
#include "transpose_v_fp8.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

// Key tiles of kBlockN keys; when kBlockN does not divide kScaleBlockK the mainloop splits a
// tile into groups with their own K/V scales (block_scales.h; exact, since the softmax
// carries V's scale in the exponent). The default is 128 keys; hdim 128 also has a 192-key
// kernel, which dispatch_fp8.cu runs from 2k keys. Consumer warpgroups of 64 rows each (one
// Q scale block each).
// Shared memory: Q + kStages * (K + V + V^T),
//   hdim  64: 12 KB + 2 * 3 *  8 KB =  60 KB (three consumer warpgroups)
//   hdim 128: 16 KB + 2 * 3 * 16 KB = 112 KB
//   hdim 256: 32 KB + 2 * 3 * 32 KB = 224 KB
// Registers per consumer thread: O kHeadDim / 2, S kBlockN / 2, P kBlockN / 8.
// kBlockNOverride (0: default) picks another key tile (the hdim 128 192-key kernels;
// launch_fwd_fp8.h, dispatch_fp8.cu).
// hdim 256 uses 128-key tiles (H200 A/B): +20..+24% non-causal and +6..+23% causal over
// 64-key tiles once the V transpose became cheap. They need all 240 registers per
// consumer thread (O 128, S 64, P 16), which leaves the producer 24, and spill a little
// (scripts/check_sass.py, KNOWN_FP8_SPILLS); the spill-free 96-key tile was 4-21% slower.
// kPersistentOverride (false: the default grid, persistent for non-causal kernels at
// hdim <= 128 and one CTA per tile otherwise; true: persistent). The persistent causal
// kernels walk the tiles in a balancing order (scheduler.h); dispatch_fp8.cu runs them below a
// seqlen_k bound. At hdim 256 the non-causal kernel runs one CTA per tile by default,
// and the persistent one serves up to 4k keys: the next
// tile's Q and first K/V then load under the current tile's last GEMMs and epilogue
// (+4..+13% at 512-2k; its loop keeps 2 + 2 local-memory instructions, check_sass.py),
// while from 8k keys the one-CTA-per-tile kernel measured 1.5-2.3% faster. Persistent causal kernels
// measured +4..+24% below 8k keys but 13-40% slower at 8-16k, where the static stride over
// unequal tiles loses to the hardware's dynamic assignment (H200 A/B).
// kWarpgroupsOverride (0: default) gives a kernel another number of consumer warpgroups:
// the hdim 64 short causal kernel for up to 1k keys has two (below).
template <int kHeadDim, bool kIsCausal, int kBlockNOverride = 0, bool kPersistentOverride = false,
          int kWarpgroupsOverride = 0>
struct TileConfigFp8 {
  // hdim 64: three consumer warpgroups (192-row tiles), as in the 16-bit hdim 64 kernel:
  // its GEMMs are the cheapest per softmax row, so a warpgroup's softmax needs two
  // others' GEMMs to hide behind. +7..+23% over two on the grid (H200 A/B),
  // except causal 512-1k (within 3%).
  // The persistent causal kernels at hdim 64 come with three and with
  // two (128-row tiles): at 512 and 1k keys, 192-row tiles leave a third of the last
  // tile empty (512 = 2 x 192 + 128) and give the persistent CTAs fewer, unequal tiles to
  // share; H200 A/B (three passes each, bitwise-identical outputs),
  // against the one-CTA-per-tile kernel: two warpgroups +42 / +33% at 512 / 1k, +8 / +1 /
  // -7% at 2k / 4k / 8k; three +24 / +18% at 512 / 1k, +11 / +8 / +5% at 2k / 4k / 8k;
  // at 16k keys both lose (-13% / -9%) to one CTA per tile (dispatch_fp8.cu).
  static constexpr int kConsumerWarpgroups = kWarpgroupsOverride ? kWarpgroupsOverride : kHeadDim == 64 ? 3 : 2;
  static constexpr int kBlockN = kBlockNOverride ? kBlockNOverride : 128;
  // Three or four K/V stages measured within 1% of two on the whole grid (one H200 run):
  // the loads are not what the tile waits for.
  static constexpr int kStages = 2;
  static constexpr bool kPersistent = (!kIsCausal && kHeadDim <= 128) || kPersistentOverride;
  // hdim 64 non-causal (the cheapest GEMMs, so the softmax's own latency is the tile):
  // no pingpong and the row max / sum split into four independent chains; together
  // +10..+14% on all six hdim 64 non-causal cells of the grid (H200 A/B).
  // Alone, no pingpong gave +4..+13% at 512-2k and -1% from 8k there, but cost 1-3% at
  // causal hdim 64 and moved causal hdim 128 by -4..+7%; the split chains gave +7% from
  // 2k there but cost 3-7% at hdim 256 and at causal hdim 64.
  static constexpr bool kPingpong = !(kHeadDim == 64 && !kIsCausal);
  static constexpr bool kSplitChains = kHeadDim == 64 && !kIsCausal;
};

// The tiles of TileConfigFp8 (tiles_fwd.h): V and O have Q and K's head dim.
template <int kHeadDim, class Config>
using FwdTilesFp8 = FwdTiles<cutlass::float_e4m3_t, Config::kConsumerWarpgroups, Config::kBlockN, kHeadDim, kHeadDim,
                             Config::kStages>;

template <int kHeadDim_, bool kIsCausal_, int kBlockNOverride = 0, bool kPersistentOverride = false,
          int kWarpgroupsOverride = 0>
struct KernelTraitsFp8
    : FwdTilesFp8<kHeadDim_, TileConfigFp8<kHeadDim_, kIsCausal_, kBlockNOverride, kPersistentOverride,
                                           kWarpgroupsOverride>> {
  using Element = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using ElementAccum = float;
  using HostParams = FwdFp8Params;
  // V is transposed in shared memory by the producer warpgroup (mainloop_fwd.h).
  static constexpr bool kTransposeV = true;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDim;  // V and O: Q and K's head dim

  using Config = TileConfigFp8<kHeadDim, kIsCausal_, kBlockNOverride, kPersistentOverride, kWarpgroupsOverride>;
  using Tiles = FwdTilesFp8<kHeadDim, Config>;
  static constexpr int kConsumerWarpgroups = Config::kConsumerWarpgroups;
  static constexpr int kThreads = (kConsumerWarpgroups + 1) * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kProducerThreads = cutlass::NumThreadsPerWarpGroup;

  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  static constexpr bool kPersistent = Config::kPersistent;
  static constexpr bool kPingpong = Config::kPingpong;
  static constexpr bool kSplitChains = Config::kSplitChains;
  // The row max and half the exponentials of key tile j + 1 run under the warpgroup's own
  // O += P(j) V(j), O's rescale beside the other half after it (mainloop_fwd.h). H200
  // A/B against the softmax after that GEMM: hdim 128 +3..+6% at
  // 8k-16k keys (the 192-key kernels) and +4% at 512 non-causal, but -6..-1% at 2k-4k;
  // hdim 64 causal +1..+2%; hdim 64 non-causal -5..0% and hdim 256 -4..-2% non-causal.
  // So: hdim 64 causal, and at hdim 128 the non-causal 128-key kernel (below 1152 keys)
  // and the causal kernels with one CTA per tile (above 8k); the persistent causal ones
  // (up to 8k) and the non-causal 192-key one (from 1152 keys) keep the old order: with
  // kLaneScales, below, they measured faster at 8k-32k too (dispatch_fp8.cu).
  static constexpr bool kSoftmaxUnderPvAtHdim128 = kIsCausal_ ? !kPersistent : kBlockN == 128;
  static constexpr SoftmaxUnderPv kSoftmaxUnderPv =
      (kHeadDim == 128 && kSoftmaxUnderPvAtHdim128) || (kHeadDim == 64 && kIsCausal_) ? SoftmaxUnderPv::kHalf
                                                                                       : SoftmaxUnderPv::kNone;
  static_assert(kBlockN % 32 == 0, "FP8 WGMMA K-blocks are 32 keys");
  // The max kept until a tile raises it by more than 2^0.75 and O's rescale skipped where
  // no row of a warp changed its max (softmax_fp8.h). H200 A/B against the exact rescale every
  // tile: +2..+4% in the hdim 128 kernels with 192-key tiles and the
  // softmax under the PV GEMM (non-causal from 8k keys, causal above 8k), 3-4% slower in
  // the persistent causal ones (2k-8k), the 128-key ones (-3% at 512) and at hdim 64 (-6%
  // non-causal, -2..0% causal); hdim 256 causal +1..+6%, non-causal -3..+1%, but one
  // test's worst element (GQA, key blocks scaled 0.01-100, 2300 keys, causal) then erred
  // 2.7x the emulation's worst (7.0 against 2.6; the bound is 2x), so hdim 256 keeps the
  // exact rescale.
  static constexpr bool kLazyRescale = kHeadDim == 128 && kSoftmaxUnderPv == SoftmaxUnderPv::kHalf && kBlockN == 192;
  // A key tile over several scale groups (hdim 128, 192-key tiles: three groups of 64
  // keys) works out each group's scales on a lane of its own and shuffles them to the
  // warp (block_scales.h BlockScalesFp8::Rows::tile): 2 MUFU instructions per warp and tile instead
  // of 6, 36 instructions at the loop's top instead of 54. H200 A/B (three passes each,
  // bitwise-identical outputs): the kernels with the
  // softmax after the PV GEMM +5.7 / +4.9% non-causal at 2k / 4k keys, +2.1 / +3.2%
  // causal; those with the softmax under the PV GEMM -2.0..-2.6% (8k, 16k): off there.
  static constexpr bool kLaneScales = kSoftmaxUnderPv == SoftmaxUnderPv::kNone;
  // The row max from the scores' bits (softmax_fp8.h, utils.h row_max_bits). H200 A/B against the
  // FMNMX chains (three passes each, bitwise-identical outputs): hdim 64 non-causal
  // +1..+11%, the hdim 128 192-key kernels +2..+7% from 4k keys (both masks); hdim 64
  // causal -2..+1%, the 128-key hdim 128 kernels -1..-3% at 512, hdim 256 non-causal -1%
  // with more spills, hdim 256 causal +1..+3% but 29-32 local-memory instructions, over
  // check_sass.py's bound: there it stays off.
  static constexpr bool kIntRowMax = (kHeadDim == 64 && !kIsCausal_) || (kHeadDim == 128 && kBlockN == 192);

  // Register budget (setmaxnreg). The whole register file (64K) cannot be handed out: with
  // 32 + 2 * 240 (= 65536) the consumers' setmaxnreg.inc waited forever on the H200; the
  // 16-bit kernels' 24 + 2 * 240 = 64512 (barriers.h) works. The producer warpgroup's V
  // transpose keeps two 16 x 32 blocks in flight (transpose_v_fp8.h), which needs 40 registers; the
  // consumers then get 232 (O, S and P need <= 208 per thread up to hdim 128):
  // 40 * 128 + 232 * 256 = 64512. hdim 256 with 128-key tiles needs 240 per consumer, so
  // the producer gets 24 and transposes one block at a time. Three consumer warpgroups
  // (hdim 64): 40 + 3 * 152 (O 32, S 64 and P 16 per thread).
  // Registers at hdim 256. kPingpongIdsFromThreadIdx: the pingpong turns' barrier ids
  // from a fresh read of %tid.x at each turn rather than from registers (barriers.h
  // PingpongTurns). kOneScaleOffset: one offset for K's and V's scales
  // (block_scales.h). With them, and the producer on one pipeline state and its
  // transposer's key steps outermost (every FP8 kernel; mainloop_fwd.h load_transposing, transpose_v_fp8.h), the
  // non-causal hdim 256 kernel holds all it needs in its registers (ptxas: no spills;
  // 22 local-memory instructions before) and the causal ones' 26 fall to 13 and 9.
  // Outputs bitwise identical; H200 A/B: hdim 256 +0.0..+1.8%.
  // One offset cost the hdim 64 non-causal kernel 2-3% (ptxas's schedule), so the other
  // head dims keep two.
  static constexpr bool kPingpongIdsFromThreadIdx = kHeadDim == 256;
  static constexpr bool kOneScaleOffset = kHeadDim == 256;
  static constexpr bool kSmallConsumer = kHeadDim <= 128 || Config::kBlockN <= 96;
  // The producer transposes V as well as loading (transpose_v_fp8.h TransposeV): 40 registers where
  // the consumers can spare them, and the shared budget rule (barriers.h) for the rest.
  using Registers = RegisterBudget<kConsumerWarpgroups, kSmallConsumer ? 40 : 24>;

  using Scales = BlockScalesFp8<kBlockM, kBlockN, kLaneScales, kOneScaleOffset>;
  template <int kRows>
  using Softmax = OnlineSoftmaxFp8<kRows, kSplitChains, kLazyRescale, kIntRowMax>;

  // Tile shapes, the Q K^T MMA, Q's and K's layouts: tiles_fwd.h.
  using typename Tiles::TileShapeMNK;
  using typename Tiles::TileShapePV;
  using typename Tiles::AtomLayoutMNK;
  using typename Tiles::TiledMmaQK;
  using typename Tiles::SmemLayoutQ;
  using typename Tiles::SmemLayoutK;

  // P from registers (K-major by construction), V^T from shared memory, K-major.
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::K>(),
      AtomLayoutMNK{}));

  // V as TMA writes it: (keys, head dim, stage), head dim contiguous.
  using SmemLayoutV = SmemLayoutK;
  // V^T as the PV WGMMA reads it: (head dim, keys, stage), keys contiguous.
  using SmemAtomVt = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
      GMMA::Major::K, Element, Int<kHeadDim>, Int<kBlockN>>());
  using SmemLayoutVt = decltype(tile_to_shape(SmemAtomVt{}, Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}));

  using Transpose = TransposeV<SmemLayoutV, SmemLayoutVt, kBlockN, kHeadDim, kProducerThreads,
                               Registers::kProducer >= 40 ? 2 : 1>;

  // kSmemOSeparate: O (bf16) leaves through a shared-memory buffer of its own and TMA stores
  // (EpilogueFwdTma, epilogue_fwd.h) rather than straight from registers: the consumers
  // hand the rows over in a few STSM and go on to the next tile, and the global writes
  // are whole lines. Shared memory has room at hdim <= 128 (24-32 KB beside 60-112 KB).
  // H200 A/B against direct stores (three passes each, outputs bitwise identical): hdim
  // 128 non-causal +16 / +10 / +3% at 512 / 1k / 2k, causal +31 / +15 / +7 / +3% at
  // 512-4k, within 1% from 8k; hdim 64 causal +7..+1% from 512 to 16k; hdim 64 non-causal
  // +3% at 512 but 5-9% slower from 2k (three consumer warpgroups on 152 registers,
  // persistent), so it keeps direct stores.
  // OutputTraits is what that epilogue reads: a bf16 tile of Q's shape ("SmemLayoutQ":
  // the staging layout) and the PV MMA, whose accumulator layout is that of any 64 x N
  // WGMMA.
  static constexpr bool kSmemOSeparate = kHeadDim == 128 || (kHeadDim == 64 && kIsCausal_);
  // kOInKVStages (hdim 256, whose shared memory has no room for O's buffer): as in the
  // 16-bit hdim 256 short kernels (traits.h), each consumer warpgroup stages its 64 rows
  // of O over one of the tile's last stages, warpgroup 0 over the last V^T stage and
  // warpgroup 1 over the last K stage (32 KB each), which the mainloop then leaves
  // locked until the store has read them. H200 A/B against direct stores (three passes
  // each, outputs bitwise identical): non-causal +16.5 / +10.5 /
  // +6.7 / +5.0 / +3.4 / +2.5% at 512-16k, causal +22.9 / +14.8 / +9.7 / +6.0 / +4.4 /
  // +2.3%.
  static constexpr bool kOInKVStages = kHeadDim == 256;
  // O leaves through TMA stores (either way above); Q has one buffer, released after the
  // tile's last Q K^T as usual.
  static constexpr bool kTmaStoreO = kSmemOSeparate || kOInKVStages;
  static constexpr int kQStages = 1;
  using PipelineStateQ = cutlass::PipelineState<kQStages>;
  static constexpr bool kReleaseQAfterEpilogue = false;
  struct OutputTraits {
    using Element = ElementOut;
    static constexpr int kBlockM = KernelTraitsFp8::kBlockM;
    static constexpr int kHeadDim = KernelTraitsFp8::kHeadDim;
    static constexpr int kHeadDimV = kHeadDim;
    using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
        GMMA::Major::K, ElementOut, Int<kBlockM>, Int<kHeadDim>>());
    using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutO = SmemLayoutQ;
    using TiledMmaPV = KernelTraitsFp8::TiledMmaPV;
    // One warpgroup's share of it (kOInKVStages stages O per warpgroup).
    using TiledMmaPVWarpgroup = decltype(make_tiled_mma(
        GMMA::rs_op_selector<typename KernelTraitsFp8::Element, typename KernelTraitsFp8::Element, float,
                             Shape<_64, Int<kHeadDim>, Int<KernelTraitsFp8::kBlockN>>, GMMA::Major::K,
                             GMMA::Major::K>()));
  };

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim;
  static constexpr uint32_t kBytesK = kBlockN * kHeadDim;
  static constexpr uint32_t kBytesV = kBytesK;
};

}  // namespace flash3
