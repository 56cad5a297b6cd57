// The torch binding: tensor checks, FwdParams filling (the parts shared with the FP8
// binding are in api_common.h), op registration with the PyTorch dispatcher, and the
// pybind11 module that carries build information.
//
// The Python layer (flash3/interface.py) validates arguments first and raises
// TypeError/ValueError with the supported values; the checks here are the last line of
// defence for direct calls of torch.ops.flash3.fwd, so that bad input is an exception,
// never a launch over invalid memory.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <cutlass/version.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "api_common.h"
#include "flash3/dispatch.h"
#include "flash3/params.h"

namespace {

flash3::DType to_dtype(at::ScalarType type) {
  TORCH_CHECK(type == at::kBFloat16 || type == at::kHalf,
              "flash3: q has dtype ", type, "; supported: torch.bfloat16, torch.float16");
  return type == at::kBFloat16 ? flash3::DType::kBF16 : flash3::DType::kFP16;
}

// The bf16/fp16 half of the checks; api_common.h holds those the FP8 binding shares.
void check_qkv(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale) {
  flash3::api::check_qkv_device(q, k, v);
  to_dtype(q.scalar_type());  // raises for an unsupported dtype
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "flash3: q, k, v must have one dtype");
  flash3::api::check_qkv_shapes(q, k, v, softmax_scale);
}

// deterministic is the backward's (see bwd); the forward is deterministic either way.
std::tuple<at::Tensor, at::Tensor> fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                       double softmax_scale, bool causal, bool /*deterministic*/) {
  check_qkv(q, k, v, softmax_scale);
  flash3::DType const dtype = to_dtype(q.scalar_type());
  int64_t const headdim = q.size(3);

  c10::cuda::CUDAGuard const device_guard(q.device());
  at::Tensor out, lse;
  if (flash3::api::alloc_fwd_outputs(q, k, q.scalar_type(), out, lse)) { return {out, lse}; }

  flash3::api::DeviceInfo const& info = flash3::api::hopper_info(q);
  at::Tensor const q_tma = flash3::api::tma_ready(q);
  at::Tensor const k_tma = flash3::api::tma_ready(k);
  at::Tensor const v_tma = flash3::api::tma_ready(v);

  flash3::FwdParams params;
  flash3::api::fill_fwd_params(params, q_tma, k_tma, v_tma, out, lse, softmax_scale, info);

  cudaError_t launch_status = cudaSuccess;
  bool const found = flash3::dispatch_fwd(dtype, static_cast<int>(headdim), causal, params,
                                          c10::cuda::getCurrentCUDAStream().stream(), &launch_status);
  TORCH_CHECK(found, "flash3: this build holds no forward kernel for dtype ", flash3::dtype_name(dtype),
              ", headdim ", headdim, ", causal ", causal, " (see flash3.build_info()['kernels'])");
  TORCH_CHECK(launch_status == cudaSuccess, "flash3: forward kernel launch failed: ",
              cudaGetErrorString(launch_status));
  return {out, lse};
}

// Gradients of out = attention(q, k, v) given dout (and optionally dlse, the gradient of
// the returned lse). deterministic: dQ's per-key-tile partial sums are added in a fixed
// order (key tiles take turns per query tile) instead of as they finish.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k,
                                                   at::Tensor const& v, at::Tensor const& out, at::Tensor const& lse,
                                                   std::optional<at::Tensor> const& dlse, double softmax_scale,
                                                   bool causal, bool deterministic) {
  check_qkv(q, k, v, softmax_scale);
  flash3::DType const dtype = to_dtype(q.scalar_type());
  int64_t const batch = q.size(0), seqlen_q = q.size(1), nheads = q.size(2), headdim = q.size(3);
  int64_t const seqlen_k = k.size(1), nheads_k = k.size(2);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), "flash3: dout and out must have the shape of q");
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "flash3: dout and out must have the dtype of q");
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device() && lse.device() == q.device(),
              "flash3: dout, out and lse must be on the device of q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == batch && lse.size(1) == nheads &&
                  lse.size(2) == seqlen_q,
              "flash3: lse must be float32 (batch, nheads, seqlen_q)");
  if (dlse.has_value()) {
    TORCH_CHECK(dlse->sizes() == lse.sizes() && dlse->scalar_type() == at::kFloat && dlse->device() == q.device(),
                "flash3: dlse must be like lse");
  }

  c10::cuda::CUDAGuard const device_guard(q.device());
  auto dq = at::empty_like(q, at::MemoryFormat::Contiguous);
  auto dk = at::empty_like(k, at::MemoryFormat::Contiguous);
  auto dv = at::empty_like(v, at::MemoryFormat::Contiguous);
  if (batch == 0 || nheads == 0 || seqlen_q == 0 || seqlen_k == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }

  flash3::api::DeviceInfo const& info = flash3::api::hopper_info(q);
  at::Tensor const q_tma = flash3::api::tma_ready(q);
  at::Tensor const k_tma = flash3::api::tma_ready(k);
  at::Tensor const v_tma = flash3::api::tma_ready(v);
  at::Tensor const do_tma = flash3::api::tma_ready(dout);
  at::Tensor const out_c = flash3::api::tma_ready(out);  // the preprocess reads it in 16-byte vectors
  at::Tensor const lse_c = lse.contiguous();
  at::Tensor dlse_c;
  if (dlse.has_value()) { dlse_c = dlse->contiguous(); }

  auto const f32 = q.options().dtype(at::kFloat);
  int64_t const seqlen_q_padded = (seqlen_q + 127) / 128 * 128;
  auto lse_log2 = at::empty({batch, nheads, seqlen_q_padded}, f32);
  auto dpsum = at::empty({batch, nheads, seqlen_q_padded}, f32);
  int64_t const block_m = flash3::bwd_block_m(static_cast<int>(headdim));
  int64_t const m_blocks = (seqlen_q + block_m - 1) / block_m;
  auto dq_accum = at::zeros({batch, nheads, m_blocks, block_m * headdim}, f32);
  at::Tensor dq_semaphore;
  if (deterministic) { dq_semaphore = at::zeros({batch, nheads, m_blocks}, q.options().dtype(at::kInt)); }
  // GQA: each query head writes its own float32 dK/dV; the heads of a group are summed
  // below (a fixed order, so deterministic too).
  bool const gqa = nheads != nheads_k;
  at::Tensor dk_heads = gqa ? at::empty({batch, seqlen_k, nheads, headdim}, f32) : dk;
  at::Tensor dv_heads = gqa ? at::empty({batch, seqlen_k, nheads, headdim}, f32) : dv;

  flash3::BwdParams params;
  flash3::api::fill_fwd_params(params, q_tma, k_tma, v_tma, out_c, lse_c, softmax_scale, info);
  using flash3::api::set_tensor;
  set_tensor(params.do_ptr, params.do_batch_stride, params.do_row_stride, params.do_head_stride, do_tma);
  set_tensor(params.dq_ptr, params.dq_batch_stride, params.dq_row_stride, params.dq_head_stride, dq);
  set_tensor(params.dk_ptr, params.dk_batch_stride, params.dk_row_stride, params.dk_head_stride, dk_heads);
  set_tensor(params.dv_ptr, params.dv_batch_stride, params.dv_row_stride, params.dv_head_stride, dv_heads);
  params.dkv_is_fp32 = gqa;
  params.dlse_ptr = dlse.has_value() ? dlse_c.data_ptr<float>() : nullptr;
  params.lse_log2_ptr = lse_log2.data_ptr<float>();
  params.dpsum_ptr = dpsum.data_ptr<float>();
  params.dq_accum_ptr = dq_accum.data_ptr<float>();
  params.dq_semaphore_ptr = deterministic ? dq_semaphore.data_ptr<int>() : nullptr;
  params.seqlen_q_padded = static_cast<int>(seqlen_q_padded);
  params.deterministic = deterministic;

  cudaError_t launch_status = cudaSuccess;
  bool const found = flash3::dispatch_bwd(dtype, static_cast<int>(headdim), causal, params,
                                          c10::cuda::getCurrentCUDAStream().stream(), &launch_status);
  TORCH_CHECK(found, "flash3: this build holds no backward kernel for dtype ", flash3::dtype_name(dtype),
              ", headdim ", headdim, ", causal ", causal, " (see flash3.build_info()['kernels'])");
  TORCH_CHECK(launch_status == cudaSuccess, "flash3: backward kernel launch failed: ",
              cudaGetErrorString(launch_status));
  if (gqa) {
    int64_t const group = nheads / nheads_k;
    dk.copy_(dk_heads.view({batch, seqlen_k, nheads_k, group, headdim}).sum(3));
    dv.copy_(dv_heads.view({batch, seqlen_k, nheads_k, group, headdim}).sum(3));
  }
  return {dq, dk, dv};
}

pybind11::dict build_info() {
  pybind11::list kernels;
  for (auto const& kernel : flash3::built_kernels()) {
    pybind11::dict entry;
    entry["kind"] = kernel.kind;
    entry["dtype"] = flash3::dtype_name(kernel.dtype);
    entry["hdim"] = kernel.headdim;
    entry["causal"] = kernel.causal;
    kernels.append(entry);
  }
  pybind11::dict info;
  info["kernels"] = kernels;
  info["cuda_version"] = CUDART_VERSION;
  info["cutlass_version"] = std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." +
                            std::to_string(CUTLASS_PATCH);
  info["arch"] = "sm_90a";
  return info;
}

}  // namespace

TORCH_LIBRARY(flash3, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, bool deterministic=False) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float softmax_scale, "
      "bool causal, bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flash3, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("bwd", &bwd);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash3 compiled kernels; the attention ops live in torch.ops.flash3";
  m.def("build_info", &build_info, "Kernels and toolchain of this build");
}
