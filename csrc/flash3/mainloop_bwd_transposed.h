// The backward mainloop of head dim 256 outside deterministic mode (Traits::kTransposed):
// 80-key tiles; S and dP split by keys (40 per warpgroup); dV^T, dK^T and dQ^T with the
// head dim as M, each warpgroup issuing its two 64-row slices one at a time; dQ^T added to
// the float32 workspace with float4 atomics from registers (MainloopBwd::mma_transposed).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "mainloop_bwd.h"

namespace flash3 {

using namespace cute;

// Per query tile, after S and dP:
//   P -> sP (one buffer), barrier; dV^T slice 0;
//   dS -> sdS (one buffer), barrier; dQ^T slice 0, dV^T slice 1;
//   dQ^T slice 0 to the workspace (atomics) under dV^T slice 1, then dK^T slice 0 and
//   dQ^T slice 1; slice 1's atomics under dK^T slice 0's tail and dK^T slice 1.
// dQ^T's slices take the same 32 registers in turn: with dK^T and dV^T (160) and S and
// dP (40) that is what a consumer thread's 240 hold.
template <class Traits, class Mask>
template <class TensordK, class TensordV>
CUTLASS_DEVICE void MainloopBwd<Traits, Mask>::mma_transposed(Params const& params, SharedStorage& storage,
                                          PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                          PipelineState& read_q, PipelineStatedO& read_do,
                                          TensordK& tdKrdK, TensordV& tdVrdV,
                                          int thread_idx, int n_block, int head, int m_begin, int m_end,
                                          Seq const& seq) {
  static_assert(Traits::kTransposed && Traits::kPdSStages == 1 && Traits::kStagesdO == 1);
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
  Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);    // (MMA, MMA_M, MMA_K, 1)
  Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);      // (MMA, MMA_N, MMA_K)
  Tensor tdVrdOt = thr_mma_dv.partition_fragment_A(sdOt);   // (MMA, 2 slices, MMA_K, 1): dO^T (d, queries)
  Tensor tdVrPt = thr_mma_dv.partition_fragment_B(sPt);     // (MMA, MMA_N, MMA_K, 1): P as (keys, queries)
  Tensor tdKrQt = thr_mma_dk.partition_fragment_A(sQt);     // (MMA, 2 slices, MMA_K, PIPE): Q^T (d, queries)
  Tensor tdKrdSt = thr_mma_dk.partition_fragment_B(sdSt);   // (MMA, MMA_N, MMA_K, 1): dS as (keys, queries)
  Tensor tdQrKt = thr_mma_dq.partition_fragment_A(sKt);     // (MMA, 2 slices, MMA_K): K^T (d, keys)
  Tensor tdQrdS = thr_mma_dq.partition_fragment_B(sdS);     // (MMA, MMA_N, MMA_K, 1): dS (queries, keys)
  auto smem_tiled_copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, tiled_mma_sdp);
  auto smem_thr_copy_pds = smem_tiled_copy_pds.get_thread_slice(thread_idx);
  Tensor tPsP = smem_thr_copy_pds.partition_D(sP);    // (CPY, CPY_M, CPY_N, 1)
  Tensor tPsdS = smem_thr_copy_pds.partition_D(sdS);  // (CPY, CPY_M, CPY_N, 1)

  // Tile coordinates (row, col) of each S element this thread holds.
  Tensor cS = make_identity_tensor(select<0, 1>(TileShapeSdP{}));
  Tensor tScS = thr_mma_sdp.partition_C(cS);
  Tensor tScS_rowcol = make_tensor(tScS.data(), accumulator_rowcol(tScS.layout()));

  Policy const policy = policy_of(params, seq);
  // This thread's float4s of a query tile's dQ^T in the workspace (register order,
  // Traits::dq_float4_index): a warp's atomics cover 512 contiguous bytes.
  float4* const dq_head = reinterpret_cast<float4*>(params.dq_accum) +
                          ((int64_t(seq.batch) * params.nheads + head) * params.dq_m_blocks +
                           seq.offset_q_padded / kBlockM) * (Traits::kDqElements / 4);
  float4* const dq_thread = dq_head + Traits::dq_float4_index(0, thread_idx);
  constexpr int kFloat4sPerSlice = Traits::kDqElements / 4 / Traits::kConsumerThreads / 2;
  constexpr int kFloat4Stride = cutlass::NumThreadsPerWarpGroup;  // dq_float4_index(i + 4, t) - dq_float4_index(i, t)

  storage.barrier_kv.wait(0);

  CUTLASS_PRAGMA_NO_UNROLL
  for (int m_block = m_begin; m_block < m_end; ++m_block) {
    Tensor tSrS = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdP{}));
    Tensor tdPrdP = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdP{}));
    Tensor tSrS_rowcol = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
    Tensor tdPrdP_rowcol = make_tensor(tdPrdP.data(), accumulator_rowcol(tdPrdP.layout()));
    pipeline_q.consumer_wait(read_q);
    warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_sdp, tSrQ(_, _, _, read_q.index()), tSrK, tSrS);
    pipeline_do.consumer_wait(read_do);
    warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_sdp, tdPrdO(_, _, _, _0{}), tdPrV, tdPrdP);

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
    Tensor rP = make_tensor<Element>(tSrS.layout());
    convert_into(tSrS, rP);
    // The one P buffer and the one dS buffer: both warpgroups' GEMMs of the previous
    // tile (each waited for its own before leaving it) are done with them.
    named_barrier_sync(kConsumerThreads, NamedBarrier::PdSEmpty);
    copy(smem_tiled_copy_pds, smem_thr_copy_pds.retile_S(rP), tPsP(_, _, _, _0{}));
    // Generic-proxy stores, read by the WGMMAs (async proxy) of both warpgroups.
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(kConsumerThreads, NamedBarrier::PFull);
    warpgroup_gemm_slice</*kZeroInit=*/false, 0>(tiled_mma_dv, tdVrdOt(_, _, _, _0{}), tdVrPt(_, _, _, _0{}), tdVrdV);

    // dS = P * (dP - dPsum).
    warpgroup_wait<1>();  // dP done; dV^T slice 0 may still run
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
      copy(smem_tiled_copy_pds, smem_thr_copy_pds.retile_S(rdS), tPsdS(_, _, _, _0{}));
    }
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(kConsumerThreads, NamedBarrier::dSFull);

    float4* const dq_tile = dq_thread + int64_t(m_block) * (Traits::kDqElements / 4);
    Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, select<0, 1>(TileShapedQ{}));  // (MMA, 2 slices, MMA_N)
    static_assert(decltype(size<1>(tdQrdQ))::value == 2 && size(tdQrdQ) == 8 * kFloat4sPerSlice);
    auto add_dq_slice = [&](auto slice) {
      constexpr int kSlice = decltype(slice)::value;
      CUTE_UNROLL
      for (int j = 0; j < kFloat4sPerSlice; ++j) {
        int const i = 4 * (kSlice * kFloat4sPerSlice + j);
        atomicAdd(dq_tile + (kSlice * kFloat4sPerSlice + j) * kFloat4Stride,
                  make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3)));
      }
    };
    warpgroup_gemm_slice</*kZeroInit=*/true, 0>(tiled_mma_dq, tdQrKt, tdQrdS(_, _, _, _0{}), tdQrdQ);
    warpgroup_gemm_slice</*kZeroInit=*/false, 1>(tiled_mma_dv, tdVrdOt(_, _, _, _0{}), tdVrPt(_, _, _, _0{}), tdVrdV);
    warpgroup_wait<1>();  // dQ^T slice 0 done (dV^T slice 1 runs)
    add_dq_slice(_0{});
    warpgroup_gemm_slice</*kZeroInit=*/false, 0>(tiled_mma_dk, tdKrQt(_, _, _, read_q.index()), tdKrdSt(_, _, _, _0{}),
                                                 tdKrdK);
    warpgroup_wait<1>();  // dV^T done: this warpgroup no longer reads dO
    pipeline_do.consumer_release(read_do);  // UNLOCK dO stage
    warpgroup_gemm_slice</*kZeroInit=*/true, 1>(tiled_mma_dq, tdQrKt, tdQrdS(_, _, _, _0{}), tdQrdQ);
    warpgroup_gemm_slice</*kZeroInit=*/false, 1>(tiled_mma_dk, tdKrQt(_, _, _, read_q.index()), tdKrdSt(_, _, _, _0{}),
                                                 tdKrdK);
    warpgroup_wait<1>();  // dQ^T slice 1 done (dK^T slice 1 runs)
    add_dq_slice(_1{});
    warpgroup_wait<0>();  // dK^T done: this warpgroup no longer reads Q (nor P, dS)
    pipeline_q.consumer_release(read_q);  // UNLOCK Q stage
    ++read_q;
    ++read_do;
  }
}

}  // namespace flash3
