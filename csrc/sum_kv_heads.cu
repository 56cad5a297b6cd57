// See sum_kv_heads.h.
#include "sum_kv_heads.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace flash3::api {
namespace {

__device__ inline void store4(__nv_bfloat16* out, float4 s) {
  __nv_bfloat162 const lo = __floats2bfloat162_rn(s.x, s.y), hi = __floats2bfloat162_rn(s.z, s.w);
  uint2 packed;
  packed.x = *reinterpret_cast<uint32_t const*>(&lo);
  packed.y = *reinterpret_cast<uint32_t const*>(&hi);
  *reinterpret_cast<uint2*>(out) = packed;
}

__device__ inline void store4(__half* out, float4 s) {
  __half2 const lo = __floats2half2_rn(s.x, s.y), hi = __floats2half2_rn(s.z, s.w);
  uint2 packed;
  packed.x = *reinterpret_cast<uint32_t const*>(&lo);
  packed.y = *reinterpret_cast<uint32_t const*>(&hi);
  *reinterpret_cast<uint2*>(out) = packed;
}

// Thread i writes output elements [4i, 4i + 4) of dK (blockIdx.y 0) or dV (1): the sum,
// head by head in order, of the group's float32 slices.
template <class Element>
__global__ void sum_kv_heads_kernel(float const* __restrict__ dk_heads, float const* __restrict__ dv_heads,
                                    Element* __restrict__ dk, Element* __restrict__ dv, int64_t vectors,
                                    int headdim, int group) {
  int64_t const i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vectors) { return; }
  float const* heads = blockIdx.y == 0 ? dk_heads : dv_heads;
  Element* out = blockIdx.y == 0 ? dk : dv;
  int64_t const element = i * 4;
  int64_t const kv_row = element / headdim;  // (batch, row, K/V head) flattened
  int const column = int(element % headdim);
  float const* first = heads + kv_row * group * headdim + column;
  float4 sum = *reinterpret_cast<float4 const*>(first);
  for (int j = 1; j < group; ++j) {
    float4 const x = *reinterpret_cast<float4 const*>(first + int64_t(j) * headdim);
    sum.x += x.x;
    sum.y += x.y;
    sum.z += x.z;
    sum.w += x.w;
  }
  store4(out + element, sum);
}

}  // namespace

void sum_kv_heads(at::Tensor const& dk_heads, at::Tensor const& dv_heads, int64_t group, at::Tensor& dk,
                  at::Tensor& dv) {
  TORCH_CHECK(dk_heads.is_contiguous() && dv_heads.is_contiguous() && dk.is_contiguous() && dv.is_contiguous() &&
                  dk.sizes() == dv.sizes() && dk_heads.numel() == dk.numel() * group && dk.size(-1) % 4 == 0,
              "flash3: sum_kv_heads got tensors of unexpected layout");
  int64_t const vectors = dk.numel() / 4;
  if (vectors == 0) { return; }
  int constexpr kThreads = 256;
  dim3 const grid(static_cast<unsigned>((vectors + kThreads - 1) / kThreads), 2);
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream().stream();
  int const headdim = static_cast<int>(dk.size(-1));
  if (dk.scalar_type() == at::kBFloat16) {
    sum_kv_heads_kernel<<<grid, kThreads, 0, stream>>>(
        dk_heads.data_ptr<float>(), dv_heads.data_ptr<float>(), reinterpret_cast<__nv_bfloat16*>(dk.data_ptr()),
        reinterpret_cast<__nv_bfloat16*>(dv.data_ptr()), vectors, headdim, static_cast<int>(group));
  } else {
    TORCH_CHECK(dk.scalar_type() == at::kHalf, "flash3: sum_kv_heads writes bf16 or fp16, got ", dk.scalar_type());
    sum_kv_heads_kernel<<<grid, kThreads, 0, stream>>>(
        dk_heads.data_ptr<float>(), dv_heads.data_ptr<float>(), reinterpret_cast<__half*>(dk.data_ptr()),
        reinterpret_cast<__half*>(dv.data_ptr()), vectors, headdim, static_cast<int>(group));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flash3::api
