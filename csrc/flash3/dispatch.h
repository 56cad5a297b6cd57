// The runtime -> template boundary, declared for the binding. Defined in dispatch.cu.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "params.h"

namespace flash3 {

enum class DType { kBF16, kFP16 };

struct KernelInfo {
  char const* kind;  // "fwd" or "bwd"
  DType dtype;
  int headdim;
  bool causal;
};

// Kernels this build holds (FLASH3_HDIMS / FLASH3_DTYPES narrow it at build time).
std::vector<KernelInfo> built_kernels();

// Launches the forward kernel for (dtype, headdim, causal). Returns false when this build
// holds no such kernel; *err carries the launch status otherwise.
bool dispatch_fwd(DType dtype, int headdim, bool causal, FwdParams const& params, cudaStream_t stream,
                  cudaError_t* err);

// The backward pass (preprocess, main kernel, postprocess) for (dtype, headdim, causal).
bool dispatch_bwd(DType dtype, int headdim, bool causal, BwdParams const& params, cudaStream_t stream,
                  cudaError_t* err);

char const* dtype_name(DType dtype);

}  // namespace flash3
