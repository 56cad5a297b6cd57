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
#include "seqlen.h"
#include "tma.h"
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
  static_assert(Traits::kConsumerWarpgroups == 2, "dQ goes to the dQ warp in two halves, one per consumer warpgroup");

  // Q, K, V, dO as (seqlen, headdim, head, batch) (tma.h); the row statistics as
  // (seqlen_q_padded, head, batch), contiguous. Packed batches (seqlen.h): batch 1, each
  // sequence's rows from its offset (its padded offset in the row statistics).
  using ShapeQKV = ShapeRowsHead;
  using ShapeRow = Shape<int32_t, int32_t, int32_t>;
  using StrideRow = Stride<_1, int64_t, int64_t>;

  static auto make_tma_q(Element const* ptr, ShapeQKV const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, take<0, 2>(SmemLayoutQ{}), select<0, 2>(TileShapeSdP{}));
  }
  static auto make_tma_k(Element const* ptr, ShapeQKV const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, SmemLayoutK{}, select<1, 2>(TileShapeSdP{}));
  }
  static auto make_tma_row(float const* ptr, ShapeRow const& shape, StrideRow const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, take<0, 1>(SmemLayoutRow{}), Shape<Int<kBlockM>>{});
  }
  using TmaQ = decltype(make_tma_q(nullptr, ShapeQKV{}, StrideRowsHead{}));
  using TmaK = decltype(make_tma_k(nullptr, ShapeQKV{}, StrideRowsHead{}));
  using TmaRow = decltype(make_tma_row(nullptr, ShapeRow{}, StrideRow{}));

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdO>, 1024> smem_do;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> smem_v;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutPdS>, 1024> smem_ds;
    // kSplitKeys keeps P in registers (smem_p is a placeholder, 16 bytes: hdim 64 with
    // three dS buffers has 1 KB to spare) and stores dS as dS^T.
    cute::array_aligned<Element, Traits::kSplitKeys ? 8 : cute::cosize_v<typename Traits::SmemLayoutPdS>,
                        Traits::kSplitKeys ? 16 : 1024> smem_p;
    cute::array_aligned<float, cute::cosize_v<SmemLayoutRow>, 128> smem_lse;
    cute::array_aligned<float, cute::cosize_v<SmemLayoutRow>, 128> smem_dpsum;
    cute::array_aligned<float, Traits::kDqViaSmem ? Traits::kDqElements : 4, 128> smem_dq;
    // Consumer warpgroup w's half of the dQ of the tile in (Q/dO) stage s is in shared
    // memory (its 128 threads arrive); mbarriers per stage rather than named barriers,
    // because a warpgroup may hand over the next tile before the dQ warp has taken this
    // one. One per warpgroup, so that neither waits for the other's dQ.
    alignas(16) cutlass::arch::ClusterBarrier barrier_dq_full[Traits::kStages][Traits::kConsumerWarpgroups];
    // Without kDqViaSmem: the dQ half over Q stage s ([s][0], warpgroup 0's) or over dO
    // stage s ([s][1]) has been read by the dQ warp's bulk reduction: the producer refills
    // the stage after it. One per half, so that Q is refilled while the second half is read.
    static constexpr int kDqReadBarriers = Traits::kDqViaSmem ? 1 : 2;  // (unused with kDqViaSmem)
    alignas(16) cutlass::arch::ClusterBarrier barrier_dq_read[Traits::kStages][kDqReadBarriers];
    // kSplitKeys: both consumer warpgroups' halves of dS^T are in buffer b (every consumer
    // thread arrives).
    alignas(16) cutlass::arch::ClusterBarrier barrier_ds_full[Traits::kPdSStages];
    // K and V of the key tile: loaded once, full when their TMA bytes have landed.
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_kv;
    alignas(16) typename PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename PipelinedO::SharedStorage pipeline_do;
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
    SeqLayout seqs;  // seqlen.h: the CTA's sequence
    int dq_m_blocks;  // the dQ workspace's tiles per head
    int nheads;
    int head_group;
    float softmax_scale_log2;
    float* dq_accum;
    int* dq_semaphore;  // null unless deterministic
  };

  static Params to_params(BwdParams const& p) {
    ShapeQKV shape_q = rows_head_shape(p.rows_q(), p.headdim, p.nheads, p.tensor_batch());
    ShapeQKV shape_k = rows_head_shape(p.rows_k(), p.headdim, p.nheads_k, p.tensor_batch());
    ShapeRow shape_row = make_shape(p.seqlen_q_padded, p.nheads, p.tensor_batch());
    StrideRow stride_row = make_stride(_1{}, int64_t(p.seqlen_q_padded), int64_t(p.seqlen_q_padded) * p.nheads);
    return {make_tma_q(static_cast<Element const*>(p.q_ptr), shape_q,
                       rows_head_stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride)),
            make_tma_q(static_cast<Element const*>(p.do_ptr), shape_q,
                       rows_head_stride(p.do_row_stride, p.do_head_stride, p.do_batch_stride)),
            make_tma_k(static_cast<Element const*>(p.k_ptr), shape_k,
                       rows_head_stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride)),
            make_tma_k(static_cast<Element const*>(p.v_ptr), shape_k,
                       rows_head_stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride)),
            make_tma_row(p.lse_log2_ptr, shape_row, stride_row),
            make_tma_row(p.dpsum_ptr, shape_row, stride_row),
            shape_q, shape_k, shape_row, p.seq_layout(), p.dq_m_blocks, p.nheads, p.nheads / p.nheads_k,
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
  CUTLASS_DEVICE static int m_block_begin(Seq const& seq, int n_block) {
    if constexpr (Mask::kIsCausal) {
      int const first_row = n_block * kBlockN - (seq.seqlen_k - seq.seqlen_q);
      return max(first_row, 0) / kBlockM;
    } else {
      return 0;
    }
  }
  CUTLASS_DEVICE static int m_block_end(Seq const& seq) { return (seq.seqlen_q + kBlockM - 1) / kBlockM; }

  CUTLASS_DEVICE static bool has_keys(Seq const& seq, int n_block) { return n_block * kBlockN < seq.seqlen_k; }

  // The last key tile that query tile m_block sees (the inverse of m_block_begin: tile n
  // sees it iff n * kBlockN - (seqlen_k - seqlen_q) < (m_block + 1) * kBlockM); -1 if none.
  CUTLASS_DEVICE static int n_block_last(Seq const& seq, int m_block) {
    int const n_blocks = (seq.seqlen_k + kBlockN - 1) / kBlockN;
    if constexpr (Mask::kIsCausal) {
      int const rows_end = (m_block + 1) * kBlockM + (seq.seqlen_k - seq.seqlen_q);
      return rows_end <= 0 ? -1 : min((rows_end - 1) / kBlockN, n_blocks - 1);
    } else {
      return n_blocks - 1;
    }
  }

  // Producer: one elected thread. K and V of the key tile once, then (Q, lse) and
  // (dO, dPsum) per query tile, each pair on its own pipeline so that S = Q K^T can start
  // before dO has landed.
  CUTLASS_DEVICE static void load(Params const& params, SharedStorage& storage,
                                  PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                  PipelineState& write_q, PipelineState& write_do,
                                  int n_block, int head, Seq const& seq) {
    int const m_begin = m_block_begin(seq, n_block);
    int const m_end = m_block_end(seq);
    if (m_begin >= m_end) { return; }
    int const head_kv = head / params.head_group;

    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(storage.smem_do.data()), SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    Tensor sLSE = make_tensor(make_smem_ptr(storage.smem_lse.data()), SmemLayoutRow{});
    Tensor sdPsum = make_tensor(make_smem_ptr(storage.smem_dpsum.data()), SmemLayoutRow{});

    auto const q_rows = make_coord(seq.offset_q, _0{});
    auto const k_rows = make_coord(seq.offset_k, _0{});
    auto const stat_rows = make_coord(seq.offset_q_padded);
    Tensor mQ = domain_offset(q_rows, params.tma_q.get_tma_tensor(params.shape_q)(_, _, head, seq.batch));     // (seqlen_q, d)
    Tensor mdO = domain_offset(q_rows, params.tma_do.get_tma_tensor(params.shape_q)(_, _, head, seq.batch));   // (seqlen_q, d)
    Tensor mK = domain_offset(k_rows, params.tma_k.get_tma_tensor(params.shape_k)(_, _, head_kv, seq.batch));  // (seqlen_k, d)
    Tensor mV = domain_offset(k_rows, params.tma_v.get_tma_tensor(params.shape_k)(_, _, head_kv, seq.batch));  // (seqlen_k, d)
    Tensor mLSE = domain_offset(stat_rows, params.tma_lse.get_tma_tensor(params.shape_row)(_, head, seq.batch));      // (seqlen_q_padded)
    Tensor mdPsum = domain_offset(stat_rows, params.tma_dpsum.get_tma_tensor(params.shape_row)(_, head, seq.batch));  // (seqlen_q_padded)
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
    auto [tDgD, tDsD] = tma_partition(params.tma_dpsum, _0{}, Layout<_1>{}, group_modes<0, 1>(sdPsum),
                                      group_modes<0, 1>(gdPsum));

    storage.barrier_kv.arrive_and_expect_tx(Traits::kBytesKV);
    auto& kv_mbar = reinterpret_cast<cutlass::arch::ClusterTransactionBarrier::ValueType&>(storage.barrier_kv);
    copy(params.tma_k.with(kv_mbar), tKgK, tKsK);
    copy(params.tma_v.with(kv_mbar), tVgV, tVsV);

    CUTLASS_PRAGMA_NO_UNROLL
    for (int m_block = m_begin; m_block < m_end; ++m_block) {
      // The stages were last used by tile m - kStages, whose dQ the dQ warp reads from them.
      [[maybe_unused]] int const uses = m_block - m_begin - Traits::kStages;
      // Without kDqViaSmem the dQ half over the dO stage is handed over and read first
      // (store_dq), so dO is loaded first, each stage once its dQ half has been read.
      if constexpr (!Traits::kDqViaSmem) {
        if (uses >= 0) { storage.barrier_dq_read[write_do.index()][1].wait((uses / Traits::kStages) & 1); }
        pipeline_do.producer_acquire(write_do);  // LOCK dO stage
        auto* do_mbar = pipeline_do.producer_get_barrier(write_do);
        copy(params.tma_do.with(*do_mbar), tdOgdO(_, m_block), tdOsdO(_, write_do.index()));
        copy(params.tma_dpsum.with(*do_mbar), tDgD(_, m_block), tDsD(_, write_do.index()));
        ++write_do;
        if (uses >= 0) { storage.barrier_dq_read[write_q.index()][0].wait((uses / Traits::kStages) & 1); }
      }
      pipeline_q.producer_acquire(write_q);  // LOCK Q stage
      auto* q_mbar = pipeline_q.producer_get_barrier(write_q);
      copy(params.tma_q.with(*q_mbar), tQgQ(_, m_block), tQsQ(_, write_q.index()));
      copy(params.tma_lse.with(*q_mbar), tLgL(_, m_block), tLsL(_, write_q.index()));
      ++write_q;
      if constexpr (Traits::kDqViaSmem) {
        pipeline_do.producer_acquire(write_do);  // LOCK dO stage
        auto* do_mbar = pipeline_do.producer_get_barrier(write_do);
        copy(params.tma_do.with(*do_mbar), tdOgdO(_, m_block), tdOsdO(_, write_do.index()));
        copy(params.tma_dpsum.with(*do_mbar), tDgD(_, m_block), tDsD(_, write_do.index()));
        ++write_do;
      }
    }
  }

  // Consumers: accumulate this thread's share of dK (unscaled) and dV for the key tile.
  template <class TensordKV>
  CUTLASS_DEVICE static void mma(Params const& params, SharedStorage& storage,
                                 PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                 PipelineState& read_q, PipelineState& read_do,
                                 TensordKV& tdKrdK, TensordKV& tdVrdV,
                                 int thread_idx, int n_block, Seq const& seq) {
    if constexpr (Traits::kSplitKeys) {
      mma_split_keys(params, storage, pipeline_q, pipeline_do, read_q, read_do, tdKrdK, tdVrdV,
                     thread_idx, n_block, seq);
    } else {
      mma_lockstep(params, storage, pipeline_q, pipeline_do, read_q, read_do, tdKrdK, tdVrdV,
                   thread_idx, n_block, seq);
    }
  }

  // With 64-row query tiles dV += P^T dO is issued before dS^T is computed (it overlaps
  // that math); taller tiles issue it after, when the fp32 P^T is dead, or they spill.
  static constexpr bool kDvBeforeDs = kBlockM <= 64;
  // 64-row query tiles carry dS^T's registers into the next turn (mma_split_keys); at
  // 128 rows that made ptxas serialise the WGMMAs for want of registers (measured 7-15%
  // slower at hdim 64).
  static constexpr bool kDkIntoNextTurn = kBlockM <= 64;

  // kSplitKeys: each warpgroup computes S^T and dP^T for its kBlockN / 2 keys against the
  // whole query tile and keeps P^T and dS^T in registers as the A operands of dV and dK.
  // Only dQ = dS K needs the other warpgroup's half of dS (through shared memory); it is
  // issued two tiles late, so the warpgroups never wait for each other and can take
  // turns on the tensor cores (pingpong).
  template <class TensordKV>
  CUTLASS_DEVICE static void mma_split_keys(Params const& params, SharedStorage& storage,
                                            PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                            PipelineState& read_q, PipelineState& read_do,
                                            TensordKV& tdKrdK, TensordKV& tdVrdV,
                                            int thread_idx, int n_block, Seq const& seq) {
    clear(tdKrdK);
    clear(tdVrdV);
    int const m_begin = m_block_begin(seq, n_block);
    int const m_end = m_block_end(seq);
    if (m_begin >= m_end) { return; }

    typename Traits::TiledMmaSdP tiled_mma_sdp;
    typename Traits::TiledMmadKV tiled_mma_dkv;
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

    Policy const policy{seq.seqlen_q, seq.seqlen_k};

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

    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0; t < n_tiles; ++t) {
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
      if (policy.needs_mask(m_block, n_block)) {
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

  // Hands this warpgroup's half of a query tile's dQ (d / 2 columns, float32) to the dQ
  // warp through its own shared-memory buffer (kDqViaSmem; without it, see
  // hand_over_dq_over_stages). stage_q names the hand-over's barrier.
  template <bool kPublish = true, class TensordQ>
  CUTLASS_DEVICE static void hand_over_dq(SharedStorage& storage, TensordQ const& tdQrdQ, int thread_idx,
                                          bool first_tile, int stage_q, [[maybe_unused]] int stage_do) {
    static_assert(Traits::kDqViaSmem);
    int const warpgroup = thread_idx / cutlass::NumThreadsPerWarpGroup;
    // The dQ warp's bulk reduction of this warpgroup's previous half must have read it.
    if (!first_tile) { named_barrier_sync(kDqBarrierThreads, dq_empty_barrier(warpgroup)); }  // LOCK sdQ half
    float4* sdQ = reinterpret_cast<float4*>(storage.smem_dq.data());
    CUTE_UNROLL
    for (int i = 0; i < size(tdQrdQ); i += 4) {
      sdQ[Traits::dq_float4_index(i, thread_idx)] = make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
    }
    if constexpr (kPublish) { publish_dq(storage, thread_idx, stage_q); }
  }
  // Without kDqViaSmem: where warpgroup w's half goes, the Q stage (w = 0) or the dO stage,
  // as float4s indexed by dq_float4_index.
  CUTLASS_DEVICE static float4* dq_half_over_stages(SharedStorage& storage, int warpgroup, int stage_q, int stage_do) {
    Element* stage = warpgroup == 0 ? storage.smem_q.data() + stage_q * kStageElements
                                    : storage.smem_do.data() + stage_do * kStageElements;
    return reinterpret_cast<float4*>(stage) - warpgroup * Traits::kDqHalfFloat4s;
  }
  // Without kDqViaSmem: this warpgroup's half over the tile's Q stage (warpgroup 0) or dO
  // stage (warpgroup 1), the caller having made sure that no GEMM reads that stage any
  // more (mma_lockstep); the producer refills it only after the dQ warp's read.
  template <class TensordQ>
  CUTLASS_DEVICE static void hand_over_dq_over_stages(SharedStorage& storage, TensordQ const& tdQrdQ, int thread_idx,
                                                      int stage_q, int stage_do) {
    static_assert(!Traits::kDqViaSmem);
    float4* sdQ = dq_half_over_stages(storage, thread_idx / cutlass::NumThreadsPerWarpGroup, stage_q, stage_do);
    CUTE_UNROLL
    for (int i = 0; i < size(tdQrdQ); i += 4) {
      sdQ[Traits::dq_float4_index(i, thread_idx)] = make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
    }
    publish_dq(storage, thread_idx, stage_q);
  }
  // The second half of a hand-over: the fence waits for this thread's stores to land, so
  // the pingpong loop issues its next GEMM between the two halves.
  CUTLASS_DEVICE static void publish_dq(SharedStorage& storage, int thread_idx, int stage_q) {
    int const warpgroup = thread_idx / cutlass::NumThreadsPerWarpGroup;
    // The bulk reduction reads shared memory through the async proxy.
    cutlass::arch::fence_view_async_shared();
    storage.barrier_dq_full[stage_q][warpgroup].arrive();  // UNLOCK sdQ half: to the dQ warp
  }

  // Without kSplitKeys: the warpgroups split the keys for S and dP but the head dim for
  // dV, dK and dQ, so P and dS both go through shared memory, a barrier each per tile.
  template <class TensordKV>
  CUTLASS_DEVICE static void mma_lockstep(Params const& params, SharedStorage& storage,
                                          PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                          PipelineState& read_q, PipelineState& read_do,
                                          TensordKV& tdKrdK, TensordKV& tdVrdV,
                                          int thread_idx, int n_block, Seq const& seq) {
    clear(tdKrdK);
    clear(tdVrdV);
    int const m_begin = m_block_begin(seq, n_block);
    int const m_end = m_block_end(seq);
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

    Policy const policy{seq.seqlen_q, seq.seqlen_k};

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
      warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_dkv, tdVrPt(_, _, _, pds), tdVrdOt(_, _, _, read_do.index()), tdVrdV);

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
      {
        Tensor rdS = make_tensor<Element>(tdPrdP.layout());
        convert_into(tdPrdP, rdS);
        copy(smem_tiled_copy_pds, smem_thr_copy_pds.retile_S(rdS), tPsdS(_, _, _, pds));
      }
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(kConsumerThreads, NamedBarrier::dSFull);

      Tensor tdQrdQ = partition_fragment_C(tiled_mma_dq, select<0, 1>(TileShapedQ{}));
      if constexpr (Traits::kDqViaSmem) {
        warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_dkv, tdKrdSt(_, _, _, pds), tdKrQt(_, _, _, read_q.index()), tdKrdK);
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
        warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_dkv, tdKrdSt(_, _, _, pds), tdKrQt(_, _, _, read_q.index()), tdKrdK);
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

  static constexpr int kDqBarrierThreads = cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp;
  // One Q (or dO) stage; stage s starts s of these into smem_q (smem_do).
  static constexpr int kStageElements = kBlockM * kHeadDim;
  static_assert(cute::cosize_v<SmemLayoutQ> == Traits::kStages * kStageElements);

  // The dQ warp (one warp of the producer warpgroup): per query tile, waits for each
  // consumer warpgroup's half of dQ in shared memory and adds it to the workspace tile
  // with a bulk reduction issued by one lane. Deterministic mode takes turns per query
  // tile so that the float32 sums happen in a fixed order: the key tiles that see query tile m are
  // 0..n_last(m), and they add in descending order (n_last first), each waiting until the
  // semaphore counts the tiles above it. Descending, because a key tile walks its query
  // tiles upwards from the first that sees it: tile n + 1 starts at a later query tile
  // and so reaches every shared one a step or more ahead of tile n, and under the causal
  // mask nobody waits in the steady state. (Ascending order made every key tile trail
  // tile 0, which sees all query tiles: causal backward ran 1.6x slower.) The grid
  // launches higher key tiles first (kernel_bwd.h), so the one waited for is running or
  // done.
  // Without kDqViaSmem the dO half (warpgroup 1's) is handed over first (mma_lockstep).
  static constexpr int kFirstHalf = Traits::kDqViaSmem ? 0 : 1;
  CUTLASS_DEVICE static void store_dq(Params const& params, SharedStorage& storage, int n_block, int head,
                                      Seq const& seq) {
    // Lean on registers: this warp runs with the producer's 24, and one lane does the work.
    int const m_begin = m_block_begin(seq, n_block);
    int const m_end = m_block_end(seq);
    int const lane = threadIdx.x % cutlass::NumThreadsPerWarp;
    int64_t const head_tile0 = (int64_t(seq.batch) * params.nheads + head) * params.dq_m_blocks + seq.offset_q_padded / kBlockM;
    constexpr uint32_t kHalfBytes = Traits::kDqElements / 2 * sizeof(float);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int m_block = m_begin; m_block < m_end; ++m_block) {
      int const stage = (m_block - m_begin) % Traits::kStages;
      uint32_t const phase = ((m_block - m_begin) / Traits::kStages) & 1;
      // Where the consumer warpgroups put their halves (hand_over_dq()).
      float const* halves[2] = {
          Traits::kDqViaSmem ? storage.smem_dq.data()
                             : reinterpret_cast<float const*>(storage.smem_q.data() + stage * kStageElements),
          Traits::kDqViaSmem ? storage.smem_dq.data() + Traits::kDqElements / 2
                             : reinterpret_cast<float const*>(storage.smem_do.data() + stage * kStageElements)};
      float* dq_tile = params.dq_accum + (head_tile0 + m_block) * Traits::kDqElements;
      int* semaphore = params.dq_semaphore != nullptr ? params.dq_semaphore + head_tile0 + m_block : nullptr;
      int turn = 0;  // deterministic: how many key tiles add to this query tile before this one
      CUTE_UNROLL
      for (int i = 0; i < 2; ++i) {
        int const half = i ^ kFirstHalf;
        storage.barrier_dq_full[stage][half].wait(phase);  // LOCK sdQ half
        if (lane == 0) {
          if (i == 0 && semaphore != nullptr) {
            turn = n_block_last(seq, m_block) - n_block;
            while (cuda_ld_acquire(semaphore) != turn) {}
            // Order the acquire before the (async-proxy) reductions below.
            asm volatile("fence.proxy.async.global;" ::: "memory");
          }
          bulk_reduce_add(dq_tile + half * (Traits::kDqElements / 2), halves[half], kHalfBytes);
          cute::tma_store_arrive();  // one bulk group per half
        }
      }
      if (lane == 0) {
        if (semaphore != nullptr) {
          // Deterministic: the next key tile may add only once this tile's sums are done.
          // (Handing the buffers back before that, as soon as they are read, measured
          // 4-14% slower at 1k-16k non-causal, though up to 6% faster causal.)
          asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
          asm volatile("fence.proxy.async.global;" ::: "memory");
          __threadfence();
          cuda_st_release(semaphore, turn + 1);
        } else {
          cute::tma_store_wait<1>();  // the first half has been read
        }
      }
      __syncwarp();
      if constexpr (Traits::kDqViaSmem) {
        // Each warpgroup waits for its half's read only before writing the next tile's.
        bool const more = m_block + 1 < m_end;
        if (more) { named_barrier_arrive(kDqBarrierThreads, NamedBarrier::DqEmptyWG0); }  // UNLOCK sdQ half 0
        if (lane == 0) { cute::tma_store_wait<0>(); }  // half 1 has been read
        __syncwarp();
        if (more) { named_barrier_arrive(kDqBarrierThreads, NamedBarrier::DqEmptyWG1); }  // UNLOCK sdQ half 1
      } else {
        // The producer waits for these before refilling the stages: the dO stage once
        // half 1, the first reduced, has been read (tma_store_wait<1> above, or the whole
        // wait_group in deterministic mode), the Q stage once half 0 has.
        if (lane == 0) {
          release_dq_read(storage, stage, 1);  // UNLOCK dO stage
          cute::tma_store_wait<0>();
          release_dq_read(storage, stage, 0);  // UNLOCK Q stage
        }
      }
    }
    if (lane == 0) { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
  }

  CUTLASS_DEVICE static void release_dq_read(SharedStorage& storage, int stage, int half) {
    storage.barrier_dq_read[stage][half].arrive();
  }

  // global[dst .. dst + bytes) += shared[src ..], float32, asynchronously (bulk_group).
  CUTLASS_DEVICE static void bulk_reduce_add(float* dst, float const* src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 ::"l"(dst), "r"(cute::cast_smem_ptr_to_uint(src)), "r"(bytes)
                 : "memory");
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
