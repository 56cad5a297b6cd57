// The torch binding of the FP8 path, next to api.cpp's and registered into the same
// `flash3` op namespace (TORCH_LIBRARY_FRAGMENT):
//
//   flash3::fwd_fp8(q, k, v, q_scale, k_scale, v_scale, softmax_scale, causal,
//                   window_left=-1, window_right=-1, softcap=0.0, sinks=None) -> (out, lse)
//       q, k, v float8_e4m3fn (batch, seqlen, nheads[_k], headdim); scales float32
//       (batch, nheads, ceil(seqlen_q / 64)) for q and (batch, nheads_k, ceil(seqlen_k / 128))
//       for k and v, any strides (zero strides for per-head or per-tensor scales);
//       out bf16 like q, lse float32 (batch, nheads, seqlen_q). The window, softcap and
//       sinks as in flash3::fwd (api.cpp): they run the local-mask kernel.
//   flash3::quantize_fp8(x, signs, block_rows) -> (x8, scale)
//       x bf16 (batch, seqlen, nheads, headdim); signs float32 (headdim,) of +-1 or None;
//       x8 float8_e4m3fn contiguous, scale float32 (batch, nheads, ceil(seqlen / block_rows)).
//   flash3::fp8_kernels() -> (int[] hdims, str[] masks)   the FP8 forward kernels built
//       (masks: "none", "causal" or "local")
//
// flash3/fp8.py validates arguments first; these checks are the last line of defence.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "api_common.h"
#include "flash3/dispatch_fp8.h"
#include "flash3/params_fp8.h"

namespace {

flash3::BlockScales block_scales(at::Tensor const& s, char const* name, int64_t batch, int64_t heads,
                                 int64_t blocks, at::Device device) {
  TORCH_CHECK(s.scalar_type() == at::kFloat, "flash3: ", name, " must be float32, got ", s.scalar_type());
  TORCH_CHECK(s.device() == device, "flash3: ", name, " must be on the device of q");
  TORCH_CHECK(s.dim() == 3 && s.size(0) == batch && s.size(1) == heads && s.size(2) == blocks, "flash3: ", name,
              " must have shape (", batch, ", ", heads, ", ", blocks, "), got ", s.sizes());
  flash3::BlockScales out;
  out.ptr = s.data_ptr<float>();
  out.batch_stride = s.stride(0);
  out.head_stride = s.stride(1);
  out.block_stride = s.stride(2);
  out.num_blocks = static_cast<int>(blocks);
  return out;
}

// Same strides on every dim that has more than one index (a and b have the same shape).
bool same_strides(at::Tensor const& a, at::Tensor const& b) {
  for (int64_t i = 0; i < a.dim(); ++i) {
    if (a.size(i) > 1 && a.stride(i) != b.stride(i)) { return false; }
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> fwd_fp8(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                           at::Tensor const& q_scale, at::Tensor const& k_scale,
                                           at::Tensor const& v_scale, double softmax_scale, bool causal,
                                           int64_t window_left, int64_t window_right, double softcap,
                                           std::optional<at::Tensor> const& sinks) {
  flash3::api::check_qkv_device(q, k, v);
  TORCH_CHECK(q.scalar_type() == at::kFloat8_e4m3fn && k.scalar_type() == at::kFloat8_e4m3fn &&
                  v.scalar_type() == at::kFloat8_e4m3fn,
              "flash3: fwd_fp8 takes torch.float8_e4m3fn q, k, v; got ", q.scalar_type(), ", ", k.scalar_type(),
              ", ", v.scalar_type());
  flash3::api::check_qkv_shapes(q, k, v, softmax_scale);
  TORCH_CHECK(v.size(3) == q.size(3), "flash3: the FP8 forward takes v with the head dim of q and k (",
              q.size(3), "), got ", v.size(3));
  int64_t const batch = q.size(0), seqlen_q = q.size(1), nheads = q.size(2), headdim = q.size(3);
  int64_t const seqlen_k = k.size(1), nheads_k = k.size(2);
  flash3::api::Options const options{window_left, window_right, softcap, sinks};
  options.check(q, nheads);
  int64_t const q_blocks = (seqlen_q + flash3::kScaleBlockQ - 1) / flash3::kScaleBlockQ;
  int64_t const k_blocks = (seqlen_k + flash3::kScaleBlockK - 1) / flash3::kScaleBlockK;
  flash3::FwdFp8Params params;
  params.q_scale = block_scales(q_scale, "q_scale", batch, nheads, q_blocks, q.device());
  params.k_scale = block_scales(k_scale, "k_scale", batch, nheads_k, k_blocks, q.device());
  params.v_scale = block_scales(v_scale, "v_scale", batch, nheads_k, k_blocks, q.device());

  c10::cuda::CUDAGuard const device_guard(q.device());
  // The kernels index K's and V's scales with one offset (csrc/flash3/block_scales.h:
  // registers at hdim 256), so the two tensors must share their strides. Where a caller's
  // differ, both are copied contiguous (a float per head and key block, on the stream, and
  // the caching allocator keeps the copies until the kernel has read them). Strides of
  // size-1 dims are never used to address anything; V takes K's there.
  at::Tensor k_scale_same, v_scale_same;
  if (!same_strides(k_scale, v_scale)) {
    k_scale_same = k_scale.contiguous();
    v_scale_same = v_scale.contiguous();
    TORCH_CHECK(same_strides(k_scale_same, v_scale_same), "flash3: internal error: k_scale and v_scale layouts differ");
    params.k_scale = block_scales(k_scale_same, "k_scale", batch, nheads_k, k_blocks, q.device());
    params.v_scale = block_scales(v_scale_same, "v_scale", batch, nheads_k, k_blocks, q.device());
  }
  params.v_scale.batch_stride = params.k_scale.batch_stride;
  params.v_scale.head_stride = params.k_scale.head_stride;
  params.v_scale.block_stride = params.k_scale.block_stride;
  at::Tensor out, lse;
  if (flash3::api::alloc_fwd_outputs(q, v, at::kBFloat16, out, lse)) {
    // No keys: with sinks, each row's whole probability is the sink's.
    if (sinks.has_value() && seqlen_k == 0) { lse.copy_(sinks->view({1, -1, 1}).expand_as(lse)); }
    return {out, lse};
  }
  flash3::api::DeviceInfo const& info = flash3::api::hopper_info(q);
  at::Tensor const q_tma = flash3::api::tma_ready(q);
  at::Tensor const k_tma = flash3::api::tma_ready(k);
  at::Tensor const v_tma = flash3::api::tma_ready(v);

  flash3::api::fill_fwd_params(params, q_tma, k_tma, v_tma, out, lse, softmax_scale, info);
  flash3::MaskKind const mask = options.resolve(causal, seqlen_q, seqlen_k, params);

  cudaError_t status = cudaSuccess;
  bool const found = flash3::dispatch_fwd_fp8(static_cast<int>(headdim), mask, params,
                                              c10::cuda::getCurrentCUDAStream().stream(), &status);
  TORCH_CHECK(found, "flash3: this build holds no FP8 forward kernel for headdim ", headdim, ", mask ",
              flash3::mask_name(mask), " (see flash3.fp8.built_kernels())");
  TORCH_CHECK(status == cudaSuccess, "flash3: FP8 forward kernel launch failed: ", cudaGetErrorString(status));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> quantize_fp8(at::Tensor const& x, std::optional<at::Tensor> const& signs,
                                                int64_t block_rows) {
  TORCH_CHECK(x.is_cuda(), "flash3: quantize_fp8 takes a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "flash3: quantize_fp8 takes bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 4, "flash3: quantize_fp8 takes (batch, seqlen, nheads, headdim)");
  int64_t const headdim = x.size(3);
  TORCH_CHECK(headdim == 64 || headdim == 128 || headdim == 256, "flash3: quantize_fp8 headdim is ", headdim,
              "; supported: 64, 128, 256");
  TORCH_CHECK(block_rows == 64 || block_rows == 128, "flash3: quantize_fp8 block_rows is ", block_rows,
              "; supported: 64, 128");
  c10::cuda::CUDAGuard const device_guard(x.device());
  at::Tensor const in = flash3::api::tma_ready(x);  // its 16-byte loads want the same layout TMA does
  int64_t const batch = x.size(0), seqlen = x.size(1), nheads = x.size(2);
  int64_t const blocks = (seqlen + block_rows - 1) / block_rows;
  auto out = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  auto scale = at::empty({batch, nheads, blocks}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) { return {out, scale}; }
  at::Tensor signs_f;
  if (signs.has_value()) {
    TORCH_CHECK(signs->dim() == 1 && signs->size(0) == headdim, "flash3: signs must be (", headdim, ",)");
    signs_f = signs->to(x.device(), at::kFloat).contiguous();
  }
  flash3::QuantizeParams p;
  flash3::api::set_tensor(p.in_ptr, p.in_batch_stride, p.in_row_stride, p.in_head_stride, in);
  flash3::api::set_tensor(p.out_ptr, p.out_batch_stride, p.out_row_stride, p.out_head_stride, out);
  p.scale_ptr = scale.data_ptr<float>();
  p.signs_ptr = signs.has_value() ? signs_f.data_ptr<float>() : nullptr;
  p.batch = static_cast<int>(batch);
  p.seqlen = static_cast<int>(seqlen);
  p.nheads = static_cast<int>(nheads);
  p.headdim = static_cast<int>(headdim);
  p.block_rows = static_cast<int>(block_rows);
  p.num_blocks = static_cast<int>(blocks);
  cudaError_t const status = flash3::run_quantize_fp8(p, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(status == cudaSuccess, "flash3: quantize_fp8 launch failed: ", cudaGetErrorString(status));
  return {out, scale};
}

// The FP8 forward kernels this build holds, as (head dims, masks) side by side.
std::tuple<std::vector<int64_t>, std::vector<std::string>> fp8_kernels() {
  std::vector<int64_t> hdims;
  std::vector<std::string> masks;
  for (auto const& k : flash3::built_kernels_fp8()) {
    hdims.push_back(k.headdim);
    masks.emplace_back(flash3::mask_name(k.mask));
  }
  return {hdims, masks};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(flash3, m) {
  m.def(
      "fwd_fp8(Tensor q, Tensor k, Tensor v, Tensor q_scale, Tensor k_scale, Tensor v_scale, float softmax_scale, "
      "bool causal, " FLASH3_OPTIONS ") -> (Tensor out, Tensor lse)");
  m.def("quantize_fp8(Tensor x, Tensor? signs, int block_rows) -> (Tensor out, Tensor scale)");
  m.def("fp8_kernels() -> (int[] hdims, str[] masks)", &fp8_kernels);
}

TORCH_LIBRARY_IMPL(flash3, CUDA, m) {
  m.impl("fwd_fp8", &fwd_fp8);
  m.impl("quantize_fp8", &quantize_fp8);
}
