// K and V read through a page table (params.h page_table), for the packed-batch forward
// kernels: a serving cache of fixed-size pages is attended to in place, with no gather.
//
// A key tile that lies in one page is one whole-tile TMA box at its cache row, as in the
// dense kernels. Any other is loaded as kBlockN / kPageChunkRows boxes of kPageChunkRows
// rows. Every such box lies in one page (page sizes and split starts are multiples of
// the box), so each needs one page-table entry; a box lands at its rows of the tile's
// shared-memory stage, the same bytes one whole-tile box would write (the swizzle
// repeats every 8 rows). The boxes of a tile complete the stage's transaction count like
// one whole-tile box: boxes past the sequence's length read rows outside the tensor,
// which TMA fills with zeros, and never touch the page table. (H200, decoding at hdim
// 128 over pages of 128 keys, batch 8, 32k keys: 3035 GB/s with the 176-key tiles of the
// general kernel, all in boxes; 3797 with the short kernel's 128-key whole tiles.)
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "params.h"
#include "tma.h"

namespace flash3 {

using namespace cute;

template <class Traits>
struct PagedKV {
  using Element = typename Traits::Element;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kChunks = Traits::kBlockN / kPageChunkRows;
  static_assert(Traits::kBlockN % kPageChunkRows == 0, "a key tile must be whole boxes");
  using ChunkShape = Shape<Int<kPageChunkRows>, Int<kHeadDim>>;

  // The first kPageChunkRows rows of one K/V stage: the box's shared-memory layout.
  static auto chunk_smem_layout() {
    return composition(take<0, 2>(typename Traits::SmemLayoutK{}),
                       make_tile(Layout<Int<kPageChunkRows>>{}, Layout<Int<kHeadDim>>{}));
  }
  static auto make_chunk_tma(Element const* ptr, ShapeRowsHead const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, chunk_smem_layout(), ChunkShape{});
  }
  using TmaChunk = decltype(make_chunk_tma(nullptr, ShapeRowsHead{}, StrideRowsHead{}));

  TmaChunk tma_k_chunk;
  TmaChunk tma_v_chunk;
  int const* page_table = nullptr;  // null: K and V are not paged
  int page_size = 0;
  int page_rows = 0;

  static PagedKV make(FwdParams const& p) {
    if (p.page_table == nullptr) { return {}; }
    ShapeRowsHead const shape_k = rows_head_shape(p.rows_k(), p.headdim, p.nheads_k, p.tensor_batch());
    return {make_chunk_tma(static_cast<Element const*>(p.k_ptr), shape_k,
                           rows_head_stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride)),
            make_chunk_tma(static_cast<Element const*>(p.v_ptr), shape_k,
                           rows_head_stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride)),
            p.page_table, p.page_size, p.page_rows};
  }

  CUTLASS_DEVICE bool paged() const { return page_table != nullptr; }

  // One key tile of K (kIsV false) or V, virtual rows [first_row, first_row + kBlockN) of
  // a sequence whose rows end at end_row, into s_stage (kBlockN, d), completing
  // `barrier`; tma_tile: the whole-tile load of the same tensor. (Reading the tile's
  // page-table entries a tile ahead, before the stage is waited for, measured no faster.)
  template <bool kIsV, class TmaTile, class SmemStage>
  CUTLASS_DEVICE void load_tile(TmaTile const& tma_tile, ShapeRowsHead const& shape, uint64_t& barrier,
                                SmemStage&& s_stage, int head_kv, int first_row, int end_row) const {
    int const in_page = first_row % page_size;
    if (in_page + Traits::kBlockN <= page_size) {
      int const row = page_table[first_row / page_size] * page_rows + in_page;
      Tensor m = domain_offset(make_coord(row, _0{}), tma_tile.get_tma_tensor(shape)(_, _, head_kv, _0{}));
      Tensor g = local_tile(m, Shape<Int<Traits::kBlockN>, Int<kHeadDim>>{}, make_coord(_0{}, _0{}));  // (N, d)
      auto [tg, ts] = tma_partition(tma_tile, _0{}, Layout<_1>{}, group_modes<0, 2>(s_stage), group_modes<0, 2>(g));
      copy(tma_tile.with(barrier), tg, ts);
      return;
    }
    TmaChunk const& tma = kIsV ? tma_v_chunk : tma_k_chunk;
    Tensor g = flat_divide(tma.get_tma_tensor(shape)(_, _, head_kv, _0{}), ChunkShape{});  // (R, d, rows / R, 1)
    Tensor s = flat_divide(s_stage, ChunkShape{});                                          // (R, d, kChunks, 1)
    auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
    int const outside = get<0>(shape) / kPageChunkRows + 1;  // a box wholly past the tensor's rows
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kChunks; ++c) {
      int const v = first_row + c * kPageChunkRows;
      int const box =
          v < end_row ? (page_table[v / page_size] * page_rows + v % page_size) / kPageChunkRows : outside;
      copy(tma.with(barrier), tg(_, box, _0{}), ts(_, c, _0{}));
    }
  }

  CUTLASS_DEVICE void prefetch_descriptors() const {
    if (paged()) {
      cute::prefetch_tma_descriptor(tma_k_chunk.get_tma_descriptor());
      cute::prefetch_tma_descriptor(tma_v_chunk.get_tma_descriptor());
    }
  }
};

// The dense kernels' stand-in: nothing paged.
struct NoPagedKV {
  static NoPagedKV make(FwdParams const&) { return {}; }
  CUTLASS_DEVICE static constexpr bool paged() { return false; }
  template <bool kIsV, class TmaTile, class SmemStage>
  CUTLASS_DEVICE void load_tile(TmaTile const&, ShapeRowsHead const&, uint64_t&, SmemStage&&, int, int, int) const {}
  CUTLASS_DEVICE void prefetch_descriptors() const {}
};

}  // namespace flash3
