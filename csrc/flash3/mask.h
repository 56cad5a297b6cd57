// Masking policies: which key tiles a query tile visits, which of them need an
// element-wise mask, and the mask itself.
//
// Masks are bottom-right aligned (as FlashAttention-2/3): with offset = seqlen_k -
// seqlen_q, query i sees key j iff
//   causal:  j <= i + offset
//   local:   i + offset - window_left <= j <= i + offset + window_right
// (a sliding window; the binding clamps an unbounded side to the sequence length, which
// is the same mask). Every policy also masks the key tail (j >= seqlen_k), since TMA
// fills out-of-range K rows with zeros, which would otherwise score exp(0 - max) > 0.
//
// Two generalisations serve the KV-cache call's split-KV parts (flash3/kvcache.py):
// query i is rows [i * rows_per_query, (i + 1) * rows_per_query) of the tile (the query
// heads that share a K/V head, packed as rows), and the offset may count keys past
// those the sequence reads (a part of a longer key range aligns its mask to the range's
// end). By default (one row per query, offset = seqlen_k - seqlen_q) they change nothing.
// A row's query is a division by rows_per_query, done as a multiply-high, an add and a
// shift (RowsPerQuery): packed kernels, which read rows_per_query at run time, then have
// no branch and no division in their masks (a branch around a division on every key
// tile cost the packed causal forward time against the dense one, which folds the
// default of one row per query away).
//
// Tile (m_block, n_block) is visited iff some row of the query tile sees some key of the
// key tile; the forward walks the key tiles of a query tile ([n_block_begin, n_block_end))
// and the backward the query tiles of a key tile ([m_block_begin, m_block_end)), and for
// the local mask both ranges are the same relation (the deterministic backward counts on
// it: a query tile's dQ waits for exactly the key tiles that visit it).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

namespace flash3 {

using namespace cute;

struct NoMask {
  static constexpr bool kIsCausal = false;
  static constexpr bool kIsLocal = false;
};

struct CausalMask {
  static constexpr bool kIsCausal = true;
  static constexpr bool kIsLocal = false;
};

// A window read at run time: sliding windows, and the kernels for softcap and attention
// sinks (which run with an unbounded window, or causal's (unbounded, 0)).
struct LocalMask {
  static constexpr bool kIsCausal = false;
  static constexpr bool kIsLocal = true;
};

// Query tiles that see different numbers of key tiles: the tile configurations and the
// longest-first grid order of causal kernels (traits.h, scheduler.h).
template <class Mask>
constexpr bool kVariableKeys = Mask::kIsCausal || Mask::kIsLocal;

// Division of a row index (0 <= row < 2^31) by rows_per_query, fixed per call: with
// l = ceil(log2 d) and m = floor(2^32 (2^l - d) / d) + 1, row / d = (mulhi(row, m) + row)
// >> l (the round-up method of Granlund and Montgomery; the add cannot overflow for rows
// below 2^31). d = 1 gives m = 1, l = 0: the row itself, which the compiler folds where
// the divisor is the default.
struct RowsPerQuery {
  uint32_t multiplier = 1;
  uint32_t shift = 0;

  static RowsPerQuery of(int d) {
    uint32_t l = 0;
    while ((uint64_t(1) << l) < uint64_t(d)) { ++l; }
    uint64_t const m = ((uint64_t(1) << 32) * ((uint64_t(1) << l) - uint64_t(d))) / uint64_t(d) + 1;
    return {uint32_t(m), l};
  }

  CUTLASS_HOST_DEVICE int divide(int row) const {
    uint32_t const r = uint32_t(row);
    uint32_t const high = uint32_t((uint64_t(r) * multiplier) >> 32);
    return int((high + r) >> shift);
  }
};

// A mainloop's tile iteration whose masking is tested at run time (needs_mask), where
// the others are compiled for masked tiles (cute::true_type) or unmasked ones (false_type).
struct TestMaskPerTile {};

template <class Mask, int kBlockM, int kBlockN>
struct MaskPolicy {
  int seqlen_q;  // query rows
  int seqlen_k;  // keys read
  // LocalMask only, each >= 0 (the binding clamps an unbounded side).
  int window_left = 0;
  int window_right = 0;
  // Key j is visible to query i up to i + offset (causal; local: + window_right).
  int offset = seqlen_k - seqlen_q;
  RowsPerQuery rows_per_query{};

  CUTLASS_HOST_DEVICE static int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

  // The query of a tile row (rows past seqlen_q map past the last query).
  CUTLASS_HOST_DEVICE int query(int row) const { return rows_per_query.divide(row); }

  // Key tiles [n_block_begin, n_block_end) hold every key some row of query tile m_block can see.
  CUTLASS_HOST_DEVICE int n_block_begin(int m_block) const {
    if constexpr (Mask::kIsLocal) {
      // The first row's first key; none visible when it is past the keys.
      int const first_key = query(m_block * kBlockM) + offset - window_left;
      return first_key >= seqlen_k ? cute::ceil_div(seqlen_k, kBlockN) : max(first_key, 0) / kBlockN;
    } else {
      return 0;
    }
  }
  CUTLASS_HOST_DEVICE int n_block_end(int m_block) const {
    int n_end = cute::ceil_div(seqlen_k, kBlockN);
    if constexpr (Mask::kIsCausal) {
      // The last row of the tile sees keys up to query((m_block + 1) * kBlockM - 1) + offset.
      int last_key = min(query((m_block + 1) * kBlockM - 1) + 1 + offset, seqlen_k);
      n_end = min(n_end, cute::ceil_div(last_key, kBlockN));
    } else if constexpr (Mask::kIsLocal) {
      // The tile's last row (rows past seqlen_q do not count) and its last key.
      int const last_row = min((m_block + 1) * kBlockM, seqlen_q) - 1;
      int const last_key = query(last_row) + offset + window_right;
      n_end = min(n_end, floor_div(last_key, kBlockN) + 1);
    }
    return n_end;
  }

  // The last key tile query tile m_block visits; below n_block_begin(m_block) if none.
  CUTLASS_HOST_DEVICE int n_block_last(int m_block) const { return n_block_end(m_block) - 1; }

  // Query tiles [m_block_begin, m_block_end) see some key of key tile n_block (local mask;
  // the backward's causal and unmasked ranges are in mainloop_bwd.h).
  CUTLASS_HOST_DEVICE int m_block_begin(int n_block) const {
    static_assert(Mask::kIsLocal);
    // The first row whose window reaches the tile's first key; none when it is past the
    // rows (the backward: one row per query).
    int const first_row = n_block * kBlockN - offset - window_right;
    return first_row >= seqlen_q ? cute::ceil_div(seqlen_q, kBlockM) : max(first_row, 0) / kBlockM;
  }
  CUTLASS_HOST_DEVICE int m_block_end(int n_block) const {
    static_assert(Mask::kIsLocal);
    // The last row whose window reaches back to the tile's last key.
    int const last_key = min((n_block + 1) * kBlockN, seqlen_k) - 1;
    int const last_row = last_key - offset + window_left;
    return min(cute::ceil_div(seqlen_q, kBlockM), floor_div(last_row, kBlockM) + 1);
  }

  // True when some element of tile (m_block, n_block) is masked. Tiles are visited from
  // the last one down, so the masked ones come first (unmasked_end below).
  CUTLASS_HOST_DEVICE bool needs_mask(int m_block, int n_block) const {
    bool tail = (n_block + 1) * kBlockN > seqlen_k;
    if constexpr (Mask::kIsCausal) {
      // The first row of the tile sees keys up to query(m_block * kBlockM) + offset.
      bool diagonal = (n_block + 1) * kBlockN - 1 > query(m_block * kBlockM) + offset;
      return tail || diagonal;
    } else if constexpr (Mask::kIsLocal) {
      bool const right = (n_block + 1) * kBlockN - 1 > query(m_block * kBlockM) + offset + window_right;
      bool const left = n_block * kBlockN < query((m_block + 1) * kBlockM - 1) + offset - window_left;
      return tail || right || left;
    } else {
      return tail;
    }
  }

  // Causal and no mask: the key tiles of query tile m_block's range [n_begin, n_end) below
  // its last one that need no mask are [n_begin, unmasked_end), with the masked ones above
  // them; the forward walks each part in a loop of its own (mainloop_fwd.h). Without a
  // causal mask only the last tile can be masked.
  CUTLASS_HOST_DEVICE int unmasked_end(int m_block, int n_begin, int n_end) const {
    static_assert(!Mask::kIsLocal, "the local kernels test each key tile");
    int end = n_end - 1;
    if constexpr (Mask::kIsCausal) {
      while (end > n_begin && needs_mask(m_block, end - 1)) { --end; }
    }
    return end;
  }

  // Causal and no mask, the backward: of the query tiles [m_begin, m_end) that see key tile
  // n_block, walked upwards, the masked ones are a prefix (the diagonal's, or every tile
  // when n_block holds the keys' end); its length.
  CUTLASS_HOST_DEVICE int masked_prefix(int n_block, int m_begin, int m_end) const {
    static_assert(!Mask::kIsLocal, "the local kernels test each query tile");
    int m = m_begin;
    while (m < m_end && needs_mask(m, n_block)) { ++m; }
    return m - m_begin;
  }

  // The visible keys [col_begin, col_end) of query row `row`, in keys.
  CUTLASS_HOST_DEVICE int key_end(int row) const {
    int end = seqlen_k;
    if constexpr (Mask::kIsCausal) { end = min(end, query(row) + 1 + offset); }
    if constexpr (Mask::kIsLocal) { end = min(end, query(row) + 1 + offset + window_right); }
    return end;
  }
  CUTLASS_HOST_DEVICE int key_begin(int row) const {
    if constexpr (Mask::kIsLocal) { return query(row) + offset - window_left; }
    return 0;
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
      if constexpr (Mask::kIsLocal) {
        // One unsigned compare per element: col - col_begin in [0, width).
        int const col_begin = key_begin(row) - col0;
        uint32_t const width = uint32_t(max(key_end(row) - key_begin(row), 0));
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(tSrS_rowcol); ++ni) {
          int const col = get<1>(tScS_rowcol(mi, ni));
          if (uint32_t(col - col_begin) >= width) { tSrS_rowcol(mi, ni) = -INFINITY; }
        }
      } else {
        int const col_limit = key_end(row);
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(tSrS_rowcol); ++ni) {
          if (col0 + get<1>(tScS_rowcol(mi, ni)) >= col_limit) {
            tSrS_rowcol(mi, ni) = -INFINITY;
          }
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
          masked = masked || key > query0 + get<1>(tStcSt_rowcol(mi, ni)) + offset;
        }
        if constexpr (Mask::kIsLocal) {
          // One unsigned compare: key - key_begin in [0, width) (the tail is in key_end).
          int const query = query0 + get<1>(tStcSt_rowcol(mi, ni));
          int const begin = key_begin(query);
          masked = uint32_t(key - begin) >= uint32_t(max(key_end(query) - begin, 0));
        }
        if (masked) { tStrSt_rowcol(mi, ni) = -INFINITY; }
      }
    }
  }
};

}  // namespace flash3
