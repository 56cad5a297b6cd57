// Masking policies: which key tiles a query tile visits, which of them need an
// element-wise mask, and the mask itself.
//
// Causal masking is bottom-right aligned (as FlashAttention-2/3): query row i sees key j
// iff j <= i + seqlen_k - seqlen_q. Every policy also masks the key tail
// (j >= seqlen_k), since TMA fills out-of-range K rows with zeros, which would
// otherwise score exp(0 - max) > 0.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

namespace flash3 {

using namespace cute;

struct NoMask {
  static constexpr bool kIsCausal = false;
};

struct CausalMask {
  static constexpr bool kIsCausal = true;
};

template <class Mask, int kBlockM, int kBlockN>
struct MaskPolicy {
  int seqlen_q;
  int seqlen_k;

  // Key tiles [0, n_block_end) hold every key some row of query tile m_block can see.
  CUTLASS_DEVICE int n_block_end(int m_block) const {
    int n_end = cute::ceil_div(seqlen_k, kBlockN);
    if constexpr (Mask::kIsCausal) {
      // The last row of the tile sees keys up to (m_block + 1) * kBlockM - 1 + seqlen_k - seqlen_q.
      int last_key = min((m_block + 1) * kBlockM + seqlen_k - seqlen_q, seqlen_k);
      n_end = min(n_end, cute::ceil_div(last_key, kBlockN));
    }
    return n_end;
  }

  // True when some element of tile (m_block, n_block) is masked. Tiles are visited from
  // the last one down, so the masked ones come first and the loop peels them.
  CUTLASS_DEVICE bool needs_mask(int m_block, int n_block) const {
    bool tail = (n_block + 1) * kBlockN > seqlen_k;
    if constexpr (Mask::kIsCausal) {
      // The first row of the tile sees keys up to m_block * kBlockM + seqlen_k - seqlen_q.
      bool diagonal = (n_block + 1) * kBlockN - 1 > m_block * kBlockM + seqlen_k - seqlen_q;
      return tail || diagonal;
    } else {
      return tail;
    }
  }

  // tSrS_rowcol: the thread's S accumulator as (rows, cols); tScS_rowcol: the tile
  // coordinates (row, col) of each of its elements, same shape.
  template <class TensorS, class TensorC>
  CUTLASS_DEVICE void apply(TensorS& tSrS_rowcol, TensorC const& tScS_rowcol, int m_block, int n_block) const {
    int const row0 = m_block * kBlockM;
    int const col0 = n_block * kBlockN;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(tSrS_rowcol); ++mi) {
      int const row = row0 + get<0>(tScS_rowcol(mi, 0));
      int col_limit = seqlen_k;
      if constexpr (Mask::kIsCausal) {
        col_limit = min(col_limit, row + 1 + seqlen_k - seqlen_q);
      }
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(tSrS_rowcol); ++ni) {
        if (col0 + get<1>(tScS_rowcol(mi, ni)) >= col_limit) {
          tSrS_rowcol(mi, ni) = -INFINITY;
        }
      }
    }
  }

  // The same mask on a transposed tile, S^T (keys as rows, queries as columns), as the
  // backward computes it: tStcSt_rowcol holds (key, query) tile coordinates.
  template <class TensorSt, class TensorC>
  CUTLASS_DEVICE void apply_transposed(TensorSt& tStrSt_rowcol, TensorC const& tStcSt_rowcol, int m_block,
                                       int n_block) const {
    int const key0 = n_block * kBlockN;
    int const query0 = m_block * kBlockM;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(tStrSt_rowcol); ++mi) {
      int const key = key0 + get<0>(tStcSt_rowcol(mi, 0));
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(tStrSt_rowcol); ++ni) {
        bool masked = key >= seqlen_k;
        if constexpr (Mask::kIsCausal) {
          masked = masked || key > query0 + get<1>(tStcSt_rowcol(mi, ni)) + seqlen_k - seqlen_q;
        }
        if (masked) { tStrSt_rowcol(mi, ni) = -INFINITY; }
      }
    }
  }
};

}  // namespace flash3
