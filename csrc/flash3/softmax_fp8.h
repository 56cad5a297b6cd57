// The FP8 forward's online softmax, with the Q, K and V block scales (params_fp8.h) folded
// into the exponent.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "params_fp8.h"
#include "softmax.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

// ---------------------------------------------------------------------------------------
// Online softmax with K and V scales per key block, V's folded into the exponent.
//
// S as computed is Q8 K8^T. A key tile splits into kGroups column groups, each within one
// K/V scale block (one group when the tile lies in one block). In group g the factor
// c_g = softmax_scale * log2(e) * q_scale * k_scale(g) turns raw scores into true scores
// in the log2 domain, t = S * c_g. The running max is kept over the *V-weighted* scores
// w = t + log2 v_scale(g), and
//   P = 2^(w - max_w + kMaxOffset) = 2^(t - max_w + kMaxOffset) * v_scale(g)   (<= 256)
// goes to the PV GEMM with the raw V8, so O = sum P V8 carries V's scale already, and
// the row sum adds P / v_scale(g) (the true exponentials, same factor). out = O / sum:
// V's scale never touches O, and a tile may span V scale blocks at no cost in accuracy:
// the largest P V products of a row get e4m3's full range. (Scaling P of a group by
// v_scale(g) / v_ref instead pushes small products into e4m3's subnormals: on the Table 3
// inputs that costs 5% RMSE with 192-key tiles over 128-key scale blocks, emulated and
// measured.) 2^kMaxOffset keeps small probabilities within e4m3's normal range; it
// cancels in O / sum. Each exponent is one FFMA, exp2(S * c_g - (shift - log2 v_scale(g))).
// ---------------------------------------------------------------------------------------
// kSplitChains: the row max and the row sum each run as four independent chains instead
// of one chain of kBlockN / 4 dependent FMNMX / FADD per row (traits_fp8.h says where;
// with kIntRowMax the max is a tree instead).
// kLazyRescale: as in softmax.h, with kRescaleThreshold below. kIntRowMax: as in softmax.h.
// A key tile's scales, per group of its keys (each group within one K/V scale block).
template <int kGroups_>
struct KeyGroupScales {
  static constexpr int kGroups = kGroups_;
  float qk_log2[kGroups];  // softmax_scale * log2(e) * q_scale * k_scale(group)
  float log2_v[kGroups];   // log2 v_scale(group)
  float inv_v[kGroups];    // 1 / v_scale(group)
};

template <int kRows, bool kSplitChains, bool kLazyRescale = false, bool kIntRowMax = false>
struct OnlineSoftmaxFp8
    : OnlineSoftmaxSteps<OnlineSoftmaxFp8<kRows, kSplitChains, kLazyRescale, kIntRowMax>, kRows, kLazyRescale,
                         kIntRowMax> {
  static constexpr float kMaxOffset = 8.f;
  // kLazyRescale: how far (log2) a tile may raise a row's max before O and the sum are
  // rescaled. P is then at most 2^(kMaxOffset + 0.75) = 431, within e4m3's 448, and O's
  // rescale is skipped in the tiles that raise no max by more (any_rescale).
  static constexpr float kRescaleThreshold = 0.75f;
  Tensor<ArrayEngine<float, kRows>, Layout<Int<kRows>>> row_max;  // V-weighted, log2 domain; -inf: no key yet
  Tensor<ArrayEngine<float, kRows>, Layout<Int<kRows>>> row_sum;  // this thread's partial sums
  // The logit scale in log2 units (params.h logit_scale_log2; softcap * log2(e) under
  // softcap), and its inverse: only softcap's steps use them, the rest of the softmax
  // takes it from each key group's factor (KeyGroupScales::qk_log2).
  float const logit_scale_log2;
  float const inv_logit_scale_log2;

  CUTLASS_DEVICE explicit OnlineSoftmaxFp8(float scale_log2)
      : logit_scale_log2(scale_log2), inv_logit_scale_log2(1.f / scale_log2) {
    fill(row_max, -INFINITY);
    fill(row_sum, 0.f);
  }

  // The subtrahend of the exponent: max - offset, with -inf (nothing visible) mapped to 0
  // so that exp2(-inf - 0) = 0 rather than NaN.
  CUTLASS_DEVICE float shift(int mi) const { return row_max(mi) == -INFINITY ? 0.f : row_max(mi) - kMaxOffset; }

  // Column ni of the row-col view is key 8 (ni / 2) + 2 q + ni % 2 of the tile, so group g
  // holds the columns [g, g + 1) * kCols / kGroups.
  static constexpr int kChains = kSplitChains ? 4 : 1;

  // This thread's part of row mi's tile max (V-weighted, log2 domain), by FMNMX: in
  // kChains dependent chains (the kernels without kIntRowMax), or as a pairwise tree (the
  // fallback of update_row_maxes).
  template <bool kTree, int kGroups, class TensorS>
  CUTLASS_DEVICE static float thread_tile_max(TensorS const& tSrS_rowcol, int mi, KeyGroupScales<kGroups> const& scales) {
    float const(&scale_log2)[kGroups] = scales.qk_log2;
    float const(&log2_v)[kGroups] = scales.log2_v;
    constexpr int kGroupCols = decltype(size<1>(tSrS_rowcol))::value / kGroups;
    static_assert(kGroupCols * kGroups == decltype(size<1>(tSrS_rowcol))::value && kGroupCols % kChains == 0);
    float tile_max = -INFINITY;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      float group_max;
      if constexpr (kTree) {
        group_max = row_max_float<kGroupCols>(tSrS_rowcol, mi, g * kGroupCols);
      } else {
        float part[kChains];
        CUTE_UNROLL
        for (int c = 0; c < kChains; ++c) { part[c] = -INFINITY; }
        CUTE_UNROLL
        for (int ni = 0; ni < kGroupCols; ++ni) {
          part[ni % kChains] = fmaxf(part[ni % kChains], tSrS_rowcol(mi, g * kGroupCols + ni));
        }
        group_max = part[0];
        CUTE_UNROLL
        for (int c = 1; c < kChains; ++c) { group_max = fmaxf(group_max, part[c]); }
      }
      tile_max = fmaxf(tile_max, fmaf(group_max, scale_log2[g], log2_v[g]));
    }
    return tile_max;
  }

  // The same from the integer max of the scores' bits (utils.h row_max_bits); exact is
  // cleared where a group's part holds no score >= +0 (its result is then not its max).
  template <int kGroups, class TensorS>
  CUTLASS_DEVICE static float thread_tile_max_int(TensorS const& tSrS_rowcol, int mi,
                                                  KeyGroupScales<kGroups> const& scales, bool& exact) {
    float const(&scale_log2)[kGroups] = scales.qk_log2;
    float const(&log2_v)[kGroups] = scales.log2_v;
    constexpr int kGroupCols = decltype(size<1>(tSrS_rowcol))::value / kGroups;
    float tile_max = -INFINITY;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      int const bits = row_max_bits<kGroupCols>(tSrS_rowcol, mi, g * kGroupCols);
      exact &= bits >= 0;
      tile_max = fmaxf(tile_max, fmaf(__int_as_float(bits), scale_log2[g], log2_v[g]));
    }
    return tile_max;
  }

  // Softcap. In key group g the raw score S = q8.k8 is q.k / qk(g), qk(g) = q_scale *
  // k_scale(g), and the group's factor is qk_log2[g] = softcap * log2(e) * qk(g). The
  // capped score c = tanh(S * qk(g) * prescale) (prescale = softmax_scale / softcap) is
  // stored as c / qk(g), so that the factor takes it to c * softcap * log2(e), its logit
  // in log2 units: the max, the exponent and the sum then treat it as a raw score. Per
  // group: what multiplies S before the tanh, and what multiplies the tanh after it. A
  // zero scale (only a caller's own scales hold one) gives c = 0, stored as 0.
  template <int kGroups>
  CUTLASS_DEVICE void tanh_group_factors(KeyGroupScales<kGroups> const& scales, float prescale,
                                         float (&before)[kGroups], float (&after)[kGroups]) const {
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      before[g] = prescale * scales.qk_log2[g] * inv_logit_scale_log2;
      after[g] = __fdividef(logit_scale_log2, fmaxf(scales.qk_log2[g], 1e-30f));
    }
  }

  // Softcap: row mi's part of S turned into the capped scores in place (as above), and
  // this thread's part of the row's tile max of them (V-weighted, log2 domain), one FMNMX
  // chain per group that takes each tanh as it comes.
  template <int kGroups, class TensorS>
  CUTLASS_DEVICE float thread_tile_tanh_max(TensorS& tSrS_rowcol, int mi, float prescale,
                                            KeyGroupScales<kGroups> const& scales) const {
    float before[kGroups], after[kGroups];
    tanh_group_factors(scales, prescale, before, after);
    constexpr int kGroupCols = decltype(size<1>(tSrS_rowcol))::value / kGroups;
    float tile_max = -INFINITY;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      float group_max = -INFINITY;
      CUTE_UNROLL
      for (int ni = 0; ni < kGroupCols; ++ni) {
        float const c = tanh_approx(tSrS_rowcol(mi, g * kGroupCols + ni) * before[g]) * after[g];
        tSrS_rowcol(mi, g * kGroupCols + ni) = c;
        group_max = fmaxf(group_max, c);
      }
      tile_max = fmaxf(tile_max, fmaf(group_max, scales.qk_log2[g], scales.log2_v[g]));
    }
    return tile_max;
  }

  // Softcap on a tile under the mask, ahead of it: all of S turned into the capped scores.
  template <int kGroups, class TensorS>
  CUTLASS_DEVICE void apply_tanh(TensorS& tSrS_rowcol, float prescale, KeyGroupScales<kGroups> const& scales) const {
    float before[kGroups], after[kGroups];
    tanh_group_factors(scales, prescale, before, after);
    constexpr int kGroupCols = decltype(size<1>(tSrS_rowcol))::value / kGroups;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(tSrS_rowcol); ++mi) {
      CUTE_UNROLL
      for (int g = 0; g < kGroups; ++g) {
        CUTE_UNROLL
        for (int ni = 0; ni < kGroupCols; ++ni) {
          float& s = tSrS_rowcol(mi, g * kGroupCols + ni);
          s = tanh_approx(s * before[g]) * after[g];
        }
      }
    }
  }

  // Row mi's running (V-weighted) max updated with the thread's part of the tile max;
  // returns the factor by which its row of O must be rescaled.
  template <bool kFirstTile>
  CUTLASS_DEVICE float merge_row_max(float thread_max, int mi) {
    float const tile_max = quad_allreduce(thread_max, MaxOp{});
    float const prev_shift = kFirstTile ? 0.f : shift(mi);
    bool const had_keys = !kFirstTile && row_max(mi) != -INFINITY;
    // The max in use stays unless the tile raises it by more than kRescaleThreshold: a
    // row with no visible key yet (-inf) takes any new max (+inf or NaN difference).
    bool const keep = kLazyRescale && !kFirstTile && tile_max - row_max(mi) <= kRescaleThreshold;
    row_max(mi) = keep ? row_max(mi) : fmaxf(row_max(mi), tile_max);
    // No visible key so far: the accumulator and the sum are 0, any factor will do.
    return had_keys && !keep ? exp2f(prev_shift - shift(mi)) : 1.f;
  }

  // Row mi of S turned into P in place, and its sum (over P / v) added.
  template <int kGroups, class TensorS>
  CUTLASS_DEVICE void exponentiate_row(TensorS& tSrS_rowcol, int mi, KeyGroupScales<kGroups> const& scales,
                                       float correction) {
    float const(&scale_log2)[kGroups] = scales.qk_log2;
    float const(&log2_v)[kGroups] = scales.log2_v;
    float const(&inv_v)[kGroups] = scales.inv_v;
    constexpr int kGroupCols = decltype(size<1>(tSrS_rowcol))::value / kGroups;
    float const cur_shift = shift(mi);
    float sum = 0.f;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      float const group_shift = cur_shift - log2_v[g];
      float sums[kChains];
      CUTE_UNROLL
      for (int c = 0; c < kChains; ++c) { sums[c] = 0.f; }
      CUTE_UNROLL
      for (int ni = 0; ni < kGroupCols; ++ni) {
        float const p = exp2f(tSrS_rowcol(mi, g * kGroupCols + ni) * scale_log2[g] - group_shift);
        tSrS_rowcol(mi, g * kGroupCols + ni) = p;
        sums[ni % kChains] += p;
      }
      float group_sum = sums[0];
      CUTE_UNROLL
      for (int c = 1; c < kChains; ++c) { group_sum += sums[c]; }
      sum = fmaf(group_sum, inv_v[g], sum);
    }
    row_sum(mi) = row_sum(mi) * correction + sum;
  }

  // O / row sum (V's scale is inside both). Returns the natural-log logsumexp of the true
  // scores (-inf for an empty row): log2 of it is max_w - kMaxOffset + log2(sum).
  // softmax_scale: unused (the logit scale is in the group factors). kSink: an attention
  // sink, a natural-log logit with no value, joins every row's sum and logsumexp (a row
  // that saw no key then has lse = sink), as in softmax.h.
  template <bool kSink = false, class TensorO>
  CUTLASS_DEVICE auto finalize(TensorO& tOrO_rowcol, float /*softmax_scale*/, float sink = 0.f) {
    Tensor lse = make_tensor<float>(Layout<Int<kRows>>{});
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      float const sum = quad_allreduce(row_sum(mi), SumOp{});
      bool const empty = sum == 0.f || sum != sum;
      float factor = empty ? 0.f : 1.f / sum;
      // O and the sum are taken against 2^shift: its natural log.
      float const base = (row_max(mi) - kMaxOffset) * 0.693147180559945309f;
      lse(mi) = empty ? -INFINITY : base + __logf(sum);
      if constexpr (kSink) {
        // lse = log(exp(lse_keys) + exp(sink)); out = O * 2^shift / exp(lse).
        float const top = fmaxf(lse(mi), sink);
        float const total = top == -INFINITY ? -INFINITY : top + __logf(__expf(lse(mi) - top) + __expf(sink - top));
        factor = empty ? 0.f : __expf(base - total);
        lse(mi) = total;
      }
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(tOrO_rowcol); ++ni) { tOrO_rowcol(mi, ni) *= factor; }
    }
    return lse;
  }
};

}  // namespace flash3
