// The FP8 forward's flat dispatch table (see dispatch.cu). Kernels left out of the build
// (FLASH3_HDIMS, or e4m3 not in FLASH3_DTYPES) have a null launcher.
#include "flash3/dispatch_fp8.h"

#include <iterator>

#include "flash3/variant_fwd.h"

#ifndef FLASH3_HDIM_MASK
#define FLASH3_HDIM_MASK 0x3f  // bit i: head dims {64, 96, 128, 192, 256, 192v128}[i]
#endif
#ifndef FLASH3_DTYPE_MASK
#define FLASH3_DTYPE_MASK 0x7  // bit 2: e4m3
#endif

namespace flash3 {

struct NoMask;
struct CausalMask;
struct LocalMask;

// Defined in launch_fwd_fp8.h, explicitly instantiated in csrc/instantiations/fwd_e4m3_*.cu.
template <int kHeadDim, class Mask, int kBlockN, bool kPersistent, int kWarpgroups>
cudaError_t run_fwd_fp8(FwdFp8Params const& params, cudaStream_t stream);

namespace {

using FwdFp8Launcher = cudaError_t (*)(FwdFp8Params const&, cudaStream_t);

constexpr bool fp8_built(int headdim) {
  int const bit = headdim == 64 ? 0 : headdim == 96 ? 1 : headdim == 128 ? 2 : headdim == 192 ? 3 : 4;
  return ((FLASH3_DTYPE_MASK >> 2) & 1) && ((FLASH3_HDIM_MASK >> bit) & 1);
}

template <int kHeadDim, class Mask, int kBlockN = 0, bool kPersistent = false, int kWarpgroups = 0>
constexpr FwdFp8Launcher fwd_fp8() {
  if constexpr (fp8_built(kHeadDim)) {
    return &run_fwd_fp8<kHeadDim, Mask, kBlockN, kPersistent, kWarpgroups>;
  } else {
    return nullptr;
  }
}

// The kernel run: of the entries for (hdim, mask) whose bounds hold the lengths, the most
// specific (variant_fwd.h: the largest min_seqlen_k, then the smallest max_seqlen_k), as
// for the 16-bit kernels' short tiles (launch_fwd.h).
struct FwdFp8Entry {
  int headdim;
  MaskKind mask;
  FwdFp8Launcher launch;
  FwdVariantBounds bounds{};
};

// The widest window span (keys) matched as that span rather than the lengths: within
// every persistent local kernel's range.
constexpr int kLocalNarrowSpan = 4096;

constexpr MaskKind kNone = MaskKind::kNone;
constexpr MaskKind kCausal = MaskKind::kCausal;
constexpr MaskKind kLocal = MaskKind::kLocal;

// clang-format off
FwdFp8Entry const kFwdFp8Table[] = {
  // Template arguments after the mask: the key tile (0: 128 keys), persistent (default:
  // only the non-causal kernels up to hdim 128), consumer warpgroups (0: default); traits_fp8.h.
  //  hdim  mask     kernel                                 seqlen_k from   to
  {   64,  kNone,   fwd_fp8< 64, NoMask>()},
  {   64,  kCausal, fwd_fp8< 64, CausalMask>()},
  {  128,  kNone,   fwd_fp8<128, NoMask>()},
  {  128,  kCausal, fwd_fp8<128, CausalMask>()},
  // hdim 128: 192-key tiles from 2k keys, +3..+12% there; 5-11% slower at 512-1k (H200
  // A/B; V's scale in the exponent makes tiles across scale blocks exact).
  // Non-causal, the 192-key kernel below serves every length from 1152 keys.
  {  128,  kCausal, fwd_fp8<128, CausalMask, 192>(),              2048},
  {  256,  kNone,   fwd_fp8<256, NoMask>()},
  {  256,  kCausal, fwd_fp8<256, CausalMask>()},
  // Persistent causal kernels, for short sequences:
  {  128,  kCausal, fwd_fp8<128, CausalMask, 0, true>(),             0,  2047},
  // Up to 8192 keys: with the scales one per lane (traits_fp8.h kLaneScales) and the dealt
  // last rounds (scheduler_tail.h) it is +8.4% at 8192 against the general 192-key kernel
  // (softmax under the PV GEMM, lazy rescale; H200 A/B, three passes each) and level at
  // 4096, while at 16k it is 18% slower.
  {  128,  kCausal, fwd_fp8<128, CausalMask, 192, true>(),        2048,  8192},
  {  256,  kCausal, fwd_fp8<256, CausalMask, 0, true>(),             0,  4096},
  // hdim 64: two consumer warpgroups up to 1k keys, three up to 8k; at 16k one CTA per
  // tile (H200 A/B: traits_fp8.h TileConfigFp8).
  {   64,  kCausal, fwd_fp8< 64, CausalMask, 0, true, 2>(),          0,  1024},
  {   64,  kCausal, fwd_fp8< 64, CausalMask, 0, true>(),             0,  8192},
  // hdim 128 non-causal from 1152 keys, at any length: the softmax after the PV GEMM
  // (traits_fp8.h kSoftmaxUnderPv; the kernel is persistent either way). With the scales
  // one per lane (traits_fp8.h kLaneScales) it is +5.3 / +3.4 / +2.4% at 8k / 16k / 32k
  // against the general 192-key non-causal kernel (softmax under the PV GEMM; H200 A/B,
  // three passes each), which is no longer built. Against the 128-key kernel below 2k
  // keys (same A/B): -7.6 / -4.6% at 512 / 1024, +7.1 / +1.8 / -1.3 / +7.6 / +0.8% at
  // 1152 / 1280 / 1408 / 1536 / 1792 (most where 192 divides the length).
  {  128,  kNone,   fwd_fp8<128, NoMask, 192>(),                  1152},
  // hdim 256 non-causal up to 4k keys: the persistent kernel, whose next tile's Q and first
  // K/V load under the current tile (H200 A/B against one CTA per tile, bitwise-identical
  // outputs: +12.7 / +7.4 / +3.9 / +0.5% at 512 / 1k / 2k / 4k; -1.5 / -2.3% at 8k / 16k,
  // which keep the general kernel).
  {  256,  kNone,   fwd_fp8<256, NoMask, 0, true>(),                 0,  4096},
  // Windows, softcap and sinks: the causal kernels' tiles, one CTA per query tile, the
  // longest first (launch_fwd_fp8.h).
  {   64,  kLocal,  fwd_fp8< 64, LocalMask>()},
  {  128,  kLocal,  fwd_fp8<128, LocalMask>()},
  {  256,  kLocal,  fwd_fp8<256, LocalMask>()},
  // Persistent local kernels, over the persistent causal kernels' ranges; a window
  // spanning at most kLocalNarrowSpan keys is matched as its span (variant_fwd.h
  // local_variant_lengths), so narrow windows run them at any length.
  {   64,  kLocal,  fwd_fp8< 64, LocalMask, 0, true>(),             0,  8192},
  {  128,  kLocal,  fwd_fp8<128, LocalMask, 0, true>(),             0,  8192},
  {  256,  kLocal,  fwd_fp8<256, LocalMask, 0, true>(),             0,  4096},
};
// clang-format on

}  // namespace

std::vector<Fp8KernelInfo> built_kernels_fp8() {
  std::vector<Fp8KernelInfo> kernels;
  for (auto const& entry : kFwdFp8Table) {
    FwdVariantBounds const any{};
    if (entry.launch != nullptr && entry.bounds.min_seqlen_k == any.min_seqlen_k &&
        entry.bounds.max_seqlen_k == any.max_seqlen_k) {
      kernels.push_back({entry.headdim, entry.mask});
    }
  }
  return kernels;
}

bool dispatch_fwd_fp8(int headdim, MaskKind mask, FwdFp8Params const& params, cudaStream_t stream,
                      cudaError_t* err) {
  // Each side of a window is at most the longest sequence (api.cpp clamps it).
  FwdVariantLengths const lengths =
      mask == MaskKind::kLocal ? local_variant_lengths(params.seqlen_q, params.seqlen_k, params.window_left,
                                                       params.window_right, kLocalNarrowSpan)
                               : FwdVariantLengths{params.seqlen_q, params.seqlen_k};
  FwdFp8Entry const* chosen =
      pick_fwd_variant(std::begin(kFwdFp8Table), std::end(kFwdFp8Table), lengths.seqlen_q, lengths.seqlen_k,
                       [&](FwdFp8Entry const& entry) {
                         return entry.headdim == headdim && entry.mask == mask && entry.launch != nullptr;
                       });
  if (chosen == nullptr) { return false; }
  *err = chosen->launch(params, stream);
  return true;
}

}  // namespace flash3
