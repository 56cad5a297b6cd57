// The forward epilogue: the normalised O accumulator to global memory in the element
// type, and the logsumexp per query row.
//
// Two paths. EpilogueFwd stores O straight from registers: each thread writes pairs of
// adjacent columns (4 bytes), rows past seqlen_q are skipped; the kernels where staging
// measured slower (the general 16-bit hdim 64 and 128 non-causal ones, FP8 hdim 64
// non-causal), and tiles that see no key, use it. EpilogueFwdTma (the other 16-bit and
// FP8 kernels) stages O in shared memory with STSM and stores it with TMA, 16 rows per
// warp, so each warp goes on as soon as its own rows are out of its registers and the
// global writes are full 128-byte lines.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include "params.h"
#include "seqlen.h"
#include "tma.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

// ElementO: the output type (the FP8 kernel writes bf16; the 16-bit ones their input type).
template <class Traits, class ElementO = typename Traits::Element>
struct EpilogueFwd {
  using Element = ElementO;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDimV = Traits::kHeadDimV;  // O's head dim

  struct Params {
    Element* o_ptr;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    float* lse_ptr;  // (batch, nheads, lse_rows): a packed batch has batch 1 and lse_rows = total_q
    int nheads;
    int lse_rows;
  };

  static Params to_params(FwdParams const& p) {
    return {static_cast<Element*>(p.o_ptr), p.o_batch_stride, p.o_row_stride, p.o_head_stride,
            p.lse_ptr, p.nheads, p.rows_q()};
  }

  // Row 0 of the sequence's O for this head, and of its lse.
  CUTLASS_DEVICE static Element* o_rows(Params const& params, int head, Seq const& seq) {
    return params.o_ptr + seq.batch * params.o_batch_stride + head * params.o_head_stride +
           int64_t(seq.offset_q) * params.o_row_stride;
  }
  CUTLASS_DEVICE static float* lse_rows(Params const& params, int head, Seq const& seq) {
    return params.lse_ptr + (int64_t(seq.batch) * params.nheads + head) * params.lse_rows + seq.offset_q;
  }

  template <class TensorO, class TensorLse>
  CUTLASS_DEVICE static void store(Params const& params, TensorO const& tOrO, TensorLse const& lse,
                                   int thread_idx, int m_block, int head, Seq const& seq) {
    typename Traits::TiledMmaPV tiled_mma_pv;
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{});
    Tensor tOcO = thr_mma_pv.partition_C(cO);
    Tensor tOcO_rowcol = make_tensor(tOcO.data(), accumulator_rowcol(tOcO.layout()));

    Tensor rO = make_tensor<Element>(tOrO.layout());
    convert_into(tOrO, rO);
    Tensor rO_rowcol = make_tensor(rO.data(), accumulator_rowcol(rO.layout()));

    Element* o_tile = o_rows(params, head, seq);
    float* lse_tile = lse_rows(params, head, seq);
    int const row0 = m_block * kBlockM;

    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(rO_rowcol); ++mi) {
      int const row = row0 + get<0>(tOcO_rowcol(mi, 0));
      if (row >= seq.seqlen_q) { continue; }
      Element* o_row = o_tile + row * params.o_row_stride;
      // Columns come in adjacent pairs: (2, N/8, MMA_N) with the pair innermost.
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(rO_rowcol); ni += 2) {
        int const col = get<1>(tOcO_rowcol(mi, ni));
        cutlass::Array<Element, 2> pair;
        pair[0] = rO_rowcol(mi, ni);
        pair[1] = rO_rowcol(mi, ni + 1);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(o_row + col) = pair;
      }
      // The four threads of a quad hold the same row; the first one writes its lse.
      if (thread_idx % 4 == 0) { lse_tile[row] = lse(mi); }
    }
  }

  template <class TensorLse>
  CUTLASS_DEVICE static void store_lse(Params const& params, TensorLse const& lse, int thread_idx, int m_block,
                                       int head, Seq const& seq) {
    typename Traits::TiledMmaPV tiled_mma_pv;
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDimV>>{});
    Tensor tOcO = thr_mma_pv.partition_C(cO);
    Tensor tOcO_rowcol = make_tensor(tOcO.data(), accumulator_rowcol(tOcO.layout()));
    float* lse_tile = lse_rows(params, head, seq);
    int const row0 = m_block * kBlockM;
    if (thread_idx % 4 != 0) { return; }  // the four threads of a quad hold the same rows
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(tOcO_rowcol); ++mi) {
      int const row = row0 + get<0>(tOcO_rowcol(mi, 0));
      if (row < seq.seqlen_q) { lse_tile[row] = lse(mi); }
    }
  }
};

// O through shared memory and TMA. The staging buffer has Q's swizzled layout over O's
// shape (traits.h SmemLayoutO; the kernel passes Q's own buffer, or a buffer of its own
// where shared memory allows), and each warp touches only its own 16 rows of it: those rows of Q were read only by
// its own warpgroup's Q K^T, which has completed, so no barrier across warps is needed.
// store_warpgroup instead takes one 64-row buffer per warpgroup (the kernel passes a
// K or V stage, after a barrier across the warpgroups: Traits::kOInKVStages).
// A TMA box is 16 rows by one swizzle atom of columns (64 at 16-bit and 128-byte
// swizzle), contiguous in shared memory; TMA skips rows past seqlen_q. In a packed
// (variable-length) batch the rows past a sequence's end belong to the next one: a warp
// whose 16 rows reach past its sequence's end stores the rows it owns with plain 16-byte
// stores from the staging buffer instead.
// kVarlen: a packed batch (seqlen.h), whose rows past a sequence's end are the next one's.
template <class Traits, bool kVarlen = false>
struct EpilogueFwdTma {
  using Element = typename Traits::Element;
  using Direct = EpilogueFwd<Traits>;  // the lse, and tiles that see no key
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDimV = Traits::kHeadDimV;  // O's head dim
  static constexpr int kRowsPerWarp = 16;  // the rows of a 64-row WGMMA accumulator one warp holds
  using SmemLayoutO = typename Traits::SmemLayoutO;
  using SmemAtomO = typename Traits::SmemAtomQ;
  static constexpr int kAtomCols = decltype(size<1>(SmemAtomO{}))::value;
  static_assert(kHeadDimV % kAtomCols == 0);
  using BoxShape = Shape<Int<kRowsPerWarp>, Int<kAtomCols>>;
  using SmemLayoutBox = decltype(tile_to_shape(SmemAtomO{}, BoxShape{}));

  static auto make_tma_o(Element* ptr, ShapeRowsHead const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_STORE{}, ptr, shape, stride, SmemLayoutBox{}, BoxShape{});
  }
  using TmaO = decltype(make_tma_o(nullptr, ShapeRowsHead{}, StrideRowsHead{}));

  struct Params {
    typename Direct::Params direct;
    TmaO tma_o;
    ShapeRowsHead shape_o;  // tma.h
  };

  static Params to_params(FwdParams const& p) {
    ShapeRowsHead shape_o = rows_head_shape(p.rows_q(), p.headdim_v, p.nheads, p.tensor_batch());
    return {Direct::to_params(p),
            make_tma_o(static_cast<Element*>(p.o_ptr), shape_o,
                       rows_head_stride(p.o_row_stride, p.o_head_stride, p.o_batch_stride)),
            shape_o};
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptor(Params const& params) {
    cute::prefetch_tma_descriptor(params.tma_o.get_tma_descriptor());
  }

  // Before a warp writes its rows of the staging buffer again (or the buffer is handed
  // back to Q or to the K/V pipelines, or the CTA exits): its earlier TMA stores have
  // finished reading them. The bulk-async groups belong to the lane that committed them.
  CUTLASS_DEVICE static void wait_staging_read() {
    if (threadIdx.x % cutlass::NumThreadsPerWarp == 0) { cute::tma_store_wait<0>(); }
    __syncwarp();
  }

  template <class TensorO, class TensorLse>
  CUTLASS_DEVICE static void store(Params const& params, Element* smem_o, TensorO const& tOrO, TensorLse const& lse,
                                   int thread_idx, int m_block, int head, Seq const& seq) {
    stage_and_store<SmemLayoutO, typename Traits::TiledMmaPV>(params, smem_o, tOrO, thread_idx, thread_idx, m_block,
                                                               head, seq);
    Direct::store_lse(params.direct, lse, thread_idx, m_block, head, seq);
  }

  // The same with each consumer warpgroup's 64 rows staged in a buffer of its own
  // (smem_o_warpgroup, 64 x d, the layout below; Traits::kOInKVStages).
  using SmemLayoutOWarpgroup = decltype(tile_to_shape(SmemAtomO{}, Shape<_64, Int<kHeadDimV>>{}));
  template <class TensorO, class TensorLse>
  CUTLASS_DEVICE static void store_warpgroup(Params const& params, Element* smem_o_warpgroup, TensorO const& tOrO,
                                             TensorLse const& lse, int thread_idx, int m_block, int head,
                                             Seq const& seq) {
    stage_and_store<SmemLayoutOWarpgroup, typename Traits::TiledMmaPVWarpgroup>(
        params, smem_o_warpgroup, tOrO, thread_idx % cutlass::NumThreadsPerWarpGroup, thread_idx, m_block, head, seq);
    Direct::store_lse(params.direct, lse, thread_idx, m_block, head, seq);
  }

 private:
  // tOrO to the staging buffer (SmemLayout, partitioned as TiledMma's thread mma_thread),
  // then this warp's 16 rows to global memory by TMA: the tile's rows 16 w .. 16 w + 15
  // (w = thread_idx / 32) are the buffer's rows from 16 (mma_thread / 32).
  template <class SmemLayout, class TiledMma, class TensorO>
  CUTLASS_DEVICE static void stage_and_store(Params const& params, Element* smem_o, TensorO const& tOrO,
                                             int mma_thread, int thread_idx, int m_block, int head,
                                             Seq const& seq) {
    TiledMma tiled_mma_pv;
    Tensor sO = make_tensor(make_smem_ptr(smem_o), SmemLayout{});
    // STSM: four 8x8 matrices per instruction from the accumulator's register layout.
    auto smem_tiled_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, tiled_mma_pv);
    auto smem_thr_copy_o = smem_tiled_copy_o.get_thread_slice(mma_thread);
    Tensor rO = make_tensor<Element>(tOrO.layout());
    convert_into(tOrO, rO);
    Tensor tOsO = smem_thr_copy_o.partition_D(sO);
    copy(smem_tiled_copy_o, smem_thr_copy_o.retile_S(rO), tOsO);
    // The rows were written through the generic proxy; TMA reads through the async proxy.
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    int const warp = thread_idx / cutlass::NumThreadsPerWarp;
    int const buffer_row0 = (mma_thread / cutlass::NumThreadsPerWarp) * kRowsPerWarp;
    if constexpr (kVarlen) {
      int const rows = seq.seqlen_q - (m_block * kBlockM + warp * kRowsPerWarp);
      if (rows < kRowsPerWarp) {
        store_rows_from_smem<SmemLayout>(params, smem_o, buffer_row0, m_block * kBlockM + warp * kRowsPerWarp, rows,
                                         head, seq);
        return;
      }
    }
    if (thread_idx % cutlass::NumThreadsPerWarp == 0) {  // lane 0 issues and later waits (wait_staging_read)
      Tensor mO = domain_offset(make_coord(seq.offset_q, _0{}),
                                params.tma_o.get_tma_tensor(params.shape_o)(_, _, head, seq.batch));  // (seqlen_q, d)
      Tensor gO = local_tile(mO, BoxShape{}, make_coord(m_block * (kBlockM / kRowsPerWarp) + warp, _));  // (16, atom, d / atom)
      CUTE_UNROLL
      for (int c = 0; c < kHeadDimV / kAtomCols; ++c) {
        // The box starts on a swizzle-atom boundary: its offset is that of the unswizzled
        // layout (TMA applies the swizzle from the address bits).
        Element* box = smem_o + SmemLayout{}.layout_b()(buffer_row0, c * kAtomCols);
        Tensor sBox = make_tensor(make_smem_ptr(box), SmemLayoutBox{});
        auto [tBgO, tBsO] = tma_partition(params.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sBox),
                                          group_modes<0, 2>(gO));  // (TMA, d / atom), (TMA)
        copy(params.tma_o, tBsO, tBgO(_, c));
      }
      cute::tma_store_arrive();
    }
  }

  // The warp's first `rows` (< 16) staged rows, from buffer row buffer_row0 on, to the
  // sequence's rows from `row` on, 16 bytes per lane and store. The swizzle (of 16-byte
  // units) keeps each 16-byte chunk of a row contiguous.
  template <class SmemLayout>
  CUTLASS_DEVICE static void store_rows_from_smem(Params const& params, Element* smem_o, int buffer_row0,
                                                  int row, int rows, int head, Seq const& seq) {
    // Through a tensor: the layout's swizzle is applied where the pointer meets it.
    Tensor sO = make_tensor(make_smem_ptr(smem_o), SmemLayout{});
    constexpr int kVec = 16 / sizeof(Element);
    constexpr int kChunksPerRow = kHeadDimV / kVec;
    Element* o_tile = Direct::o_rows(params.direct, head, seq);
    int const lane = threadIdx.x % cutlass::NumThreadsPerWarp;
    // Not unrolled: this is the rare path, and its addresses would otherwise be held in
    // registers all at once.
    CUTLASS_PRAGMA_NO_UNROLL
    for (int chunk = lane; chunk < kRowsPerWarp * kChunksPerRow; chunk += cutlass::NumThreadsPerWarp) {
      int const r = chunk / kChunksPerRow;
      int const col = chunk % kChunksPerRow * kVec;
      if (r < rows) {
        *reinterpret_cast<uint4*>(o_tile + int64_t(row + r) * params.direct.o_row_stride + col) =
            *reinterpret_cast<uint4 const*>(raw_pointer_cast(&sO(buffer_row0 + r, col)));
      }
    }
  }
};

}  // namespace flash3
