// The GQA backward's last step: the query heads of a group wrote their dK (or dV) in
// float32, one slice per query head (deterministic mode); sum_kv_heads adds each group's
// slices in a fixed order and writes the K/V head's gradient in the element type of k.
// With group 1 (the heads already added into one slice per K/V head) it only converts.
// One launch for dK and dV together.
#pragma once

#include <ATen/ATen.h>

namespace flash3::api {

// dk_heads, dv_heads: float32 (batch, rows, nheads, headdim), contiguous (dv's headdim
// may differ from dk's). dk, dv: (batch, rows, nheads / group, headdim), contiguous, bf16
// or fp16; each headdim % 4 == 0.
void sum_kv_heads(at::Tensor const& dk_heads, at::Tensor const& dv_heads, int64_t group, at::Tensor& dk,
                  at::Tensor& dv);

}  // namespace flash3::api
