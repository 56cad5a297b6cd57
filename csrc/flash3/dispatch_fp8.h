// The FP8 runtime -> template boundary, declared for the binding (api_fp8.cpp). Defined in
// dispatch_fp8.cu and quantize_fp8.cu.
#pragma once

#include <cuda_runtime.h>

#include <vector>

#include "dispatch.h"
#include "params_fp8.h"

namespace flash3 {

struct Fp8KernelInfo {
  int headdim;
  MaskKind mask;
};

// FP8 forward kernels this build holds (FLASH3_HDIMS / FLASH3_DTYPES narrow it).
std::vector<Fp8KernelInfo> built_kernels_fp8();

// Launches the FP8 forward kernel for (headdim, mask); false when the build holds none.
bool dispatch_fwd_fp8(int headdim, MaskKind mask, FwdFp8Params const& params, cudaStream_t stream,
                      cudaError_t* err);

// The fused quantiser; cudaErrorInvalidValue for an unsupported head dim or block size.
cudaError_t run_quantize_fp8(QuantizeParams const& params, cudaStream_t stream);

}  // namespace flash3
