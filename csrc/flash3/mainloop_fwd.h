// The forward mainloop: the producer's TMA loads of Q, K and V into shared memory, and
// the consumers' WGMMAs and online softmax over the key tiles.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "barriers.h"
#include "mask.h"
#include "paged_kv.h"
#include "params.h"
#include "seqlen.h"
#include "softmax.h"
#include "tma.h"
#include "traits.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

// kVarlen: packed batches (seqlen.h), whose key slots past seqused_k may hold anything,
// and whose K and V may be paged (paged_kv.h).
template <class Traits, class Mask, bool kVarlen = false>
struct MainloopFwd {
  using Element = typename Traits::Element;
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
  using PipelineK = typename Traits::PipelineK;
  using PipelineV = typename Traits::PipelineV;
  using PipelineState = typename Traits::PipelineState;
  using Policy = MaskPolicy<Mask, kBlockM, kBlockN>;

  using Loads = FwdLoadsTma<Traits>;  // tma.h

  static constexpr int kQStages = Traits::kQStages;
  static constexpr int kQStageElements = cute::cosize_v<SmemLayoutQ>;

  struct SharedStorage {
    cute::array_aligned<Element, kQStageElements * kQStages, 1024> smem_q;  // kQStages buffers
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> smem_v;
  };

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

  // tma_q, tma_k, tma_v, shape_q, shape_k, shape_v from Loads.
  struct Params : Loads, Options, Pages {
    SeqLayout seqs;  // seqlen.h: each tile's sequence
    int head_group;  // nheads / nheads_k: query heads per K/V head
    int rows_per_query;  // packed batches: query rows per query position (params.h)
    // From the scores the softmax sees (q.k, or under softcap tanh(...)) to logits, in
    // natural-log and log2 units (params.h logit_scale).
    float softmax_scale;
    float softmax_scale_log2;
  };

  static Params to_params(FwdParams const& p) {
    return {Loads::make(p), Options::make(p), Pages::make(p), p.seq_layout(), p.nheads / p.nheads_k, p.rows_per_query,
            p.logit_scale(), p.logit_scale_log2()};
  }

  CUTLASS_DEVICE static Policy policy_of(Params const& params, Seq const& seq) {
    int window_left = 0, window_right = 0;
    if constexpr (Mask::kIsLocal) {
      window_left = params.window_left;
      window_right = params.window_right;
    }
    if constexpr (kVarlen) {  // GQA-packed rows and split-KV parts (mask.h)
      int const queries = params.rows_per_query == 1 ? seq.seqlen_q : seq.seqlen_q / params.rows_per_query;
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

  // Producer: one elected thread of the producer warp. Q once, then K and V tile by
  // tile from the last key tile down (the masked tiles first, see mask.h). K and V have
  // separate pipelines so that S = Q K^T can start before V has landed. The first K goes
  // out before Q: it only needs a free stage, while Q must wait until the consumers are
  // done with the previous tile's Q.
  CUTLASS_DEVICE static void load(Params const& params, SharedStorage& storage,
                                  cutlass::arch::ClusterTransactionBarrier& barrier_q_full,
                                  cutlass::arch::ClusterBarrier& barrier_q_empty, int q_phase, int q_stage,
                                  PipelineK& pipeline_k, PipelineV& pipeline_v,
                                  PipelineState& write_k, PipelineState& write_v,
                                  int m_block, int head, Seq const& seq) {
    Policy const policy = policy_of(params, seq);
    int const n_begin = policy.n_block_begin(m_block);
    int const n_end = policy.n_block_end(m_block);
    if (n_end <= n_begin) { return; }
    int const head_kv = head / params.head_group;

    Tensor sQ = make_tensor(make_smem_ptr(smem_q_stage(storage, q_stage)), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});

    // The sequence's rows (from its first row in packed tensors).
    Tensor mQ = domain_offset(make_coord(seq.offset_q, _0{}),
                              params.tma_q.get_tma_tensor(params.shape_q)(_, _, head, seq.batch));     // (seqlen_q, d)
    Tensor mK = domain_offset(make_coord(seq.offset_k, _0{}),
                              params.tma_k.get_tma_tensor(params.shape_k)(_, _, head_kv, seq.batch));  // (seqlen_k, d)
    Tensor mV = domain_offset(make_coord(seq.offset_k, _0{}),
                              params.tma_v.get_tma_tensor(params.shape_v)(_, _, head_kv, seq.batch));  // (seqlen_k, dv)
    Tensor gQ = local_tile(mQ, select<0, 2>(TileShapeMNK{}), make_coord(m_block, _0{}));  // (M, d)
    Tensor gK = local_tile(mK, select<1, 2>(TileShapeMNK{}), make_coord(_, _0{}));        // (N, d, n)
    Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, _0{}));  // (N, dv, n)

    auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));  // (TMA), (TMA)
    // (TMA, n), (TMA, PIPE); not structured bindings, which C++17 lambdas cannot capture.
    auto const tK = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto const tV = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

    // Key tile n_block of K or V into a stage: one box, or through the page table.
    auto load_tile = [&](auto is_v, auto const& tma, auto const& tXgX, auto const& tXsX, auto& sX, uint64_t* barrier,
                         int n_block, int stage) {
      if (params.paged()) {
        params.template load_tile<decltype(is_v)::value>(tma, params.shape_k, *barrier, sX(_, _, stage), head_kv,
                                                         seq.offset_k + n_block * kBlockN,
                                                         seq.offset_k + seq.seqlen_k);
      } else {
        copy(tma.with(*barrier), tXgX(_, n_block), tXsX(_, stage));
      }
    };
    auto load_k = [&](int n_block) {
      pipeline_k.producer_acquire(write_k);
      load_tile(cute::false_type{}, params.tma_k, get<0>(tK), get<1>(tK), sK, pipeline_k.producer_get_barrier(write_k),
                n_block, write_k.index());
      ++write_k;
    };
    auto load_v = [&](int n_block) {
      pipeline_v.producer_acquire(write_v);
      load_tile(cute::true_type{}, params.tma_v, get<0>(tV), get<1>(tV), sV, pipeline_v.producer_get_barrier(write_v),
                n_block, write_v.index());
      ++write_v;
    };

    int n_block = n_end - 1;
    // K first: the first GEMM needs only Q and K.
    load_k(n_block);
    // The empty barrier starts in phase 0; waiting on the opposite parity passes at once
    // for the first tile.
    barrier_q_empty.wait(q_phase ^ 1);  // LOCK sQ
    barrier_q_full.arrive_and_expect_tx(Traits::kBytesQ);
    copy(params.tma_q.with(reinterpret_cast<cutlass::arch::ClusterTransactionBarrier::ValueType&>(barrier_q_full)),
         tQgQ, tQsQ);
    load_v(n_block);
    CUTLASS_PRAGMA_NO_UNROLL
    for (--n_block; n_block >= n_begin; --n_block) {
      load_k(n_block);
      load_v(n_block);
    }
  }

  // Pingpong between the consumer warpgroups: a warpgroup waits for its turn before
  // issuing WGMMAs and hands the turn to the next one (in a ring) right after issuing
  // them, so that while one warpgroup's GEMMs occupy the tensor cores the others run
  // their softmax. Each barrier counts the waiting warpgroup and the one handing over.
  // Where Traits::kPingpong is off the warpgroups issue freely and the hardware's warp
  // scheduler interleaves them (measured faster for some tiles, see traits.h).
  struct WarpScheduler {
    static constexpr int kWarpgroups = Traits::kConsumerWarpgroups;
    static constexpr int kBarrierThreads = 2 * cutlass::NumThreadsPerWarpGroup;
    int warpgroup;  // index among the consumers
    int slots;      // how many times this warpgroup issues GEMMs for the tile
    int issued = 0;

    // Warpgroup 0 goes first: the last warpgroup hands it the first turn.
    CUTLASS_DEVICE void start() const {
      if (!Traits::kPingpong) { return; }
      if (warpgroup == kWarpgroups - 1 && slots > 0) {
        named_barrier_arrive(kBarrierThreads, warp_scheduler_barrier(0));
      }
    }
    CUTLASS_DEVICE void wait_turn() const {
      if (!Traits::kPingpong) { return; }
      named_barrier_sync(kBarrierThreads, warp_scheduler_barrier(warpgroup));  // LOCK: the tensor cores are ours
    }
    // Every warpgroup issues the same number of times per tile; the last warpgroup's
    // final hand-over would have no matching wait (its first one was start()), so it is
    // skipped and the barriers are balanced at every tile boundary.
    CUTLASS_DEVICE void pass_turn() {
      if (!Traits::kPingpong) { return; }
      ++issued;
      if (!(warpgroup == kWarpgroups - 1 && issued == slots)) {
        named_barrier_arrive(kBarrierThreads, warp_scheduler_barrier((warpgroup + 1) % kWarpgroups));  // UNLOCK
      }
    }
  };

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
  // (the intra-warpgroup overlap of the paper).
  template <class TensorO>
  CUTLASS_DEVICE static auto mma(Params const& params, SharedStorage& storage,
                                 cutlass::arch::ClusterTransactionBarrier& barrier_q_full,
                                 cutlass::arch::ClusterBarrier& barrier_q_empty, int q_phase, int q_stage,
                                 PipelineK& pipeline_k, PipelineV& pipeline_v,
                                 PipelineState& read_k, PipelineState& read_v,
                                 TensorO& tOrO, int thread_idx, int m_block, int head, Seq const& seq) {
    using TiledMmaQK = typename Traits::TiledMmaQK;
    using TiledMmaPV = typename Traits::TiledMmaPV;
    TiledMmaQK tiled_mma_qk;
    TiledMmaPV tiled_mma_pv;
    auto thr_mma_qk = tiled_mma_qk.get_thread_slice(thread_idx);
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);

    Tensor sQ = make_tensor(make_smem_ptr(smem_q_stage(storage, q_stage)), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutVt{});
    Tensor tSrQ = thr_mma_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr_mma_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tOrV = thr_mma_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, PIPE)

    // Coordinates (row, col) within the tile of each S element this thread holds.
    Tensor cS = make_identity_tensor(select<0, 1>(TileShapeMNK{}));
    Tensor tScS_rowcol = make_tensor(thr_mma_qk.partition_C(cS).data(),
                                     accumulator_rowcol(thr_mma_qk.partition_C(cS).layout()));

    Policy const policy = policy_of(params, seq);
    int const n_begin = policy.n_block_begin(m_block);
    int const n_end = policy.n_block_end(m_block);
    constexpr int kRows = decltype(size<0>(tScS_rowcol))::value;
    OnlineSoftmax<kRows, Traits::kLazyRescale, Traits::kIntRowMax> softmax(params.softmax_scale_log2);
    Tensor tOrO_rowcol = make_tensor(tOrO.data(), accumulator_rowcol(tOrO.layout()));

    int const warpgroup = thread_idx / cutlass::NumThreadsPerWarpGroup;
    WarpScheduler scheduler{warpgroup, n_end > n_begin ? n_end - n_begin + 1 : 0};
    scheduler.start();

    // Normalises O and returns the rows' logsumexp; attention sinks join the sum there.
    auto finalize = [&] {
      if constexpr (Mask::kIsLocal) {
        if (params.sinks != nullptr) {
          return softmax.template finalize</*kSink=*/true>(tOrO_rowcol, params.softmax_scale, params.sinks[head]);
        }
      }
      return softmax.finalize(tOrO_rowcol, params.softmax_scale);
    };

    if (n_end <= n_begin) {
      clear(tOrO);
      return finalize();
    }
    if constexpr (kVarlen) {
      // Before any accumulator is live: later (after the first tile's softmax, or in the
      // loop) the hdim 64 and 256 kernels spilled. The first S = Q K^T then waits for V too.
      if (params.seqs.seqused_k != nullptr && seq.seqlen_k < n_end * kBlockN) {
        pipeline_v.consumer_wait(read_v);  // the first V stage, waited on again below
        zero_v_tail(storage, read_v.index(), seq.seqlen_k - (n_end - 1) * kBlockN, thread_idx);
      }
    }

    auto compute_scores = [&](auto& tSrS, int n_block) {
      Tensor tSrS_rowcol = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
      if constexpr (Mask::kIsLocal) {
        // Softcap before the mask: tanh(-inf) would be -1.
        if (params.tanh_prescale != 0.f) { apply_tanh(tSrS_rowcol, params.tanh_prescale); }
      }
      if (policy.needs_mask(m_block, n_block)) { policy.apply(tSrS_rowcol, tScS_rowcol, m_block, n_block); }
      return tSrS_rowcol;
    };

    barrier_q_full.wait(q_phase);
    uint32_t const zero = opaque_zero(seq.seqlen_q);  // utils.h run_in_own_block

    // First key tile: S only.
    int n_block = n_end - 1;
    Tensor tSrS = partition_fragment_C(tiled_mma_qk, select<0, 1>(TileShapeMNK{}));
    pipeline_k.consumer_wait(read_k);
    scheduler.wait_turn();
    warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
    scheduler.pass_turn();
    warpgroup_wait<0>();
    // UNLOCK K stage (the tile's last one: after O's store, where O is staged over it)
    if (!(Traits::kOInKVStages && n_block == n_begin)) { pipeline_k.consumer_release(read_k); }
    ++read_k;
    // UNLOCK sQ: that was the last Q K^T (unless O is staged there: the kernel hands it back)
    if (n_block == n_begin && !Traits::kReleaseQAfterEpilogue) { barrier_q_empty.arrive(); }
    {
      Tensor tSrS_rowcol = compute_scores(tSrS, n_block);
      bool const masked = policy.needs_mask(m_block, n_block);
      softmax.template online_update</*kFirstTile=*/true>(tSrS_rowcol, masked);
    }
    // P(j) in the element type, read by the PV WGMMA as its register A operand.
    Tensor rP = make_tensor<Element>(tSrS.layout());
    Tensor tOrP = make_tensor(rP.data(), accumulator_as_operand_a(rP.layout()));
    convert_into(tSrS, rP);
    clear(tOrO);

    CUTLASS_PRAGMA_NO_UNROLL
    for (--n_block; n_block >= n_begin; --n_block) {
      Tensor tSrS_next = partition_fragment_C(tiled_mma_qk, select<0, 1>(TileShapeMNK{}));
      pipeline_k.consumer_wait(read_k);
      pipeline_v.consumer_wait(read_v);
      scheduler.wait_turn();
      warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS_next);
      warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
      scheduler.pass_turn();
      warpgroup_wait<1>();  // S(j+1) has landed; O += P(j) V(j) may still run
      // UNLOCK K stage (the tile's last one: after O's store, where O is staged over it)
      if (!(Traits::kOInKVStages && n_block == n_begin)) { pipeline_k.consumer_release(read_k); }
      ++read_k;
      // UNLOCK sQ: that was the last Q K^T (unless O is staged there: the kernel hands it back)
      if (n_block == n_begin && !Traits::kReleaseQAfterEpilogue) { barrier_q_empty.arrive(); }
      Tensor tSrS_rowcol = compute_scores(tSrS_next, n_block);
      bool const masked = policy.needs_mask(m_block, n_block);  // the softmax's row max path
      Tensor correction = make_tensor<float>(Layout<Int<kRows>>{});
      if constexpr (Traits::kSoftmaxUnderPv == SoftmaxUnderPv::kWhole) {
        // The softmax of S(j+1) runs while O += P(j) V(j) is in flight: in a block of its
        // own, or ptxas hoists the wait below above it (utils.h run_in_own_block).
        run_in_own_block(zero, [&] { correction = softmax.template online_update</*kFirstTile=*/false>(tSrS_rowcol, masked); });
      } else if constexpr (Traits::kSoftmaxUnderPv == SoftmaxUnderPv::kHalf) {
        // The row max and the first half of the rows' exponentials run under O += P(j) V(j);
        // O's rescale then fills the issue slots that the second half's exponentials leave
        // free (they wait on the MUFU pipe).
        run_in_own_block(zero, [&] {
          softmax.template update_row_maxes</*kFirstTile=*/false>(tSrS_rowcol, correction, masked);
          CUTE_UNROLL
          for (int mi = 0; mi < kRows / 2; ++mi) { softmax.exponentiate_row(tSrS_rowcol, mi, correction(mi)); }
        });
      } else {
        correction = softmax.template online_update</*kFirstTile=*/false>(tSrS_rowcol, masked);
      }
      warpgroup_wait<0>();  // O += P(j) V(j) done: P(j)'s registers and the V stage are free
      pipeline_v.consumer_release(read_v);  // UNLOCK V stage
      ++read_v;
      softmax.rescale_if_needed(tOrO_rowcol, correction);
      if constexpr (Traits::kSoftmaxUnderPv == SoftmaxUnderPv::kHalf) {
        CUTE_UNROLL
        for (int mi = kRows / 2; mi < kRows; ++mi) { softmax.exponentiate_row(tSrS_rowcol, mi, correction(mi)); }
      }
      convert_into(tSrS_next, rP);
    }

    // Last key tile: O += P V only.
    pipeline_v.consumer_wait(read_v);
    scheduler.wait_turn();
    warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
    scheduler.pass_turn();
    warpgroup_wait<0>();
    // UNLOCK V stage (where O is staged over it: after O's store, by the kernel)
    if constexpr (!Traits::kOInKVStages) { pipeline_v.consumer_release(read_v); }
    ++read_v;

    return finalize();
  }
};

}  // namespace flash3
