// What the two torch bindings (api.cpp for bf16/fp16, api_fp8.cpp for e4m3) check and
// fill alike: the q, k, v tensor checks, the Hopper device check, the forward's outputs
// for empty problems, the FwdParams fields and the local mask's options (window, softcap,
// sinks). The dtype checks differ per binding and stay there.
//
// Functions are inline in a named namespace, so both translation units share one device
// property cache.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <vector>

#include "flash3/dispatch.h"
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
// TMA reads each tensor through a descriptor: the last dimension must be contiguous,
// the other strides multiples of 16 bytes and the base address 16-byte aligned. Any other
// layout is copied once to a contiguous tensor rather than refused.
inline at::Tensor tma_ready(at::Tensor const& t) {
  int64_t const align = 16 / t.element_size();
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  // A broadcast dimension (stride 0, e.g. the gradient of a sum) is not TMA-readable.
  for (int d = 0; d < t.dim() - 1; ++d) {
    ok = ok && ((t.stride(d) > 0 && t.stride(d) % align == 0) || t.size(d) == 1);
  }
  return ok ? t : t.contiguous();
}

inline void check_qkv_device(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flash3: q, k, v must be CUDA tensors");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), "flash3: q, k, v must be on one device");
}

// q (batch, seqlen_q, nheads, headdim), k (batch, seqlen_k, nheads_k, headdim) and v
// (batch, seqlen_k, nheads_k, headdim_v) with nheads a multiple of nheads_k; a positive
// finite softmax_scale; seqlens that fit an int. Which head dim pairs have kernels is the
// dispatch's business (the FP8 binding asks for equal ones).
inline void check_qkv_shapes(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "flash3: q, k, v must be 4-D (batch, seqlen, nheads, headdim)");
  int64_t const batch = q.size(0), seqlen_q = q.size(1), nheads = q.size(2), headdim = q.size(3);
  int64_t const seqlen_k = k.size(1), nheads_k = k.size(2);
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2),
              "flash3: k and v must have the same batch, seqlen_k and nheads_k");
  TORCH_CHECK(k.size(0) == batch && k.size(3) == headdim, "flash3: k must be (batch, seqlen_k, nheads_k, ",
              headdim, ") with batch ", batch);
  TORCH_CHECK(nheads_k > 0 && nheads % nheads_k == 0, "flash3: nheads (", nheads,
              ") must be a multiple of nheads_k (", nheads_k, ")");
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, "flash3: softmax_scale must be positive and finite");
  TORCH_CHECK(seqlen_q < (int64_t(1) << 31) && seqlen_k < (int64_t(1) << 31), "flash3: seqlen must be < 2^31");
}

// The forward's out (batch, seqlen_q, nheads, headdim_v) in out_dtype and lse (batch,
// nheads, seqlen_q) float32, allocated on q's device (the caller holds its device guard).
// Returns true when no kernel is needed and they already hold the answer: with no query
// rows there is nothing to write; with no keys the softmax is over an empty set, so the
// output is 0 and the logsumexp -inf.
inline bool alloc_fwd_outputs(at::Tensor const& q, at::Tensor const& v, at::ScalarType out_dtype, at::Tensor& out,
                              at::Tensor& lse) {
  int64_t const batch = q.size(0), seqlen_q = q.size(1), nheads = q.size(2), headdim_v = v.size(3);
  out = at::empty({batch, seqlen_q, nheads, headdim_v}, q.options().dtype(out_dtype));
  lse = at::empty({batch, nheads, seqlen_q}, q.options().dtype(at::kFloat));
  if (batch == 0 || nheads == 0 || seqlen_q == 0) { return true; }
  if (v.size(1) == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return true;
  }
  return false;
}

// A (batch, seqlen, heads, headdim) tensor as the kernels' params hold it: the data
// pointer and the batch, row and head strides in elements (the last dimension is
// contiguous).
template <class Ptr>
void set_tensor(Ptr& ptr, int64_t& batch_stride, int64_t& row_stride, int64_t& head_stride, at::Tensor const& t) {
  ptr = t.data_ptr();
  batch_stride = t.stride(0);
  row_stride = t.stride(1);
  head_stride = t.stride(2);
}

// Every field of FwdParams, from the (TMA-readable) q, k, v, the output and its
// logsumexp (float32, contiguous).
inline void fill_fwd_params(FwdParams& params, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                            at::Tensor const& out, at::Tensor const& lse, double softmax_scale,
                            DeviceInfo const& device) {
  set_tensor(params.q_ptr, params.q_batch_stride, params.q_row_stride, params.q_head_stride, q);
  set_tensor(params.k_ptr, params.k_batch_stride, params.k_row_stride, params.k_head_stride, k);
  set_tensor(params.v_ptr, params.v_batch_stride, params.v_row_stride, params.v_head_stride, v);
  set_tensor(params.o_ptr, params.o_batch_stride, params.o_row_stride, params.o_head_stride, out);
  params.lse_ptr = lse.data_ptr<float>();
  params.batch = static_cast<int>(q.size(0));
  params.seqlen_q = static_cast<int>(q.size(1));
  params.seqlen_k = static_cast<int>(k.size(1));
  params.nheads = static_cast<int>(q.size(2));
  params.nheads_k = static_cast<int>(k.size(2));
  params.headdim = static_cast<int>(q.size(3));
  params.headdim_v = static_cast<int>(v.size(3));
  params.softmax_scale = static_cast<float>(softmax_scale);
  params.softmax_scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  params.num_sms = device.num_sms;
}

// The options every attention op's schema ends with (Options below): the window, softcap
// and sinks.
#define FLASH3_OPTIONS "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? sinks=None"

// The options of the local-mask kernels as the ops take them: FlashAttention-3's window
// (-1: unbounded), softcap (0: off) and attention sinks (float32 (nheads), or none).
struct Options {
  int64_t window_left = -1;
  int64_t window_right = -1;
  double softcap = 0.0;
  std::optional<at::Tensor> sinks;

  void check(at::Tensor const& q, int64_t nheads) const {
    TORCH_CHECK(window_left >= -1, "flash3: window_left is ", window_left, "; supported: -1 (unbounded) or >= 0");
    TORCH_CHECK(window_right >= -1, "flash3: window_right is ", window_right, "; supported: -1 (unbounded) or >= 0");
    TORCH_CHECK(std::isfinite(softcap) && softcap >= 0, "flash3: softcap is ", softcap,
                "; supported: 0 (off) or a positive finite value");
    if (sinks.has_value()) {
      TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == nheads &&
                      sinks->is_contiguous() && sinks->device() == q.device(),
                  "flash3: sinks must be a contiguous float32 tensor of nheads (", nheads,
                  ") elements on the device of q, got ", sinks->scalar_type(), " ", sinks->sizes());
    }
  }

  // FlashAttention-3's rules (hopper/flash_api.cpp): a left window reaching back past the
  // longest key sequence, or a right one past the longest query sequence, is none; causal
  // is the window (-1, 0). Anything else with a window, a softcap or sinks runs the local
  // kernel, whose window sides are then clamped to those lengths (the same mask).
  flash3::MaskKind resolve(bool causal, int64_t max_seqlen_q, int64_t max_seqlen_k, FwdParams& params) const {
    int64_t left = window_left >= max_seqlen_k - 1 ? -1 : window_left;
    int64_t right = window_right >= max_seqlen_q - 1 ? -1 : window_right;
    if (causal) { right = 0; }
    bool const is_causal = left < 0 && right == 0;
    bool const is_local = (left >= 0 || right >= 0) && !is_causal;
    if (!is_local && softcap == 0.0 && !sinks.has_value()) {
      return is_causal ? flash3::MaskKind::kCausal : flash3::MaskKind::kNone;
    }
    params.window_left = static_cast<int>(left < 0 ? max_seqlen_k : std::min(left, max_seqlen_k));
    params.window_right = static_cast<int>(right < 0 ? max_seqlen_q : std::min(right, max_seqlen_q));
    params.softcap = static_cast<float>(softcap);
    params.sinks_ptr = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
    return flash3::MaskKind::kLocal;
  }
};

}  // namespace flash3::api
