// The two small kernels around the backward mainloop.
//   preprocess: per query row, dPsum = rowsum(dO * O) - dlse (the gradient of the
//     returned lse, if any) and the lse in the log2 domain, both into (batch, nheads,
//     seqlen_q_padded) float32 rows that the mainloop loads with TMA. Rows past seqlen_q
//     get lse = +inf (so P = 0 there), as do rows that saw no key (lse = -inf), whose
//     output is 0 and whose gradient must be too.
//   postprocess: dQ = softmax_scale * dq_accum, from the workspace's register-ordered
//     float32 tiles to the element type in dq's layout.
// Both are bandwidth-bound passes over O, dO and dQ.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include <cute/tensor.hpp>

#include "params.h"

namespace flash3 {

constexpr int kPrepostThreads = 256;
constexpr int kPrepostRowsPerBlock = kPrepostThreads / 32;

template <class Element>
__global__ void __launch_bounds__(kPrepostThreads) bwd_preprocess_kernel(BwdParams const params) {
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int const row = blockIdx.x * kPrepostRowsPerBlock + warp;
  int const head = blockIdx.y, batch = blockIdx.z;
  if (row >= params.seqlen_q_padded) { return; }
  int64_t const out_idx = (int64_t(batch) * params.nheads + head) * params.seqlen_q_padded + row;
  if (row >= params.seqlen_q) {
    if (lane == 0) {
      params.dpsum_ptr[out_idx] = 0.f;
      params.lse_log2_ptr[out_idx] = INFINITY;
    }
    return;
  }
  auto const* o = static_cast<Element const*>(params.o_ptr) + batch * params.o_batch_stride +
                  row * params.o_row_stride + head * params.o_head_stride;
  auto const* dout = static_cast<Element const*>(params.do_ptr) + batch * params.do_batch_stride +
                     row * params.do_row_stride + head * params.do_head_stride;
  float sum = 0.f;
  for (int col = lane * 2; col < params.headdim; col += 64) {
    auto const o2 = *reinterpret_cast<cutlass::Array<Element, 2> const*>(o + col);
    auto const do2 = *reinterpret_cast<cutlass::Array<Element, 2> const*>(dout + col);
    sum += float(o2[0]) * float(do2[0]) + float(o2[1]) * float(do2[1]);
  }
  CUTLASS_PRAGMA_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, offset); }
  if (lane == 0) {
    int64_t const lse_idx = (int64_t(batch) * params.nheads + head) * params.seqlen_q + row;
    float const lse = params.lse_ptr[lse_idx];
    if (params.dlse_ptr != nullptr) { sum -= params.dlse_ptr[lse_idx]; }
    params.dpsum_ptr[out_idx] = sum;
    params.lse_log2_ptr[out_idx] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
  }
}

// One CTA per query tile; thread t reads the elements consumer thread t held (the
// workspace's register order, Traits::dq_float4_index) and maps them back to
// (row, col) through the same tiled MMA.
template <class Traits>
__global__ void __launch_bounds__(Traits::kConsumerThreads) bwd_postprocess_kernel(BwdParams const params) {
  using Element = typename Traits::Element;
  int const m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  int const tid = threadIdx.x;
  int const m_blocks = gridDim.x;
  float4 const* tile = reinterpret_cast<float4 const*>(
      params.dq_accum_ptr + ((int64_t(batch) * params.nheads + head) * m_blocks + m_block) * Traits::kDqElements);
  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tid);
  cute::Tensor cdQ = cute::make_identity_tensor(cute::select<0, 1>(typename Traits::TileShapedQ{}));
  cute::Tensor tdQcdQ = thr_mma_dq.partition_C(cdQ);
  auto* dq_head = static_cast<Element*>(params.dq_ptr) + batch * params.dq_batch_stride + head * params.dq_head_stride;
  int const row0 = m_block * Traits::kBlockM;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(tdQcdQ); i += 4) {
    float4 const a = tile[Traits::dq_float4_index(i, tid)];
    float const values[4] = {a.x, a.y, a.z, a.w};
    // Elements (i, i + 1) and (i + 2, i + 3) are pairs of adjacent columns of one row.
    CUTLASS_PRAGMA_UNROLL
    for (int pair = 0; pair < 2; ++pair) {
      int const row = row0 + cute::get<0>(tdQcdQ(i + 2 * pair));
      int const col = cute::get<1>(tdQcdQ(i + 2 * pair));
      if (row < params.seqlen_q) {
        cutlass::Array<Element, 2> out;
        out[0] = Element(values[2 * pair] * params.softmax_scale);
        out[1] = Element(values[2 * pair + 1] * params.softmax_scale);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dq_head + row * params.dq_row_stride + col) = out;
      }
    }
  }
}

template <class Element>
cudaError_t run_bwd_preprocess(BwdParams const& params, cudaStream_t stream) {
  dim3 const grid((params.seqlen_q_padded + kPrepostRowsPerBlock - 1) / kPrepostRowsPerBlock, params.nheads, params.batch);
  bwd_preprocess_kernel<Element><<<grid, kPrepostThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

template <class Traits>
cudaError_t run_bwd_postprocess(BwdParams const& params, cudaStream_t stream) {
  dim3 const grid((params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM, params.nheads, params.batch);
  bwd_postprocess_kernel<Traits><<<grid, Traits::kConsumerThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flash3
