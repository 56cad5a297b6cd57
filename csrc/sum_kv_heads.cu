// See sum_kv_heads.h.
#include "sum_kv_heads.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
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
// head by head in order, of the group's float32 slices. dK and dV may differ in head dim.
struct Slices {
  float const* heads;
  void* out;
  int64_t vectors;
  int headdim;
};

template <class Element>
__global__ void sum_kv_heads_kernel(Slices const dk, Slices const dv, int group) {
  Slices const& t = blockIdx.y == 0 ? dk : dv;
  int64_t const i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= t.vectors) { return; }
  int64_t const element = i * 4;
  int64_t const kv_row = element / t.headdim;  // (batch, row, K/V head) flattened
  int const column = int(element % t.headdim);
  float const* first = t.heads + kv_row * group * t.headdim + column;
  float4 sum = *reinterpret_cast<float4 const*>(first);
  for (int j = 1; j < group; ++j) {
    float4 const x = *reinterpret_cast<float4 const*>(first + int64_t(j) * t.headdim);
    sum.x += x.x;
    sum.y += x.y;
    sum.z += x.z;
    sum.w += x.w;
  }
  store4(static_cast<Element*>(t.out) + element, sum);
}

}  // namespace

void sum_kv_heads(at::Tensor const& dk_heads, at::Tensor const& dv_heads, int64_t group, at::Tensor& dk,
                  at::Tensor& dv) {
  TORCH_CHECK(dk_heads.is_contiguous() && dv_heads.is_contiguous() && dk.is_contiguous() && dv.is_contiguous() &&
                  dk_heads.numel() == dk.numel() * group && dv_heads.numel() == dv.numel() * group &&
                  dk.size(-1) % 4 == 0 && dv.size(-1) % 4 == 0 && dk.scalar_type() == dv.scalar_type(),
              "flash3: sum_kv_heads got tensors of unexpected layout");
  Slices const k{dk_heads.data_ptr<float>(), dk.data_ptr(), dk.numel() / 4, static_cast<int>(dk.size(-1))};
  Slices const v{dv_heads.data_ptr<float>(), dv.data_ptr(), dv.numel() / 4, static_cast<int>(dv.size(-1))};
  int64_t const vectors = std::max(k.vectors, v.vectors);
  if (vectors == 0) { return; }
  int constexpr kThreads = 256;
  dim3 const grid(static_cast<unsigned>((vectors + kThreads - 1) / kThreads), 2);
  cudaStream_t const stream = c10::cuda::getCurrentCUDAStream().stream();
  if (dk.scalar_type() == at::kBFloat16) {
    sum_kv_heads_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(k, v, static_cast<int>(group));
  } else {
    TORCH_CHECK(dk.scalar_type() == at::kHalf, "flash3: sum_kv_heads writes bf16 or fp16, got ", dk.scalar_type());
    sum_kv_heads_kernel<__half><<<grid, kThreads, 0, stream>>>(k, v, static_cast<int>(group));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace flash3::api
