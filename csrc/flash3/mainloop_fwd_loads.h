// The forward producer's loads (MainloopFwd::load): Q once per tile, then K and V key tile
// by key tile through TMA (load_direct, 16-bit inputs, dense or paged), or with V
// transposed into V^T in shared memory by the producer warpgroup (load_transposing, e4m3).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include "mainloop_fwd.h"

namespace flash3 {

using namespace cute;

// Q once, then K and V tile by tile from the last key tile down (the masked tiles
// first, see mask.h). K and V have separate pipelines so that S = Q K^T can start
// before V has landed. The first K goes out before Q: it only needs a free stage, while
// Q must wait until the consumers are done with the previous tile's Q.
template <class Traits, class Mask, bool kVarlen>
CUTLASS_DEVICE void MainloopFwd<Traits, Mask, kVarlen>::load_direct(
    Params const& params, SharedStorage& storage, cutlass::arch::ClusterTransactionBarrier& barrier_q_full,
    cutlass::arch::ClusterBarrier& barrier_q_empty, int q_phase, int q_stage, PipelineK& pipeline_k,
    PipelineV& pipeline_v, PipelineState& write_k, PipelineState& write_v, int m_block, int head, Seq const& seq) {
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

// e4m3: the producer warpgroup, all 128 threads (thread_idx 0..127); tma_thread is the
// one that issues TMA. Key tiles go from the last one down, as in load_direct. V(n) is
// transposed into V^T while the TMA of K(n-1) and V(n-1) is in flight.
template <class Traits, class Mask, bool kVarlen>
CUTLASS_DEVICE void MainloopFwd<Traits, Mask, kVarlen>::load_transposing(
    Params const& params, SharedStorage& storage, cutlass::arch::ClusterTransactionBarrier& barrier_q_full,
    cutlass::arch::ClusterBarrier& barrier_q_empty, int q_phase, Pipelines& pipelines, PipelineState& transpose,
    int m_block, int head, Seq const& seq, bool tma_thread, int thread_idx) {
  Policy const policy = policy_of(params, seq);
  int const n_begin = policy.n_block_begin(m_block);
  int const n_end = policy.n_block_end(m_block);
  if (n_end <= n_begin) { return; }
  int const head_kv = head / params.head_group;

  Tensor sQ = make_tensor(make_smem_ptr(smem_q_stage(storage, 0)), SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
  Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q)(_, _, head, seq.batch);     // (seqlen_q, d)
  Tensor mK = params.tma_k.get_tma_tensor(params.shape_k)(_, _, head_kv, seq.batch);  // (seqlen_k, d)
  Tensor mV = params.tma_v.get_tma_tensor(params.shape_k)(_, _, head_kv, seq.batch);  // (seqlen_k, d)
  Tensor gQ = local_tile(mQ, select<0, 2>(TileShapeMNK{}), make_coord(m_block, _0{}));  // (M, d)
  Tensor gK = local_tile(mK, select<1, 2>(TileShapeMNK{}), make_coord(_, _0{}));        // (N, d, n)
  Tensor gV = local_tile(mV, select<1, 2>(TileShapeMNK{}), make_coord(_, _0{}));        // (N, d, n)
  auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
  auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

  // transpose: the V stage the transposer reads next and the V^T stage it writes. K and V
  // stages are written one key tile ahead of it (K and V advance together): with the
  // same stage count, the write state is the transpose state, advanced once, and at a
  // tile's start (all stages transposed) the two are equal. One state instead of two
  // (registers: the producer runs on 24 at hdim 256, where a second one spilled).
  static_assert(PipelineK::Stages == PipelinePV::Stages && PipelineV::Stages == PipelinePV::Stages,
                "the K/V write state is derived from the transpose state");
  PipelineState const& write_first = transpose;
  if (tma_thread) {
    pipelines.k.producer_acquire(write_first);
    copy(params.tma_k.with(*pipelines.k.producer_get_barrier(write_first)), tKgK(_, n_end - 1),
         tKsK(_, write_first.index()));
    barrier_q_empty.wait(q_phase ^ 1);  // LOCK sQ
    barrier_q_full.arrive_and_expect_tx(Traits::kBytesQ);
    copy(params.tma_q.with(reinterpret_cast<cutlass::arch::ClusterTransactionBarrier::ValueType&>(barrier_q_full)),
         tQgQ, tQsQ);
    pipelines.v.producer_acquire(write_first);
    copy(params.tma_v.with(*pipelines.v.producer_get_barrier(write_first)), tVgV(_, n_end - 1),
         tVsV(_, write_first.index()));
  }

  uint8_t* smem_vt = reinterpret_cast<uint8_t*>(storage.smem_vt.data());
  CUTLASS_PRAGMA_NO_UNROLL
  for (int n_block = n_end - 1; n_block >= n_begin; --n_block) {
    if (n_block > n_begin) {
      if (tma_thread) {
        PipelineState write_kv = transpose;
        ++write_kv;
        pipelines.k.producer_acquire(write_kv);
        copy(params.tma_k.with(*pipelines.k.producer_get_barrier(write_kv)), tKgK(_, n_block - 1),
             tKsK(_, write_kv.index()));
        pipelines.v.producer_acquire(write_kv);
        copy(params.tma_v.with(*pipelines.v.producer_get_barrier(write_kv)), tVgV(_, n_block - 1),
             tVsV(_, write_kv.index()));
      }
    }
    __syncwarp();  // ldmatrix / stmatrix are warp-collective
    // transpose is a producer state of V^T (its phase starts at 1); as a consumer state
    // of V the same stage has the other phase.
    PipelineState const read_v(transpose.index(), transpose.phase() ^ 1, transpose.count());
    pipelines.v.consumer_wait(read_v);         // LOCK V stage (TMA landed)
    pipelines.vt.producer_acquire(transpose);  // LOCK V^T stage (consumers done with it)
    // The lane's addresses are written at their use (a few instructions); where registers
    // allow, the compiler hoists them out of the loop.
    Traits::Transpose::run(Traits::Transpose::addresses(reinterpret_cast<uint8_t*>(storage.smem_v.data()), thread_idx),
                           smem_vt, transpose.index(), transpose.index());
    // The WGMMAs read V^T through the async proxy: make the generic-proxy stores visible.
    cutlass::arch::fence_view_async_shared();
    pipelines.vt.producer_commit(transpose);  // UNLOCK V^T stage for the consumers
    pipelines.v.consumer_release(transpose);  // UNLOCK V stage for the next TMA
    ++transpose;
  }
}

}  // namespace flash3
