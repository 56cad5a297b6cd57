// The host-device ABI of the FP8 forward kernel: FwdParams plus the block scales.
// Free of CuTe and torch, so that the binding can include it.
#pragma once

#include <cstdint>

#include "params.h"

namespace flash3 {

// Block quantisation: one float scale per 64 query rows (kScaleBlockQ) and per 128 keys
// (kScaleBlockK), per head; x = x8 * scale. The scales enter the kernel as strided
// (batch, head, block) tensors, so a per-(batch, head) or per-tensor scale is the same
// tensor with a zero block (and head) stride.
constexpr int kScaleBlockQ = 64;   // query rows per Q scale: one consumer warpgroup's rows
constexpr int kScaleBlockK = 128;  // keys per K and V scale: a multiple of every FP8 kBlockN

// x = x8 * scale, scale at ptr[batch * batch_stride + head * head_stride + block * block_stride].
// A per-(batch, head) or per-tensor scale is the same tensor with zero strides.
struct BlockScales {
  float const* ptr = nullptr;
  int64_t batch_stride = 0, head_stride = 0, block_stride = 0;
  int num_blocks = 0;  // blocks along the sequence: ceil(seqlen / block rows)

#if defined(__CUDACC__)
  __host__ __device__
#endif
  float const* head_ptr(int batch, int head) const {
    return ptr + batch * batch_stride + head * head_stride;
  }
};

// FwdParams with q, k, v pointing to e4m3 and o to bf16, and the block scales.
struct FwdFp8Params : FwdParams {
  BlockScales q_scale;  // (batch, nheads, ceil(seqlen_q / 64))
  BlockScales k_scale;  // (batch, nheads_k, ceil(seqlen_k / 128))
  BlockScales v_scale;  // (batch, nheads_k, ceil(seqlen_k / 128)), with k_scale's strides
};

// The fused quantiser (csrc/quantize_fp8.cu): x (batch, seqlen, nheads, headdim) bf16 ->
// optionally x * diag(signs) * H / sqrt(headdim) (H the Sylvester Hadamard matrix) ->
// e4m3 with one scale per block_rows rows per head.
struct QuantizeParams {
  void const* in_ptr = nullptr;  // bf16
  int64_t in_batch_stride = 0, in_row_stride = 0, in_head_stride = 0;
  void* out_ptr = nullptr;  // e4m3
  int64_t out_batch_stride = 0, out_row_stride = 0, out_head_stride = 0;
  float* scale_ptr = nullptr;  // (batch, nheads, num_blocks), contiguous
  float const* signs_ptr = nullptr;  // (headdim,) of +-1, or null: no rotation
  int batch = 0, seqlen = 0, nheads = 0, headdim = 0, block_rows = 0, num_blocks = 0;
};

}  // namespace flash3
