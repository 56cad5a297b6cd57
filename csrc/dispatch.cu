// The only place where a runtime (dtype, head dim, causal) becomes template arguments:
// one flat table. Kernels left out of the build (FLASH3_HDIMS / FLASH3_DTYPES, turned
// into the two masks below by setup.py) have a null launcher and are reported as not
// built rather than failing to link.
#include <cutlass/numeric_types.h>

#include "flash3/dispatch.h"

#ifndef FLASH3_HDIM_MASK
#define FLASH3_HDIM_MASK 0x1f  // bit i: head dim kHeadDims[i]
#endif
#ifndef FLASH3_DTYPE_MASK
#define FLASH3_DTYPE_MASK 0x3  // bit 0: bf16, bit 1: fp16
#endif

namespace flash3 {

struct NoMask;
struct CausalMask;

// Defined in launch_fwd.h, explicitly instantiated one per file in csrc/instantiations/.
template <class Element, int kHeadDim, class Mask>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream);

namespace {

using FwdLauncher = cudaError_t (*)(FwdParams const&, cudaStream_t);

constexpr int kHeadDims[] = {64, 96, 128, 192, 256};

constexpr bool hdim_built(int headdim) {
  for (int i = 0; i < 5; ++i) {
    if (kHeadDims[i] == headdim) { return (FLASH3_HDIM_MASK >> i) & 1; }
  }
  return false;
}

template <class Element>
constexpr bool dtype_built() {
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) { return FLASH3_DTYPE_MASK & 1; }
  else { return (FLASH3_DTYPE_MASK >> 1) & 1; }
}

template <class Element, int kHeadDim, class Mask>
constexpr FwdLauncher fwd() {
  if constexpr (dtype_built<Element>() && hdim_built(kHeadDim)) {
    return &run_fwd<Element, kHeadDim, Mask>;
  } else {
    return nullptr;
  }
}

struct FwdEntry {
  DType dtype;
  int headdim;
  bool causal;
  FwdLauncher launch;
};

using bf16 = cutlass::bfloat16_t;
using fp16 = cutlass::half_t;

// clang-format off
FwdEntry const kFwdTable[] = {
  //  dtype         hdim  causal  kernel
  {DType::kBF16,    64,  false, fwd<bf16,  64, NoMask>()},
  {DType::kBF16,    64,  true,  fwd<bf16,  64, CausalMask>()},
  {DType::kBF16,    96,  false, fwd<bf16,  96, NoMask>()},
  {DType::kBF16,    96,  true,  fwd<bf16,  96, CausalMask>()},
  {DType::kBF16,   128,  false, fwd<bf16, 128, NoMask>()},
  {DType::kBF16,   128,  true,  fwd<bf16, 128, CausalMask>()},
  {DType::kBF16,   192,  false, fwd<bf16, 192, NoMask>()},
  {DType::kBF16,   192,  true,  fwd<bf16, 192, CausalMask>()},
  {DType::kBF16,   256,  false, fwd<bf16, 256, NoMask>()},
  {DType::kBF16,   256,  true,  fwd<bf16, 256, CausalMask>()},
  {DType::kFP16,    64,  false, fwd<fp16,  64, NoMask>()},
  {DType::kFP16,    64,  true,  fwd<fp16,  64, CausalMask>()},
  {DType::kFP16,    96,  false, fwd<fp16,  96, NoMask>()},
  {DType::kFP16,    96,  true,  fwd<fp16,  96, CausalMask>()},
  {DType::kFP16,   128,  false, fwd<fp16, 128, NoMask>()},
  {DType::kFP16,   128,  true,  fwd<fp16, 128, CausalMask>()},
  {DType::kFP16,   192,  false, fwd<fp16, 192, NoMask>()},
  {DType::kFP16,   192,  true,  fwd<fp16, 192, CausalMask>()},
  {DType::kFP16,   256,  false, fwd<fp16, 256, NoMask>()},
  {DType::kFP16,   256,  true,  fwd<fp16, 256, CausalMask>()},
};
// clang-format on

}  // namespace

std::vector<KernelInfo> built_kernels() {
  std::vector<KernelInfo> kernels;
  for (auto const& entry : kFwdTable) {
    if (entry.launch != nullptr) { kernels.push_back({"fwd", entry.dtype, entry.headdim, entry.causal}); }
  }
  return kernels;
}

bool dispatch_fwd(DType dtype, int headdim, bool causal, FwdParams const& params, cudaStream_t stream,
                  cudaError_t* err) {
  for (auto const& entry : kFwdTable) {
    if (entry.dtype == dtype && entry.headdim == headdim && entry.causal == causal && entry.launch != nullptr) {
      *err = entry.launch(params, stream);
      return true;
    }
  }
  return false;
}

char const* dtype_name(DType dtype) { return dtype == DType::kBF16 ? "bf16" : "fp16"; }

}  // namespace flash3
