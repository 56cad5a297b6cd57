// Per (element type, head dim) tile shapes, shared-memory layouts and tiled MMAs of the
// forward kernel. Everything here is a compile-time type; no code runs.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "barriers.h"
#include "block_scales.h"
#include "params.h"
#include "softmax.h"
#include "tiles_fwd.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

// Tile sizes per head dim and mask. kBlockM = 64 rows of Q per consumer warpgroup (the M
// of one WGMMA); kBlockN keys per K/V tile. Limits: Q + kStages * (K + V) within the
// 227 KB of shared memory, and per consumer thread the S accumulator (kBlockN / 2 fp32),
// P (kBlockN / 4 registers) and O (kHeadDim / 2 fp32) within the setmaxnreg budget (240
// with two consumer warpgroups, 160 with three).
//
// kPersistent: a grid of one CTA per SM walking the tiles (scheduler.h), which overlaps a
// tile's loads with the previous tile's math. In the general kernels for equal-length
// (non-causal) tiles where the loop's extra live registers fit (hdim 256's 80-key
// non-causal loop spilled 12 B, the causal one 88 B), and at hdim 64 for every mask (its
// causal and local tiles in a balancing order, or claimed from the packed tile table;
// docs/performance.md); the short-sequence kernels below are all persistent.
// kPingpong: the consumer warpgroups take turns on the tensor cores (mainloop_fwd.h).
// Measured on the H200 against free issue, same run: +2% at hdim 64, +3-5% at hdim 192,
// +1-2% at hdim 256, +1-4% for hdim 128 causal, within 1.5% at hdim 96; but 1-7% slower
// for hdim 128 non-causal (128x176 tiles), where it is off, as it is for the short
// hdim 64 and hdim 128 non-causal tiles (free issue faster) and the short causal hdim
// 256 tile (it spilled with pingpong).
// kTmaStoreO: O leaves through shared memory and TMA stores (epilogue_fwd.h) rather than
// straight from registers: +1..+21% where a tile is one CTA's whole work (causal, hdim
// 192/256; most at 512 tokens), no gain where it costs registers or Q's early release.
//   hdim  WGs  kBlockM  kBlockN          persistent  smem: Q + 2 stages of K and V
//    64    3     192      128             yes         24 KB + 64 KB   (softmax-bound: two
//                                                     warpgroups in softmax while one runs
//                                                     GEMMs)
//    96    2     128      128             non-causal  24 KB + 96 KB
//   128    2     128   176 / 128 causal   non-causal  32 KB + 176 KB  (causal: finer diagonal)
//   192    2     128      112             no          48 KB + 168 KB
//   256    2     128       80             no          64 KB + 160 KB
// and the short-sequence tiles (kShortSeq, below), all persistent with the TMA store:
//    64    2     128      128  non-causal <= 1k tokens, causal <= 2k (no pingpong)
//   128    2     128      128  non-causal and causal <= 2k (non-causal: no pingpong)
//   256    2     128       64  non-causal <= 512, causal <= 1k (causal: no pingpong)
// (dense causal calls keep them longer: kDenseCausalShortMaxSeqlen).
// docs/kernels.md lists every built kernel with these values resolved.

// kShortSeq: a second kernel for short sequences, picked at launch when both seqlen_q
// and seqlen_k are at most kShortSeqMaxSeqlen (launch_fwd.h). A short tile is a few
// microseconds of math, so the next tile's loads should overlap it: these kernels are
// persistent (causal ones in a balancing order of scheduler.h: the snake, or pairs of
// equal work) and stage O for a TMA store. Their tiles also fit short problems:
// - hdim 64: 128 rows, not 192. Three warpgroups suit long sequences (softmax-bound), but
//   a 192-row tile wastes a third of its rows on a 512-token problem's last tile and,
//   when causal, much of the diagonal.
// - hdim 128 non-causal: 128 keys, not 176 (512 and 1024 are multiples of 128, not 176),
//   and with the persistent loop's registers to spare, O through shared memory.
// - hdim 256: 64 keys, not 80 (the same multiples; also 12 fewer registers, which is what
//   lets its persistent loop fit at all: the 80-key one spilled 88 B; causal still spilled
//   12 B with pingpong, so its short tile runs without).
// A/B on the H200 against the general kernels (bf16, TFLOPs/s, 512 / 1k / 2k tokens):
//   causal hdim 64 +33 / +19 / +7%, hdim 128 +29 / +19 / +11% (one CTA per tile then);
//   non-causal hdim 64 +7 / +2 / -9%, hdim 128 +13 / +6 / +2%, hdim 256 +3 / -5 / -6%;
//   causal hdim 256 (with pingpong) +7 / +2 / -1%.
// The lengths below stop where the general kernel wins. Both lengths count: with few
// queries against many keys (bottom-right aligned) the causal tiles are long and nearly
// equal, which the general kernels handle better.
template <int kHeadDim, bool kIsCausal>
constexpr int short_seq_max_seqlen() {
  if constexpr (kIsCausal) {
    return kHeadDim == 64 || kHeadDim == 128 ? 2048 : kHeadDim == 256 ? 1024 : 0;
  } else {
    return kHeadDim == 64 ? 1024 : kHeadDim == 128 ? 2048 : kHeadDim == 256 ? 512 : 0;
  }
}
template <int kHeadDim, bool kIsCausal>
constexpr int kShortSeqMaxSeqlen = short_seq_max_seqlen<kHeadDim, kIsCausal>();
// Dense causal calls keep the persistent short tile up to these lengths: since its tiles
// walk a balancing order chosen per shape (scheduler.h, scheduler_tail.h), it is ahead
// of one CTA per tile there too (H100 A/B, two passes, paper grid): hdim 128 +2..+8% at
// 3k-12k tokens and +1% at 16k; hdim 256 (64-key tiles against 80) +2..+9% at 2k-12k,
// level at 8k and 16k; hdim 64 (two warpgroups of 128 rows against three of 192) +2%
// at 3k and +4% at 4k, but 5-11% slower from 6k. Only where the grid has at least two
// short tiles per SM (launch_fwd.h): with fewer, a CTA has no next tile to overlap, and
// at hdim 256 the general tile is the faster one (2 x 8 heads x 1243 tokens, 160 tiles:
// 0.90x, H100). Packed batches of (near-)equal lengths, which the persistent kernel walks
// in the dense order, keep them too (launch_fwd.h causal_long_range; H100, two passes:
// hdim 128 +2..+9% at 3k-12k, -3% at 16k; hdim 256 +1..+8%; hdim 64 +1..+3% at 3k-4k);
// long-tailed mixes keep kShortSeqMaxSeqlen. The local mask's causal windows (softcap or
// sinks with causal: launch_fwd.h walks_causal_keys) take the same ranges on its short
// tile, with the dealt tail modelled on the window (at hdim 256 sinks only: softcap keeps
// the general tile there). Not measured past 16k.
template <int kHeadDim>
constexpr int kDenseCausalShortMaxSeqlen =
    kHeadDim == 64 ? 4096 : kHeadDim == 128 || kHeadDim == 256 ? 16384 : kShortSeqMaxSeqlen<kHeadDim, true>;
template <int kHeadDim, bool kIsCausal>
constexpr bool kHasShortSeqTile = kShortSeqMaxSeqlen<kHeadDim, kIsCausal> > 0;
// The local mask (windows, softcap, sinks) also runs on the causal short tile at hdim 64,
// 128 and 256 (launch_fwd.h): for short sequences, and for any sequence where the window spans
// at most kShortSeqMaxSeqlen keys, since a query tile then walks no more key tiles than a
// short causal tile does, and the persistent grid overlaps one tile's loads with the
// previous tile's math. At hdim 256 the short causal tile runs without pingpong (to stay
// clear of spills, TileConfig<256> below), which softcap's tanh needs: there calls with
// softcap keep the general tile (kLocalShortTileTakesSoftcap). H100 A/B against the
// general tile only, 4k / 16k / 32k tokens: window 1024 +10 / +7 / +2%, window 4096 and
// 128 level, softcap with causal on the short tile -4 / -6% (docs/performance.md).
template <int kHeadDim>
constexpr bool kHasLocalShortTile = kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256;
template <int kHeadDim>
constexpr bool kLocalShortTileTakesSoftcap = kHeadDim != 256;

// kHeadDimV: the head dim of V and O where it differs from Q and K's (192 / 128).
template <int kHeadDim, bool kIsCausal, bool kShortSeq, int kHeadDimV = kHeadDim>
struct TileConfig;
template <bool kIsCausal, bool kShortSeq> struct TileConfig<64, kIsCausal, kShortSeq> {
  static constexpr bool kTwoWarpgroups = kShortSeq;
  static constexpr int kConsumerWarpgroups = kTwoWarpgroups ? 2 : 3;
  // 128 keys for every mask. The causal and local tiles had 112 until the mainloop sliced
  // the shared-memory descriptors per warpgroup (mainloop_fwd.h): with the registers that
  // freed, 128 keys fit there without local memory. With the split key-tile loop, 128 keys
  // against 112 (H200): +0.5..+3.5% on most causal cells, -0.8% at 1 x 10000, -1.2% with
  // GQA 2 x 7000. The local kernels, with their one loop, against 112 keys (H100): a 4k
  // window +6%, softcap causal +2%, a 2k window with softcap and a 1k window level.
  static constexpr int kBlockN = 128, kStages = 2;
  static constexpr bool kPersistent = true;
  // Short tiles: free issue measured 2-7% faster than pingpong (A/B, H200, 512-2k).
  static constexpr bool kPingpong = !kShortSeq;
  // The non-causal persistent loop (three warpgroups, 160 registers per consumer) spills
  // 20-28 B with the TMA store; the causal and local ones and two warpgroups have the
  // registers for it.
  static constexpr bool kTmaStoreO = kIsCausal || kTwoWarpgroups;
};
template <bool kIsCausal, bool kShortSeq> struct TileConfig<96, kIsCausal, kShortSeq> {
  static constexpr int kConsumerWarpgroups = 2, kBlockN = 128, kStages = 2;
  static constexpr bool kPersistent = !kIsCausal, kPingpong = true;
  static constexpr bool kTmaStoreO = true;
};
template <bool kIsCausal, bool kShortSeq> struct TileConfig<128, kIsCausal, kShortSeq> {
  static constexpr int kConsumerWarpgroups = 2, kStages = 2;
  // Non-causal 176 keys: 160- and 192-key tiles measured within 1-2% of it (H200 A/B).
  static constexpr int kBlockN = kIsCausal || kShortSeq ? 128 : 176;
  static constexpr bool kPersistent = kShortSeq || !kIsCausal;
  static constexpr bool kPingpong = kIsCausal;
  // Non-causal: the persistent 128x176 tile has no shared memory left to stage O apart
  // from Q, and staging it in Q's buffer holds back the next tile's Q (-2..-11%). The
  // tiles that do leave room (x144, x160) with the TMA store were within +-4% of this
  // one with direct stores (A/B, H200), so it stays on direct stores. Staged over the
  // last K and V stages instead (kOInKVStages) it was 4-5% slower from 4k keys.
  static constexpr bool kTmaStoreO = kIsCausal || kShortSeq;
};
template <bool kIsCausal, bool kShortSeq> struct TileConfig<192, kIsCausal, kShortSeq> {
  static constexpr int kConsumerWarpgroups = 2, kBlockN = 112, kStages = 2;
  static constexpr bool kPersistent = false, kPingpong = true;
  static constexpr bool kTmaStoreO = true;
};
// Q and K of 192, V and O of 128 (DeepSeek-V3-style attention): 128 keys, as the narrower
// V leaves room for (Q 48 KB + 2 stages of K 48 KB and V 32 KB; S 64, P 32 and O 64
// registers per consumer thread).
template <bool kIsCausal, bool kShortSeq> struct TileConfig<192, kIsCausal, kShortSeq, 128> {
  static constexpr int kConsumerWarpgroups = 2, kBlockN = 128, kStages = 2;
  static constexpr bool kPersistent = false, kPingpong = true;
  static constexpr bool kTmaStoreO = true;
};
template <bool kIsCausal, bool kShortSeq> struct TileConfig<256, kIsCausal, kShortSeq> {
  static constexpr int kConsumerWarpgroups = 2, kBlockN = kShortSeq ? 64 : 80, kStages = 2;
  static constexpr bool kPersistent = kShortSeq, kPingpong = !(kShortSeq && kIsCausal);
  // Short tiles too: their O is staged over the last K and V stages (kOInKVStages below);
  // direct stores (Q free after the last Q K^T) had measured 13-14% slower at 512 tokens
  // and 10% at 1k causal than O staged over Q.
  static constexpr bool kTmaStoreO = true;
};

// The tiles of TileConfig (tiles_fwd.h).
template <class Element, int kHeadDim, bool kIsCausal, bool kShortSeq, int kHeadDimV,
          class Config = TileConfig<kHeadDim, kIsCausal, kShortSeq, kHeadDimV>>
using FwdTilesOf = FwdTiles<Element, Config::kConsumerWarpgroups, Config::kBlockN, kHeadDim, kHeadDimV, Config::kStages>;

template <class Element_, int kHeadDim_, bool kIsCausal_, bool kShortSeq_ = false, int kHeadDimV_ = kHeadDim_>
struct KernelTraits : FwdTilesOf<Element_, kHeadDim_, kIsCausal_, kShortSeq_, kHeadDimV_> {
  using Element = Element_;
  using ElementOut = Element;
  using ElementAccum = float;
  using HostParams = FwdParams;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;  // of V and O
  // The PV WGMMA reads V from shared memory as TMA wrote it (traits_fp8.h transposes it).
  static constexpr bool kTransposeV = false;

  using Config = TileConfig<kHeadDim, kIsCausal_, kShortSeq_, kHeadDimV>;
  using Tiles = FwdTilesOf<Element_, kHeadDim_, kIsCausal_, kShortSeq_, kHeadDimV_>;
  static constexpr int kConsumerWarpgroups = Config::kConsumerWarpgroups;
  static constexpr int kProducerWarpgroups = 1;
  static constexpr int kThreads = (kConsumerWarpgroups + kProducerWarpgroups) * cutlass::NumThreadsPerWarpGroup;
  static constexpr int kConsumerThreads = kConsumerWarpgroups * cutlass::NumThreadsPerWarpGroup;

  static constexpr int kBlockM = 64 * kConsumerWarpgroups;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  static constexpr bool kPersistent = Config::kPersistent;
  static constexpr bool kPingpong = Config::kPingpong;
  // How much of the softmax of key tile j + 1 runs under the warpgroup's own
  // O += P(j) V(j) (mainloop_fwd.h; without utils.h run_in_own_block ptxas waits for the
  // GEMM first). H200 A/Bs against the softmax after that GEMM, bitwise-identical outputs:
  // - kHalf (the row max and half the rows' exponentials under the GEMM, O's rescale
  //   beside the other half after it, as in the FP8 kernels): hdim 96 +0..+8% (most at
  //   long non-causal), hdim 128 +0..+3%, hdim 192 +0..+3%; at hdim 64 0.93-1.00 (and its
  //   general non-causal kernel spilled);
  // - kWhole at hdim 256: +1..+3% on all twelve cells; there kHalf gave -1..+4%, ahead
  //   only at 512-1k, which the short tiles (kShortSeq) serve; at hdim 128 kWhole was
  //   within +-2%, at hdim 64 0.87-0.98;
  // - so hdim 64 keeps the old order (kNone): with two or three warpgroups in pingpong
  //   the others' GEMMs already fill the tensor cores during a softmax there, and its
  //   tiles' GEMMs are short against their softmax. kHalf in the general causal kernels
  //   with 192 x 128 tiles and the split key-tile loop: 0.99-1.02 (H100), within noise.
  static constexpr SoftmaxUnderPv kSoftmaxUnderPv =
      kHeadDim == 64                     ? SoftmaxUnderPv::kNone
      : kHeadDim == 256 && !kShortSeq_   ? SoftmaxUnderPv::kWhole
                                         : SoftmaxUnderPv::kHalf;
  // The max kept until a tile raises it by more than 2^8 and O's rescale skipped where no
  // row of a warp changed its max (softmax.h). H200 A/B against the exact rescale every
  // tile: hdim 96, 128, 192 and 256 +0..+7%, no cell below 1.00;
  // hdim 64 0.94-1.01 non-causal and 0.89-0.96 causal: there O's rescale is 32
  // multiplications per tile (64-128 elsewhere), which the row-max test and the warp vote
  // do not pay for, and the softmax runs after the PV GEMM's wait (kNone) anyway.
  static constexpr bool kLazyRescale = kHeadDim != 64;
  // The row max from the scores' bits with 3-input integer maxima, as a tree (softmax.h,
  // utils.h row_max_bits): half the instructions of the FMNMX chain and a short dependency
  // path ahead of the exponentials. H200 A/B against the FMNMX chain (three passes each,
  // bitwise-identical outputs): hdim 64 non-causal +3..+5% from 2k keys, the short causal
  // kernels (<= 2k) +0.5..+4.5%; hdim 128 causal -1..-3%, hdim 128 non-causal and hdim 256
  // within +-1%: there it stays off. The general hdim 64 causal kernel lost 1.5% with 112
  // keys and one loop for masked and unmasked tiles; with 128 keys and the split loop it
  // gains up to 2.2% (most at 12k-16k and in varlen mixes), with softcap -0.9%.
  static constexpr bool kIntRowMax = kHeadDim == 64;
  // One logit scale for the whole kernel (block_scales.h), and the softmax of softmax.h.
  using Scales = NoBlockScales;
  template <int kRows>
  using Softmax = OnlineSoftmax<kRows, kLazyRescale, kIntRowMax>;
  // setmaxnreg: the producer only issues TMA (barriers.h).
  using Registers = RegisterBudget<kConsumerWarpgroups>;
  // The pingpong turns' barrier ids from registers (barriers.h PingpongTurns).
  static constexpr bool kPingpongIdsFromThreadIdx = false;

  // Tile shapes, the Q K^T MMA, Q's and K's layouts: tiles_fwd.h.
  using typename Tiles::TileShapeMNK;
  using typename Tiles::TileShapePV;
  using typename Tiles::AtomLayoutMNK;
  using typename Tiles::TiledMmaQK;
  using typename Tiles::SmemAtomQ;
  using typename Tiles::SmemLayoutQ;
  using typename Tiles::SmemLayoutK;

  // O += P V: P comes from registers (the S accumulator converted in place); V is read
  // from shared memory as an MN-major operand (head dim contiguous), so no transpose
  // is needed for 16-bit types.
  using MmaAtomPV = decltype(GMMA::rs_op_selector<Element, Element, ElementAccum, Shape<_64, Int<kHeadDimV>, Int<kBlockN>>,
                                                   GMMA::Major::K, GMMA::Major::MN>());
  using TiledMmaPV = decltype(make_tiled_mma(MmaAtomPV{}, AtomLayoutMNK{}));
  // One warpgroup's share of it (its 64 rows), for O staged per warpgroup (kOInKVStages).
  using TiledMmaPVWarpgroup = decltype(make_tiled_mma(MmaAtomPV{}));

  // V is stored like K (as TMA brings it: keys x head dim; the same layout where the head
  // dims are equal) ...
  using SmemAtomV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
      GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDimV>>());
  using SmemLayoutV = decltype(tile_to_shape(
      SmemAtomV{}, Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kStages>>{}));
  // ... and read by the PV WGMMA through a transposed view: (head dim, keys, stage).
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{},
      make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // O as the TMA-store epilogue stages it (epilogue_fwd.h): Q's swizzle atom over
  // (kBlockM, kHeadDimV), Q's own layout where the head dims are equal. Row r of O then
  // lies where row r of Q did, for the columns they share, which lets O be staged in Q's
  // buffer one warp's rows at a time.
  using SmemLayoutO = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDimV>>{}));
  static_assert(cute::cosize_v<SmemLayoutO> <= cute::cosize_v<SmemLayoutQ>, "O fits in Q's buffer");

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesV = kBlockN * kHeadDimV * sizeof(Element);
  static constexpr uint32_t kBytesO = kBlockM * kHeadDimV * sizeof(Element);

  // The O epilogue (epilogue_fwd.h): staged in shared memory and stored with TMA where
  // Config::kTmaStoreO says so, else stored straight from registers. The staging buffer
  // has Q's size (per warpgroup, with kOInKVStages below, 64 rows over a K or V stage).
  // A kernel with one tile per CTA reuses Q's buffer:
  // each warp's rows are free once its warpgroup's last Q K^T is done, and Q is handed
  // back to the producer (which has no next tile to load) after the store has read them.
  // A persistent kernel would then hold the next tile's Q load until O has left, so it
  // gets a buffer of its own where shared memory allows (hdim 96 non-causal, the hdim 64
  // and 128 short tiles). The hdim 256 short tiles have no room for one (2 x 64 KB of Q
  // and O beside 128 KB of K/V stages) and stage O over K/V stages (kOInKVStages).
  static constexpr bool kTmaStoreO = Config::kTmaStoreO;
  // kQStages: two Q buffers let the producer load the next tile's Q as soon as it has
  // loaded that tile's first K, one key tile earlier than when Q must wait for the current
  // tile's last Q K^T. On for the hdim 64 short non-causal kernel (H200 A/B: +1.7% at 512
  // tokens, +3.0% at 1k; the short causal kernel measured -0.7..+0.8% and keeps one).
  // Needs room for both Q buffers beside O's own.
  static constexpr int kQStages =
      kHeadDim == 64 && kShortSeq_ && !kIsCausal_ && kTmaStoreO && kPersistent &&
              2 * kBytesQ + kBytesO + kStages * (kBytesK + kBytesV) + 1024 <= 227 * 1024
          ? 2
          : 1;
  static constexpr bool kSmemOSeparate =
      kTmaStoreO && kPersistent && kQStages * kBytesQ + kBytesO + kStages * (kBytesK + kBytesV) + 1024 <= 227 * 1024;
  static_assert(kQStages == 1 || kSmemOSeparate, "O is staged in Q's buffer only where there is one");
  using PipelineStateQ = cutlass::PipelineState<kQStages>;  // which Q buffer, and its phase
  // kOInKVStages: a persistent kernel without room for a separate buffer (the hdim 256
  // short tiles) stages each warpgroup's 64 rows of O over the tile's last V stage
  // (warpgroup 0) and last K stage (warpgroup 1), each kBlockN x d, instead of over Q:
  // Q is then released after the last Q K^T as usual, and what waits for the store is the
  // next tile's second K and V, not its Q (its first K and V go to the other stage).
  // H200 A/B against O over Q (three passes each, outputs bitwise identical): non-causal
  // 512 +3.8%; causal 512 +4.0%, 1k +1.9%.
  static constexpr bool kOInKVStages =
      kTmaStoreO && kPersistent && !kSmemOSeparate && kBlockN >= 64 && kConsumerWarpgroups == 2;
  static constexpr bool kReleaseQAfterEpilogue = kTmaStoreO && !kSmemOSeparate && !kOInKVStages;
  // What the O epilogue reads (epilogue_fwd.h): these traits themselves (traits_fp8.h has
  // its own, for a bf16 output).
  using OutputTraits = KernelTraits;
};

}  // namespace flash3
