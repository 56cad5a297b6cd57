// Which tile variant of a forward kernel serves a call, for both element types: the
// 16-bit kernels' short-sequence tiles against their general ones (launch_fwd.h, traits.h
// kShortSeqMaxSeqlen) and the FP8 kernels' variants per (head dim, mask) (dispatch_fp8.cu).
// A variant serves the lengths within its bounds; of the variants that serve a call, the
// most specific runs: the largest lower bound on seqlen_k, then the smallest upper bound
// on seqlen_k, then on seqlen_q. Host code, free of CuTe.
#pragma once

#include <climits>
#include <cstdint>

namespace flash3 {

struct FwdVariantBounds {
  int min_seqlen_k = 0;
  int max_seqlen_k = INT_MAX;
  int max_seqlen_q = INT_MAX;

  constexpr bool serves(int seqlen_q, int seqlen_k) const {
    return seqlen_k >= min_seqlen_k && seqlen_k <= max_seqlen_k && seqlen_q <= max_seqlen_q;
  }
  constexpr bool more_specific_than(FwdVariantBounds const& other) const {
    if (min_seqlen_k != other.min_seqlen_k) { return min_seqlen_k > other.min_seqlen_k; }
    if (max_seqlen_k != other.max_seqlen_k) { return max_seqlen_k < other.max_seqlen_k; }
    return max_seqlen_q < other.max_seqlen_q;
  }
};

// The short-sequence tiles' bounds: both lengths at most max_seqlen.
constexpr FwdVariantBounds short_seq_bounds(int max_seqlen) { return {0, max_seqlen, max_seqlen}; }

// The lengths a local-mask call is matched against: a window spanning at most `reach`
// keys makes its query tiles walk no more key tiles than a short tile's (traits.h
// kHasLocalShortTile), at any length, so it is matched as that span; else the lengths.
struct FwdVariantLengths {
  int seqlen_q;
  int seqlen_k;
};
constexpr FwdVariantLengths local_variant_lengths(int seqlen_q, int seqlen_k, int window_left, int window_right,
                                                  int reach) {
  int64_t const span = int64_t(window_left) + window_right + 1;
  return span <= reach ? FwdVariantLengths{int(span), int(span)} : FwdVariantLengths{seqlen_q, seqlen_k};
}

// The entry of [begin, end) to run: among those with usable(entry) whose entry.bounds
// serve the lengths, the most specific; null when none does.
template <class Entry, class Usable>
Entry const* pick_fwd_variant(Entry const* begin, Entry const* end, int seqlen_q, int seqlen_k, Usable&& usable) {
  Entry const* chosen = nullptr;
  for (Entry const* entry = begin; entry != end; ++entry) {
    if (!usable(*entry) || !entry->bounds.serves(seqlen_q, seqlen_k)) { continue; }
    if (chosen == nullptr || entry->bounds.more_specific_than(chosen->bounds)) { chosen = entry; }
  }
  return chosen;
}

}  // namespace flash3
