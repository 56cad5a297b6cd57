// The host-device ABI of the forward kernel: plain pointers, int64 strides, sizes and
// scales. The binding (api.cpp) fills one of these from tensors; everything below it
// is free of torch.
#pragma once

#include <cstdint>

namespace flash3 {

struct FwdParams {
  // q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_k, headdim);
  // o like q. The last dimension is contiguous (the binding checks it), so only the
  // batch, row (seqlen) and head strides are stored, in elements.
  void const* q_ptr = nullptr;
  void const* k_ptr = nullptr;
  void const* v_ptr = nullptr;
  void* o_ptr = nullptr;
  // Float32, (batch, nheads, seqlen_q), contiguous.
  float* lse_ptr = nullptr;

  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int nheads = 0;
  int nheads_k = 0;
  int headdim = 0;

  // softmax_scale multiplies Q K^T; softmax_scale_log2 = softmax_scale * log2(e) is what
  // the kernel uses, so that exp(x * scale) becomes a single FFMA feeding exp2.
  float softmax_scale = 0.f;
  float softmax_scale_log2 = 0.f;

  // Multiprocessors of the device, for grid sizing of persistent schedulers.
  int num_sms = 0;
};

}  // namespace flash3
