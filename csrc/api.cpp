// The torch binding: tensor checks, FwdParams filling, op registration with the PyTorch
// dispatcher, and the pybind11 module that carries build information.
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

#include <cmath>
#include <mutex>
#include <tuple>
#include <vector>

#include "flash3/dispatch.h"
#include "flash3/params.h"

namespace {

#define FLASH3_CUDA_CHECK(expr)                                                                      \
  do {                                                                                               \
    cudaError_t const status_ = (expr);                                                              \
    TORCH_CHECK(status_ == cudaSuccess, "flash3: ", #expr, " failed: ", cudaGetErrorString(status_)); \
  } while (0)

struct DeviceInfo {
  int major = 0;
  int minor = 0;
  int num_sms = 0;
};

// Device properties are queried once per device: cudaGetDeviceProperties is slow enough
// to show on short sequences.
DeviceInfo const& device_info(int device) {
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

flash3::DType to_dtype(at::ScalarType type) {
  TORCH_CHECK(type == at::kBFloat16 || type == at::kHalf,
              "flash3: q has dtype ", type, "; supported: torch.bfloat16, torch.float16");
  return type == at::kBFloat16 ? flash3::DType::kBF16 : flash3::DType::kFP16;
}

// TMA reads each tensor through a descriptor: the last dimension must be contiguous,
// the other strides multiples of 16 bytes and the base address 16-byte aligned. Any other
// layout is copied once to a contiguous tensor rather than refused.
at::Tensor tma_ready(at::Tensor const& t) {
  int64_t const align = 16 / t.element_size();
  bool ok = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int d = 0; d < 3; ++d) { ok = ok && (t.stride(d) % align == 0 || t.size(d) == 1); }
  return ok ? t : t.contiguous();
}

std::tuple<at::Tensor, at::Tensor> fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                       double softmax_scale, bool causal) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flash3: q, k, v must be CUDA tensors");
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), "flash3: q, k, v must be on one device");
  flash3::DType const dtype = to_dtype(q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "flash3: q, k, v must have one dtype");
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

  c10::cuda::CUDAGuard const device_guard(q.device());
  auto out = at::empty({batch, seqlen_q, nheads, headdim}, q.options());
  auto lse = at::empty({batch, nheads, seqlen_q}, q.options().dtype(at::kFloat));
  if (batch == 0 || nheads == 0 || seqlen_q == 0) { return {out, lse}; }
  if (seqlen_k == 0) {
    // No keys: softmax over an empty set. The output is 0 and the logsumexp -inf.
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }

  DeviceInfo const& info = device_info(q.get_device());
  TORCH_CHECK(info.major == 9 && info.minor == 0, "flash3: needs a Hopper GPU (sm_90), got sm_", info.major,
              info.minor);
  at::Tensor const q_tma = tma_ready(q);
  at::Tensor const k_tma = tma_ready(k);
  at::Tensor const v_tma = tma_ready(v);

  flash3::FwdParams params;
  params.q_ptr = q_tma.data_ptr();
  params.k_ptr = k_tma.data_ptr();
  params.v_ptr = v_tma.data_ptr();
  params.o_ptr = out.data_ptr();
  params.lse_ptr = lse.data_ptr<float>();
  params.q_batch_stride = q_tma.stride(0);
  params.q_row_stride = q_tma.stride(1);
  params.q_head_stride = q_tma.stride(2);
  params.k_batch_stride = k_tma.stride(0);
  params.k_row_stride = k_tma.stride(1);
  params.k_head_stride = k_tma.stride(2);
  params.v_batch_stride = v_tma.stride(0);
  params.v_row_stride = v_tma.stride(1);
  params.v_head_stride = v_tma.stride(2);
  params.o_batch_stride = out.stride(0);
  params.o_row_stride = out.stride(1);
  params.o_head_stride = out.stride(2);
  params.batch = static_cast<int>(batch);
  params.seqlen_q = static_cast<int>(seqlen_q);
  params.seqlen_k = static_cast<int>(seqlen_k);
  params.nheads = static_cast<int>(nheads);
  params.nheads_k = static_cast<int>(nheads_k);
  params.headdim = static_cast<int>(headdim);
  params.softmax_scale = static_cast<float>(softmax_scale);
  params.softmax_scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  params.num_sms = info.num_sms;

  cudaError_t launch_status = cudaSuccess;
  bool const found = flash3::dispatch_fwd(dtype, static_cast<int>(headdim), causal, params,
                                          c10::cuda::getCurrentCUDAStream().stream(), &launch_status);
  TORCH_CHECK(found, "flash3: this build holds no forward kernel for dtype ", flash3::dtype_name(dtype),
              ", headdim ", headdim, ", causal ", causal, " (see flash3.build_info()['kernels'])");
  TORCH_CHECK(launch_status == cudaSuccess, "flash3: forward kernel launch failed: ",
              cudaGetErrorString(launch_status));
  return {out, lse};
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
  m.def("fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(flash3, CUDA, m) { m.impl("fwd", &fwd); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash3 compiled kernels; the attention ops live in torch.ops.flash3";
  m.def("build_info", &build_info, "Kernels and toolchain of this build");
}
