// The only place where a runtime (dtype, head dim, mask) becomes template arguments:
// one flat table per pass. Kernels left out of the build (FLASH3_HDIMS / FLASH3_DTYPES /
// FLASH3_KINDS, turned into the masks below by setup.py) have a null launcher and are
// reported as not built rather than failing to link.
#include <cutlass/numeric_types.h>

#include "flash3/dispatch.h"

#ifndef FLASH3_HDIM_MASK
#define FLASH3_HDIM_MASK 0x3f  // bit i: head dims kHeadDims[i]
#endif
#ifndef FLASH3_DTYPE_MASK
#define FLASH3_DTYPE_MASK 0x3  // bit 0: bf16, bit 1: fp16
#endif
#ifndef FLASH3_KIND_MASK
#define FLASH3_KIND_MASK 0x3  // bit 0: forward, bit 1: backward
#endif

namespace flash3 {

struct NoMask;
struct CausalMask;
struct LocalMask;

// Defined in launch_fwd.h / launch_bwd.h, explicitly instantiated one per file in
// csrc/instantiations/.
template <class Element, int kHeadDim, class Mask, int kHeadDimV>
cudaError_t run_fwd(FwdParams const& params, cudaStream_t stream);
template <class Element, int kHeadDim, class Mask, int kHeadDimV>
cudaError_t run_bwd(BwdParams const& params, cudaStream_t stream);

namespace {

// (head dim of Q and K, head dim of V), in setup.py's order (ALL_HDIMS).
struct HeadDims {
  int qk, v;
};
constexpr HeadDims kHeadDims[] = {{64, 64}, {96, 96}, {128, 128}, {192, 192}, {256, 256}, {192, 128}};

constexpr bool hdim_built(int headdim, int headdim_v) {
  for (int i = 0; i < int(sizeof(kHeadDims) / sizeof(kHeadDims[0])); ++i) {
    if (kHeadDims[i].qk == headdim && kHeadDims[i].v == headdim_v) { return (FLASH3_HDIM_MASK >> i) & 1; }
  }
  return false;
}

template <class Element>
constexpr bool dtype_built() {
  if constexpr (std::is_same_v<Element, cutlass::bfloat16_t>) { return FLASH3_DTYPE_MASK & 1; }
  else { return (FLASH3_DTYPE_MASK >> 1) & 1; }
}

template <class Params>
using Launcher = cudaError_t (*)(Params const&, cudaStream_t);

template <class Params>
struct Entry {
  DType dtype;
  int headdim;
  int headdim_v;
  MaskKind mask;
  Launcher<Params> launch;
};

template <class Element, int kHeadDim, int kHeadDimV, class Mask>
constexpr Launcher<FwdParams> fwd() {
  if constexpr ((FLASH3_KIND_MASK & 1) && dtype_built<Element>() && hdim_built(kHeadDim, kHeadDimV)) {
    return &run_fwd<Element, kHeadDim, Mask, kHeadDimV>;
  } else {
    return nullptr;
  }
}

template <class Element, int kHeadDim, int kHeadDimV, class Mask>
constexpr Launcher<BwdParams> bwd() {
  if constexpr ((FLASH3_KIND_MASK & 2) && dtype_built<Element>() && hdim_built(kHeadDim, kHeadDimV)) {
    return &run_bwd<Element, kHeadDim, Mask, kHeadDimV>;
  } else {
    return nullptr;
  }
}

using bf16 = cutlass::bfloat16_t;
using fp16 = cutlass::half_t;

// Every (dtype, head dims, mask) of one pass, in one list.
template <class Params, template <class, int, int, class> class Make>
struct Table {
  static constexpr Entry<Params> kEntries[36] = {
    // clang-format off
    //  dtype    hdim hdim_v  mask              kernel
    {DType::kBF16,   64,  64, MaskKind::kNone,   Make<bf16,  64,  64, NoMask>::value},
    {DType::kBF16,   64,  64, MaskKind::kCausal, Make<bf16,  64,  64, CausalMask>::value},
    {DType::kBF16,   64,  64, MaskKind::kLocal,  Make<bf16,  64,  64, LocalMask>::value},
    {DType::kBF16,   96,  96, MaskKind::kNone,   Make<bf16,  96,  96, NoMask>::value},
    {DType::kBF16,   96,  96, MaskKind::kCausal, Make<bf16,  96,  96, CausalMask>::value},
    {DType::kBF16,   96,  96, MaskKind::kLocal,  Make<bf16,  96,  96, LocalMask>::value},
    {DType::kBF16,  128, 128, MaskKind::kNone,   Make<bf16, 128, 128, NoMask>::value},
    {DType::kBF16,  128, 128, MaskKind::kCausal, Make<bf16, 128, 128, CausalMask>::value},
    {DType::kBF16,  128, 128, MaskKind::kLocal,  Make<bf16, 128, 128, LocalMask>::value},
    {DType::kBF16,  192, 192, MaskKind::kNone,   Make<bf16, 192, 192, NoMask>::value},
    {DType::kBF16,  192, 192, MaskKind::kCausal, Make<bf16, 192, 192, CausalMask>::value},
    {DType::kBF16,  192, 192, MaskKind::kLocal,  Make<bf16, 192, 192, LocalMask>::value},
    {DType::kBF16,  256, 256, MaskKind::kNone,   Make<bf16, 256, 256, NoMask>::value},
    {DType::kBF16,  256, 256, MaskKind::kCausal, Make<bf16, 256, 256, CausalMask>::value},
    {DType::kBF16,  256, 256, MaskKind::kLocal,  Make<bf16, 256, 256, LocalMask>::value},
    {DType::kBF16,  192, 128, MaskKind::kNone,   Make<bf16, 192, 128, NoMask>::value},
    {DType::kBF16,  192, 128, MaskKind::kCausal, Make<bf16, 192, 128, CausalMask>::value},
    {DType::kBF16,  192, 128, MaskKind::kLocal,  Make<bf16, 192, 128, LocalMask>::value},
    {DType::kFP16,   64,  64, MaskKind::kNone,   Make<fp16,  64,  64, NoMask>::value},
    {DType::kFP16,   64,  64, MaskKind::kCausal, Make<fp16,  64,  64, CausalMask>::value},
    {DType::kFP16,   64,  64, MaskKind::kLocal,  Make<fp16,  64,  64, LocalMask>::value},
    {DType::kFP16,   96,  96, MaskKind::kNone,   Make<fp16,  96,  96, NoMask>::value},
    {DType::kFP16,   96,  96, MaskKind::kCausal, Make<fp16,  96,  96, CausalMask>::value},
    {DType::kFP16,   96,  96, MaskKind::kLocal,  Make<fp16,  96,  96, LocalMask>::value},
    {DType::kFP16,  128, 128, MaskKind::kNone,   Make<fp16, 128, 128, NoMask>::value},
    {DType::kFP16,  128, 128, MaskKind::kCausal, Make<fp16, 128, 128, CausalMask>::value},
    {DType::kFP16,  128, 128, MaskKind::kLocal,  Make<fp16, 128, 128, LocalMask>::value},
    {DType::kFP16,  192, 192, MaskKind::kNone,   Make<fp16, 192, 192, NoMask>::value},
    {DType::kFP16,  192, 192, MaskKind::kCausal, Make<fp16, 192, 192, CausalMask>::value},
    {DType::kFP16,  192, 192, MaskKind::kLocal,  Make<fp16, 192, 192, LocalMask>::value},
    {DType::kFP16,  256, 256, MaskKind::kNone,   Make<fp16, 256, 256, NoMask>::value},
    {DType::kFP16,  256, 256, MaskKind::kCausal, Make<fp16, 256, 256, CausalMask>::value},
    {DType::kFP16,  256, 256, MaskKind::kLocal,  Make<fp16, 256, 256, LocalMask>::value},
    {DType::kFP16,  192, 128, MaskKind::kNone,   Make<fp16, 192, 128, NoMask>::value},
    {DType::kFP16,  192, 128, MaskKind::kCausal, Make<fp16, 192, 128, CausalMask>::value},
    {DType::kFP16,  192, 128, MaskKind::kLocal,  Make<fp16, 192, 128, LocalMask>::value},
    // clang-format on
  };
};

template <class Element, int kHeadDim, int kHeadDimV, class Mask>
struct MakeFwd {
  static constexpr Launcher<FwdParams> value = fwd<Element, kHeadDim, kHeadDimV, Mask>();
};
template <class Element, int kHeadDim, int kHeadDimV, class Mask>
struct MakeBwd {
  static constexpr Launcher<BwdParams> value = bwd<Element, kHeadDim, kHeadDimV, Mask>();
};

using FwdTable = Table<FwdParams, MakeFwd>;
using BwdTable = Table<BwdParams, MakeBwd>;

template <class Params, size_t N>
bool dispatch(Entry<Params> const (&table)[N], DType dtype, int headdim, MaskKind mask, Params const& params,
              cudaStream_t stream, cudaError_t* err) {
  for (auto const& entry : table) {
    if (entry.dtype == dtype && entry.headdim == headdim && entry.headdim_v == params.headdim_v &&
        entry.mask == mask && entry.launch != nullptr) {
      *err = entry.launch(params, stream);
      return true;
    }
  }
  return false;
}

}  // namespace

std::vector<KernelInfo> built_kernels() {
  std::vector<KernelInfo> kernels;
  for (auto const& entry : FwdTable::kEntries) {
    if (entry.launch != nullptr) { kernels.push_back({"fwd", entry.dtype, entry.headdim, entry.headdim_v, entry.mask}); }
  }
  for (auto const& entry : BwdTable::kEntries) {
    if (entry.launch != nullptr) { kernels.push_back({"bwd", entry.dtype, entry.headdim, entry.headdim_v, entry.mask}); }
  }
  return kernels;
}

bool dispatch_fwd(DType dtype, int headdim, MaskKind mask, FwdParams const& params, cudaStream_t stream,
                  cudaError_t* err) {
  return dispatch(FwdTable::kEntries, dtype, headdim, mask, params, stream, err);
}

bool dispatch_bwd(DType dtype, int headdim, MaskKind mask, BwdParams const& params, cudaStream_t stream,
                  cudaError_t* err) {
  return dispatch(BwdTable::kEntries, dtype, headdim, mask, params, stream, err);
}

char const* dtype_name(DType dtype) { return dtype == DType::kBF16 ? "bf16" : "fp16"; }

char const* mask_name(MaskKind mask) {
  return mask == MaskKind::kNone ? "none" : mask == MaskKind::kCausal ? "causal" : "local";
}

}  // namespace flash3
