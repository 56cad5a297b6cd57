// The FP8 forward's flat dispatch table (see dispatch.cu). Kernels left out of the build
// (FLASH3_HDIMS, or e4m3 not in FLASH3_DTYPES) have a null launcher.
#include "flash3/dispatch_fp8.h"

#include <cstdlib>

#ifndef FLASH3_HDIM_MASK
#define FLASH3_HDIM_MASK 0x1f  // bit i: head dim {64, 96, 128, 192, 256}[i]
#endif
#ifndef FLASH3_DTYPE_MASK
#define FLASH3_DTYPE_MASK 0x7  // bit 2: e4m3
#endif

namespace flash3 {

struct NoMask;
struct CausalMask;

// Defined in launch_fwd_fp8.h, explicitly instantiated in csrc/instantiations/fwd_e4m3_*.cu.
template <int kHeadDim, class Mask, int kBlockN>
cudaError_t run_fwd_fp8(FwdFp8Params const& params, cudaStream_t stream);

namespace {

using FwdFp8Launcher = cudaError_t (*)(FwdFp8Params const&, cudaStream_t);

constexpr bool fp8_built(int headdim) {
  int const bit = headdim == 64 ? 0 : headdim == 96 ? 1 : headdim == 128 ? 2 : headdim == 192 ? 3 : 4;
  return ((FLASH3_DTYPE_MASK >> 2) & 1) && ((FLASH3_HDIM_MASK >> bit) & 1);
}

template <int kHeadDim, class Mask, int kBlockN = 0>
constexpr FwdFp8Launcher fwd_fp8() {
  if constexpr (fp8_built(kHeadDim)) {
    return &run_fwd_fp8<kHeadDim, Mask, kBlockN>;
  } else {
    return nullptr;
  }
}

struct FwdFp8Entry {
  int headdim;
  bool causal;
  FwdFp8Launcher launch;
  int block_n = 0;  // 0: the default tile; else an alternative, chosen by FLASH3_FP8_BLOCK_N
};

// clang-format off
FwdFp8Entry const kFwdFp8Table[] = {
  //  hdim  causal  kernel
  {   64,  false, fwd_fp8< 64, NoMask>()},
  {   64,  true,  fwd_fp8< 64, CausalMask>()},
  {  128,  false, fwd_fp8<128, NoMask>()},
  {  128,  true,  fwd_fp8<128, CausalMask>()},
  {  256,  false, fwd_fp8<256, NoMask>()},
  {  256,  true,  fwd_fp8<256, CausalMask>()},
  // Alternatives for A/B runs go here, e.g. {256, false, fwd_fp8<256, NoMask, 128>(), 128}
  // with FLASH3_FP8_BLOCK_N=128 (and the instantiation from generate.py's FP8_ALT_BLOCK_N).
};
// clang-format on

}  // namespace

std::vector<Fp8KernelInfo> built_kernels_fp8() {
  std::vector<Fp8KernelInfo> kernels;
  for (auto const& entry : kFwdFp8Table) {
    if (entry.launch != nullptr && entry.block_n == 0) { kernels.push_back({entry.headdim, entry.causal}); }
  }
  return kernels;
}

// FLASH3_FP8_BLOCK_N (read once): run the alternative key tile where one is built.
static int alternative_block_n() {
  static int const value = [] {
    char const* env = std::getenv("FLASH3_FP8_BLOCK_N");
    return env != nullptr ? std::atoi(env) : 0;
  }();
  return value;
}

bool dispatch_fwd_fp8(int headdim, bool causal, FwdFp8Params const& params, cudaStream_t stream, cudaError_t* err) {
  int const alt = alternative_block_n();
  for (int pass = 0; pass < 2; ++pass) {
    int const block_n = pass == 0 ? alt : 0;
    for (auto const& entry : kFwdFp8Table) {
      if (entry.headdim == headdim && entry.causal == causal && entry.launch != nullptr && entry.block_n == block_n) {
        *err = entry.launch(params, stream);
        return true;
      }
    }
  }
  return false;
}

}  // namespace flash3
