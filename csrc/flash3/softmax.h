// Online softmax over key tiles: a running row max and row sum per query row, the
// rescale of the output accumulator when the max grows, and the final normalisation.
//
// Everything is in the log2 domain: with scale_log2 = softmax_scale * log2(e),
// exp(scale * (s - m)) = exp2(s * scale_log2 - m * scale_log2), one FFMA and one MUFU.EX2
// per score.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "utils.h"

namespace flash3 {

using namespace cute;

// The steps every online softmax of the forward takes per key tile, over the parts its
// element type defines (Derived: OnlineSoftmax below, OnlineSoftmaxFp8 in softmax_fp8.h):
// thread_tile_max<kTree>(S, mi, scales), thread_tile_max_int(S, mi, scales, exact),
// merge_row_max<kFirstTile>(thread_max, mi) and exponentiate_row(S, mi, scales, correction).
// scales: what a key tile's scores need besides the kernel's constants (NoTileScales for
// 16-bit inputs, the FP8 block scales' KeyGroupScales).
// kLazyRescale: a row's max in use stays until a tile raises it by more than the
// Derived's kRescaleThreshold, and O's rescale is skipped where no row of the warp changed
// its max (any_rescale; the traits say where).
// kIntRowMax: the row max from the scores' bits (update_row_maxes; the traits say where).
template <class Derived, int kRows, bool kLazyRescale, bool kIntRowMax>
struct OnlineSoftmaxSteps {
  CUTLASS_DEVICE Derived& self() { return static_cast<Derived&>(*this); }

  // Every row's running max updated with tile S; correction(mi) gets the factor by which
  // row mi of the output accumulator must be rescaled.
  // kIntRowMax: the thread's parts come from the integer max of the scores' bits (utils.h
  // row_max_bits), exact wherever a part holds a score >= +0; a warp with any other part
  // (all its scores negative: rare for real scores) takes the float max for all its rows,
  // and so do tiles under the mask (masked: warp-uniform), where a thread's part is often
  // all -inf. Both give the same bits.
  // kSoftcap (the local kernels, which take softcap): tanh_prescale != 0 means S still
  // holds q.k on this tile; the tanh is then taken inside the row max (thread_tile_tanh_max),
  // so that ptxas interleaves the MUFU.TANH with the max's FMNMX, rather than issuing the
  // tanh as a block of its own ahead of it.
  template <bool kFirstTile, bool kSoftcap = false, class TensorS, class TileScales, class TensorCorrection>
  CUTLASS_DEVICE void update_row_maxes(TensorS& tSrS_rowcol, TileScales const& scales,
                                       TensorCorrection& correction, bool masked, float tanh_prescale = 0.f) {
    float thread_max[kRows];
    bool tanh_taken = false;
    if constexpr (kSoftcap) {
      if (tanh_prescale != 0.f) {
        tanh_taken = true;
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          thread_max[mi] = self().thread_tile_tanh_max(tSrS_rowcol, mi, tanh_prescale, scales);
        }
      }
    }
    if (!tanh_taken) {
      if constexpr (kIntRowMax) {
        bool exact = false;
        if (!masked) {
          exact = true;
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi) { thread_max[mi] = self().thread_tile_max_int(tSrS_rowcol, mi, scales, exact); }
          exact = __all_sync(0xffffffffu, exact);
        }
        if (!exact) {
          CUTE_UNROLL
          for (int mi = 0; mi < kRows; ++mi) {
            thread_max[mi] = self().template thread_tile_max</*kTree=*/true>(tSrS_rowcol, mi, scales);
          }
        }
      } else {
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          thread_max[mi] = self().template thread_tile_max</*kTree=*/false>(tSrS_rowcol, mi, scales);
        }
      }
    }
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) { correction(mi) = self().template merge_row_max<kFirstTile>(thread_max[mi], mi); }
  }

  // Updates the running max with tile S (raw scores), turns S into P in place, adds P's
  // row sums, and returns the factor by which each row of the output accumulator must be
  // rescaled.
  // kSoftcap, tanh_prescale: as in update_row_maxes.
  template <bool kFirstTile, bool kSoftcap = false, class TensorS, class TileScales>
  CUTLASS_DEVICE auto online_update(TensorS& tSrS_rowcol, TileScales const& scales, bool masked,
                                    float tanh_prescale = 0.f) {
    static_assert(decltype(size<0>(tSrS_rowcol))::value == kRows);
    Tensor correction = make_tensor<float>(Layout<Int<kRows>>{});
    if (kIntRowMax || (kSoftcap && tanh_prescale != 0.f)) {
      update_row_maxes<kFirstTile, kSoftcap>(tSrS_rowcol, scales, correction, masked, tanh_prescale);
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) { self().exponentiate_row(tSrS_rowcol, mi, scales, correction(mi)); }
    } else {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        correction(mi) = self().template merge_row_max<kFirstTile>(
            self().template thread_tile_max</*kTree=*/false>(tSrS_rowcol, mi, scales), mi);
        self().exponentiate_row(tSrS_rowcol, mi, scales, correction(mi));
      }
    }
    return correction;
  }

  // Whether any row of this warp's part of O has a factor other than 1 (a warp-uniform
  // branch around the rescale); always where the rescale is not lazy.
  template <class TensorCorrection>
  CUTLASS_DEVICE static bool any_rescale(TensorCorrection const& correction) {
    if constexpr (!kLazyRescale) { return true; }
    bool any = false;
    CUTE_UNROLL
    for (int mi = 0; mi < size(correction); ++mi) { any |= correction(mi) != 1.f; }
    return __any_sync(0xffffffffu, any);
  }

  // O *= the factors, skipped (kLazyRescale) where every factor of the warp's rows is 1: a
  // warp-uniform branch, and a multiplication by exactly 1 changes nothing.
  template <class TensorO, class TensorCorrection>
  CUTLASS_DEVICE static void rescale_if_needed(TensorO& tOrO_rowcol, TensorCorrection const& correction) {
    if (!any_rescale(correction)) { return; }
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(tOrO_rowcol); ++mi) {
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(tOrO_rowcol); ++ni) { tOrO_rowcol(mi, ni) *= correction(mi); }
    }
  }
};

// 16-bit inputs: the scores of every key tile take the kernel's one logit scale.
struct NoTileScales {};

template <int kRows, bool kLazyRescale = false, bool kIntRowMax = false>
struct OnlineSoftmax : OnlineSoftmaxSteps<OnlineSoftmax<kRows, kLazyRescale, kIntRowMax>, kRows, kLazyRescale, kIntRowMax> {
  // Per row: the running max of the raw scores (-inf until a visible key is seen) and
  // this thread's partial sum of exp2 (the quad reduces the sums once, at the end).
  Tensor<ArrayEngine<float, kRows>, Layout<Int<kRows>>> row_max;
  Tensor<ArrayEngine<float, kRows>, Layout<Int<kRows>>> row_sum;
  float const scale_log2;
  // kLazyRescale: P is at most 2^kRescaleThreshold = 256, which 16-bit operands and the
  // fp32 accumulators hold with room to spare; the result is the same up to rounding
  // (out = O / sum and the logsumexp take O and the sum against the same max).
  static constexpr float kRescaleThreshold = 8.f;

  CUTLASS_DEVICE explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    fill(row_max, -INFINITY);
    fill(row_sum, 0.f);
  }

  // The max scaled into the log2 domain, with -inf (a row that has seen only masked
  // keys so far) mapped to 0 so that exp2(-inf - 0) = 0 rather than NaN.
  CUTLASS_DEVICE float scaled_max(int mi) const {
    return row_max(mi) == -INFINITY ? 0.f : row_max(mi) * scale_log2;
  }

  // This thread's part of row mi's tile max (raw scores), by FMNMX: as a dependent chain
  // that starts from the running max (the kernels without kIntRowMax), or as a pairwise
  // tree (the fallback of update_row_maxes; merge_row_max adds the running max).
  template <bool kTree, class TensorS>
  CUTLASS_DEVICE float thread_tile_max(TensorS const& tSrS_rowcol, int mi, NoTileScales) const {
    constexpr int kCols = decltype(size<1>(tSrS_rowcol))::value;
    if constexpr (kTree) {
      return row_max_float<kCols>(tSrS_rowcol, mi, 0);
    } else {
      float tile_max = row_max(mi);
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ++ni) { tile_max = fmaxf(tile_max, tSrS_rowcol(mi, ni)); }
      return tile_max;
    }
  }

  // Softcap: row mi's part of S (q.k) turned into tanh(S * prescale) in place, and this
  // thread's part of the row's tile max of the result, as a chain from the running max
  // that takes each tanh as it comes.
  template <class TensorS>
  CUTLASS_DEVICE float thread_tile_tanh_max(TensorS& tSrS_rowcol, int mi, float prescale, NoTileScales) const {
    float tile_max = row_max(mi);
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(tSrS_rowcol); ++ni) {
      float const t = tanh_approx(tSrS_rowcol(mi, ni) * prescale);
      tSrS_rowcol(mi, ni) = t;
      tile_max = fmaxf(tile_max, t);
    }
    return tile_max;
  }

  // Softcap on a tile under the mask, ahead of it: all of S turned into tanh(S * prescale).
  template <class TensorS>
  CUTLASS_DEVICE static void apply_tanh(TensorS& tSrS_rowcol, float prescale, NoTileScales) {
    flash3::apply_tanh(tSrS_rowcol, prescale);
  }

  // Row mi's running max updated with the thread's part of the tile max; returns the
  // factor by which its row of the output accumulator must be rescaled.
  template <bool kFirstTile>
  CUTLASS_DEVICE float merge_row_max(float thread_max, int mi) {
    float const tile_max = quad_allreduce(kIntRowMax ? fmaxf(row_max(mi), thread_max) : thread_max, MaxOp{});
    float const prev_scaled = kFirstTile ? -INFINITY : row_max(mi) * scale_log2;
    // Lazy: a row with no visible key yet (-inf) takes any new max, since the difference
    // is then +inf (or NaN when the tile has no visible key either).
    bool const keep = kLazyRescale && !kFirstTile && (tile_max - row_max(mi)) * scale_log2 <= kRescaleThreshold;
    row_max(mi) = keep ? row_max(mi) : tile_max;
    // prev_scaled is -inf when the row had no visible key yet: the factor is then 0,
    // harmless since the accumulator and sum are still 0.
    return kFirstTile || keep ? 1.f : exp2f(prev_scaled - scaled_max(mi));
  }

  // The same from the integer max of the scores' bits (utils.h row_max_bits); exact is
  // cleared where the part holds no score >= +0 (its result is then not its max).
  template <class TensorS>
  CUTLASS_DEVICE static float thread_tile_max_int(TensorS const& tSrS_rowcol, int mi, NoTileScales, bool& exact) {
    constexpr int kCols = decltype(size<1>(tSrS_rowcol))::value;
    int const bits = row_max_bits<kCols>(tSrS_rowcol, mi, 0);
    exact &= bits >= 0;
    return __int_as_float(bits);
  }

  // Row mi of S turned into P = exp2(S * scale_log2 - max) in place, and its sum added.
  template <class TensorS>
  CUTLASS_DEVICE void exponentiate_row(TensorS& tSrS_rowcol, int mi, NoTileScales, float correction) {
    float const max_scaled = scaled_max(mi);
    float sum = 0.f;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(tSrS_rowcol); ++ni) {
      float const p = exp2f(tSrS_rowcol(mi, ni) * scale_log2 - max_scaled);
      tSrS_rowcol(mi, ni) = p;
      sum += p;
    }
    row_sum(mi) = row_sum(mi) * correction + sum;
  }

  // Divides O by the row sums and returns the natural-log logsumexp per row
  // (-inf for a row that saw no key; its output is 0). softmax_scale takes the raw
  // scores to natural-log logits. kSink: an attention sink, a logit with no value, joins
  // every row's sum (and its logsumexp; a row that saw no key then has lse = sink).
  template <bool kSink = false, class TensorO>
  CUTLASS_DEVICE auto finalize(TensorO& tOrO_rowcol, float softmax_scale, float sink = 0.f) {
    Tensor lse = make_tensor<float>(Layout<Int<kRows>>{});
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      float const sum = quad_allreduce(row_sum(mi), SumOp{});
      bool const empty = sum == 0.f || sum != sum;
      float inv_sum = empty ? 0.f : 1.f / sum;
      lse(mi) = empty ? -INFINITY : row_max(mi) * softmax_scale + __logf(sum);
      if constexpr (kSink) {
        // lse = log(exp(lse_keys) + exp(sink)); O's rows were summed against the row max.
        float const top = fmaxf(lse(mi), sink);
        float const total = top == -INFINITY ? -INFINITY : top + __logf(__expf(lse(mi) - top) + __expf(sink - top));
        inv_sum = empty ? 0.f : __expf(row_max(mi) * softmax_scale - total);
        lse(mi) = total;
      }
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(tOrO_rowcol); ++ni) {
        tOrO_rowcol(mi, ni) *= inv_sum;
      }
    }
    return lse;
  }
};

}  // namespace flash3
