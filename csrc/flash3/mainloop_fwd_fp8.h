// The FP8 forward mainloop. Producer warpgroup: one elected thread issues the TMA loads of
// Q, K and V; all 128 threads transpose each V tile into V^T in shared memory. Consumers:
// S = Q K^T and O += P V^T as FP8 WGMMAs with the online softmax in between, the same
// overlapped schedule as the 16-bit mainloop (mainloop_fwd.h), plus the block scales.
#pragma once

#include <numeric>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "barriers.h"
#include "mask.h"
#include "operand_p_fp8.h"
#include "softmax_fp8.h"
#include "tma.h"
#include "traits_fp8.h"
#include "transpose_v_fp8.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

template <class Traits, class Mask>
struct MainloopFwdFp8 {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  using TileShapeMNK = typename Traits::TileShapeMNK;
  using SmemLayoutQ = typename Traits::SmemLayoutQ;
  using SmemLayoutK = typename Traits::SmemLayoutK;
  using SmemLayoutV = typename Traits::SmemLayoutV;
  using SmemLayoutVt = typename Traits::SmemLayoutVt;
  using PipelineK = typename Traits::PipelineK;
  using PipelineV = typename Traits::PipelineV;
  using PipelineVt = typename Traits::PipelineVt;
  using PipelineState = typename Traits::PipelineState;
  using Policy = MaskPolicy<Mask, kBlockM, kBlockN>;

  using Loads = FwdLoadsTma<Traits>;  // tma.h; V is staged with K's layout, then transposed (transpose_v_fp8.h)

  // Key tiles and K/V scale blocks: a tile within one block has one (K, V) scale pair;
  // otherwise it splits into groups of kScaleGroupKeys keys, each within one block (the
  // softmax folds V's scale into the exponent, so any split costs no accuracy; softmax_fp8.h).
  static constexpr int kScaleGroupKeys = std::gcd(kBlockN, kScaleBlockK);
  static constexpr int kScaleGroups = kBlockN / kScaleGroupKeys;
  struct GroupScales {
    float qk_log2[kScaleGroups];  // softmax_scale * log2(e) * q_scale * k_scale(group)
    float log2_v[kScaleGroups];   // log2 v_scale(group)
    float inv_v[kScaleGroups];    // 1 / v_scale(group)
  };

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> smem_q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> smem_k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> smem_v;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutVt>, 1024> smem_vt;
  };

  // tma_q, tma_k, tma_v, shape_q, shape_k from Loads.
  struct Params : Loads {
    int seqlen_q;
    int seqlen_k;
    int head_group;  // nheads / nheads_k
    float softmax_scale_log2;
    BlockScales q_scale, k_scale, v_scale;
  };

  static Params to_params(FwdFp8Params const& pf) {
    FwdParams const& p = pf.base;
    return {Loads::make(p), p.seqlen_q, p.seqlen_k, p.nheads / p.nheads_k, p.softmax_scale_log2,
            pf.q_scale, pf.k_scale, pf.v_scale};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) { params.prefetch_descriptors(); }

  CUTLASS_DEVICE static int n_block_end(Params const& params, int m_block) {
    return Policy{params.seqlen_q, params.seqlen_k}.n_block_end(m_block);
  }

  // Producer warpgroup, all 128 threads (thread_idx 0..127); tma_thread is the one that
  // issues TMA. Key tiles go from the last one down, as in the 16-bit mainloop. V(n) is
  // transposed while the TMA of K(n-1) and V(n-1) is in flight.
  CUTLASS_DEVICE static void load(Params const& params, SharedStorage& storage,
                                  cutlass::arch::ClusterTransactionBarrier& barrier_q_full,
                                  cutlass::arch::ClusterBarrier& barrier_q_empty, int q_phase,
                                  PipelineK& pipeline_k, PipelineV& pipeline_v, PipelineVt& pipeline_vt,
                                  PipelineState& transpose, int m_block, int head,
                                  int batch, bool tma_thread, int thread_idx) {
    int const n_end = n_block_end(params, m_block);
    if (n_end <= 0) { return; }
    int const head_kv = head / params.head_group;

    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(storage.smem_v.data()), SmemLayoutV{});
    Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q)(_, _, head, batch);     // (seqlen_q, d)
    Tensor mK = params.tma_k.get_tma_tensor(params.shape_k)(_, _, head_kv, batch);  // (seqlen_k, d)
    Tensor mV = params.tma_v.get_tma_tensor(params.shape_k)(_, _, head_kv, batch);  // (seqlen_k, d)
    Tensor gQ = local_tile(mQ, select<0, 2>(TileShapeMNK{}), make_coord(m_block, _0{}));  // (M, d)
    Tensor gK = local_tile(mK, select<1, 2>(TileShapeMNK{}), make_coord(_, _0{}));        // (N, d, n)
    Tensor gV = local_tile(mV, select<1, 2>(TileShapeMNK{}), make_coord(_, _0{}));        // (N, d, n)
    auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

    // transpose: the V stage the transposer reads next and the V^T stage it writes (they
    // advance together; kernel_fwd_fp8.h). K and V stages are written one key tile ahead
    // of it (K and V advance together): with the same stage count, the write state is the
    // transpose state, advanced once, and at a tile's start (all stages transposed) the
    // two are equal. One state instead of two (registers: the producer runs on 24 at
    // hdim 256, where a second one spilled).
    PipelineState const& write_first = transpose;
    if (tma_thread) {
      pipeline_k.producer_acquire(write_first);
      copy(params.tma_k.with(*pipeline_k.producer_get_barrier(write_first)), tKgK(_, n_end - 1),
           tKsK(_, write_first.index()));
      barrier_q_empty.wait(q_phase ^ 1);  // LOCK sQ
      barrier_q_full.arrive_and_expect_tx(Traits::kBytesQ);
      copy(params.tma_q.with(reinterpret_cast<cutlass::arch::ClusterTransactionBarrier::ValueType&>(barrier_q_full)),
           tQgQ, tQsQ);
      pipeline_v.producer_acquire(write_first);
      copy(params.tma_v.with(*pipeline_v.producer_get_barrier(write_first)), tVgV(_, n_end - 1),
           tVsV(_, write_first.index()));
    }

    uint8_t* smem_vt = reinterpret_cast<uint8_t*>(storage.smem_vt.data());
    CUTLASS_PRAGMA_NO_UNROLL
    for (int n_block = n_end - 1; n_block >= 0; --n_block) {
      if (n_block > 0) {
        if (tma_thread) {
          PipelineState write_kv = transpose;
          ++write_kv;
          pipeline_k.producer_acquire(write_kv);
          copy(params.tma_k.with(*pipeline_k.producer_get_barrier(write_kv)), tKgK(_, n_block - 1),
               tKsK(_, write_kv.index()));
          pipeline_v.producer_acquire(write_kv);
          copy(params.tma_v.with(*pipeline_v.producer_get_barrier(write_kv)), tVgV(_, n_block - 1),
               tVsV(_, write_kv.index()));
        }
      }
      __syncwarp();  // ldmatrix / stmatrix are warp-collective
      // transpose is a producer state of V^T (its phase starts at 1); as a consumer state
      // of V the same stage has the other phase.
      PipelineState const read_v(transpose.index(), transpose.phase() ^ 1, transpose.count());
      pipeline_v.consumer_wait(read_v);         // LOCK V stage (TMA landed)
      pipeline_vt.producer_acquire(transpose);  // LOCK V^T stage (consumers done with it)
      // The lane's addresses are written at their use (a few instructions); where registers
      // allow, the compiler hoists them out of the loop.
      Traits::Transpose::run(Traits::Transpose::addresses(reinterpret_cast<uint8_t*>(storage.smem_v.data()), thread_idx),
                             smem_vt, transpose.index(), transpose.index());
      // The WGMMAs read V^T through the async proxy: make the generic-proxy stores visible.
      cutlass::arch::fence_view_async_shared();
      pipeline_vt.producer_commit(transpose);  // UNLOCK V^T stage for the consumers
      pipeline_v.consumer_release(transpose);  // UNLOCK V stage for the next TMA
      ++transpose;
    }
  }

  // Consumers: returns the output accumulator (normalised, dequantised) and the logsumexp
  // of this thread's rows. As in the 16-bit mainloop, iteration j issues S(j) = Q K(j)^T
  // and O += P(j+1) V(j+1) together and runs the softmax of S(j) while the latter runs.
  template <class TensorO>
  CUTLASS_DEVICE static auto mma(Params const& params, SharedStorage& storage,
                                 cutlass::arch::ClusterTransactionBarrier& barrier_q_full,
                                 cutlass::arch::ClusterBarrier& barrier_q_empty, int q_phase,
                                 PipelineK& pipeline_k, PipelineVt& pipeline_vt,
                                 PipelineState& read_k, PipelineState& read_vt,
                                 TensorO& tOrO, int thread_idx, int m_block, int head, int batch) {
    using TiledMmaQK = typename Traits::TiledMmaQK;
    using TiledMmaPV = typename Traits::TiledMmaPV;
    TiledMmaQK tiled_mma_qk;
    TiledMmaPV tiled_mma_pv;
    auto thr_mma_qk = tiled_mma_qk.get_thread_slice(thread_idx);
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);

    Tensor sQ = make_tensor(make_smem_ptr(storage.smem_q.data()), SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.smem_k.data()), SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(storage.smem_vt.data()), SmemLayoutVt{});
    Tensor tSrQ = thr_mma_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr_mma_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, PIPE)
    Tensor tOrV = thr_mma_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, PIPE)

    Tensor cS = make_identity_tensor(select<0, 1>(TileShapeMNK{}));
    Tensor tScS_rowcol = make_tensor(thr_mma_qk.partition_C(cS).data(),
                                     accumulator_rowcol(thr_mma_qk.partition_C(cS).layout()));

    Policy const policy{params.seqlen_q, params.seqlen_k};
    int const n_end = policy.n_block_end(m_block);
    constexpr int kRows = decltype(size<0>(tScS_rowcol))::value;
    OnlineSoftmaxFp8<kRows, Traits::kSplitChains, Traits::kLazyRescale, Traits::kIntRowMax> softmax;
    Tensor tOrO_rowcol = make_tensor(tOrO.data(), accumulator_rowcol(tOrO.layout()));

    int const warpgroup = thread_idx / cutlass::NumThreadsPerWarpGroup;
    if (n_end <= 0) {
      clear(tOrO);
      return softmax.finalize(tOrO_rowcol);
    }
    PingpongTurns<Traits::kConsumerWarpgroups, Traits::kPingpong, Traits::kPingpongIdsFromThreadIdx> const turns{
        warpgroup};
    turns.start();

    // Scales: this warpgroup's 64 query rows share one (a warpgroup wholly past seqlen_q
    // reads none); each group of a key tile lies in one K and one V scale block.
    int const head_kv = head / params.head_group;
    int const q_block = (m_block * kBlockM) / kScaleBlockQ + warpgroup;
    float const q_scale = q_block < params.q_scale.num_blocks
                              ? params.q_scale.head_ptr(batch, head)[q_block * params.q_scale.block_stride]
                              : 1.f;
    float const qk_scale_log2 = params.softmax_scale_log2 * q_scale;
    // K/V scales: the pointers and strides stay in the kernel parameters (constant memory)
    // and only 32-bit offsets in registers (hdim 256 needs 240 per thread for O, S and P;
    // 64-bit pointers kept live across the loop spilled there). With kOneScaleOffset
    // (traits_fp8.h) K's offset and strides index V's scales too: the binding
    // (api_fp8.cpp) gives both tensors the same strides. Scale tensors hold fewer than
    // 2^31 elements. Groups wholly past seqlen_k (masked) read the last block. A V scale
    // of 0 (only a caller's own scales can hold one) is taken as 2^-64, so that P / v
    // stays finite.
    int const k_head_offset = int(batch * params.k_scale.batch_stride + head_kv * params.k_scale.head_stride);
    int const v_head_offset =
        Traits::kOneScaleOffset ? k_head_offset
                                : int(batch * params.v_scale.batch_stride + head_kv * params.v_scale.head_stride);
    int64_t const& v_block_stride = Traits::kOneScaleOffset ? params.k_scale.block_stride : params.v_scale.block_stride;
    auto group_scale = [&](int n_block, int g, float& qk_log2, float& log2_v, float& inv_v) {
      int const block = min((n_block * kBlockN + g * kScaleGroupKeys) / kScaleBlockK, params.k_scale.num_blocks - 1);
      qk_log2 = qk_scale_log2 * params.k_scale.ptr[k_head_offset + block * int(params.k_scale.block_stride)];
      float const v = fmaxf(params.v_scale.ptr[v_head_offset + block * int(v_block_stride)], 0x1p-64f);
      log2_v = __log2f(v);
      inv_v = __fdividef(1.f, v);
    };
    auto group_scales = [&](int n_block) {
      GroupScales t;
      if constexpr (kScaleGroups > 1 && Traits::kLaneScales) {
        // Lane g works out group g's scales and the warp reads them from it: one LG2 and
        // one RCP per warp and key tile instead of one per group (MUFU instructions, in
        // the pipe the exponentials keep busy at hdim 128), and one load each of K's and
        // V's scales. The same operations on the same values: bitwise the same scales.
        static_assert(kScaleGroups <= 32);
        float qk_log2, log2_v, inv_v;
        group_scale(n_block, min(thread_idx % 32, kScaleGroups - 1), qk_log2, log2_v, inv_v);
        CUTE_UNROLL
        for (int g = 0; g < kScaleGroups; ++g) {
          t.qk_log2[g] = __shfl_sync(0xffffffff, qk_log2, g);
          t.log2_v[g] = __shfl_sync(0xffffffff, log2_v, g);
          t.inv_v[g] = __shfl_sync(0xffffffff, inv_v, g);
        }
      } else {
        CUTE_UNROLL
        for (int g = 0; g < kScaleGroups; ++g) { group_scale(n_block, g, t.qk_log2[g], t.log2_v[g], t.inv_v[g]); }
      }
      return t;
    };

    auto compute_scores = [&](auto& tSrS, int n_block) {
      Tensor tSrS_rowcol = make_tensor(tSrS.data(), accumulator_rowcol(tSrS.layout()));
      if (policy.needs_mask(m_block, n_block)) { policy.apply(tSrS_rowcol, tScS_rowcol, m_block, n_block); }
      return tSrS_rowcol;
    };

    int n_block = n_end - 1;
    GroupScales tile_scales = group_scales(n_block);
    uint32_t const zero = opaque_zero(params.seqlen_q);  // utils.h run_in_own_block

    barrier_q_full.wait(q_phase);

    // First key tile: S only.
    Tensor tSrS = partition_fragment_C(tiled_mma_qk, select<0, 1>(TileShapeMNK{}));
    pipeline_k.consumer_wait(read_k);
    turns.wait_turn();
    warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
    turns.template pass_turn</*kFinalIssue=*/false>();
    warpgroup_wait<0>();
    // UNLOCK K stage (the tile's last one: after O's store, where O is staged over it)
    if (!(Traits::kOInKVStages && n_block == 0)) { pipeline_k.consumer_release(read_k); }
    ++read_k;
    if (n_block == 0) { barrier_q_empty.arrive(); }  // UNLOCK sQ
    {
      Tensor tSrS_rowcol = compute_scores(tSrS, n_block);
      bool const masked = policy.needs_mask(m_block, n_block);
      softmax.template online_update</*kFirstTile=*/true>(tSrS_rowcol, tile_scales.qk_log2, tile_scales.log2_v,
                                                          tile_scales.inv_v, masked);
    }
    // P in e4m3, in the register order of the PV WGMMA's A operand.
    Tensor tOrP = make_tensor<Element>(partition_shape_A(tiled_mma_pv, select<0, 2>(typename Traits::TileShapePV{})));
    convert_p_to_operand_a(tSrS, tOrP);
    clear(tOrO);

    CUTLASS_PRAGMA_NO_UNROLL
    for (--n_block; n_block >= 0; --n_block) {
      tile_scales = group_scales(n_block);
      Tensor tSrS_next = partition_fragment_C(tiled_mma_qk, select<0, 1>(TileShapeMNK{}));
      pipeline_k.consumer_wait(read_k);
      pipeline_vt.consumer_wait(read_vt);
      turns.wait_turn();
      warpgroup_gemm</*kZeroInit=*/true>(tiled_mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS_next);
      warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_pv, tOrP, tOrV(_, _, _, read_vt.index()), tOrO);
      turns.template pass_turn</*kFinalIssue=*/false>();
      warpgroup_wait<1>();  // S(j) has landed; O += P(j+1) V(j+1) may still run
      // UNLOCK K stage (the tile's last one: after O's store, where O is staged over it)
      if (!(Traits::kOInKVStages && n_block == 0)) { pipeline_k.consumer_release(read_k); }
      ++read_k;
      if (n_block == 0) { barrier_q_empty.arrive(); }  // UNLOCK sQ
      Tensor tSrS_rowcol = compute_scores(tSrS_next, n_block);
      bool const masked = policy.needs_mask(m_block, n_block);  // the softmax's row max path
      Tensor correction = make_tensor<float>(Layout<Int<kRows>>{});
      if constexpr (Traits::kSoftmaxUnderPv == SoftmaxUnderPv::kHalf) {
        // The row max and the first half of the rows' exponentials run while O += P V is in
        // flight (in a block of their own, or ptxas hoists the wait above them: utils.h);
        // O's rescale then fills the issue slots that the second half's exponentials leave
        // free (they wait on the MUFU pipe).
        run_in_own_block(zero, [&] {
          softmax.template update_row_maxes</*kFirstTile=*/false>(tSrS_rowcol, tile_scales.qk_log2,
                                                                  tile_scales.log2_v, correction, masked);
          CUTE_UNROLL
          for (int mi = 0; mi < kRows / 2; ++mi) {
            softmax.exponentiate_row(tSrS_rowcol, mi, tile_scales.qk_log2, tile_scales.log2_v, tile_scales.inv_v,
                                     correction(mi));
          }
        });
      } else {
        correction = softmax.template online_update</*kFirstTile=*/false>(
            tSrS_rowcol, tile_scales.qk_log2, tile_scales.log2_v, tile_scales.inv_v, masked);
      }
      warpgroup_wait<0>();  // O += P V done: P's registers and the V^T stage are free
      pipeline_vt.consumer_release(read_vt);  // UNLOCK V^T stage
      ++read_vt;
      if (softmax.any_rescale(correction)) {
        CUTE_UNROLL
        for (int mi = 0; mi < size<0>(tOrO_rowcol); ++mi) {
          CUTE_UNROLL
          for (int ni = 0; ni < size<1>(tOrO_rowcol); ++ni) { tOrO_rowcol(mi, ni) *= correction(mi); }
        }
      }
      if constexpr (Traits::kSoftmaxUnderPv == SoftmaxUnderPv::kHalf) {
        CUTE_UNROLL
        for (int mi = kRows / 2; mi < kRows; ++mi) {
          softmax.exponentiate_row(tSrS_rowcol, mi, tile_scales.qk_log2, tile_scales.log2_v, tile_scales.inv_v,
                                   correction(mi));
        }
      }
      convert_p_to_operand_a(tSrS_next, tOrP);
    }

    // Last key tile: O += P V only.
    pipeline_vt.consumer_wait(read_vt);
    turns.wait_turn();
    warpgroup_gemm</*kZeroInit=*/false>(tiled_mma_pv, tOrP, tOrV(_, _, _, read_vt.index()), tOrO);
    turns.template pass_turn</*kFinalIssue=*/true>();
    warpgroup_wait<0>();
    // UNLOCK V^T stage (where O is staged over it: after O's store, by the kernel)
    if constexpr (!Traits::kOInKVStages) { pipeline_vt.consumer_release(read_vt); }
    ++read_vt;

    return softmax.finalize(tOrO_rowcol);
  }
};

}  // namespace flash3
