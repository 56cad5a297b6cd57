// The backward epilogue: the CTA's dK (scaled by softmax_scale) and dV to global memory.
// 16-bit outputs are staged in shared memory over K and V (dead by then) and written with
// one TMA store each, which skips rows past seqlen_k (a packed batch's partial last key
// tile, whose next rows are the next sequence's, goes straight from the accumulators, as
// float32 outputs do). Under GQA dK and dV are float32: each query head adds its own into
// its K/V head's (params.h dkv_accumulate; bulk reductions or float4 atomics), or, in
// deterministic mode, writes them to a slice of its own, and the binding sums the heads
// of a group.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include "barriers.h"
#include "params.h"
#include "seqlen.h"
#include "tma.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

template <class Traits>
struct EpilogueBwd {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;

  // dK is staged where K was, dV where V was, in their layouts. With Traits::kTransposed
  // the accumulators hold dK^T and dV^T, which transposing stmatrix (STSM.T) writes
  // through the (d, keys) views of those layouts.
  static constexpr bool kTransposed = Traits::kTransposed;
  using SmemLayoutdK = typename Traits::SmemLayoutK;
  using SmemLayoutdV = typename Traits::SmemLayoutV;
  static_assert(!kTransposed || std::is_same_v<SmemLayoutdK, SmemLayoutdV>, "dV^T uses K's transposed view");
  using SmemLayoutdKStaging = std::conditional_t<kTransposed, typename Traits::SmemLayoutKt, SmemLayoutdK>;
  using SmemLayoutdVStaging = std::conditional_t<kTransposed, typename Traits::SmemLayoutKt, SmemLayoutdV>;
  using StagingCopyAtom = Copy_Atom<std::conditional_t<kTransposed, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>, Element>;
  using TileShapedK = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileShapedV = Shape<Int<kBlockN>, Int<kHeadDimV>>;

  static auto make_tma_dk(Element* ptr, ShapeRowsHead const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_STORE{}, ptr, shape, stride, SmemLayoutdK{}, TileShapedK{});
  }
  static auto make_tma_dv(Element* ptr, ShapeRowsHead const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_STORE{}, ptr, shape, stride, SmemLayoutdV{}, TileShapedV{});
  }
  using TmadK = decltype(make_tma_dk(nullptr, ShapeRowsHead{}, StrideRowsHead{}));
  using TmadV = decltype(make_tma_dv(nullptr, ShapeRowsHead{}, StrideRowsHead{}));

  struct Params {
    // 16-bit outputs (fp32_out false); with fp32_out these describe the same memory as
    // 16-bit elements and are never used.
    TmadK tma_dk;
    TmadV tma_dv;
    ShapeRowsHead shape_dkv;  // dK's; dV's has head dim kHeadDimV (with_head_dim_v)
    void* dk_ptr;
    void* dv_ptr;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    float softmax_scale;
    int head_group;   // query heads per head of dK and dV: nheads / nheads_k when accumulating, else 1
    bool fp32_out;
    bool accumulate;  // fp32_out added with atomics (dkv_accumulate)
    bool is_varlen;
  };

  static Params to_params(BwdParams const& p) {
    int const nheads_dkv = p.dkv_is_fp32 && !p.dkv_accumulate ? p.nheads : p.nheads_k;
    ShapeRowsHead shape_dkv = rows_head_shape(p.rows_k(), p.headdim, nheads_dkv, p.tensor_batch());
    ShapeRowsHead shape_dv = rows_head_shape(p.rows_k(), p.headdim_v, nheads_dkv, p.tensor_batch());
    return {make_tma_dk(static_cast<Element*>(p.dk_ptr), shape_dkv,
                        rows_head_stride(p.dk_row_stride, p.dk_head_stride, p.dk_batch_stride)),
            make_tma_dv(static_cast<Element*>(p.dv_ptr), shape_dv,
                        rows_head_stride(p.dv_row_stride, p.dv_head_stride, p.dv_batch_stride)),
            shape_dkv, p.dk_ptr, p.dv_ptr, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride,
            p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, p.softmax_scale,
            p.dkv_accumulate ? p.nheads / p.nheads_k : 1, p.dkv_is_fp32, p.dkv_is_fp32 && p.dkv_accumulate,
            p.is_varlen()};
  }

  // dV has dK's rows, heads and batch, with V's head dim: the device side derives its
  // shape (for the TMA coordinate tensor) rather than keep another.
  CUTLASS_HOST_DEVICE static ShapeRowsHead with_head_dim_v(ShapeRowsHead const& shape) {
    return replace<1>(shape, int32_t(kHeadDimV));
  }

  template <class Out, class TensorAcc, class TensorC>
  CUTLASS_DEVICE static void store_one(TensorAcc const& acc_rowcol, TensorC const& coord_rowcol, Out* tile,
                                       int64_t row_stride, int row0, int seqlen_k, float scale) {
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(acc_rowcol); ++mi) {
      int const row = row0 + get<0>(coord_rowcol(mi, 0));
      if (row >= seqlen_k) { continue; }
      Out* out_row = tile + row * row_stride;
      // Columns come in adjacent pairs: (2, N/8, MMA_N) with the pair innermost.
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(acc_rowcol); ni += 2) {
        int const col = get<1>(coord_rowcol(mi, ni));
        cutlass::Array<Out, 2> pair;
        pair[0] = static_cast<Out>(acc_rowcol(mi, ni) * scale);
        pair[1] = static_cast<Out>(acc_rowcol(mi, ni + 1) * scale);
        *reinterpret_cast<cutlass::Array<Out, 2>*>(out_row + col) = pair;
      }
    }
  }

  // smem_k, smem_v: the CTA's K and V tiles, which both consumer warpgroups have finished
  // reading once they pass the first barrier below.
  // smem_q: the Q and dO stages (dead too), used by store_through_smem.
  // Where float32 dK and dV go through shared memory: the transposed kernels (always), and
  // those whose dQ has a buffer of its own (with dQ over the Q/dO stages, the dQ warp may
  // still be reading the last tile's there). The others (hdim 256 in deterministic mode)
  // store them from the accumulators, and never accumulate (params.h dkv_accumulate).
  static constexpr bool kFloat32ThroughSmem = kTransposed || Traits::kDqViaSmem;
  template <class TensordK, class TensordV>
  CUTLASS_DEVICE static void store(Params const& params, TensordK const& tdKrdK, TensordV const& tdVrdV, Element* smem_k,
                                   Element* smem_v, Element* smem_q, int thread_idx, int n_block, int head,
                                   Seq const& seq) {
    // (In a packed batch the rows past the sequence's last key are the next sequence's.)
    bool const partial_tile = params.is_varlen && (n_block + 1) * kBlockN > seq.seqlen_k;
    if ((kFloat32ThroughSmem && params.fp32_out) || (kTransposed && partial_tile)) {
      store_through_smem(params, tdKrdK, tdVrdV, reinterpret_cast<float*>(smem_q), reinterpret_cast<float*>(smem_k),
                         thread_idx, n_block, head, seq);
      return;
    }
    if constexpr (!kTransposed) {
      if (params.fp32_out || partial_tile) {
        store_direct(params, tdKrdK, tdVrdV, thread_idx, n_block, head, seq);
        return;
      }
    }
    store_tma(params, tdKrdK, tdVrdV, smem_k, smem_v, thread_idx, n_block, head, seq);
  }

  template <class TensordK, class TensordV>
  CUTLASS_DEVICE static void store_tma(Params const& params, TensordK const& tdKrdK, TensordV const& tdVrdV,
                                       Element* smem_k, Element* smem_v, int thread_idx, int n_block, int head,
                                       Seq const& seq) {
    constexpr int kConsumerThreads = Traits::kConsumerThreads;
    // The last dQ GEMM of either warpgroup reads all of K: K and V are dead only when both
    // are done.
    named_barrier_sync(kConsumerThreads, NamedBarrier::dKVStaging);  // LOCK sK, sV
    Tensor sdK = make_tensor(make_smem_ptr(smem_k), SmemLayoutdK{});
    Tensor sdV = make_tensor(make_smem_ptr(smem_v), SmemLayoutdV{});
    Tensor sdKStaging = make_tensor(make_smem_ptr(smem_k), SmemLayoutdKStaging{});
    Tensor sdVStaging = make_tensor(make_smem_ptr(smem_v), SmemLayoutdVStaging{});
    auto smem_tiled_copy_dk = make_tiled_copy_C(StagingCopyAtom{}, typename Traits::TiledMmadK{});
    auto smem_tiled_copy_dv = make_tiled_copy_C(StagingCopyAtom{}, typename Traits::TiledMmadV{});
    auto smem_thr_copy_dk = smem_tiled_copy_dk.get_thread_slice(thread_idx);
    auto smem_thr_copy_dv = smem_tiled_copy_dv.get_thread_slice(thread_idx);
    {
      Tensor rdK = make_tensor<Element>(tdKrdK.layout());
      CUTE_UNROLL
      for (int i = 0; i < size(tdKrdK); ++i) { rdK(i) = static_cast<Element>(tdKrdK(i) * params.softmax_scale); }
      copy(smem_tiled_copy_dk, smem_thr_copy_dk.retile_S(rdK), smem_thr_copy_dk.partition_D(sdKStaging));
      Tensor rdV = make_tensor<Element>(tdVrdV.layout());
      convert_into(tdVrdV, rdV);
      copy(smem_tiled_copy_dv, smem_thr_copy_dv.retile_S(rdV), smem_thr_copy_dv.partition_D(sdVStaging));
    }
    // The tiles were written through the generic proxy; TMA reads through the async proxy.
    cutlass::arch::fence_view_async_shared();
    named_barrier_sync(kConsumerThreads, NamedBarrier::dKVStaging);  // the whole tiles are staged
    if (thread_idx == 0) {
      auto const rows = make_coord(seq.offset_k, _0{});
      ShapeRowsHead const shape_dv = with_head_dim_v(params.shape_dkv);
      Tensor mdK = domain_offset(rows, params.tma_dk.get_tma_tensor(params.shape_dkv)(_, _, head, seq.batch));  // (seqlen_k, d)
      Tensor mdV = domain_offset(rows, params.tma_dv.get_tma_tensor(shape_dv)(_, _, head, seq.batch));          // (seqlen_k, dv)
      Tensor gdK = local_tile(mdK, TileShapedK{}, make_coord(n_block, _0{}));  // (N, d)
      Tensor gdV = local_tile(mdV, TileShapedV{}, make_coord(n_block, _0{}));  // (N, dv)
      auto [tdKgdK, tdKsdK] = tma_partition(params.tma_dk, _0{}, Layout<_1>{}, group_modes<0, 2>(sdK),
                                            group_modes<0, 2>(gdK));
      auto [tdVgdV, tdVsdV] = tma_partition(params.tma_dv, _0{}, Layout<_1>{}, group_modes<0, 2>(sdV),
                                            group_modes<0, 2>(gdV));
      copy(params.tma_dk, tdKsdK, tdKgdK);
      copy(params.tma_dv, tdVsdV, tdVgdV);
      cute::tma_store_arrive();
      cute::tma_store_wait<0>();  // shared memory must outlive the stores' reads
    }
  }

  // dK and dV as float32 (keys, d) tiles in shared memory, dK's over the Q and dO stages
  // and dV's over K and V, then to global memory 16 bytes of a row per thread (a warp's
  // 512 contiguous bytes), skipping rows past seqlen_k: float32 outputs (added, when
  // accumulating GQA heads, with bulk reductions of whole tiles or float4 atomics), and
  // the transposed kernels' partial tiles. (From the accumulators, the transposed
  // kernels' row addresses spilled, and the others add a pair of elements per 8-byte
  // atomic.)
  template <class TensordK, class TensordV>
  CUTLASS_DEVICE static void store_through_smem(Params const& params, TensordK const& tdKrdK, TensordV const& tdVrdV,
                                                float* smem_dk, float* smem_dv, int thread_idx, int n_block, int head,
                                                Seq const& seq) {
    constexpr int kConsumerThreads = Traits::kConsumerThreads;
    static_assert(kBlockN * kHeadDim * sizeof(float) <=
                      (cute::cosize_v<typename Traits::SmemLayoutQ> + cute::cosize_v<typename Traits::SmemLayoutdO>) *
                          sizeof(Element),
                  "dK's float32 tile fits over the Q and dO stages");
    static_assert(kBlockN * kHeadDimV * sizeof(float) <=
                      (cute::cosize_v<typename Traits::SmemLayoutK> + cute::cosize_v<typename Traits::SmemLayoutV>) *
                          sizeof(Element),
                  "dV's float32 tile fits over K and V");
    // Both warpgroups' last GEMMs (which read K, V, Q and dO) are done.
    named_barrier_sync(kConsumerThreads, NamedBarrier::dKVStaging);  // LOCK Q, dO, K, V
    // Accumulator coordinates: (key, column), or (column, key) transposed.
    auto stage = [&](auto const& acc, auto const& tiled_mma, auto tile_shape, float* tile, int columns, float scale) {
      Tensor coord = tiled_mma.get_thread_slice(thread_idx).partition_C(make_identity_tensor(tile_shape));
      CUTE_UNROLL
      for (int i = 0; i < size(acc); ++i) {
        int const key = kTransposed ? get<1>(coord(i)) : get<0>(coord(i));
        int const column = kTransposed ? get<0>(coord(i)) : get<1>(coord(i));
        tile[key * columns + column] = acc(i) * scale;
      }
    };
    stage(tdKrdK, typename Traits::TiledMmadK{}, select<0, 1>(typename Traits::TileShapedK{}), smem_dk, kHeadDim,
          params.softmax_scale);
    stage(tdVrdV, typename Traits::TiledMmadV{}, select<0, 1>(typename Traits::TileShapedV{}), smem_dv, kHeadDimV, 1.f);
    int const row0 = n_block * kBlockN;
    int const rows = min(seq.seqlen_k - row0, kBlockN);
    // Traits::kDkvBulkReduce: a whole tile added to its K/V head's float32 rows goes out as
    // bulk reductions, one per row of dK or dV (the rows of a head are a head's width
    // apart), read from shared memory by the TMA unit through the async proxy; a partial
    // one (the next rows are the next sequence's) as float4 atomics below.
    bool const bulk = Traits::kDkvBulkReduce && params.accumulate && rows == kBlockN;
    if (bulk) { cutlass::arch::fence_view_async_shared(); }
    named_barrier_sync(kConsumerThreads, NamedBarrier::dKVStaging);
    int const head_dkv = head / params.head_group;
    int64_t const dk_offset = seq.batch * params.dk_batch_stride + head_dkv * params.dk_head_stride +
                              (int64_t(seq.offset_k) + row0) * params.dk_row_stride;
    int64_t const dv_offset = seq.batch * params.dv_batch_stride + head_dkv * params.dv_head_stride +
                              (int64_t(seq.offset_k) + row0) * params.dv_row_stride;
    if (bulk) {
      float* dk = static_cast<float*>(params.dk_ptr) + dk_offset;
      float* dv = static_cast<float*>(params.dv_ptr) + dv_offset;
      for (int i = thread_idx; i < 2 * kBlockN; i += kConsumerThreads) {
        if (i < kBlockN) {
          bulk_reduce_add(dk + i * params.dk_row_stride, smem_dk + i * kHeadDim, kHeadDim * sizeof(float));
        } else {
          int const row = i - kBlockN;
          bulk_reduce_add(dv + row * params.dv_row_stride, smem_dv + row * kHeadDimV, kHeadDimV * sizeof(float));
        }
      }
      // The CTA's shared memory must outlive the reads (the sums land in L2 after).
      cute::tma_store_arrive();
      cute::tma_store_wait<0>();
      return;
    }
    auto copy_out = [&](float const* src, auto* dst, int64_t row_stride, int columns) {
      using Out = std::remove_pointer_t<decltype(dst)>;
      int const chunks_per_row = columns / 4;
      for (int chunk = thread_idx; chunk < rows * chunks_per_row; chunk += kConsumerThreads) {
        int const row = chunk / chunks_per_row;
        int const col = chunk % chunks_per_row * 4;
        float4 const v = *reinterpret_cast<float4 const*>(src + row * columns + col);
        if constexpr (std::is_same_v<Out, float>) {
          if (params.accumulate) {
            atomicAdd(reinterpret_cast<float4*>(dst + row * row_stride + col), v);
            continue;
          }
        }
        cutlass::Array<Out, 4> out;
        out[0] = static_cast<Out>(v.x);
        out[1] = static_cast<Out>(v.y);
        out[2] = static_cast<Out>(v.z);
        out[3] = static_cast<Out>(v.w);
        *reinterpret_cast<cutlass::Array<Out, 4>*>(dst + row * row_stride + col) = out;
      }
    };
    if (params.fp32_out) {
      copy_out(smem_dk, static_cast<float*>(params.dk_ptr) + dk_offset, params.dk_row_stride, kHeadDim);
      copy_out(smem_dv, static_cast<float*>(params.dv_ptr) + dv_offset, params.dv_row_stride, kHeadDimV);
    } else {
      copy_out(smem_dk, static_cast<Element*>(params.dk_ptr) + dk_offset, params.dk_row_stride, kHeadDim);
      copy_out(smem_dv, static_cast<Element*>(params.dv_ptr) + dv_offset, params.dv_row_stride, kHeadDimV);
    }
  }

  template <class TensordK, class TensordV>
  CUTLASS_DEVICE static void store_direct(Params const& params, TensordK const& tdKrdK, TensordV const& tdVrdV,
                                          int thread_idx, int n_block, int head, Seq const& seq) {
    auto thr_mma_dk = typename Traits::TiledMmadK{}.get_thread_slice(thread_idx);
    auto thr_mma_dv = typename Traits::TiledMmadV{}.get_thread_slice(thread_idx);
    int const row0 = n_block * kBlockN;
    int const head_dkv = head / params.head_group;
    int64_t const dk_offset = seq.batch * params.dk_batch_stride + head_dkv * params.dk_head_stride +
                              int64_t(seq.offset_k) * params.dk_row_stride;
    int64_t const dv_offset = seq.batch * params.dv_batch_stride + head_dkv * params.dv_head_stride +
                              int64_t(seq.offset_k) * params.dv_row_stride;
    Tensor tdKcdK = thr_mma_dk.partition_C(make_identity_tensor(TileShapedK{}));
    Tensor tdVcdV = thr_mma_dv.partition_C(make_identity_tensor(TileShapedV{}));
    Tensor coord_rowcol_dk = make_tensor(tdKcdK.data(), accumulator_rowcol(tdKcdK.layout()));
    Tensor coord_rowcol_dv = make_tensor(tdVcdV.data(), accumulator_rowcol(tdVcdV.layout()));
    Tensor dK_rowcol = make_tensor(tdKrdK.data(), accumulator_rowcol(tdKrdK.layout()));
    Tensor dV_rowcol = make_tensor(tdVrdV.data(), accumulator_rowcol(tdVrdV.layout()));
    if (params.fp32_out) {
      store_one(dK_rowcol, coord_rowcol_dk, static_cast<float*>(params.dk_ptr) + dk_offset, params.dk_row_stride, row0,
                seq.seqlen_k, params.softmax_scale);
      store_one(dV_rowcol, coord_rowcol_dv, static_cast<float*>(params.dv_ptr) + dv_offset, params.dv_row_stride, row0,
                seq.seqlen_k, 1.f);
    } else {
      store_one(dK_rowcol, coord_rowcol_dk, static_cast<Element*>(params.dk_ptr) + dk_offset, params.dk_row_stride, row0,
                seq.seqlen_k, params.softmax_scale);
      store_one(dV_rowcol, coord_rowcol_dv, static_cast<Element*>(params.dv_ptr) + dv_offset, params.dv_row_stride, row0,
                seq.seqlen_k, 1.f);
    }
  }
};

}  // namespace flash3
