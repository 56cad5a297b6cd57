// Where one sequence of a batch lives, for dense and variable-length batches alike.
//
// Dense batches: sequence b has the params' seqlen_q and seqlen_k and is entry b of the
// tensors' batch dimension. Variable-length batches (cu_seqlens_q non-null): q, k, v and
// o are packed (total, nheads, headdim) and seen as one batch entry of `total` rows;
// sequence b owns rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and o and rows
// [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v, of which seqused_q[b] and
// seqused_k[b], where given, are used. The lengths are read on the device, per tile: the
// host knows only their maxima, so a call needs no host synchronisation.
//
// Split-KV parts (split_keys, the KV-cache call): sequence b is a part of a longer key
// range that starts at its first key; seqused_k[b] counts the keys from there to the
// range's end, of which it reads those of its slot [cu_seqlens_k[b], cu_seqlens_k[b + 1])
// and its masks count the rest (mask.h).
#pragma once

#include <cutlass/cutlass.h>

namespace flash3 {

// The row statistics and dQ workspaces of the backward pad every sequence to whole tiles
// of this many rows (a multiple of every backward query tile).
constexpr int kVarlenRowPad = 128;

// One sequence: its lengths, its first row in the packed tensors (0 for dense batches)
// and its index in the tensors' batch dimension (b for dense batches, 0 for packed ones).
struct Seq {
  int seqlen_q;
  int seqlen_k;
  int offset_q;
  int offset_k;
  int batch;
  // The first row of the sequence in the backward's padded workspaces (kVarlenRowPad):
  // sequence b's rows start at a multiple of the pad, with room for its last tile before
  // sequence b + 1's; 0 for dense batches, whose workspaces have a batch dimension.
  int offset_q_padded;
  // Keys past seqlen_k that the masks' alignment counts (split-KV parts), else 0.
  int keys_after = 0;
};

// Sequence b's keys read and keys after them (split_keys), from its slot's first row
// begin_k, the slot's end end_k and its seqused_k entry used_k (or the slot's length).
struct SeqKeys {
  int read;
  int after;
};
CUTLASS_HOST_DEVICE SeqKeys split_seq_keys(int used_k, int begin_k, int end_k, bool split_keys) {
  int const slot = end_k - begin_k;
  if (!split_keys || used_k <= (slot > 0 ? slot : 0)) { return {used_k, 0}; }  // (parts past the range: none)
  return {slot, used_k - slot};
}

// Sequence b's first row in the backward's padded workspaces, from its first row begin_q.
CUTLASS_HOST_DEVICE int varlen_padded_offset(int begin_q, int b) {
  return (begin_q + b * kVarlenRowPad) / kVarlenRowPad * kVarlenRowPad;
}

struct SeqLayout {
  int const* cu_seqlens_q = nullptr;  // (batch + 1), or null: a dense batch
  int const* cu_seqlens_k = nullptr;
  int const* seqused_q = nullptr;  // (batch), or null
  int const* seqused_k = nullptr;
  int seqlen_q = 0;  // dense: every sequence's length; packed: the maxima
  int seqlen_k = 0;
  bool split_keys = false;  // the sequences are split-KV parts (above)

  CUTLASS_HOST_DEVICE bool is_varlen() const { return cu_seqlens_q != nullptr; }

  // kVarlen known at compile time (the forward kernels): a dense batch's lengths stay
  // kernel parameters (operands from the constant bank), not registers.
  template <bool kVarlen>
  CUTLASS_DEVICE Seq at(int b) const {
    if constexpr (!kVarlen) {
      return {seqlen_q, seqlen_k, 0, 0, b, 0};
    } else {
      return at_packed(b);
    }
  }
  CUTLASS_DEVICE Seq at(int b) const { return cu_seqlens_q == nullptr ? at<false>(b) : at_packed(b); }

  CUTLASS_DEVICE Seq at_packed(int b) const {
    int const begin_q = cu_seqlens_q[b];
    int const begin_k = cu_seqlens_k[b];
    int const len_q = seqused_q != nullptr ? seqused_q[b] : cu_seqlens_q[b + 1] - begin_q;
    int const len_k = seqused_k != nullptr ? seqused_k[b] : cu_seqlens_k[b + 1] - begin_k;
    if (!split_keys) { return {len_q, len_k, begin_q, begin_k, 0, varlen_padded_offset(begin_q, b)}; }
    SeqKeys const keys = split_seq_keys(len_k, begin_k, cu_seqlens_k[b + 1], true);
    return {len_q, keys.read, begin_q, begin_k, 0, varlen_padded_offset(begin_q, b), keys.after};
  }
};

}  // namespace flash3
