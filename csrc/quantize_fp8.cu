// The fused FP8 quantiser: one pass over a bf16 (batch, seqlen, nheads, headdim) tensor
// that applies the incoherent-processing rotation (random signs, then a normalised
// Hadamard transform along the head dim), computes one scale per block of rows per head,
// and writes e4m3.
//
// One CTA per (row block, head, batch), 4 * headdim threads: a row of headdim values is
// split over headdim / 16 consecutive lanes, 16 values each, so a CTA covers 64 rows per
// pass and a 128-row block in two passes; every value stays in registers between the
// transform, the block's amax and the cast. The Hadamard transform is the fast
// Walsh-Hadamard butterfly: strides 1..8 inside a thread, 16 .. headdim/2 across lanes
// with shuffles. Reads 2 bytes and writes 1 byte per element: bandwidth-bound.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "flash3/params_fp8.h"

namespace flash3 {
namespace {

constexpr int kValuesPerThread = 16;
constexpr int kRowsPerPass = 64;
constexpr float kE4M3Max = 448.f;

__device__ __forceinline__ uint32_t cvt_e4m3x2_q(float lo, float hi) {
  uint16_t out;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(out) : "f"(hi), "f"(lo));
  return out;
}

template <int kHeadDim, int kPasses, bool kRotate>
__global__ void __launch_bounds__(4 * kHeadDim) quantize_fp8_kernel(QuantizeParams const p) {
  constexpr int kThreadsPerRow = kHeadDim / kValuesPerThread;
  constexpr int kThreads = kThreadsPerRow * kRowsPerPass;
  constexpr int kWarps = kThreads / 32;
  static_assert(kThreadsPerRow <= 32 && 32 % kThreadsPerRow == 0);

  int const block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  int const tid = threadIdx.x;
  int const chunk = tid % kThreadsPerRow;  // which 16 columns of the row
  int const col0 = chunk * kValuesPerThread;
  int const row_in_pass = tid / kThreadsPerRow;
  int const row_base = block * p.block_rows;

  auto const* in = static_cast<__nv_bfloat16 const*>(p.in_ptr) + batch * p.in_batch_stride + head * p.in_head_stride;
  auto* out = static_cast<uint8_t*>(p.out_ptr) + batch * p.out_batch_stride + head * p.out_head_stride;

  float sign[kValuesPerThread];
  if constexpr (kRotate) {
#pragma unroll
    for (int i = 0; i < kValuesPerThread; ++i) { sign[i] = p.signs_ptr[col0 + i]; }
  }

  float x[kPasses][kValuesPerThread];
  float amax = 0.f;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    int const row = row_base + pass * kRowsPerPass + row_in_pass;
    bool const valid = pass * kRowsPerPass < p.block_rows && row < p.seqlen;
    uint4 raw[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
    if (valid) {
      uint4 const* src = reinterpret_cast<uint4 const*>(in + row * p.in_row_stride + col0);
      raw[0] = src[0];
      raw[1] = src[1];
    }
    __nv_bfloat162 const* pairs = reinterpret_cast<__nv_bfloat162 const*>(raw);
#pragma unroll
    for (int i = 0; i < kValuesPerThread / 2; ++i) {
      float2 const f = __bfloat1622float2(pairs[i]);
      x[pass][2 * i] = f.x;
      x[pass][2 * i + 1] = f.y;
    }
    if constexpr (kRotate) {
#pragma unroll
      for (int i = 0; i < kValuesPerThread; ++i) { x[pass][i] *= sign[i]; }
      // Butterflies (a, b) -> (a + b, a - b) over index pairs h apart.
#pragma unroll
      for (int h = 1; h < kValuesPerThread; h *= 2) {
#pragma unroll
        for (int i = 0; i < kValuesPerThread; ++i) {
          if ((i & h) == 0) {
            float const a = x[pass][i], b = x[pass][i + h];
            x[pass][i] = a + b;
            x[pass][i + h] = a - b;
          }
        }
      }
#pragma unroll
      for (int lane_h = 1; lane_h < kThreadsPerRow; lane_h *= 2) {
        bool const upper = chunk & lane_h;
#pragma unroll
        for (int i = 0; i < kValuesPerThread; ++i) {
          float const other = __shfl_xor_sync(0xffffffff, x[pass][i], lane_h);
          x[pass][i] = upper ? other - x[pass][i] : x[pass][i] + other;
        }
      }
      float const norm = rsqrtf(float(kHeadDim));
#pragma unroll
      for (int i = 0; i < kValuesPerThread; ++i) { x[pass][i] *= norm; }
    }
    if (valid) {
#pragma unroll
      for (int i = 0; i < kValuesPerThread; ++i) { amax = fmaxf(amax, fabsf(x[pass][i])); }
    }
  }

  // Block amax: warp, then CTA.
  __shared__ float warp_amax[kWarps];
  __shared__ float block_inv_scale;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) { amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, offset)); }
  if (tid % 32 == 0) { warp_amax[tid / 32] = amax; }
  __syncthreads();
  if (tid == 0) {
    float m = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) { m = fmaxf(m, warp_amax[w]); }
    // An all-zero block gets scale 1 (its values are 0 either way): the attention kernel
    // divides V scales of neighbouring tiles.
    float const scale = m > 0.f ? m / kE4M3Max : 1.f;
    p.scale_ptr[(int64_t(batch) * p.nheads + head) * p.num_blocks + block] = scale;
    block_inv_scale = m > 0.f ? kE4M3Max / m : 1.f;
  }
  __syncthreads();
  float const inv_scale = block_inv_scale;

#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    int const row = row_base + pass * kRowsPerPass + row_in_pass;
    if (pass * kRowsPerPass >= p.block_rows || row >= p.seqlen) { continue; }
    uint4 packed;
    uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float const* v = &x[pass][4 * w];
      words[w] = cvt_e4m3x2_q(v[0] * inv_scale, v[1] * inv_scale) |
                 (cvt_e4m3x2_q(v[2] * inv_scale, v[3] * inv_scale) << 16);
    }
    *reinterpret_cast<uint4*>(out + row * p.out_row_stride + col0) = packed;
  }
}

template <int kHeadDim, int kPasses>
cudaError_t launch(QuantizeParams const& p, cudaStream_t stream) {
  dim3 const grid(p.num_blocks, p.nheads, p.batch);
  if (p.signs_ptr != nullptr) {
    quantize_fp8_kernel<kHeadDim, kPasses, true><<<grid, 4 * kHeadDim, 0, stream>>>(p);
  } else {
    quantize_fp8_kernel<kHeadDim, kPasses, false><<<grid, 4 * kHeadDim, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <int kHeadDim>
cudaError_t launch_rows(QuantizeParams const& p, cudaStream_t stream) {
  return p.block_rows <= kRowsPerPass ? launch<kHeadDim, 1>(p, stream) : launch<kHeadDim, 2>(p, stream);
}

}  // namespace

// Returns cudaErrorInvalidValue for a head dim or block size it does not handle.
cudaError_t run_quantize_fp8(QuantizeParams const& p, cudaStream_t stream) {
  if (p.block_rows != 64 && p.block_rows != 128) { return cudaErrorInvalidValue; }
  switch (p.headdim) {
    case 64: return launch_rows<64>(p, stream);
    case 128: return launch_rows<128>(p, stream);
    case 256: return launch_rows<256>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace flash3
