// The two small kernels around the backward mainloop.
//   preprocess: per query row, dPsum = rowsum(dO * O) - dlse (the gradient of the
//     returned lse, if any) and the lse in the log2 domain, both into (batch, nheads,
//     seqlen_q_padded) float32 rows that the mainloop loads with TMA. Rows past seqlen_q
//     get lse = +inf (so P = 0 there), as do rows that saw no key (lse = -inf), whose
//     output is 0 and whose gradient must be too. With attention sinks, also each row's
//     share of the sinks' gradient (params.h dsink_rows_ptr).
//   postprocess: dQ = softmax_scale * dq_accum, from the workspace's register-ordered
//     float32 tiles to the element type in dq's layout.
// Both are bandwidth-bound passes over O, dO and dQ.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include <cute/tensor.hpp>

#include "params.h"
#include "seqlen.h"

namespace flash3 {

constexpr int kPrepostThreads = 256;

// Preprocess: a row of O and dO (headdim_v columns) is read by a group of lanes, 16 bytes
// (8 elements) each, so that a warp has several rows' loads in flight: kLanesPerRow is the
// power of two at or above dv / 8 (8 lanes at hdim 64, 16 at 96/128, 32 at 192/256). One
// lane per 4 bytes, one row per warp, ran at half the copy bandwidth (measured: 70-110 us
// at 16k tokens x 2048 hidden, 10-15% of a 512-token backward).
CUTLASS_HOST_DEVICE constexpr int prepost_lanes_per_row(int headdim) {
  return headdim <= 64 ? 8 : headdim <= 128 ? 16 : 32;
}

template <class Element>
__global__ void __launch_bounds__(kPrepostThreads) bwd_preprocess_kernel(BwdParams const params) {
  constexpr int kVec = 16 / sizeof(Element);
  int const lanes_per_row = prepost_lanes_per_row(params.headdim_v);
  int const rows_per_block = kPrepostThreads / lanes_per_row;
  int const group_lane = threadIdx.x % lanes_per_row;
  int const row = blockIdx.x * rows_per_block + threadIdx.x / lanes_per_row;
  int const head = blockIdx.y;
  Seq const seq = params.seq_layout().at(blockIdx.z);
  // No early return: every lane of a row group takes part in the shuffles below.
  bool const in_pad = row < (seq.seqlen_q + kVarlenRowPad - 1) / kVarlenRowPad * kVarlenRowPad;
  bool const valid = row < seq.seqlen_q;
  float sum = 0.f;
  if (valid) {
    int64_t const o_row = int64_t(seq.offset_q) + row;
    auto const* o = static_cast<Element const*>(params.o_ptr) + seq.batch * params.o_batch_stride +
                    o_row * params.o_row_stride + head * params.o_head_stride;
    auto const* dout = static_cast<Element const*>(params.do_ptr) + seq.batch * params.do_batch_stride +
                       o_row * params.do_row_stride + head * params.do_head_stride;
    for (int col = group_lane * kVec; col < params.headdim_v; col += lanes_per_row * kVec) {
      auto const o8 = *reinterpret_cast<cutlass::Array<Element, kVec> const*>(o + col);
      auto const do8 = *reinterpret_cast<cutlass::Array<Element, kVec> const*>(dout + col);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < kVec; ++e) { sum += float(o8[e]) * float(do8[e]); }
    }
  }
  for (int offset = lanes_per_row / 2; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffff, sum, offset); }
  if (group_lane != 0 || !in_pad) { return; }
  int64_t const out_idx =
      (int64_t(seq.batch) * params.nheads + head) * params.seqlen_q_padded + seq.offset_q_padded + row;
  if (!valid) {
    // Rows past seqlen_q: lse = +inf, so P = 0 there.
    params.dpsum_ptr[out_idx] = 0.f;
    params.lse_log2_ptr[out_idx] = INFINITY;
    if (params.dsink_rows_ptr != nullptr) { params.dsink_rows_ptr[out_idx] = 0.f; }
    return;
  }
  int64_t const lse_idx =
      (int64_t(seq.batch) * params.nheads + head) * params.rows_q() + seq.offset_q + row;
  float const lse = params.lse_ptr[lse_idx];
  if (params.dlse_ptr != nullptr) { sum -= params.dlse_ptr[lse_idx]; }
  params.dpsum_ptr[out_idx] = sum;
  params.lse_log2_ptr[out_idx] = lse == -INFINITY ? INFINITY : lse * float(M_LOG2E);
  if (params.dsink_rows_ptr != nullptr) {
    // d lse / d sink = exp(sink - lse), the sink's probability; its value is 0, so
    // d loss / d sink = P_sink * (0 - dPsum).
    float const p_sink = lse == -INFINITY ? 0.f : __expf(params.sinks_ptr[head] - lse);
    params.dsink_rows_ptr[out_idx] = -p_sink * sum;
  }
}

// One CTA per query tile; thread t reads the elements consumer thread t held (the
// workspace's register order, Traits::dq_float4_index) and maps them back to
// (row, col) through the same tiled MMA. The converted tile is staged in shared memory and
// written out in 16-byte row chunks: storing the register pairs straight to dQ (4 bytes
// per lane, eight rows per warp store) ran at a third of the copy bandwidth (170 us at
// 16k tokens x 2048 hidden, over a quarter of a 512-token backward).
template <class Traits>
__global__ void __launch_bounds__(Traits::kConsumerThreads) bwd_postprocess_kernel(BwdParams const params) {
  using Element = typename Traits::Element;
  constexpr int kRows = Traits::kBlockM;
  constexpr int kCols = Traits::kHeadDim;
  constexpr int kVec = 16 / sizeof(Element);
  // 16 bytes of padding per row: the 4-byte stores of a warp (8 rows x 4 column pairs)
  // then fall in 32 different banks, and rows stay 16-byte aligned.
  constexpr int kSmemRowStride = kCols + kVec;
  __shared__ alignas(16) Element tile_smem[kRows * kSmemRowStride];
  int const m_block = blockIdx.x, head = blockIdx.y;
  Seq const seq = params.seq_layout().at(blockIdx.z);
  int const row0 = m_block * kRows;
  if (row0 >= seq.seqlen_q) { return; }  // packed batches: the grid covers the longest sequence
  int const tid = threadIdx.x;
  float4 const* tile = reinterpret_cast<float4 const*>(
      params.dq_accum_ptr +
      ((int64_t(seq.batch) * params.nheads + head) * params.dq_m_blocks + seq.offset_q_padded / kRows + m_block) *
          Traits::kDqElements);
  typename Traits::TiledMmadQ tiled_mma_dq;
  auto thr_mma_dq = tiled_mma_dq.get_thread_slice(tid);
  cute::Tensor cdQ = cute::make_identity_tensor(cute::select<0, 1>(typename Traits::TileShapedQ{}));
  cute::Tensor tdQcdQ = thr_mma_dq.partition_C(cdQ);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < cute::size(tdQcdQ); i += 4) {
    float4 const a = tile[Traits::dq_float4_index(i, tid)];
    float const values[4] = {a.x, a.y, a.z, a.w};
    if constexpr (Traits::kTransposed) {
      // dQ^T: coordinates (col, row), one element at a time.
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; ++e) {
        int const row = cute::get<1>(tdQcdQ(i + e));
        int const col = cute::get<0>(tdQcdQ(i + e));
        tile_smem[row * kSmemRowStride + col] = Element(values[e] * params.softmax_scale);
      }
      continue;
    }
    // Elements (i, i + 1) and (i + 2, i + 3) are pairs of adjacent columns of one row.
    CUTLASS_PRAGMA_UNROLL
    for (int pair = 0; pair < 2; ++pair) {
      int const row = cute::get<0>(tdQcdQ(i + 2 * pair));
      int const col = cute::get<1>(tdQcdQ(i + 2 * pair));
      cutlass::Array<Element, 2> out;
      out[0] = Element(values[2 * pair] * params.softmax_scale);
      out[1] = Element(values[2 * pair + 1] * params.softmax_scale);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(&tile_smem[row * kSmemRowStride + col]) = out;
    }
  }
  __syncthreads();
  auto* dq_head = static_cast<Element*>(params.dq_ptr) + seq.batch * params.dq_batch_stride +
                  head * params.dq_head_stride + int64_t(seq.offset_q) * params.dq_row_stride;
  constexpr int kChunksPerRow = kCols / kVec;
  CUTLASS_PRAGMA_UNROLL
  for (int chunk = tid; chunk < kRows * kChunksPerRow; chunk += Traits::kConsumerThreads) {
    int const row = chunk / kChunksPerRow;
    int const col = chunk % kChunksPerRow * kVec;
    if (row0 + row < seq.seqlen_q) {
      *reinterpret_cast<uint4*>(dq_head + int64_t(row0 + row) * params.dq_row_stride + col) =
          *reinterpret_cast<uint4 const*>(&tile_smem[row * kSmemRowStride + col]);
    }
  }
}

template <class Element>
cudaError_t run_bwd_preprocess(BwdParams const& params, cudaStream_t stream) {
  int const rows_per_block = kPrepostThreads / prepost_lanes_per_row(params.headdim_v);
  // Each sequence's rows, padded (seqlen.h; for dense batches, seqlen_q_padded).
  int const rows = (params.seqlen_q + kVarlenRowPad - 1) / kVarlenRowPad * kVarlenRowPad;
  dim3 const grid((rows + rows_per_block - 1) / rows_per_block, params.nheads, params.batch);
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
