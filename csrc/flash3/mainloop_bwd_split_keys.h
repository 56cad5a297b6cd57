// The backward mainloop of head dims up to 128: each consumer warpgroup owns half the keys
// for all GEMMs but dQ, and the two take turns on the tensor cores (MainloopBwd::mma_split_keys).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "mainloop_bwd.h"

namespace flash3 {

using namespace cute;

// kSplitKeys: each warpgroup computes S^T and dP^T for its kBlockN / 2 keys against the
// whole query tile and keeps P^T and dS^T in registers as the A operands of dV and dK.
// Only dQ = dS K needs the other warpgroup's half of dS (through shared memory); it is
// issued two tiles late, so the warpgroups never wait for each other and can take
// turns on the tensor cores (pingpong).
template <class Traits, class Mask>
template <class TensordK, class TensordV>
CUTLASS_DEVICE void MainloopBwd<Traits, Mask>::mma_split_keys(Params const& params, SharedStorage& storage,
                                          PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                          PipelineState& read_q, PipelineStatedO& read_do,
                                          TensordK& tdKrdK, TensordV& tdVrdV,
                                          int thread_idx, int n_block, int m_begin, int m_end,
                                          Seq const& seq) {

  typename Traits::TiledMmaSdP tiled_mma_sdp;
  // dK and dV: one tiled MMA (kSplitKeys has kHeadDimV == kHeadDim, traits_bwd.h).
  typename Traits::TiledMmadK tiled_mma_dkv;
  static_assert(std::is_same_v<typename Traits::TiledMmadK, typename Traits::TiledMmadV>);
  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(thread_idx);
  auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(thread_idx);
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(thread_idx);
  using TileShapeSdPt = typename Traits::TileShapeSdPt;

  Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
  Tensor sQt = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(storage.smem_do.data()), typename Traits::SmemLayoutdOt{});
  Tensor sKt = make_tensor(make_smem_ptr(storage.smem_k.data()), typename Traits::SmemLayoutKt{});
  Tensor sdSt = make_tensor(make_smem_ptr(storage.smem_ds.data()), typename Traits::SmemLayoutdSt{});
  Tensor sdS = make_tensor(make_smem_ptr(storage.smem_ds.data()), typename Traits::SmemLayoutdSForDq{});
  Tensor sLSE = make_tensor(make_smem_ptr(storage.smem_lse.data()), SmemLayoutRow{});
  Tensor sdPsum = make_tensor(make_smem_ptr(storage.smem_dpsum.data()), SmemLayoutRow{});

  Tensor tStrK = thr_mma_sdp.partition_fragment_A(sK);      // (MMA, MMA_N, MMA_K): this warpgroup's keys
  Tensor tStrQ = thr_mma_sdp.partition_fragment_B(sQ);      // (MMA, MMA_M, MMA_K, PIPE)
  Tensor tdPtrV = thr_mma_sdp.partition_fragment_A(sV);     // (MMA, MMA_N, MMA_K)
  Tensor tdPtrdO = thr_mma_sdp.partition_fragment_B(sdO);   // (MMA, MMA_M, MMA_K, PIPE)
  Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_D, MMA_M, PIPE)
  Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(sQt);    // (MMA, MMA_D, MMA_M, PIPE)
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);     // (MMA, MMA_M, MMA_N, PDS)
  Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKt);     // (MMA, MMA_D, MMA_N)
  auto smem_tiled_copy_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma_sdp);
  auto smem_thr_copy_ds = smem_tiled_copy_ds.get_thread_slice(thread_idx);
  Tensor tdSsdS = smem_thr_copy_ds.partition_D(sdSt);  // (CPY, CPY_N, CPY_M, PDS)

  // Tile coordinates (key, query) of each S^T element this thread holds.
  Tensor cSt = make_identity_tensor(select<0, 1>(TileShapeSdPt{}));
  Tensor tStcSt = thr_mma_sdp.partition_C(cSt);
  Tensor tStcSt_rowcol = make_tensor(tStcSt.data(), accumulator_rowcol(tStcSt.layout()));

  Policy const policy = policy_of(params, seq);

  storage.barrier_kv.wait(0);

  int const warpgroup = thread_idx / cutlass::NumThreadsPerWarpGroup;
  int const n_tiles = m_end - m_begin;
  // The warpgroups take turns on the tensor cores: a turn issues S^T and dP^T of query
  // tile t (and dQ of tile t - 2), and the other warpgroup runs its exponentials and dS
  // under it. The turns are what keep them half a tile apart; without them both would
  // issue at once and meet the softmax at the same time, with the tensor cores idle.
  PingpongTurns<Traits::kConsumerWarpgroups, true> const turns{warpgroup};
  turns.start();

  // dQ of tile t needs both warpgroups' dS^T of tile t, but when warpgroup 0 takes its
  // turn t + 1 warpgroup 1 is still computing its dS^T of tile t under it. So dQ of tile
  // t is issued in turn t + 2 (or after the last tile), when both halves have long been
  // written, and dS^T has three buffers: buffer t % 3 is next written by tile t + 3's
  // softmax, which starts after the writer's turn t + 3, and that comes after the other
  // warpgroup's turn t + 2 (dQ of tile t issued and waited for before it passed the
  // turn on).
  auto issue_dq = [&](auto& tdQrdQ, int t) {
    int const buffer = t % Traits::kPdSStages;
    storage.barrier_ds_full[buffer].wait((t / Traits::kPdSStages) & 1);  // both halves of dS^T(t)
    warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_dq, tdQrdS(_, _, _, buffer), tdQrKt, tdQrdQ);
  };
  // In a turn the dQ stores are published only after dP^T is issued (see publish_dq;
  // with dK issued before the dS^T fence, +0..+9% at hdim 128). Not in deterministic
  // mode, whose dQ warp then starts each reduction later and holds up the next key
  // tile's turn (up to 14% slower).
  bool const publish_late = params.dq_semaphore == nullptr;
  auto hand_over = [&](auto& tdQrdQ, int t, bool publish) {
    warpgroup_fence_operand(tdQrdQ);
    hand_over_dq</*kPublish=*/false>(storage, tdQrdQ, thread_idx, t == 0, t % Traits::kStages, t % Traits::kStages);
    if (publish) { publish_dq(storage, thread_idx, t % Traits::kStages); }
  };

  // kDkIntoNextTurn: dK += dS^T Q of tile t runs into turn t + 1, which waits for it
  // before its own dQ hand-over (rather than idling at the end of tile t, which drained
  // the tensor cores between turns), so dS^T's registers, its A operand, outlive the
  // iteration.
  Tensor rdSt = make_tensor<Element>(partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdPt{})).layout());
  PipelineState previous_q = read_q;  // the Q stage dK of the previous tile reads

  // Query tile t of the key tile. masked_tile: cute::true_type or false_type, whether some
  // score of the tile is masked (the tiles under no mask run a copy of the loop without
  // the mask's code: kSeparateMaskedTiles), or TestMaskPerTile (one loop).
  auto query_tile = [&](int t, auto masked_tile) __attribute__((always_inline)) {
    int const m_block = m_begin + t;
    if constexpr (Traits::kDqSplitRows) {
      // Both read states follow from the loop counter (the Q and dO pipelines start with
      // this loop and advance once per tile). Carried across the loop, their phase took
      // a register, and with dQ split by rows the loop spilled. (At hdim 128 deriving
      // them made no difference, so they are carried there.)
      read_q = PipelineState(t % Traits::kStages, (t / Traits::kStages) & 1, t);
      read_do = read_q;
    }
    Tensor tStrSt = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdPt{}));
    Tensor tdPtrdPt = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdPt{}));
    turns.wait_turn();  // LOCK tensor cores
    if (t >= 2) {
      // dQ of tile t - 2 first; it goes to the dQ warp while S^T runs, before dP^T's
      // accumulator is allocated.
      Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, select<0, 1>(TileShapedQ{}));
      issue_dq(tdQrdQ, t - 2);
      pipeline_q.consumer_wait(read_q);
      warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_sdp, tStrK, tStrQ(_, _, _, read_q.index()), tStrSt);
      if constexpr (kDkIntoNextTurn) {
        warpgroup_wait<2>();  // dK of tile t - 1 done: its Q has been read
        warpgroup_fence_operand(rdSt);
        pipeline_q.consumer_release(previous_q);  // UNLOCK Q stage
      }
      warpgroup_wait<1>();  // dQ done
      hand_over(tdQrdQ, t - 2, /*publish=*/!publish_late);
    } else {
      pipeline_q.consumer_wait(read_q);
      warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_sdp, tStrK, tStrQ(_, _, _, read_q.index()), tStrSt);
      if (kDkIntoNextTurn && t == 1) {
        warpgroup_wait<1>();  // dK of tile 0 done
        warpgroup_fence_operand(rdSt);
        pipeline_q.consumer_release(previous_q);  // UNLOCK Q stage
      }
    }
    pipeline_do.consumer_wait(read_do);
    warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_sdp, tdPtrV, tdPtrdO(_, _, _, read_do.index()), tdPtrdPt);
    turns.pass_turn(t == n_tiles - 1);  // UNLOCK tensor cores
    if (publish_late && t >= 2) { publish_dq(storage, thread_idx, (t - 2) % Traits::kStages); }

    Tensor tStrSt_rowcol = make_tensor(tStrSt.data(), accumulator_rowcol(tStrSt.layout()));
    Tensor tdPtrdPt_rowcol = make_tensor(tdPtrdPt.data(), accumulator_rowcol(tdPtrdPt.layout()));
    // P^T = exp2(S^T * scale * log2(e) - lse * log2(e)) while dP^T = V dO^T runs; the
    // statistics are per query, i.e. per column.
    warpgroup_wait<1>();
    warpgroup_fence_operand(tStrSt);
    apply_softcap(params, tStrSt_rowcol);
    if constexpr (std::is_same_v<decltype(masked_tile), TestMaskPerTile>) {
      if (policy.needs_mask(m_block, n_block)) {
        policy.apply_transposed(tStrSt_rowcol, tStcSt_rowcol, m_block, n_block);
      }
    } else if constexpr (decltype(masked_tile)::value) {
      policy.apply_transposed(tStrSt_rowcol, tStcSt_rowcol, m_block, n_block);
    }
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(tStrSt_rowcol); ++ni) {
      float const lse = sLSE(get<1>(tStcSt_rowcol(0, ni)), read_q.index());
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(tStrSt_rowcol); ++mi) {
        tStrSt_rowcol(mi, ni) = exp2f(tStrSt_rowcol(mi, ni) * params.softmax_scale_log2 - lse);
      }
    }
    // dV += P^T dO, P^T straight from the accumulator registers. Issued before dS is
    // computed, so that it runs under that math, where registers allow: the bf16 copy
    // of P^T (kBlockM / 4 registers) is then live beside P^T and dP^T (kBlockM / 2
    // each; dS^T overwrites dP^T), on top of dK and dV.
    Tensor rPt = make_tensor<Element>(tStrSt.layout());
    auto issue_dv = [&] {
      convert_into(tStrSt, rPt);
      Tensor tdVrPt = make_tensor(rPt.data(), accumulator_as_operand_a(rPt.layout()));
      warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_dkv, tdVrPt, tdVrdOt(_, _, _, read_do.index()), tdVrdV);
    };
    if constexpr (kDvBeforeDs) {
      issue_dv();
      warpgroup_wait<1>();  // dP^T done; dV may still run
    } else {
      warpgroup_wait<0>();  // dP^T done
    }
    warpgroup_fence_operand(tdPtrdPt);

    // dS^T = P^T * (dP^T - dPsum).
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(tdPtrdPt_rowcol); ++ni) {
      float const dpsum = sdPsum(get<1>(tStcSt_rowcol(0, ni)), read_do.index());
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(tdPtrdPt_rowcol); ++mi) {
        tdPtrdPt_rowcol(mi, ni) = tStrSt_rowcol(mi, ni) * (tdPtrdPt_rowcol(mi, ni) - dpsum);
      }
    }
    if (has_softcap(params)) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(tdPtrdPt_rowcol); ++ni) {
        float const lse = sLSE(get<1>(tStcSt_rowcol(0, ni)), read_q.index());
        CUTE_UNROLL
        for (int mi = 0; mi < size<0>(tdPtrdPt_rowcol); ++mi) {
          tdPtrdPt_rowcol(mi, ni) *= softcap_dtanh(params, tStrSt_rowcol(mi, ni), lse);
        }
      }
    }
    if constexpr (!kDvBeforeDs) { issue_dv(); }
    convert_into(tdPtrdPt, rdSt);
    // dS^T to shared memory for the dQ GEMMs of both warpgroups (see issue_dq).
    copy(smem_tiled_copy_ds, smem_thr_copy_ds.retile_S(rdSt), tdSsdS(_, _, _, t % Traits::kPdSStages));
    // dK += dS^T Q, from registers, issued before the fence below waits for the stores.
    // It and dV queue behind the other warpgroup's turn.
    Tensor tdKrdSt = make_tensor(rdSt.data(), accumulator_as_operand_a(rdSt.layout()));
    warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_dkv, tdKrdSt, tdKrQt(_, _, _, read_q.index()), tdKrdK);
    // The generic-proxy stores must be visible to the WGMMAs (async proxy) of both
    // warpgroups before either reads the buffer.
    cutlass::arch::fence_view_async_shared();
    storage.barrier_ds_full[t % Traits::kPdSStages].arrive();
    if constexpr (kDkIntoNextTurn) {
      warpgroup_wait<1>();  // dV done: dO has been read
      previous_q = read_q;
    } else {
      warpgroup_wait<0>();  // dV and dK done: dO and Q have been read
      pipeline_q.consumer_release(read_q);  // UNLOCK Q stage
    }
    pipeline_do.consumer_release(read_do);  // UNLOCK dO stage
    if constexpr (!Traits::kDqSplitRows) {
      ++read_q;
      ++read_do;
    }
  };
  if constexpr (Mask::kIsLocal || !Traits::kSeparateMaskedTiles) {
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0; t < n_tiles; ++t) { query_tile(t, TestMaskPerTile{}); }
  } else {
    // The masked tiles first (the diagonal's; all of them on the keys' last, partial tile),
    // then the rest (mask.h masked_prefix).
    int const t_unmasked = policy.masked_prefix(n_block, m_begin, m_end);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0; t < t_unmasked; ++t) { query_tile(t, cute::true_type{}); }
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = t_unmasked; t < n_tiles; ++t) { query_tile(t, cute::false_type{}); }
  }
  if constexpr (kDkIntoNextTurn) {
    warpgroup_wait<0>();  // dK of the last tile
    warpgroup_fence_operand(rdSt);
    pipeline_q.consumer_release(previous_q);  // UNLOCK Q stage
  }
  // The dQ of the last two tiles, outside the turns.
  CUTLASS_PRAGMA_NO_UNROLL
  for (int t = max(n_tiles - 2, 0); t < n_tiles; ++t) {
    Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, select<0, 1>(TileShapedQ{}));
    issue_dq(tdQrdQ, t);
    warpgroup_wait<0>();
    hand_over(tdQrdQ, t, /*publish=*/true);
  }
}

}  // namespace flash3
