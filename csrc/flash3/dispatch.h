// The runtime -> template boundary, declared for the binding. Defined in dispatch.cu.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "params.h"

namespace flash3 {

enum class DType { kBF16, kFP16 };

// The kernels' masks (mask.h): none, causal, or local (a window read at run time, and
// softcap and attention sinks, which only the local kernels take).
enum class MaskKind { kNone, kCausal, kLocal };

struct KernelInfo {
  char const* kind;  // "fwd" or "bwd"
  DType dtype;
  int headdim;
  int headdim_v;  // the head dim of V (and of the output)
  MaskKind mask;
};

// Kernels this build holds (FLASH3_HDIMS / FLASH3_DTYPES narrow it at build time).
std::vector<KernelInfo> built_kernels();

// Launches the forward kernel for (dtype, headdim, params.headdim_v, mask). Returns false when this build
// holds no such kernel; *err carries the launch status otherwise.
bool dispatch_fwd(DType dtype, int headdim, MaskKind mask, FwdParams const& params, cudaStream_t stream,
                  cudaError_t* err);

// The backward pass (preprocess, main kernel, postprocess) for (dtype, headdim,
// params.headdim_v, mask).
bool dispatch_bwd(DType dtype, int headdim, MaskKind mask, BwdParams const& params, cudaStream_t stream,
                  cudaError_t* err);

char const* dtype_name(DType dtype);
char const* mask_name(MaskKind mask);  // "none", "causal", "local"

}  // namespace flash3
