// The backward mainloop of head dims 192 and 256: the consumer warpgroups split the keys for
// S and dP and the head dim for dV, dK and dQ, in lockstep (MainloopBwd::mma_lockstep).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "mainloop_bwd.h"

namespace flash3 {

using namespace cute;

// Without kSplitKeys: the warpgroups split the keys for S and dP but the head dim for
// dV, dK and dQ, so P and dS both go through shared memory, a barrier each per tile.
template <class Traits, class Mask>
template <class TensordK, class TensordV>
CUTLASS_DEVICE void MainloopBwd<Traits, Mask>::mma_lockstep(Params const& params, SharedStorage& storage,
                                        PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                        PipelineState& read_q, PipelineStatedO& read_do,
                                        TensordK& tdKrdK, TensordV& tdVrdV,
                                        int thread_idx, int n_block, int m_begin, int m_end,
                                        Seq const& seq) {

  typename Traits::TiledMmaSdP tiled_mma_sdp;
  typename Traits::TiledMmadK tiled_mma_dk;
  typename Traits::TiledMmadV tiled_mma_dv;
  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(thread_idx);
  auto thr_mma_dk = tiled_mma_dk.get_thread_slice(thread_idx);
  auto thr_mma_dv = tiled_mma_dv.get_thread_slice(thread_idx);
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(thread_idx);

  Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
  Tensor sQt = make_tensor(make_smem_ptr(storage.smem_q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(storage.smem_do.data()), typename Traits::SmemLayoutdOt{});
  Tensor sKt = make_tensor(make_smem_ptr(storage.smem_k.data()), typename Traits::SmemLayoutKt{});
  Tensor sP = make_tensor(make_smem_ptr(storage.smem_p.data()), typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(make_smem_ptr(storage.smem_ds.data()), typename Traits::SmemLayoutPdS{});
  Tensor sPt = make_tensor(make_smem_ptr(storage.smem_p.data()), typename Traits::SmemLayoutPdSt{});
  Tensor sdSt = make_tensor(make_smem_ptr(storage.smem_ds.data()), typename Traits::SmemLayoutPdSt{});
  Tensor sLSE = make_tensor(make_smem_ptr(storage.smem_lse.data()), SmemLayoutRow{});
  Tensor sdPsum = make_tensor(make_smem_ptr(storage.smem_dpsum.data()), SmemLayoutRow{});

  Tensor tSrQ = thr_mma_sdp.partition_fragment_A(sQ);       // (MMA, MMA_M, MMA_K, PIPE)
  Tensor tSrK = thr_mma_sdp.partition_fragment_B(sK);       // (MMA, MMA_N, MMA_K)
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);    // (MMA, MMA_M, MMA_K, PIPE): K over dv
  Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);      // (MMA, MMA_N, MMA_K)
  Tensor tdVrPt = thr_mma_dv.partition_fragment_A(sPt);     // (MMA, MMA_M, MMA_K, PDS)
  Tensor tdVrdOt = thr_mma_dv.partition_fragment_B(sdOt);   // (MMA, MMA_N, MMA_K, PIPE): N over dv / 2
  Tensor tdKrdSt = thr_mma_dk.partition_fragment_A(sdSt);   // (MMA, MMA_M, MMA_K, PDS)
  Tensor tdKrQt = thr_mma_dk.partition_fragment_B(sQt);     // (MMA, MMA_N, MMA_K, PIPE)
  Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);     // (MMA, MMA_M, MMA_K, PDS)
  Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKt);     // (MMA, MMA_N, MMA_K)
  // Where this thread's S accumulator elements go in sP / sdS.
  // P and dS go to shared memory with STSM (stmatrix): four 8x8 matrices per
  // instruction, one address per thread, instead of a 4-byte store per column pair.
  auto smem_tiled_copy_pds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma_sdp);
  auto smem_thr_copy_pds = smem_tiled_copy_pds.get_thread_slice(thread_idx);
  Tensor tPsP = smem_thr_copy_pds.partition_D(sP);    // (CPY, CPY_M, CPY_N, PDS)
  Tensor tPsdS = smem_thr_copy_pds.partition_D(sdS);  // (CPY, CPY_M, CPY_N, PDS)

  // Tile coordinates (row, col) of each S element this thread holds.
  Tensor cS = make_identity_tensor(select<0, 1>(TileShapeSdP{}));
  Tensor tScS = thr_mma_sdp.partition_C(cS);
  Tensor tScS_rowcol = make_tensor(tScS.data(), accumulator_rowcol(tScS.layout()));

  Policy const policy = policy_of(params, seq);

  storage.barrier_kv.wait(0);

  // S = Q K^T and dP = dO V^T of one query tile, issued as two WGMMA batches.
  auto issue_sdp = [&](auto& tSrS, auto& tdPrdP, PipelineState const& q_stage, PipelineState const& do_stage) {
    pipeline_q.consumer_wait(q_stage);
    warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_sdp, tSrQ(_, _, _, q_stage.index()), tSrK, tSrS);
    pipeline_do.consumer_wait(do_stage);
    warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_sdp, tdPrdO(_, _, _, do_stage.index()), tdPrV, tdPrdP);
  };

  int pds = 0;  // the P/dS buffer of this query tile

  // One query tile, from S and dP in flight to dQ handed to the dQ warp.
  auto process_tile = [&](auto& tSrS, auto& tdPrdP, int m_block) {
    Tensor tSrS_rowcol = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
    Tensor tdPrdP_rowcol = make_tensor(tdPrdP.data(), accumulator_rowcol(tdPrdP.layout()));
    // P = exp2(S * scale * log2(e) - lse * log2(e)) while dO V^T runs.
    warpgroup_wait<1>();
    apply_softcap(params, tSrS_rowcol);
    if (policy.needs_mask(m_block, n_block)) { policy.apply(tSrS_rowcol, tScS_rowcol, m_block, n_block); }
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(tSrS_rowcol); ++mi) {
      float const lse = sLSE(get<0>(tScS_rowcol(mi, 0)), read_q.index());
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(tSrS_rowcol); ++ni) {
        tSrS_rowcol(mi, ni) = exp2f(tSrS_rowcol(mi, ni) * params.softmax_scale_log2 - lse);
      }
    }
    // P to shared memory first, so that dV += P^T dO runs while dS is computed.
    // Buffer pds was last read by tile m - 2's GEMMs, which both warpgroups finished
    // before arriving at tile m - 1's barriers.
    {
      Tensor rP = make_tensor<Element>(tSrS.layout());
      convert_into(tSrS, rP);
      copy(smem_tiled_copy_pds, smem_thr_copy_pds.retile_S(rP), tPsP(_, _, _, pds));
    }
    // The generic-proxy stores must be visible to the WGMMAs (async proxy) of both
    // warpgroups before either reads the buffer.
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(kConsumerThreads, NamedBarrier::PFull);
    warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_dv, tdVrPt(_, _, _, pds), tdVrdOt(_, _, _, read_do.index()), tdVrdV);

    // dS = P * (dP - dPsum).
    warpgroup_wait<1>();  // dP done; dV may still run
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(tdPrdP_rowcol); ++mi) {
      float const dpsum = sdPsum(get<0>(tScS_rowcol(mi, 0)), read_do.index());
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(tdPrdP_rowcol); ++ni) {
        tdPrdP_rowcol(mi, ni) = tSrS_rowcol(mi, ni) * (tdPrdP_rowcol(mi, ni) - dpsum);
      }
    }
    if (has_softcap(params)) {
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(tdPrdP_rowcol); ++mi) {
        float const lse = sLSE(get<0>(tScS_rowcol(mi, 0)), read_q.index());
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(tdPrdP_rowcol); ++ni) {
          tdPrdP_rowcol(mi, ni) *= softcap_dtanh(params, tSrS_rowcol(mi, ni), lse);
        }
      }
    }
    {
      Tensor rdS = make_tensor<Element>(tdPrdP.layout());
      convert_into(tdPrdP, rdS);
      copy(smem_tiled_copy_pds, smem_thr_copy_pds.retile_S(rdS), tPsdS(_, _, _, pds));
    }
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(kConsumerThreads, NamedBarrier::dSFull);

    Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, select<0, 1>(TileShapedQ{}));
    if constexpr (Traits::kDqViaSmem) {
      warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_dk, tdKrdSt(_, _, _, pds), tdKrQt(_, _, _, read_q.index()), tdKrdK);
      warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_dq, tdQrdS(_, _, _, pds), tdQrKt, tdQrdQ);
      warpgroup_wait<0>();
      hand_over_dq(storage, tdQrdQ, thread_idx, m_block == m_begin, read_q.index(), read_do.index());
    } else {
      // dQ goes over the tile's Q stage (warpgroup 0's half) and dO stage (warpgroup
      // 1's). The dO stage is dead once both warpgroups' dV is done, the Q stage only
      // once both dK are, so dQ is issued before dK and warpgroup 1 hands its half
      // over while dK runs; the dQ warp reduces that half first (store_dq).
      int const warpgroup = thread_idx / cutlass::NumThreadsPerWarpGroup;
      warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_dq, tdQrdS(_, _, _, pds), tdQrKt, tdQrdQ);
      warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_dk, tdKrdSt(_, _, _, pds), tdKrQt(_, _, _, read_q.index()), tdKrdK);
      // Each stage goes back to the producer as soon as this warpgroup's GEMMs are done
      // with it; the producer also waits for the dQ warp to have read the dQ half
      // written over it (barrier_dq_read).
      // (The WGMMA waits stay outside the branches on the warpgroup: inside them ptxas
      // serialised every WGMMA.)
      warpgroup_wait<1>();  // dV (issued before) and dQ done: this warpgroup no longer reads dO
      if (warpgroup == 0) {
        named_barrier_arrive(kConsumerThreads, NamedBarrier::dOStageRead);
        pipeline_do.consumer_release(read_do);  // UNLOCK dO stage
      } else {
        named_barrier_sync(kConsumerThreads, NamedBarrier::dOStageRead);  // LOCK dO stage for dQ
        pipeline_do.consumer_release(read_do);  // UNLOCK dO stage
        hand_over_dq_over_stages(storage, tdQrdQ, thread_idx, read_q.index(), read_do.index());
      }
      warpgroup_wait<0>();  // dK done: this warpgroup no longer reads Q
      if (warpgroup == 0) {
        named_barrier_sync(kConsumerThreads, NamedBarrier::QStageRead);  // LOCK Q stage for dQ
        hand_over_dq_over_stages(storage, tdQrdQ, thread_idx, read_q.index(), read_do.index());
      } else {
        named_barrier_arrive(kConsumerThreads, NamedBarrier::QStageRead);
      }
    }
    pipeline_q.consumer_release(read_q);  // UNLOCK Q stage
    ++read_q;
    if constexpr (Traits::kDqViaSmem) { pipeline_do.consumer_release(read_do); }  // UNLOCK dO stage
    ++read_do;
    pds ^= 1;
  };

  CUTLASS_PRAGMA_NO_UNROLL
  for (int m_block = m_begin; m_block < m_end; ++m_block) {
    // Fresh accumulators per tile: nothing stays live across the loop's back edge.
    Tensor tSrS = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdP{}));
    Tensor tdPrdP = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdP{}));
    issue_sdp(tSrS, tdPrdP, read_q, read_do);
    process_tile(tSrS, tdPrdP, m_block);
  }
}

}  // namespace flash3
