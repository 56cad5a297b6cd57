// The forward mainloop, for 16-bit and e4m3 inputs alike: the producer's TMA loads of Q,
// K and V into shared memory (and, for e4m3, the producer warpgroup's transpose of V into
// V^T; mainloop_fwd_loads.h), and the consumers' WGMMAs and online softmax over the key
// tiles. What the element type changes comes from the traits (traits.h, traits_fp8.h):
// kTransposeV and the pipelines (pipelines_fwd.h), the block scales (block_scales.h), the
// softmax (softmax.h, softmax_fp8.h) and P's operand.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "barriers.h"
#include "mask.h"
#include "operand_p.h"
#include "paged_kv.h"
#include "params.h"
#include "pipelines_fwd.h"
#include "seqlen.h"
#include "softmax.h"
#include "tma.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

// kVarlen: packed batches (seqlen.h), whose key slots past seqused_k may hold anything,
// and whose K and V may be paged (paged_kv.h).
template <class Traits, class Mask, bool kVarlen = false>
struct MainloopFwd {
  using Element = typename Traits::Element;
  static constexpr bool kTransposeV = Traits::kTransposeV;
  static_assert(!(kTransposeV && kVarlen), "packed batches: 16-bit inputs only");
  static_assert(!kTransposeV || Traits::kQStages == 1, "load_transposing loads Q into its only buffer");
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  static constexpr int kConsumerThreads = Traits::kConsumerThreads;
  using TileShapeMNK = typename Traits::TileShapeMNK;
  using SmemLayoutQ = typename Traits::SmemLayoutQ;
  using SmemLayoutK = typename Traits::SmemLayoutK;
  using SmemLayoutV = typename Traits::SmemLayoutV;
  using SmemLayoutVt = typename Traits::SmemLayoutVt;
  using Pipelines = FwdPipelines<Traits>;
  using PipelineK = typename Pipelines::PipelineK;
  using PipelineV = typename Pipelines::PipelineV;
  using PipelinePV = typename Pipelines::PipelinePV;  // what the PV GEMM reads: V, or V^T
  using PipelineState = typename Pipelines::PipelineState;
  using ProducerState = typename Pipelines::ProducerState;
  using Policy = MaskPolicy<Mask, kBlockM, kBlockN>;
  using Scales = typename Traits::Scales;
  using OperandP = flash3::OperandP<Element, typename Traits::TileShapePV, kTransposeV>;  // operand_p.h

  using Loads = FwdLoadsTma<Traits>;  // tma.h; for e4m3 V is staged with K's layout, then transposed
  static constexpr int kQStages = Traits::kQStages;
  static constexpr int kQStageElements = cute::cosize_v<SmemLayoutQ>;

  struct StorageQKV {
    cute::array_aligned<Element, kQStageElements * kQStages, 1024> smem_q;  // kQStages buffers
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> smem_v;
  };
  struct StorageQKVVt : StorageQKV {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutVt>, 1024> smem_vt;
  };
  using SharedStorage = std::conditional_t<kTransposeV, StorageQKVVt, StorageQKV>;
  // The PV GEMM's B operand: V as TMA wrote it, or V^T.
  CUTLASS_DEVICE static Element* smem_pv(SharedStorage& storage) {
    if constexpr (kTransposeV) { return storage.smem_vt.data(); } else { return storage.smem_v.data(); }
  }
  // One stage of K and of the PV operand, in bytes (the stage is the outermost mode).
  static constexpr int kStageBytesK = cute::cosize_v<SmemLayoutK> / Traits::kStages * sizeof(Element);
  static constexpr int kStageBytesPV = cute::cosize_v<SmemLayoutVt> / Traits::kStages * sizeof(Element);

  // The local-mask kernels' options (params.h); other kernels hold none (an empty base).
  struct NoOptions {
    static NoOptions make(FwdParams const&) { return {}; }
  };
  struct LocalOptions {
    int window_left;
    int window_right;
    float tanh_prescale;  // 0: no softcap
    float const* sinks;   // null: no sinks
    static LocalOptions make(FwdParams const& p) {
      return {p.window_left, p.window_right, p.tanh_prescale(), p.sinks_ptr};
    }
  };
  using Options = std::conditional_t<Mask::kIsLocal, LocalOptions, NoOptions>;
  // Paged K and V have one head dim (the binding checks it).
  using Pages = std::conditional_t<kVarlen && kHeadDimV == kHeadDim, PagedKV<Traits>, NoPagedKV>;

  // tma_q, tma_k, tma_v, shape_q, shape_k, shape_v from Loads; e4m3: the block scales.
  struct Params : Loads, Options, Pages, Scales {
    SeqLayout seqs;  // seqlen.h: each tile's sequence
    int head_group;  // nheads / nheads_k: query heads per K/V head
    RowsPerQuery rows_per_query;  // packed batches: query rows per query position (params.h, mask.h)
    // From the scores the softmax sees (q.k, or under softcap tanh(...)) to logits, in
    // natural-log and log2 units (params.h logit_scale).
    float softmax_scale;
    float softmax_scale_log2;
  };

  static Params to_params(typename Traits::HostParams const& p) {
    return {Loads::make(p),
            Options::make(p),
            Pages::make(p),
            Scales::make(p),
            p.seq_layout(),
            p.nheads / p.nheads_k,
            RowsPerQuery::of(p.rows_per_query),
            p.logit_scale(),
            p.logit_scale_log2()};
  }

  CUTLASS_DEVICE static Policy policy_of(Params const& params, Seq const& seq) {
    int window_left = 0, window_right = 0;
    if constexpr (Mask::kIsLocal) {
      window_left = params.window_left;
      window_right = params.window_right;
    }
    if constexpr (kVarlen) {  // GQA-packed rows and split-KV parts (mask.h)
      int const queries = params.rows_per_query.divide(seq.seqlen_q);
      return {seq.seqlen_q, seq.seqlen_k, window_left, window_right, seq.seqlen_k + seq.keys_after - queries,
              params.rows_per_query};
    } else {
      return {seq.seqlen_q, seq.seqlen_k, window_left, window_right};
    }
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    params.Loads::prefetch_descriptors();
    params.Pages::prefetch_descriptors();
  }

  // Whether query tile m_block sees any key.
  CUTLASS_DEVICE static bool has_keys(Params const& params, Seq const& seq, int m_block) {
    Policy const policy = policy_of(params, seq);
    return policy.n_block_end(m_block) > policy.n_block_begin(m_block);
  }

  CUTLASS_DEVICE static Element* smem_q_stage(SharedStorage& storage, int q_stage) {
    return storage.smem_q.data() + (kQStages > 1 ? q_stage * kQStageElements : 0);
  }

  // Producer, one tile: load_direct on the producer warp's elected thread (tma_thread)
  // for 16-bit inputs, load_transposing on every producer thread for e4m3.
  CUTLASS_DEVICE static void load(Params const& params, SharedStorage& storage,
                                  cutlass::arch::ClusterTransactionBarrier& barrier_q_full,
                                  cutlass::arch::ClusterBarrier& barrier_q_empty, int q_phase, int q_stage,
                                  Pipelines& pipelines, ProducerState& state, int m_block, int head, Seq const& seq,
                                  bool tma_thread, int thread_idx) {
    if constexpr (kTransposeV) {
      load_transposing(params, storage, barrier_q_full, barrier_q_empty, q_phase, pipelines, state.transpose, m_block,
                       head, seq, tma_thread, thread_idx);
    } else {
      load_direct(params, storage, barrier_q_full, barrier_q_empty, q_phase, q_stage, pipelines.k, pipelines.v,
                  state.k, state.v, m_block, head, seq);
    }
  }

  // The two producers (mainloop_fwd_loads.h).
  CUTLASS_DEVICE static void load_direct(Params const& params, SharedStorage& storage,
                                         cutlass::arch::ClusterTransactionBarrier& barrier_q_full,
                                         cutlass::arch::ClusterBarrier& barrier_q_empty, int q_phase, int q_stage,
                                         PipelineK& pipeline_k, PipelineV& pipeline_v,
                                         PipelineState& write_k, PipelineState& write_v,
                                         int m_block, int head, Seq const& seq);
  CUTLASS_DEVICE static void load_transposing(Params const& params, SharedStorage& storage,
                                              cutlass::arch::ClusterTransactionBarrier& barrier_q_full,
                                              cutlass::arch::ClusterBarrier& barrier_q_empty, int q_phase,
                                              Pipelines& pipelines, PipelineState& transpose, int m_block, int head,
                                              Seq const& seq, bool tma_thread, int thread_idx);

  // Packed batches with seqused_k (a KV cache): the key slots past a sequence's length
  // may hold anything, NaN included. Their scores are masked to -inf, but a zero weight
  // times a NaN of V is still NaN, so the rows of the partial last key tile's V stage past
  // the length are zeroed before the first O += P V reads them. Every consumer thread
  // zeroes a share, makes its stores visible to the tensor cores' (async) proxy and meets
  // the others at a named barrier, before its turn (no turn is held while waiting).
  // Not inlined: its registers then stay out of the mainloop's allocation (inlined, the
  // persistent hdim 256 kernels spilled).
  __device__ __noinline__ static void zero_v_tail(SharedStorage& storage, int stage, int first_row, int thread_idx) {
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    int const elements = (kBlockN - first_row) * kHeadDimV;
    for (int i = thread_idx; i < elements; i += kConsumerThreads) {
      sV(first_row + i / kHeadDimV, i % kHeadDimV, stage) = Element(0);
    }
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(kConsumerThreads, NamedBarrier::VTailZeroed);
  }

  // Consumers: returns the output accumulator of this thread (normalised) and the
  // logsumexp of its rows. Iteration j issues S(j+1) = Q K(j+1)^T and O += P(j) V(j)
  // together, then runs the softmax of S(j+1) while O's GEMM is still in flight
  // (the intra-warpgroup overlap of the paper). With Traits::kPingpong the consumer
  // warpgroups take turns to issue their GEMMs (barriers.h PingpongTurns).
  template <class TensorO>
  CUTLASS_DEVICE static auto mma(Params const& params, SharedStorage& storage,
                                 cutlass::arch::ClusterTransactionBarrier& barrier_q_full,
                                 cutlass::arch::ClusterBarrier& barrier_q_empty, int q_phase, int q_stage,
                                 PipelineK& pipeline_k, PipelinePV& pipeline_v,
                                 PipelineState& read_k, PipelineState& read_v,
                                 TensorO& tOrO, int thread_idx, int m_block, int head, Seq const& seq) {
    using TiledMmaQK = typename Traits::TiledMmaQK;
    using TiledMmaPV = typename Traits::TiledMmaPV;
    TiledMmaQK tiled_mma_qk;
    TiledMmaPV tiled_mma_pv;
    auto thr_mma_qk = tiled_mma_qk.get_thread_slice(thread_idx);
    // The shared-memory operands' descriptors depend only on the warpgroup: sliced from a
    // warp-uniform index (a shuffle from lane 0), ptxas keeps them in uniform registers
    // rather than copying them from vector registers (R2UR) before every GEMM.
    int const warpgroup_first_thread =
        __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0) * cutlass::NumThreadsPerWarpGroup;
    auto wg_mma_qk = tiled_mma_qk.get_slice(warpgroup_first_thread);
    auto wg_mma_pv = tiled_mma_pv.get_slice(warpgroup_first_thread);

    Tensor sQ = make_tensor(make_smem_ptr(smem_q_stage(storage, q_stage)), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem_pv(storage)), SmemLayoutVt{});
    Tensor tSrQ = wg_mma_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
    Tensor tSrK = wg_mma_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tOrV = wg_mma_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, PIPE)

    // Coordinates (row, col) within the tile of each S element this thread holds.
    Tensor cS = make_identity_tensor(select<0, 1>(TileShapeMNK{}));
    Tensor tScS_rowcol = make_tensor(thr_mma_qk.partition_C(cS).data(),
                                     accumulator_rowcol(thr_mma_qk.partition_C(cS).layout()));

    Policy const policy = policy_of(params, seq);
    int const n_begin = policy.n_block_begin(m_block);
    int const n_end = policy.n_block_end(m_block);
    constexpr int kRows = decltype(size<0>(tScS_rowcol))::value;
    typename Traits::template Softmax<kRows> softmax(params.softmax_scale_log2);
    Tensor tOrO_rowcol = make_tensor(tOrO.data(), accumulator_rowcol(tOrO.layout()));

    // Normalises O and returns the rows' logsumexp; attention sinks join the sum there.
    auto finalize = [&] {
      if constexpr (Mask::kIsLocal) {
        if (params.sinks != nullptr) {
          return softmax.template finalize</*kSink=*/true>(tOrO_rowcol, params.softmax_scale, params.sinks[head]);
        }
      }
      return softmax.finalize(tOrO_rowcol, params.softmax_scale);
    };

    // No key: written with 0 for the masks whose key tiles start at 0, which ptxas lays out
    // better in the FP8 hdim 256 causal kernel (10 local-memory instructions, against 18
    // with n_begin; CUDA 13.0).
    if (n_end <= (Mask::kIsLocal ? n_begin : 0)) {
      clear(tOrO);
      return finalize();
    }
    int const warpgroup = thread_idx / cutlass::NumThreadsPerWarpGroup;
    PingpongTurns<Traits::kConsumerWarpgroups, Traits::kPingpong, Traits::kPingpongIdsFromThreadIdx> const turns{
        warpgroup};
    turns.start();
    // e4m3: this warpgroup's rows' Q scale and the key tiles' K/V scales (block_scales.h).
    auto const scales = params.Scales::rows(params.softmax_scale_log2, seq.batch, head, head / params.head_group,
                                            m_block, warpgroup, thread_idx);
    if constexpr (kVarlen) {
      // Before any accumulator is live: later (after the first tile's softmax, or in the
      // loop) the hdim 64 and 256 kernels spilled. The first S = Q K^T then waits for V too.
      if (params.seqs.seqused_k != nullptr && seq.seqlen_k < n_end * kBlockN) {
        pipeline_v.consumer_wait(read_v);  // the first V stage, waited on again below
        zero_v_tail(storage, read_v.index(), seq.seqlen_k - (n_end - 1) * kBlockN, thread_idx);
      }
    }

    // The key tiles' loop, compiled twice in the local kernels: with softcap's tanh
    // (kSoftcap) and without it, so that windows and sinks run the loop they ran before
    // softcap's code joined it (a branch per tile on the option cost them 4% at hdim 128, H100).
    float softcap_prescale = 0.f;  // what multiplies q.k before the tanh; 0: no softcap
    if constexpr (Mask::kIsLocal) { softcap_prescale = params.tanh_prescale; }
    auto key_tiles = [&](auto softcap) __attribute__((always_inline)) {
      constexpr bool kSoftcap = decltype(softcap)::value;
      // Softcap (local kernels): on a tile under the mask the tanh comes first (tanh(-inf)
      // would be -1); elsewhere the softmax takes it inside the row max (softmax.h
      // update_row_maxes), given tanh_in_max(masked) as the prescale.
      auto compute_scores = [&](auto& tSrS, int n_block, bool masked, auto const& tile_scales) {
        Tensor tSrS_rowcol = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
        if (masked) {
          if constexpr (kSoftcap) { softmax.apply_tanh(tSrS_rowcol, softcap_prescale, tile_scales); }
          policy.apply(tSrS_rowcol, tScS_rowcol, m_block, n_block);
        }
        return tSrS_rowcol;
      };
      auto tanh_in_max = [&](bool masked) {
        if constexpr (kSoftcap) { return masked ? 0.f : softcap_prescale; } else { return 0.f; }
      };

      int n_block = n_end - 1;
      auto tile_scales = scales.tile(n_block);
      barrier_q_full.wait(q_phase);
      uint32_t const zero = opaque_zero(seq.seqlen_q);  // utils.h run_in_own_block

      // First key tile: S only.
      Tensor tSrS = partition_fragment_C(tiled_mma_qk, select<0, 1>(TileShapeMNK{}));
      pipeline_k.consumer_wait(read_k);
      turns.wait_turn();
      warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
      turns.template pass_turn</*kFinalIssue=*/false>();
      warpgroup_wait<0>();
      // UNLOCK K stage (the tile's last one: after O's store, where O is staged over it)
      if (!(Traits::kOInKVStages && n_block == n_begin)) { pipeline_k.consumer_release(read_k); }
      ++read_k;
      // UNLOCK sQ: that was the last Q K^T (unless O is staged there: the kernel hands it back)
      if (n_block == n_begin && !Traits::kReleaseQAfterEpilogue) { barrier_q_empty.arrive(); }
      {
        bool const masked = policy.needs_mask(m_block, n_block);
        Tensor tSrS_rowcol = compute_scores(tSrS, n_block, masked, tile_scales);
        softmax.template online_update</*kFirstTile=*/true, kSoftcap>(tSrS_rowcol, tile_scales, masked,
                                                                       tanh_in_max(masked));
      }
      Tensor rP = OperandP::make(tiled_mma_pv, tSrS);
      Tensor tOrP = OperandP::as_operand_a(rP);
      OperandP::convert(tSrS, rP);
      clear(tOrO);

      // Key tile n_block after the first. masked_tile: cute::true_type or false_type, whether
      // some score of the tile is masked (the tiles under no mask run a loop without the
      // mask's code), or TestMaskPerTile (the local kernels).
      auto key_tile = [&](int n_block, auto masked_tile) __attribute__((always_inline)) {
        tile_scales = scales.tile(n_block);
        Tensor tSrS_next = partition_fragment_C(tiled_mma_qk, select<0, 1>(TileShapeMNK{}));
        pipeline_k.consumer_wait(read_k);
        pipeline_v.consumer_wait(read_v);
        turns.wait_turn();
        warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS_next);
        warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        turns.template pass_turn</*kFinalIssue=*/false>();
        warpgroup_wait<1>();  // S(j+1) has landed; O += P(j) V(j) may still run
        // UNLOCK K stage (the tile's last one: after O's store, where O is staged over it)
        if (!(Traits::kOInKVStages && n_block == n_begin)) { pipeline_k.consumer_release(read_k); }
        ++read_k;
        // UNLOCK sQ: that was the last Q K^T (unless O is staged there: the kernel hands it back)
        if (n_block == n_begin && !Traits::kReleaseQAfterEpilogue) { barrier_q_empty.arrive(); }
        bool const masked = [&] {  // also the softmax's row max path
          if constexpr (std::is_same_v<decltype(masked_tile), TestMaskPerTile>) {
            return policy.needs_mask(m_block, n_block);
          } else {
            return decltype(masked_tile)::value;
          }
        }();
        Tensor tSrS_rowcol = compute_scores(tSrS_next, n_block, masked, tile_scales);
        float const tanh_prescale = tanh_in_max(masked);
        Tensor correction = make_tensor<float>(Layout<Int<kRows>>{});
        if constexpr (Traits::kSoftmaxUnderPv == SoftmaxUnderPv::kWhole) {
          // The softmax of S(j+1) runs while O += P(j) V(j) is in flight: in a block of its
          // own, or ptxas hoists the wait below above it (utils.h run_in_own_block).
          run_in_own_block(zero, [&] {
            correction = softmax.template online_update</*kFirstTile=*/false, kSoftcap>(tSrS_rowcol, tile_scales, masked,
                                                                                    tanh_prescale);
          });
        } else if constexpr (Traits::kSoftmaxUnderPv == SoftmaxUnderPv::kHalf) {
          // The row max and the first half of the rows' exponentials run under O += P(j) V(j);
          // O's rescale then fills the issue slots that the second half's exponentials leave
          // free (they wait on the MUFU pipe).
          run_in_own_block(zero, [&] {
            softmax.template update_row_maxes</*kFirstTile=*/false, kSoftcap>(tSrS_rowcol, tile_scales, correction, masked,
                                                                               tanh_prescale);
            CUTE_UNROLL
            for (int mi = 0; mi < kRows / 2; ++mi) { softmax.exponentiate_row(tSrS_rowcol, mi, tile_scales, correction(mi)); }
          });
        } else {
          correction = softmax.template online_update</*kFirstTile=*/false, kSoftcap>(tSrS_rowcol, tile_scales, masked,
                                                                                    tanh_prescale);
        }
        warpgroup_wait<0>();  // O += P(j) V(j) done: P(j)'s registers and the V stage are free
        pipeline_v.consumer_release(read_v);  // UNLOCK V (V^T) stage
        ++read_v;
        softmax.rescale_if_needed(tOrO_rowcol, correction);
        if constexpr (Traits::kSoftmaxUnderPv == SoftmaxUnderPv::kHalf) {
          CUTE_UNROLL
          for (int mi = kRows / 2; mi < kRows; ++mi) { softmax.exponentiate_row(tSrS_rowcol, mi, tile_scales, correction(mi)); }
        }
        OperandP::convert(tSrS_next, rP);
      };
      if constexpr (Mask::kIsLocal) {
        // One loop that tests each tile. Split like the others (up to six copies of the loop
        // with softcap's), no local cell gained against this loop (H100 and H200, windows
        // and softcap at hdim 64 and 128: 0.98-1.03, within the runs' noise).
        CUTLASS_PRAGMA_NO_UNROLL
        for (--n_block; n_block >= n_begin; --n_block) { key_tile(n_block, TestMaskPerTile{}); }
      } else {
        // The masked tiles above the unmasked ones (causal), then those (mask.h unmasked_end).
        if constexpr (Mask::kIsCausal) {
          int const unmasked_end = policy.unmasked_end(m_block, n_begin, n_end);
          CUTLASS_PRAGMA_NO_UNROLL
          for (--n_block; n_block >= unmasked_end; --n_block) { key_tile(n_block, cute::true_type{}); }
          ++n_block;
        }
        CUTLASS_PRAGMA_NO_UNROLL
        for (--n_block; n_block >= n_begin; --n_block) { key_tile(n_block, cute::false_type{}); }
      }

      // Last key tile: O += P V only.
      pipeline_v.consumer_wait(read_v);
      turns.wait_turn();
      warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
      turns.template pass_turn</*kFinalIssue=*/true>();
      warpgroup_wait<0>();
      // UNLOCK V (V^T) stage (where O is staged over it: after O's store, by the kernel)
      if constexpr (!Traits::kOInKVStages) { pipeline_v.consumer_release(read_v); }
      ++read_v;

      return finalize();
    };
    if constexpr (Mask::kIsLocal) {
      if (softcap_prescale != 0.f) { return key_tiles(cute::true_type{}); }
    }
    return key_tiles(cute::false_type{});
  }
};

}  // namespace flash3
