// The backward mainloop: the producer's TMA loads (K and V of the CTA's key tile once;
// Q with its lse and dO with its dPsum per query tile, pipelined), and the consumers'
// five WGMMAs per query tile with dQ summed into a float32 workspace.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "barriers.h"
#include "mask.h"
#include "params.h"
#include "traits_bwd.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

template <class Traits, class Mask>
struct MainloopBwd {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kConsumerThreads = Traits::kConsumerThreads;
  using TileShapeSdP = typename Traits::TileShapeSdP;
  using TileShapedQ = typename Traits::TileShapedQ;
  using SmemLayoutQ = typename Traits::SmemLayoutQ;
  using SmemLayoutdO = typename Traits::SmemLayoutdO;
  using SmemLayoutK = typename Traits::SmemLayoutK;
  using SmemLayoutV = typename Traits::SmemLayoutV;
  using SmemLayoutRow = typename Traits::SmemLayoutRow;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelinedO = typename Traits::PipelinedO;
  using PipelineState = typename Traits::PipelineState;
  using Policy = MaskPolicy<Mask, kBlockM, kBlockN>;

  // (seqlen, headdim, head, batch) as in the forward; the row statistics are
  // (seqlen_q_padded, head, batch), contiguous.
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using ShapeRow = Shape<int32_t, int32_t, int32_t>;
  using StrideRow = Stride<_1, int64_t, int64_t>;

  static auto make_tma_q(Element const* ptr, ShapeQKV const& shape, StrideQKV const& stride) {
    Tensor gmem = make_tensor(make_gmem_ptr(ptr), shape, stride);
    return make_tma_copy(SM90_TMA_LOAD{}, gmem, take<0, 2>(SmemLayoutQ{}), select<0, 2>(TileShapeSdP{}), _1{});
  }
  static auto make_tma_k(Element const* ptr, ShapeQKV const& shape, StrideQKV const& stride) {
    Tensor gmem = make_tensor(make_gmem_ptr(ptr), shape, stride);
    return make_tma_copy(SM90_TMA_LOAD{}, gmem, SmemLayoutK{}, select<1, 2>(TileShapeSdP{}), _1{});
  }
  static auto make_tma_row(float const* ptr, ShapeRow const& shape, StrideRow const& stride) {
    Tensor gmem = make_tensor(make_gmem_ptr(ptr), shape, stride);
    return make_tma_copy(SM90_TMA_LOAD{}, gmem, take<0, 1>(SmemLayoutRow{}), Shape<Int<kBlockM>>{}, _1{});
  }
  using TmaQ = decltype(make_tma_q(nullptr, ShapeQKV{}, StrideQKV{}));
  using TmaK = decltype(make_tma_k(nullptr, ShapeQKV{}, StrideQKV{}));
  using TmaRow = decltype(make_tma_row(nullptr, ShapeRow{}, StrideRow{}));

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdO>, 1024> smem_do;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> smem_v;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutPdS>, 1024> smem_p;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutPdS>, 1024> smem_ds;
    cute::array_aligned<float, cute::cosize_v<SmemLayoutRow>, 128> smem_lse;
    cute::array_aligned<float, cute::cosize_v<SmemLayoutRow>, 128> smem_dpsum;
    cute::array_aligned<float, Traits::kDqViaSmem ? Traits::kDqElements : 4, 128> smem_dq;
  };

  struct Params {
    TmaQ tma_q;
    TmaQ tma_do;
    TmaK tma_k;
    TmaK tma_v;
    TmaRow tma_lse;
    TmaRow tma_dpsum;
    ShapeQKV shape_q;
    ShapeQKV shape_k;
    ShapeRow shape_row;
    int seqlen_q;
    int seqlen_k;
    int nheads;
    int head_group;
    float softmax_scale_log2;
    float* dq_accum;
    int* dq_semaphore;  // null unless deterministic
  };

  static Params to_params(BwdParams const& p) {
    ShapeQKV shape_q = make_shape(p.seqlen_q, p.headdim, p.nheads, p.batch);
    ShapeQKV shape_k = make_shape(p.seqlen_k, p.headdim, p.nheads_k, p.batch);
    ShapeRow shape_row = make_shape(p.seqlen_q_padded, p.nheads, p.batch);
    StrideRow stride_row = make_stride(_1{}, int64_t(p.seqlen_q_padded), int64_t(p.seqlen_q_padded) * p.nheads);
    return {make_tma_q(static_cast<Element const*>(p.q_ptr), shape_q,
                       make_stride(p.q_row_stride, _1{}, p.q_head_stride, p.q_batch_stride)),
            make_tma_q(static_cast<Element const*>(p.do_ptr), shape_q,
                       make_stride(p.do_row_stride, _1{}, p.do_head_stride, p.do_batch_stride)),
            make_tma_k(static_cast<Element const*>(p.k_ptr), shape_k,
                       make_stride(p.k_row_stride, _1{}, p.k_head_stride, p.k_batch_stride)),
            make_tma_k(static_cast<Element const*>(p.v_ptr), shape_k,
                       make_stride(p.v_row_stride, _1{}, p.v_head_stride, p.v_batch_stride)),
            make_tma_row(p.lse_log2_ptr, shape_row, stride_row),
            make_tma_row(p.dpsum_ptr, shape_row, stride_row),
            shape_q, shape_k, shape_row, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads / p.nheads_k,
            p.softmax_scale_log2, p.dq_accum_ptr, p.deterministic ? p.dq_semaphore_ptr : nullptr};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_lse.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_dpsum.get_tma_descriptor());
  }

  // Query tiles [m_begin, m_end) see some key of key tile n_block. Under the causal mask
  // (bottom-right aligned: row i sees key j iff j <= i + seqlen_k - seqlen_q) the first
  // row that sees the tile's first key is n_block * kBlockN - (seqlen_k - seqlen_q).
  CUTLASS_DEVICE static int m_block_begin(Params const& params, int n_block) {
    if constexpr (Mask::kIsCausal) {
      int const first_row = n_block * kBlockN - (params.seqlen_k - params.seqlen_q);
      return max(first_row, 0) / kBlockM;
    } else {
      return 0;
    }
  }
  CUTLASS_DEVICE static int m_block_end(Params const& params) { return (params.seqlen_q + kBlockM - 1) / kBlockM; }

  // Producer: one elected thread. K and V of the key tile once, then (Q, lse) and
  // (dO, dPsum) per query tile, each pair on its own pipeline so that S = Q K^T can start
  // before dO has landed.
  CUTLASS_DEVICE static void load(Params const& params, SharedStorage& storage,
                                  cutlass::arch::ClusterTransactionBarrier& barrier_kv,
                                  PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                  PipelineState& write_q, PipelineState& write_do,
                                  int n_block, int head, int batch) {
    int const m_begin = m_block_begin(params, n_block);
    int const m_end = m_block_end(params);
    if (m_begin >= m_end) { return; }
    int const head_kv = head / params.head_group;

    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    Tensor sLSE = make_tensor(make_smem_ptr(storage.smem_lse.data()), SmemLayoutRow{});
    Tensor sdPsum = make_tensor(make_smem_ptr(storage.smem_dpsum.data()), SmemLayoutRow{});

    Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q)(_, _, head, batch);     // (seqlen_q, d)
    Tensor mdO = params.tma_do.get_tma_tensor(params.shape_q)(_, _, head, batch);   // (seqlen_q, d)
    Tensor mK = params.tma_k.get_tma_tensor(params.shape_k)(_, _, head_kv, batch);  // (seqlen_k, d)
    Tensor mV = params.tma_v.get_tma_tensor(params.shape_k)(_, _, head_kv, batch);  // (seqlen_k, d)
    Tensor mLSE = params.tma_lse.get_tma_tensor(params.shape_row)(_, head, batch);      // (seqlen_q_padded)
    Tensor mdPsum = params.tma_dpsum.get_tma_tensor(params.shape_row)(_, head, batch);  // (seqlen_q_padded)
    Tensor gQ = local_tile(mQ, select<0, 2>(TileShapeSdP{}), make_coord(_, _0{}));      // (M, d, m)
    Tensor gdO = local_tile(mdO, select<0, 2>(TileShapeSdP{}), make_coord(_, _0{}));    // (M, d, m)
    Tensor gK = local_tile(mK, select<1, 2>(TileShapeSdP{}), make_coord(n_block, _0{}));  // (N, d)
    Tensor gV = local_tile(mV, select<1, 2>(TileShapeSdP{}), make_coord(n_block, _0{}));  // (N, d)
    Tensor gLSE = local_tile(mLSE, Shape<Int<kBlockM>>{}, make_coord(_));      // (M, m)
    Tensor gdPsum = local_tile(mdPsum, Shape<Int<kBlockM>>{}, make_coord(_));  // (M, m)

    auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tdOgdO, tdOsdO] = tma_partition(params.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    auto [tLgL, tLsL] = tma_partition(params.tma_lse, _0{}, Layout<_1>{}, group_modes<0, 1>(sLSE), group_modes<0, 1>(gLSE));
    auto [tDgD, tDsD] = tma_partition(params.tma_dpsum, _0{}, Layout<_1>{}, group_modes<0, 1>(sdPsum), group_modes<0, 1>(gdPsum));

    barrier_kv.arrive_and_expect_tx(Traits::kBytesKV);
    auto& kv_mbar = reinterpret_cast<cutlass::arch::ClusterTransactionBarrier::ValueType&>(barrier_kv);
    copy(params.tma_k.with(kv_mbar), tKgK, tKsK);
    copy(params.tma_v.with(kv_mbar), tVgV, tVsV);

    CUTLASS_PRAGMA_NO_UNROLL
    for (int m_block = m_begin; m_block < m_end; ++m_block) {
      pipeline_q.producer_acquire(write_q);  // LOCK Q stage
      auto* q_mbar = pipeline_q.producer_get_barrier(write_q);
      copy(params.tma_q.with(*q_mbar), tQgQ(_, m_block), tQsQ(_, write_q.index()));
      copy(params.tma_lse.with(*q_mbar), tLgL(_, m_block), tLsL(_, write_q.index()));
      ++write_q;
      pipeline_do.producer_acquire(write_do);  // LOCK dO stage
      auto* do_mbar = pipeline_do.producer_get_barrier(write_do);
      copy(params.tma_do.with(*do_mbar), tdOgdO(_, m_block), tdOsdO(_, write_do.index()));
      copy(params.tma_dpsum.with(*do_mbar), tDgD(_, m_block), tDsD(_, write_do.index()));
      ++write_do;
    }
  }

  // Consumers: accumulate this thread's share of dK (unscaled) and dV for the key tile.
  template <class TensordKV>
  CUTLASS_DEVICE static void mma(Params const& params, SharedStorage& storage,
                                 cutlass::arch::ClusterTransactionBarrier& barrier_kv,
                                 PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                 PipelineState& read_q, PipelineState& read_do,
                                 TensordKV& tdKrdK, TensordKV& tdVrdV,
                                 int thread_idx, int n_block, int head, int batch) {
    clear(tdKrdK);
    clear(tdVrdV);
    int const m_begin = m_block_begin(params, n_block);
    int const m_end = m_block_end(params);
    if (m_begin >= m_end) { return; }

    typename Traits::TiledMmaSdP tiled_mma_sdp;
    typename Traits::TiledMmadKV tiled_mma_dkv;
    typename Traits::TiledMmadQ tiled_mma_dq;
    auto thr_mma_sdp = tiled_mma_sdp.get_thread_slice(thread_idx);
    auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(thread_idx);
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
    Tensor tdPrdO = thr_mma_sdp.partition_fragment_A(sdO);    // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tdPrV = thr_mma_sdp.partition_fragment_B(sV);      // (MMA, MMA_N, MMA_K)
    Tensor tdVrPt = thr_mma_dkv.partition_fragment_A(sPt);    // (MMA, MMA_M, MMA_K, PDS)
    Tensor tdVrdOt = thr_mma_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tdKrdSt = thr_mma_dkv.partition_fragment_A(sdSt);  // (MMA, MMA_M, MMA_K, PDS)
    Tensor tdKrQt = thr_mma_dkv.partition_fragment_B(sQt);    // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tdQrdS = thr_mma_dq.partition_fragment_A(sdS);     // (MMA, MMA_M, MMA_K, PDS)
    Tensor tdQrKt = thr_mma_dq.partition_fragment_B(sKt);     // (MMA, MMA_N, MMA_K)
    // Where this thread's S accumulator elements go in sP / sdS.
    Tensor tPsP = thr_mma_sdp.partition_C(sP);    // (MMA, MMA_M, MMA_N, PDS)
    Tensor tPsdS = thr_mma_sdp.partition_C(sdS);  // (MMA, MMA_M, MMA_N, PDS)

    // Tile coordinates (row, col) of each S element this thread holds.
    Tensor cS = make_identity_tensor(select<0, 1>(TileShapeSdP{}));
    Tensor tScS = thr_mma_sdp.partition_C(cS);
    Tensor tScS_rowcol = make_tensor(tScS.data(), accumulator_rowcol(tScS.layout()));

    Policy const policy{params.seqlen_q, params.seqlen_k};
    int const num_m_blocks = m_end;
    // dQ workspace tiles of this head: (m_blocks, kDqElements).
    float* dq_head = params.dq_accum + (int64_t(batch) * params.nheads + head) * num_m_blocks * Traits::kDqElements;

    barrier_kv.wait(0);

    // S = Q K^T and dP = dO V^T of one query tile, issued as two WGMMA batches.
    auto issue_sdp = [&](auto& tSrS, auto& tdPrdP, PipelineState const& q_stage, PipelineState const& do_stage) {
      pipeline_q.consumer_wait(q_stage);
      warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_sdp, tSrQ(_, _, _, q_stage.index()), tSrK, tSrS);
      pipeline_do.consumer_wait(do_stage);
      warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_sdp, tdPrdO(_, _, _, do_stage.index()), tdPrV, tdPrdP);
    };

    int pds = 0;  // the P/dS buffer of this query tile

    // One query tile, from S and dP in flight to dQ handed off. issue_next(tSrS, tdPrdP)
    // may start the next tile's S and dP right after this tile's GEMMs (kOverlapDq) and
    // returns whether it did.
    auto process_tile = [&](auto& tSrS, auto& tdPrdP, int m_block, auto&& issue_next) {
      Tensor tSrS_rowcol = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
      Tensor tdPrdP_rowcol = make_tensor(tdPrdP.data(), accumulator_rowcol(tdPrdP.layout()));
      // P = exp2(S * scale * log2(e) - lse * log2(e)) while dO V^T runs.
      warpgroup_wait<1>();
      if (policy.needs_mask(m_block, n_block)) { policy.apply(tSrS_rowcol, tScS_rowcol, m_block, n_block); }
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(tSrS_rowcol); ++mi) {
        float const lse = sLSE(get<0>(tScS_rowcol(mi, 0)), read_q.index());
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(tSrS_rowcol); ++ni) {
          tSrS_rowcol(mi, ni) = exp2f(tSrS_rowcol(mi, ni) * params.softmax_scale_log2 - lse);
        }
      }
      // dS = P * (dP - dPsum).
      warpgroup_wait<0>();
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(tdPrdP_rowcol); ++mi) {
        float const dpsum = sdPsum(get<0>(tScS_rowcol(mi, 0)), read_do.index());
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(tdPrdP_rowcol); ++ni) {
          tdPrdP_rowcol(mi, ni) = tSrS_rowcol(mi, ni) * (tdPrdP_rowcol(mi, ni) - dpsum);
        }
      }
      // Buffer pds was last read by tile m - 2's GEMMs, which both warpgroups finished
      // before arriving at tile m - 1's PdSFull barrier. Converting and storing one
      // tensor at a time keeps fewer registers live (the dK/dV accumulators hold most).
      {
        Tensor rP = make_tensor<Element>(tSrS.layout());
        convert_into(tSrS, rP);
        copy(rP, tPsP(_, _, _, pds));
      }
      {
        Tensor rdS = make_tensor<Element>(tdPrdP.layout());
        convert_into(tdPrdP, rdS);
        copy(rdS, tPsdS(_, _, _, pds));
      }
      // The generic-proxy stores must be visible to the WGMMAs (async proxy) of both
      // warpgroups before either reads the buffer.
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(kConsumerThreads, NamedBarrier::PdSFull);

      warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_dkv, tdVrPt(_, _, _, pds), tdVrdOt(_, _, _, read_do.index()), tdVrdV);
      warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_dkv, tdKrdSt(_, _, _, pds), tdKrQt(_, _, _, read_q.index()), tdKrdK);
      Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, select<0, 1>(TileShapedQ{}));
      warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_dq, tdQrdS(_, _, _, pds), tdQrKt, tdQrdQ);
      if (issue_next(tSrS, tdPrdP)) {
        warpgroup_wait<2>();  // dV, dK, dQ done; the next tile's S and dP in flight
      } else {
        warpgroup_wait<0>();
      }
      pipeline_q.consumer_release(read_q);  // UNLOCK Q stage
      ++read_q;
      pipeline_do.consumer_release(read_do);  // UNLOCK dO stage
      ++read_do;

      if constexpr (Traits::kDqViaSmem) {
        // The dQ warp's bulk reduction of the previous tile must have read the buffer.
        if (m_block > m_begin) { named_barrier_sync(kDqBarrierThreads, NamedBarrier::DqEmpty); }  // LOCK sdQ
        float4* sdQ = reinterpret_cast<float4*>(storage.smem_dq.data());
        CUTE_UNROLL
        for (int i = 0; i < size(tdQrdQ); i += 4) {
          sdQ[(i / 4) * kConsumerThreads + thread_idx] =
              make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
        }
        // The bulk reduction reads shared memory through the async proxy.
        cutlass::arch::fence_view_async_shared();
        named_barrier_arrive(kDqBarrierThreads, NamedBarrier::DqFull);  // UNLOCK sdQ: to the dQ warp
      } else {
        add_dq(params, tdQrdQ, dq_head + int64_t(m_block) * Traits::kDqElements, thread_idx, n_block,
               (int64_t(batch) * params.nheads + head) * num_m_blocks + m_block);
      }
      pds ^= 1;
    };

    if constexpr (Traits::kOverlapDq) {
      // Software-pipelined: S and dP of tile m + 1 run while tile m's dQ is added.
      Tensor tSrS = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdP{}));
      Tensor tdPrdP = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdP{}));
      issue_sdp(tSrS, tdPrdP, read_q, read_do);
      CUTLASS_PRAGMA_NO_UNROLL
      for (int m_block = m_begin; m_block < m_end; ++m_block) {
        process_tile(tSrS, tdPrdP, m_block, [&](auto& tSrS_next, auto& tdPrdP_next) {
          if (m_block + 1 >= m_end) { return false; }
          PipelineState next_q = read_q, next_do = read_do;
          ++next_q;
          ++next_do;
          issue_sdp(tSrS_next, tdPrdP_next, next_q, next_do);
          return true;
        });
      }
    } else {
      // Fresh accumulators per tile: nothing stays live across the loop's back edge.
      CUTLASS_PRAGMA_NO_UNROLL
      for (int m_block = m_begin; m_block < m_end; ++m_block) {
        Tensor tSrS = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdP{}));
        Tensor tdPrdP = partition_fragment_C(tiled_mma_sdp, select<0, 1>(TileShapeSdP{}));
        issue_sdp(tSrS, tdPrdP, read_q, read_do);
        process_tile(tSrS, tdPrdP, m_block, [](auto&, auto&) { return false; });
      }
    }
  }

  // The dQ workspace holds each query tile in register order: element i of consumer
  // thread t at ((i / 4) * kConsumerThreads + t) * 4 + i % 4, so that a warp's float4
  // accesses are 512 contiguous bytes (the postprocess kernel puts rows back).
  static constexpr int kDqBarrierThreads = kConsumerThreads + cutlass::NumThreadsPerWarp;

  // Consumers, without kDqViaSmem: dq_tile += dQ with float4 atomics. Deterministic mode
  // takes turns per query tile in key-tile order: key tile n waits until tile n - 1 has
  // added (the tiles that see a query tile are 0..n_max, and CTAs start in blockIdx
  // order, so the one waited for is running or done).
  template <class TensordQ>
  CUTLASS_DEVICE static void add_dq(Params const& params, TensordQ const& tdQrdQ, float* dq_tile, int thread_idx,
                                    int n_block, int64_t semaphore_idx) {
    int* semaphore = params.dq_semaphore != nullptr ? params.dq_semaphore + semaphore_idx : nullptr;
    if (semaphore != nullptr) {
      if (thread_idx == 0) {
        while (cuda_ld_acquire(semaphore) != n_block) {}
      }
      named_barrier_sync(kConsumerThreads, NamedBarrier::DqTurn);  // LOCK dQ tile
    }
#ifndef FLASH3_BWD_SKIP_DQ  // defined only in timing experiments: what the atomics cost
    float4* dq4 = reinterpret_cast<float4*>(dq_tile);
    CUTE_UNROLL
    for (int i = 0; i < size(tdQrdQ); i += 4) {
      atomicAdd(dq4 + (i / 4) * kConsumerThreads + thread_idx,
                make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3)));
    }
#endif
    if (semaphore != nullptr) {
      __threadfence();
      named_barrier_sync(kConsumerThreads, NamedBarrier::DqTurn);
      if (thread_idx == 0) { cuda_st_release(semaphore, n_block + 1); }  // UNLOCK dQ tile
    }
  }

  // The dQ warp (one warp of the producer warpgroup), with kDqViaSmem: per query tile,
  // waits for the consumers' dQ in shared memory and adds it to the workspace: one bulk
  // reduction issued by one lane, or, in deterministic mode, in turn (as above) with
  // float4 atomics from the whole warp.
  CUTLASS_DEVICE static void store_dq(Params const& params, SharedStorage& storage, int n_block, int head, int batch) {
    int const m_begin = m_block_begin(params, n_block);
    int const m_end = m_block_end(params);
    int const lane = threadIdx.x % cutlass::NumThreadsPerWarp;
    int64_t const head_idx = int64_t(batch) * params.nheads + head;
    float* dq_head = params.dq_accum + head_idx * m_end * Traits::kDqElements;
    float const* sdQ = storage.smem_dq.data();
    uint32_t const sdQ_addr = cute::cast_smem_ptr_to_uint(sdQ);
    for (int m_block = m_begin; m_block < m_end; ++m_block) {
      named_barrier_sync(kDqBarrierThreads, NamedBarrier::DqFull);  // LOCK sdQ
      float* dq_tile = dq_head + int64_t(m_block) * Traits::kDqElements;
      if (params.dq_semaphore == nullptr) {
        if (lane == 0) {
#ifndef FLASH3_BWD_SKIP_DQ
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                       ::"l"(dq_tile), "r"(sdQ_addr), "r"(uint32_t(Traits::kDqElements * sizeof(float)))
                       : "memory");
#endif
          cute::tma_store_arrive();
          cute::tma_store_wait<0>();  // the reduction has read sdQ
        }
        __syncwarp();
      } else {
        int* semaphore = params.dq_semaphore + head_idx * m_end + m_block;
        if (lane == 0) {
          while (cuda_ld_acquire(semaphore) != n_block) {}
        }
        __syncwarp();
        float4 const* sdQ4 = reinterpret_cast<float4 const*>(sdQ);
        float4* dq4 = reinterpret_cast<float4*>(dq_tile);
        for (int j = lane; j < Traits::kDqElements / 4; j += cutlass::NumThreadsPerWarp) {
          atomicAdd(dq4 + j, sdQ4[j]);
        }
        __threadfence();
        __syncwarp();
        if (lane == 0) { cuda_st_release(semaphore, n_block + 1); }
      }
      // The consumers wait for this only before writing the next tile's dQ.
      if (m_block + 1 < m_end) { named_barrier_arrive(kDqBarrierThreads, NamedBarrier::DqEmpty); }  // UNLOCK sdQ
    }
    if (lane == 0) { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
  }

  CUTLASS_DEVICE static int cuda_ld_acquire(int const* ptr) {
    int value;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
    return value;
  }
  CUTLASS_DEVICE static void cuda_st_release(int* ptr, int value) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
  }
};

}  // namespace flash3
