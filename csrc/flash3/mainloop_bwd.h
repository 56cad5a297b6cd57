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
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  static constexpr int kConsumerThreads = Traits::kConsumerThreads;
  using TileShapeSdP = typename Traits::TileShapeSdP;
  using TileShapedP = typename Traits::TileShapedP;
  using TileShapedQ = typename Traits::TileShapedQ;
  using SmemLayoutQ = typename Traits::SmemLayoutQ;
  using SmemLayoutdO = typename Traits::SmemLayoutdO;
  using SmemLayoutK = typename Traits::SmemLayoutK;
  using SmemLayoutV = typename Traits::SmemLayoutV;
  using SmemLayoutRow = typename Traits::SmemLayoutRow;
  using PipelineQ = typename Traits::PipelineQ;
  using PipelinedO = typename Traits::PipelinedO;
  using PipelineState = typename Traits::PipelineState;
  using PipelineStatedO = typename Traits::PipelineStatedO;
  using Policy = MaskPolicy<Mask, kBlockM, kBlockN>;
  static_assert(Traits::kConsumerWarpgroups == 2, "dQ goes to the dQ warp in two halves, one per consumer warpgroup");

  // Q, K, V, dO as (seqlen, headdim, head, batch) (tma.h; headdim_v for V and dO); the
  // row statistics as (seqlen_q_padded, head, batch), contiguous. Packed batches
  // (seqlen.h): batch 1, each sequence's rows from its offset (its padded offset in the
  // row statistics).
  using ShapeQKV = ShapeRowsHead;
  using ShapeRow = Shape<int32_t, int32_t, int32_t>;
  using StrideRow = Stride<_1, int64_t, int64_t>;

  static auto make_tma_q(Element const* ptr, ShapeQKV const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, take<0, 2>(SmemLayoutQ{}), select<0, 2>(TileShapeSdP{}));
  }
  static auto make_tma_do(Element const* ptr, ShapeQKV const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, take<0, 2>(SmemLayoutdO{}), select<0, 2>(TileShapedP{}));
  }
  static auto make_tma_k(Element const* ptr, ShapeQKV const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, SmemLayoutK{}, select<1, 2>(TileShapeSdP{}));
  }
  static auto make_tma_v(Element const* ptr, ShapeQKV const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, SmemLayoutV{}, select<1, 2>(TileShapedP{}));
  }
  static auto make_tma_row(float const* ptr, ShapeRow const& shape, StrideRow const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, take<0, 1>(SmemLayoutRow{}), Shape<Int<kBlockM>>{});
  }
  using TmaQ = decltype(make_tma_q(nullptr, ShapeQKV{}, StrideRowsHead{}));
  using TmadO = decltype(make_tma_do(nullptr, ShapeQKV{}, StrideRowsHead{}));
  using TmaK = decltype(make_tma_k(nullptr, ShapeQKV{}, StrideRowsHead{}));
  using TmaV = decltype(make_tma_v(nullptr, ShapeQKV{}, StrideRowsHead{}));
  using TmaRow = decltype(make_tma_row(nullptr, ShapeRow{}, StrideRow{}));
  // dO has Q's rows, heads and batch, V has K's, both with V's head dim: the device side
  // derives their shapes (for the TMA coordinate tensors) rather than keep two more.
  CUTLASS_HOST_DEVICE static ShapeQKV with_head_dim_v(ShapeQKV const& shape) {
    return replace<1>(shape, int32_t(kHeadDimV));
  }

  // smem_q and smem_do, and smem_k and smem_v, are adjacent (every tile a multiple of 1 KB):
  // the epilogue stages float32 dK over the first pair and dV over the second
  // (epilogue_bwd.h store_through_smem).
  static_assert(cute::cosize_v<SmemLayoutQ> * sizeof(Element) % 1024 == 0 &&
                    cute::cosize_v<SmemLayoutK> * sizeof(Element) % 1024 == 0,
                "smem_do follows smem_q and smem_v follows smem_k with no padding");
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
    // kDqOverStages: the dQ half over Q stage s ([s][0], warpgroup 0's) or over dO
    // stage s ([s][1]) has been read by the dQ warp's bulk reduction: the producer refills
    // the stage after it. One per half, so that Q is refilled while the second half is read.
    static constexpr int kDqReadBarriers = Traits::kDqViaSmem ? 1 : 2;  // (used only with kDqOverStages)
    alignas(16) cutlass::arch::ClusterBarrier barrier_dq_read[Traits::kStages][kDqReadBarriers];
    // kSplitKeys: both consumer warpgroups' halves of dS^T are in buffer b (every consumer
    // thread arrives).
    alignas(16) cutlass::arch::ClusterBarrier barrier_ds_full[Traits::kPdSStages];
    // K and V of the key tile: loaded once, full when their TMA bytes have landed.
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_kv;
    alignas(16) typename PipelineQ::SharedStorage pipeline_q;
    alignas(16) typename PipelinedO::SharedStorage pipeline_do;
  };

  // The local-mask kernels' options (params.h); other kernels hold none (an empty base).
  struct NoOptions {
    static NoOptions make(BwdParams const&) { return {}; }
  };
  struct LocalOptions {
    int window_left;
    int window_right;
    float tanh_prescale;        // 0: no softcap
    float inv_logit_scale_log2;  // softcap: from P's log2 back to tanh(...)
    static LocalOptions make(BwdParams const& p) {
      return {p.window_left, p.window_right, p.tanh_prescale(), 1.f / p.logit_scale_log2()};
    }
  };
  using Options = std::conditional_t<Mask::kIsLocal, LocalOptions, NoOptions>;

  struct Params : Options {
    TmaQ tma_q;
    TmadO tma_do;
    TmaK tma_k;
    TmaV tma_v;
    TmaRow tma_lse;
    TmaRow tma_dpsum;
    ShapeQKV shape_q;
    ShapeQKV shape_k;
    ShapeRow shape_row;
    SeqLayout seqs;  // seqlen.h: the CTA's sequence
    int dq_m_blocks;  // the dQ workspace's tiles per head
    int nheads;
    int head_group;
    float softmax_scale_log2;  // to log2 logits: params.h logit_scale_log2
    float* dq_accum;
    int* dq_semaphore;  // null unless deterministic
  };

  static Params to_params(BwdParams const& p) {
    ShapeQKV shape_q = rows_head_shape(p.rows_q(), p.headdim, p.nheads, p.tensor_batch());
    ShapeQKV shape_k = rows_head_shape(p.rows_k(), p.headdim, p.nheads_k, p.tensor_batch());
    ShapeQKV shape_do = rows_head_shape(p.rows_q(), p.headdim_v, p.nheads, p.tensor_batch());
    ShapeQKV shape_v = rows_head_shape(p.rows_k(), p.headdim_v, p.nheads_k, p.tensor_batch());
    ShapeRow shape_row = make_shape(p.seqlen_q_padded, p.nheads, p.tensor_batch());
    StrideRow stride_row = make_stride(_1{}, int64_t(p.seqlen_q_padded), int64_t(p.seqlen_q_padded) * p.nheads);
    return {Options::make(p),
            make_tma_q(static_cast<Element const*>(p.q_ptr), shape_q,
                       rows_head_stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride)),
            make_tma_do(static_cast<Element const*>(p.do_ptr), shape_do,
                        rows_head_stride(p.do_row_stride, p.do_head_stride, p.do_batch_stride)),
            make_tma_k(static_cast<Element const*>(p.k_ptr), shape_k,
                       rows_head_stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride)),
            make_tma_v(static_cast<Element const*>(p.v_ptr), shape_v,
                       rows_head_stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride)),
            make_tma_row(p.lse_log2_ptr, shape_row, stride_row),
            make_tma_row(p.dpsum_ptr, shape_row, stride_row),
            shape_q, shape_k, shape_row, p.seq_layout(), p.dq_m_blocks, p.nheads, p.nheads / p.nheads_k,
            p.logit_scale_log2(), p.dq_accum_ptr, p.deterministic ? p.dq_semaphore_ptr : nullptr};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_lse.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_dpsum.get_tma_descriptor());
  }

  CUTLASS_DEVICE static Policy policy_of(Params const& params, Seq const& seq) {
    if constexpr (Mask::kIsLocal) {
      return {seq.seqlen_q, seq.seqlen_k, params.window_left, params.window_right};
    } else {
      return {seq.seqlen_q, seq.seqlen_k};
    }
  }

  // Query tiles [m_begin, m_end) see some key of key tile n_block. Under the causal mask
  // (bottom-right aligned: row i sees key j iff j <= i + seqlen_k - seqlen_q) the first
  // row that sees the tile's first key is n_block * kBlockN - (seqlen_k - seqlen_q); the
  // local mask's range is MaskPolicy's.
  CUTLASS_DEVICE static int m_block_begin(Params const& params, Seq const& seq, int n_block) {
    if constexpr (Mask::kIsLocal) {
      return policy_of(params, seq).m_block_begin(n_block);
    } else if constexpr (Mask::kIsCausal) {
      int const first_row = n_block * kBlockN - (seq.seqlen_k - seq.seqlen_q);
      return max(first_row, 0) / kBlockM;
    } else {
      return 0;
    }
  }
  CUTLASS_DEVICE static int m_block_end(Params const& params, Seq const& seq, int n_block) {
    if constexpr (Mask::kIsLocal) {
      return policy_of(params, seq).m_block_end(n_block);
    } else {
      return (seq.seqlen_q + kBlockM - 1) / kBlockM;
    }
  }

  CUTLASS_DEVICE static bool has_keys(Seq const& seq, int n_block) { return n_block * kBlockN < seq.seqlen_k; }

  // The last key tile that query tile m_block sees (the inverse of m_block_begin: tile n
  // sees it iff n * kBlockN - (seqlen_k - seqlen_q) < (m_block + 1) * kBlockM); -1 if none.
  CUTLASS_DEVICE static int n_block_last(Params const& params, Seq const& seq, int m_block) {
    if constexpr (Mask::kIsLocal) { return policy_of(params, seq).n_block_last(m_block); }
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
                                  PipelineState& write_q, PipelineStatedO& write_do,
                                  int n_block, int head, Seq const& seq) {
    int const m_begin = m_block_begin(params, seq, n_block);
    int const m_end = m_block_end(params, seq, n_block);
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
    ShapeQKV const shape_do = with_head_dim_v(params.shape_q);
    ShapeQKV const shape_v = with_head_dim_v(params.shape_k);
    Tensor mQ = domain_offset(q_rows, params.tma_q.get_tma_tensor(params.shape_q)(_, _, head, seq.batch));     // (seqlen_q, d)
    Tensor mdO = domain_offset(q_rows, params.tma_do.get_tma_tensor(shape_do)(_, _, head, seq.batch));         // (seqlen_q, dv)
    Tensor mK = domain_offset(k_rows, params.tma_k.get_tma_tensor(params.shape_k)(_, _, head_kv, seq.batch));  // (seqlen_k, d)
    Tensor mV = domain_offset(k_rows, params.tma_v.get_tma_tensor(shape_v)(_, _, head_kv, seq.batch));         // (seqlen_k, dv)
    Tensor mLSE = domain_offset(stat_rows, params.tma_lse.get_tma_tensor(params.shape_row)(_, head, seq.batch));      // (seqlen_q_padded)
    Tensor mdPsum = domain_offset(stat_rows, params.tma_dpsum.get_tma_tensor(params.shape_row)(_, head, seq.batch));  // (seqlen_q_padded)
    Tensor gQ = local_tile(mQ, select<0, 2>(TileShapeSdP{}), make_coord(_, _0{}));      // (M, d, m)
    Tensor gdO = local_tile(mdO, select<0, 2>(TileShapedP{}), make_coord(_, _0{}));    // (M, dv, m)
    Tensor gK = local_tile(mK, select<1, 2>(TileShapeSdP{}), make_coord(n_block, _0{}));  // (N, d)
    Tensor gV = local_tile(mV, select<1, 2>(TileShapedP{}), make_coord(n_block, _0{}));   // (N, dv)
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
      // With kDqOverStages the dQ half over the dO stage is handed over and read first
      // (store_dq), so dO is loaded first, each stage once its dQ half has been read.
      if constexpr (Traits::kDqOverStages) {
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
      if constexpr (!Traits::kDqOverStages) {
        pipeline_do.producer_acquire(write_do);  // LOCK dO stage
        auto* do_mbar = pipeline_do.producer_get_barrier(write_do);
        copy(params.tma_do.with(*do_mbar), tdOgdO(_, m_block), tdOsdO(_, write_do.index()));
        copy(params.tma_dpsum.with(*do_mbar), tDgD(_, m_block), tDsD(_, write_do.index()));
        ++write_do;
      }
    }
  }

  // Consumers: accumulate this thread's share of dK (unscaled) and dV for the key tile.
  template <class TensordK, class TensordV>
  CUTLASS_DEVICE static void mma(Params const& params, SharedStorage& storage,
                                 PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                 PipelineState& read_q, PipelineStatedO& read_do,
                                 TensordK& tdKrdK, TensordV& tdVrdV,
                                 int thread_idx, int n_block, int head, Seq const& seq) {
    clear(tdKrdK);
    clear(tdVrdV);
    // Query tiles [m_begin, m_end) see the key tile; none: dK = dV = 0.
    int const m_begin = m_block_begin(params, seq, n_block);
    int const m_end = m_block_end(params, seq, n_block);
    if (m_begin >= m_end) { return; }
    if constexpr (Traits::kTransposed) {
      mma_transposed(params, storage, pipeline_q, pipeline_do, read_q, read_do, tdKrdK, tdVrdV,
                     thread_idx, n_block, head, m_begin, m_end, seq);
    } else if constexpr (Traits::kSplitKeys) {
      mma_split_keys(params, storage, pipeline_q, pipeline_do, read_q, read_do, tdKrdK, tdVrdV,
                     thread_idx, n_block, m_begin, m_end, seq);
    } else {
      mma_lockstep(params, storage, pipeline_q, pipeline_do, read_q, read_do, tdKrdK, tdVrdV,
                   thread_idx, n_block, m_begin, m_end, seq);
    }
  }

  // Softcap's chain rule (local-mask kernels): dS is multiplied by 1 - t^2, where t =
  // tanh(...) is recovered from P = exp2(t * logit_scale_log2 - lse_log2) rather than kept
  // in registers. P = 0 (masked, or underflowed) gives t = -inf, clamped to -1: a factor
  // of 0 on a dS that is 0 anyway (as are the NaNs of rows with lse_log2 = +inf).
  CUTLASS_DEVICE static float softcap_dtanh(Params const& params, float p, float lse_log2) {
    if constexpr (Mask::kIsLocal) {
      float const t = fminf(fmaxf((__log2f(p) + lse_log2) * params.inv_logit_scale_log2, -1.f), 1.f);
      return 1.f - t * t;
    } else {
      return 1.f;
    }
  }
  CUTLASS_DEVICE static bool has_softcap(Params const& params) {
    if constexpr (Mask::kIsLocal) { return params.tanh_prescale != 0.f; } else { return false; }
  }
  // The scores S (or S^T) under softcap: tanh(S * prescale), before the mask.
  template <class TensorS>
  CUTLASS_DEVICE static void apply_softcap(Params const& params, TensorS& tSrS) {
    if constexpr (Mask::kIsLocal) {
      if (params.tanh_prescale != 0.f) { apply_tanh(tSrS, params.tanh_prescale); }
    }
  }

  // With 64-row query tiles dV += P^T dO is issued before dS^T is computed (it overlaps
  // that math); taller tiles issue it after, when the fp32 P^T is dead, or they spill.
  static constexpr bool kDvBeforeDs = kBlockM <= 64;
  // 64-row query tiles carry dS^T's registers into the next turn (mma_split_keys); at
  // 128 rows that made ptxas serialise the WGMMAs for want of registers (measured 7-15%
  // slower at hdim 64).
  static constexpr bool kDkIntoNextTurn = kBlockM <= 64;

  // The two schedules of the consumers (kSplitKeys: mainloop_bwd_split_keys.h; otherwise
  // mainloop_bwd_lockstep.h).
  template <class TensordK, class TensordV>
  CUTLASS_DEVICE static void mma_split_keys(Params const& params, SharedStorage& storage,
                                            PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                            PipelineState& read_q, PipelineStatedO& read_do,
                                            TensordK& tdKrdK, TensordV& tdVrdV,
                                            int thread_idx, int n_block, int m_begin, int m_end,
                                            Seq const& seq);

  // Hands this warpgroup's half of a query tile's dQ (d / 2 columns, float32) to the dQ
  // warp through its own shared-memory buffer (kDqViaSmem; with kDqOverStages, see
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
  // kDqOverStages: where warpgroup w's half goes, the Q stage (w = 0) or the dO stage,
  // as float4s indexed by dq_float4_index.
  CUTLASS_DEVICE static float4* dq_half_over_stages(SharedStorage& storage, int warpgroup, int stage_q, int stage_do) {
    Element* stage = warpgroup == 0 ? storage.smem_q.data() + stage_q * kStageElements
                                    : storage.smem_do.data() + stage_do * kStageElements;
    return reinterpret_cast<float4*>(stage) - warpgroup * Traits::kDqHalfFloat4s;
  }
  // kDqOverStages: this warpgroup's half over the tile's Q stage (warpgroup 0) or dO
  // stage (warpgroup 1), the caller having made sure that no GEMM reads that stage any
  // more (mma_lockstep); the producer refills it only after the dQ warp's read.
  template <class TensordQ>
  CUTLASS_DEVICE static void hand_over_dq_over_stages(SharedStorage& storage, TensordQ const& tdQrdQ, int thread_idx,
                                                      int stage_q, int stage_do) {
    static_assert(Traits::kDqOverStages);
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

  template <class TensordK, class TensordV>
  CUTLASS_DEVICE static void mma_lockstep(Params const& params, SharedStorage& storage,
                                          PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                          PipelineState& read_q, PipelineStatedO& read_do,
                                          TensordK& tdKrdK, TensordV& tdVrdV,
                                          int thread_idx, int n_block, int m_begin, int m_end,
                                          Seq const& seq);

  // kTransposed (mainloop_bwd_transposed.h): 80-key tiles, dQ^T added by the consumers.
  template <class TensordK, class TensordV>
  CUTLASS_DEVICE static void mma_transposed(Params const& params, SharedStorage& storage,
                                            PipelineQ& pipeline_q, PipelinedO& pipeline_do,
                                            PipelineState& read_q, PipelineStatedO& read_do,
                                            TensordK& tdKrdK, TensordV& tdVrdV,
                                            int thread_idx, int n_block, int head, int m_begin, int m_end,
                                            Seq const& seq);

  static constexpr int kDqBarrierThreads = cutlass::NumThreadsPerWarpGroup + cutlass::NumThreadsPerWarp;
  // One Q stage; stage s starts s of these into smem_q. With kDqOverStages, dQ halves go
  // over dO stages too, which are then as large (kHeadDimV == kHeadDim, traits_bwd.h).
  static constexpr int kStageElements = kBlockM * kHeadDim;
  static_assert(cute::cosize_v<SmemLayoutQ> == Traits::kStages * kStageElements);
  static_assert(!Traits::kDqOverStages || cute::cosize_v<SmemLayoutdO> == Traits::kStages * kStageElements);

  // The dQ warp (dq_writer_bwd.h).
  // With kDqOverStages the dO half (warpgroup 1's) is handed over first (mma_lockstep).
  static constexpr int kFirstHalf = Traits::kDqViaSmem ? 0 : 1;
  CUTLASS_DEVICE static void store_dq(Params const& params, SharedStorage& storage, int n_block, int head,
                                      Seq const& seq);

  CUTLASS_DEVICE static void release_dq_read(SharedStorage& storage, int stage, int half) {
    storage.barrier_dq_read[stage][half].arrive();
  }
};

}  // namespace flash3
