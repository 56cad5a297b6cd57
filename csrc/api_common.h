// What the two torch bindings (api.cpp for bf16/fp16, api_fp8.cpp for e4m3) check and
// fill alike: the q, k, v tensor checks, the Hopper device check and the FwdParams sizes,
// strides and scales. The dtype checks differ per binding and stay there.
//
// Functions are inline in a named namespace, so both translation units share one device
// property cache.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "flash3/params.h"

#define FLASH3_CUDA_CHECK(expr)                                                                      \
  do {                                                                                               \
    cudaError_t const status_ = (expr);                                                              \
    TORCH_CHECK(status_ == cudaSuccess, "flash3: ", #expr, " failed: ", cudaGetErrorString(status_)); \
  } while (0)

namespace flash3::api {

struct DeviceInfo {
  int major = 0;
  int minor = 0;
  int num_sms = 0;
};

// Device properties are queried once per device: cudaGetDeviceProperties is slow enough
// to show on short sequences.
inline DeviceInfo const& device_info(int device) {
  static std::mutex mutex;
  static std::vector<DeviceInfo> cache;
  static std::vector<bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<int>(cache.size())) {
    cache.resize(device + 1);
    known.resize(device + 1, false);
  }
  if (!known[device]) {
    DeviceInfo info;
    FLASH3_CUDA_CHECK(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device));
    FLASH3_CUDA_CHECK(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, device));
    FLASH3_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device));
    cache[device] = info;
    known[device] = true;
  }
  return cache[device];
}

// The kernels are built for sm_90a only.
inline DeviceInfo const& hopper_info(at::Tensor const& q) {
  DeviceInfo const& info = device_info(q.get_device());
  TORCH_CHECK(info.major == 9 && info.minor == 0, "flash3: needs a Hopper GPU (sm_90), got sm_", info.major,
              info.minor);
  return info;
}

// The checks of q, k, v come in two halves so that each binding's dtype check stands
// between them, where it always stood: the order decides which error a call with several
// faults raises.

// q, k, v are CUDA tensors on one device.
inline void check_qkv_device(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flash3: q, k, v must be CUDA tensors");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), "flash3: q, k, v must be on one device");
}

// q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_k, headdim) with
// nheads a multiple of nheads_k; a positive finite softmax_scale; seqlens that fit an int.
inline void check_qkv_shapes(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "flash3: q, k, v must be 4-D (batch, seqlen, nheads, headdim)");
  int64_t const batch = q.size(0), seqlen_q = q.size(1), nheads = q.size(2), headdim = q.size(3);
  int64_t const seqlen_k = k.size(1), nheads_k = k.size(2);
  TORCH_CHECK(k.sizes() == v.sizes(), "flash3: k and v must have the same shape");
  TORCH_CHECK(k.size(0) == batch && k.size(3) == headdim, "flash3: k must be (batch, seqlen_k, nheads_k, ",
              headdim, ") with batch ", batch);
  TORCH_CHECK(nheads_k > 0 && nheads % nheads_k == 0, "flash3: nheads (", nheads,
              ") must be a multiple of nheads_k (", nheads_k, ")");
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, "flash3: softmax_scale must be positive and finite");
  TORCH_CHECK(seqlen_q < (int64_t(1) << 31) && seqlen_k < (int64_t(1) << 31), "flash3: seqlen must be < 2^31");
}

// The q, k, v pointers and every size, stride and scale of FwdParams, from the
// (TMA-readable) q, k, v and the output; the o and lse pointers are the caller's.
inline void fill_fwd_params(FwdParams& params, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                            at::Tensor const& out, double softmax_scale, int num_sms) {
  params.q_ptr = q.data_ptr();
  params.k_ptr = k.data_ptr();
  params.v_ptr = v.data_ptr();
  params.q_batch_stride = q.stride(0);
  params.q_row_stride = q.stride(1);
  params.q_head_stride = q.stride(2);
  params.k_batch_stride = k.stride(0);
  params.k_row_stride = k.stride(1);
  params.k_head_stride = k.stride(2);
  params.v_batch_stride = v.stride(0);
  params.v_row_stride = v.stride(1);
  params.v_head_stride = v.stride(2);
  params.o_batch_stride = out.stride(0);
  params.o_row_stride = out.stride(1);
  params.o_head_stride = out.stride(2);
  params.batch = static_cast<int>(q.size(0));
  params.seqlen_q = static_cast<int>(q.size(1));
  params.seqlen_k = static_cast<int>(k.size(1));
  params.nheads = static_cast<int>(q.size(2));
  params.nheads_k = static_cast<int>(k.size(2));
  params.headdim = static_cast<int>(q.size(3));
  params.softmax_scale = static_cast<float>(softmax_scale);
  params.softmax_scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  params.num_sms = num_sms;
}

}  // namespace flash3::api
