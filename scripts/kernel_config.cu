// Prints the resolved compile-time configuration of every kernel flash3 builds: one line
// per kernel with the constexprs of its traits (traits.h, traits_fp8.h, traits_bwd.h)
// and kernel (kernel_fwd.h, kernel_bwd.h). Host code only: it launches
// nothing and needs no GPU. docs/kernels.md is this output as tables; to check it:
//   CUTLASS=$(python -c 'import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))')/source/include
//   nvcc -gencode arch=compute_90a,code=sm_90a -std=c++17 --expt-relaxed-constexpr \
//       -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -I csrc -I $CUTLASS scripts/kernel_config.cu -o /tmp/kernel_config
//   /tmp/kernel_config
// (a few minutes on two cores). The list of kernels below follows csrc/instantiations/
// (generate.py) and csrc/dispatch_fp8.cu; the dispatch ranges are in launch_fwd.h
// (kShortSeqMaxSeqlen) and dispatch_fp8.cu.
#include <cstdio>
#include "flash3/mask.h"
#include "flash3/kernel_fwd.h"
#include "flash3/traits.h"
#include "flash3/traits_fp8.h"
#include "flash3/kernel_bwd.h"

using namespace flash3;

template <class E, int D, class M, bool S, int DV = D>
void fwd(char const* name) {
  using T = KernelTraits<E, D, M::kIsCausal, S, DV>;
  using K = FlashFwdKernel<T, M>;
  std::printf("fwd %s hdim=%d hdim_v=%d causal=%d short=%d maxlen=%d WG=%d M=%d N=%d stages=%d persistent=%d pingpong=%d "
              "tmastoreO=%d OinKV=%d smemOsep=%d qstages=%d releaseQ=%d softmaxUnderPv=%d lazy=%d introwmax=%d "
              "tail=%d regs=%d/%d smem=%d threads=%d\n",
              name, D, DV, int(M::kIsCausal), int(S), S ? kShortSeqMaxSeqlen<D, M::kIsCausal> : -1,
              T::kConsumerWarpgroups, T::kBlockM, T::kBlockN, T::kStages, int(T::kPersistent), int(T::kPingpong),
              int(T::kTmaStoreO), int(T::kOInKVStages), int(T::kSmemOSeparate), T::kQStages,
              int(T::kReleaseQAfterEpilogue), int(T::kSoftmaxUnderPv), int(T::kLazyRescale), int(T::kIntRowMax),
              int(K::kTailBalanced), int(K::Registers::kProducer), int(K::Registers::kConsumer),
              int(K::kSharedStorageSize), int(K::kThreads));
}

template <int D, class M, int N, bool P, int W>
void fp8() {
  using T = KernelTraitsFp8<D, kVariableKeys<M>, N, P, W>;
  using K = FlashFwdKernel<T, M>;
  std::printf("fp8 hdim=%d causal=%d local=%d n=%d persistent_override=%d w=%d WG=%d M=%d N=%d stages=%d persistent=%d pingpong=%d "
              "split=%d softmaxUnderPv=%d lazy=%d lanescales=%d introwmax=%d pingpongtid=%d onescale=%d "
              "regs=%d/%d tmastoreO=%d OinKV=%d smemOsep=%d tail=%d smem=%d threads=%d\n",
              D, int(M::kIsCausal), int(M::kIsLocal), N, int(P), W, T::kConsumerWarpgroups, T::kBlockM, T::kBlockN, T::kStages,
              int(T::kPersistent), int(T::kPingpong), int(T::kSplitChains), int(T::kSoftmaxUnderPv),
              int(T::kLazyRescale), int(T::kLaneScales), int(T::kIntRowMax), int(T::kPingpongIdsFromThreadIdx),
              int(T::kOneScaleOffset), int(K::Registers::kProducer), int(K::Registers::kConsumer), int(T::kTmaStoreO),
              int(T::kOInKVStages), int(T::kSmemOSeparate), int(K::kTailBalanced), int(K::kSharedStorageSize),
              int(K::kThreads));
}

template <class E, int D, class M, int DV = D, bool kTransposed = false>
void bwd(char const* name) {
  using T = BwdKernelTraits<E, D, M::kIsCausal, DV, kTransposed>;
  using K = FlashBwdKernel<T, M>;
  std::printf("bwd %s hdim=%d hdim_v=%d causal=%d transposed=%d M=%d N=%d stages=%d stages_do=%d blockm_fn=%d "
              "smem=%d threads=%d\n", name, D, DV, int(M::kIsCausal), int(kTransposed), T::kBlockM, T::kBlockN,
              T::kStages, T::kStagesdO, bwd_block_m(D), int(K::kSharedStorageSize), int(K::kThreads));
}

template <class E>
void all16(char const* n) {
  fwd<E, 64, NoMask, false>(n); fwd<E, 64, CausalMask, false>(n);
  fwd<E, 64, NoMask, true>(n); fwd<E, 64, CausalMask, true>(n);
  fwd<E, 96, NoMask, false>(n); fwd<E, 96, CausalMask, false>(n);
  fwd<E, 128, NoMask, false>(n); fwd<E, 128, CausalMask, false>(n);
  fwd<E, 128, NoMask, true>(n); fwd<E, 128, CausalMask, true>(n);
  fwd<E, 192, NoMask, false>(n); fwd<E, 192, CausalMask, false>(n);
  fwd<E, 192, NoMask, false, 128>(n); fwd<E, 192, CausalMask, false, 128>(n);
  fwd<E, 256, NoMask, false>(n); fwd<E, 256, CausalMask, false>(n);
  fwd<E, 256, NoMask, true>(n); fwd<E, 256, CausalMask, true>(n);
  bwd<E, 64, NoMask>(n); bwd<E, 64, CausalMask>(n);
  bwd<E, 96, NoMask>(n); bwd<E, 96, CausalMask>(n);
  bwd<E, 128, NoMask>(n); bwd<E, 128, CausalMask>(n);
  bwd<E, 192, NoMask>(n); bwd<E, 192, CausalMask>(n);
  bwd<E, 192, NoMask, 128>(n); bwd<E, 192, CausalMask, 128>(n);
  bwd<E, 256, NoMask>(n); bwd<E, 256, CausalMask>(n);
  bwd<E, 256, NoMask, 256, true>(n); bwd<E, 256, CausalMask, 256, true>(n);
}

int main() {
  all16<cutlass::bfloat16_t>("bf16");
  all16<cutlass::half_t>("fp16");
  fp8<64, NoMask, 0, false, 0>(); fp8<64, CausalMask, 0, false, 0>();
  fp8<64, CausalMask, 0, true, 0>(); fp8<64, CausalMask, 0, true, 2>();
  fp8<128, NoMask, 0, false, 0>(); fp8<128, CausalMask, 0, false, 0>(); fp8<128, CausalMask, 192, false, 0>();
  fp8<128, CausalMask, 0, true, 0>(); fp8<128, CausalMask, 192, true, 0>(); fp8<128, NoMask, 192, false, 0>();
  fp8<256, NoMask, 0, false, 0>(); fp8<256, CausalMask, 0, false, 0>();
  fp8<256, CausalMask, 0, true, 0>(); fp8<256, NoMask, 0, true, 0>();
  fp8<64, LocalMask, 0, false, 0>(); fp8<128, LocalMask, 0, false, 0>(); fp8<256, LocalMask, 0, false, 0>();
  fp8<64, LocalMask, 0, true, 0>(); fp8<128, LocalMask, 0, true, 0>(); fp8<256, LocalMask, 0, true, 0>();
  std::printf("shortmax hdim=64 noncausal=%d causal=%d\n", kShortSeqMaxSeqlen<64, false>, kShortSeqMaxSeqlen<64, true>);
  std::printf("shortmax hdim=96 noncausal=%d causal=%d\n", kShortSeqMaxSeqlen<96, false>, kShortSeqMaxSeqlen<96, true>);
  std::printf("shortmax hdim=128 noncausal=%d causal=%d\n", kShortSeqMaxSeqlen<128, false>,
              kShortSeqMaxSeqlen<128, true>);
  std::printf("shortmax hdim=192 noncausal=%d causal=%d\n", kShortSeqMaxSeqlen<192, false>,
              kShortSeqMaxSeqlen<192, true>);
  std::printf("shortmax hdim=256 noncausal=%d causal=%d\n", kShortSeqMaxSeqlen<256, false>,
              kShortSeqMaxSeqlen<256, true>);
  std::printf("shortmax dense causal hdim=64 %d hdim=128 %d hdim=256 %d\n", kDenseCausalShortMaxSeqlen<64>,
              kDenseCausalShortMaxSeqlen<128>, kDenseCausalShortMaxSeqlen<256>);
  return 0;
}
