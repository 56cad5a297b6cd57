// The host-device ABI of the forward kernel: plain pointers, int64 strides, sizes and
// scales. The binding (api.cpp) fills one of these from tensors; everything below it
// is free of torch.
#pragma once

#include <cstdint>

#include "seqlen.h"

namespace flash3 {

// A paged K/V is loaded in boxes of this many rows, each within one page (paged_kv.h).
constexpr int kPageChunkRows = 16;

// The fewest query rows of any packed-batch forward kernel's tile: the binding sizes the
// tile table for it.
constexpr int kPackedMinBlockRows = 64;

// The host's bound on a packed batch's query tiles (scheduler_packed.h): every sequence
// has at most one partial tile, and whole tiles cover at most total_q rows.
inline int64_t packed_tile_bound(int64_t total_q, int64_t batch, int64_t nheads, int block_m) {
  return (total_q / block_m + batch) * nheads;
}

struct FwdParams {
  // q: (batch, seqlen_q, nheads, headdim); k: (batch, seqlen_k, nheads_k, headdim); v:
  // (batch, seqlen_k, nheads_k, headdim_v); o: (batch, seqlen_q, nheads, headdim_v). The last dimension is contiguous (the binding checks it), so only the
  // batch, row (seqlen) and head strides are stored, in elements.
  void const* q_ptr = nullptr;
  void const* k_ptr = nullptr;
  void const* v_ptr = nullptr;
  void* o_ptr = nullptr;
  // Float32, contiguous: (batch, nheads, seqlen_q) for dense batches, (nheads, total_q)
  // for packed ones.
  float* lse_ptr = nullptr;

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  // Variable-length batches (seqlen.h): q, k, v, o packed as (total, nheads, headdim),
  // i.e. batch dimension 1 with batch strides unused; batch counts the sequences and
  // seqlen_q / seqlen_k are their maxima. Null cu_seqlens_q: a dense batch.
  int const* cu_seqlens_q = nullptr;
  int const* cu_seqlens_k = nullptr;
  int const* seqused_q = nullptr;
  int const* seqused_k = nullptr;
  int total_q = 0;
  int total_k = 0;
  // The packed-batch forward's tile table (scheduler_packed.h), entries of 8 int32, and
  // its capacity in entries: packed_tile_bound(total_q, batch, nheads,
  // kPackedMinBlockRows), followed by one more entry for the persistent kernels' claim
  // counter. Null where every sequence fits one tile (decoding).
  int* packed_tiles = nullptr;
  int packed_tiles_capacity = 0;
  // Packed batches may read K and V through a page table (paged_kv.h), or null. k and v
  // are then (rows, nheads_k, headdim) over the cache's pages, page p's slots from row
  // p * page_rows, and cu_seqlens_k holds virtual rows: sequence b's key j is virtual row
  // v = cu_seqlens_k[b] + j, the cache row page_table[v / page_size] * page_rows +
  // v % page_size. page_size, page_rows and every cu_seqlens_k entry are multiples of
  // kPageChunkRows (the binding and its caller see to it); the table's entries for the
  // keys a sequence uses must be valid pages.
  int const* page_table = nullptr;
  int page_size = 0;
  int page_rows = 0;
  // The KV-cache call's split-KV parts (flash3/kvcache.py), forward only: the sequences
  // are parts of longer key ranges (seqlen.h split_keys), and each query's rows_per_query
  // query heads of one K/V head are consecutive rows (GQA packing; the masks see
  // row / rows_per_query, mask.h). Neither changes a kernel where left at false and 1.
  bool split_keys = false;
  int rows_per_query = 1;

  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int nheads = 0;
  int nheads_k = 0;
  int headdim = 0;
  // The head dim of V (and of o, dout, dv): headdim, or less (DeepSeek-V3-style 192 / 128).
  int headdim_v = 0;

  // softmax_scale multiplies Q K^T; softmax_scale_log2 = softmax_scale * log2(e) is what
  // the kernel uses, so that exp(x * scale) becomes a single FFMA feeding exp2.
  float softmax_scale = 0.f;
  float softmax_scale_log2 = 0.f;

  // Multiprocessors of the device, for grid sizing of persistent schedulers.
  int num_sms = 0;

  // Options of the local-mask kernels (mask.h LocalMask; the other kernels ignore them).
  // The window, bottom-right aligned: row i sees keys [i + seqlen_k - seqlen_q -
  // window_left, i + seqlen_k - seqlen_q + window_right], each side >= 0 (the binding
  // clamps an unbounded side to the longest sequence, the same mask).
  int window_left = 0;
  int window_right = 0;
  // softcap > 0: the scores are softcap * tanh(softmax_scale * q.k / softcap).
  float softcap = 0.f;
  // Attention sinks, float32 (nheads), or null: one logit per query head that joins each
  // row's softmax denominator (and its logsumexp) with no value.
  float const* sinks_ptr = nullptr;

  CUTLASS_HOST_DEVICE bool has_softcap() const { return softcap > 0.f; }
  // What multiplies Q K^T before the tanh under softcap.
  CUTLASS_HOST_DEVICE float tanh_prescale() const { return has_softcap() ? softmax_scale / softcap : 0.f; }
  // The factor from the scores the softmax sees (q.k, or tanh(...) under softcap) to
  // logits in natural-log units, and in log2 units.
  CUTLASS_HOST_DEVICE float logit_scale() const { return has_softcap() ? softcap : softmax_scale; }
  CUTLASS_HOST_DEVICE float logit_scale_log2() const {
    return has_softcap() ? softcap * 1.4426950408889634f : softmax_scale_log2;
  }

  CUTLASS_HOST_DEVICE bool is_varlen() const { return cu_seqlens_q != nullptr; }
  CUTLASS_HOST_DEVICE SeqLayout seq_layout() const {
    return {cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, seqlen_q, seqlen_k, split_keys};
  }
  // The row and batch extents of the tensors as TMA sees them (tma.h).
  CUTLASS_HOST_DEVICE int rows_q() const { return is_varlen() ? total_q : seqlen_q; }
  CUTLASS_HOST_DEVICE int rows_k() const { return is_varlen() ? total_k : seqlen_k; }
  CUTLASS_HOST_DEVICE int tensor_batch() const { return is_varlen() ? 1 : batch; }
};

// The query-tile height of the backward kernel of a head dim. The binding sizes the dQ
// workspace (whole tiles) and the deterministic-mode semaphores (one per tile) with it.
// hdim 64's GEMMs are short in K (64), so a taller query tile halves the per-tile costs
// (barriers, the dQ hand-over) against its math.
constexpr int bwd_block_m(int headdim) { return headdim == 64 ? 128 : 64; }

// The backward pass (launch_bwd.h): the forward's tensors plus the gradients and the
// fp32 workspaces the binding allocates.
struct BwdParams : FwdParams {
  // dout like o (the binding makes it TMA-readable); dq like q; dk, dv: (batch, seqlen_k,
  // nheads_dkv, headdim / headdim_v), where nheads_dkv is nheads_k, or under GQA float32
  // (dkv_is_fp32): in deterministic mode nheads, every query head writing its own dK/dV,
  // which the binding sums over a group in a fixed order; otherwise nheads_k, zeroed, the
  // query heads of a group adding theirs (dkv_accumulate: bulk reductions or float32
  // atomics, epilogue_bwd.h), and the binding converts them.
  void const* do_ptr = nullptr;
  void* dq_ptr = nullptr;
  void* dk_ptr = nullptr;
  void* dv_ptr = nullptr;
  // The gradient of the returned lse, float32 (batch, nheads, seqlen_q), or null.
  float const* dlse_ptr = nullptr;
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  bool dkv_is_fp32 = false;
  bool dkv_accumulate = false;  // with dkv_is_fp32

  // Workspaces, float32. lse_log2 and dpsum: (batch, nheads, seqlen_q_padded), written by
  // the preprocess kernel; dq_accum: (batch, nheads, m_blocks, bwd_block_m(headdim) * headdim),
  // zeroed by the binding, summed into by every key tile, each tile stored in the order
  // of the dQ accumulator's registers (mainloop_bwd.h) and put back in rows by the
  // postprocess kernel; dq_semaphore: int32 (batch, nheads, m_blocks), zeroed, only with
  // deterministic. m_blocks = ceil(seqlen_q / bwd_block_m(headdim)).
  // Packed batches (seqlen.h): batch dimension 1, seqlen_q_padded rows per head, each
  // sequence's from Seq::offset_q_padded, and m_blocks = seqlen_q_padded / bwd_block_m.
  float* lse_log2_ptr = nullptr;
  float* dpsum_ptr = nullptr;
  float* dq_accum_ptr = nullptr;
  int* dq_semaphore_ptr = nullptr;
  int seqlen_q_padded = 0;
  int dq_m_blocks = 0;  // m_blocks above: the dQ workspace's tiles per head
  bool deterministic = false;
  // With sinks: float32 like dpsum, where the preprocess writes each row's share of the
  // sinks' gradient, -exp(sink - lse) * dPsum (0 in rows past seqlen_q); the binding sums
  // them per head.
  float* dsink_rows_ptr = nullptr;
};

}  // namespace flash3
