// Small CuTe helpers shared by the mainloops: views of WGMMA accumulators, register
// conversion, the WGMMA issue sequence, quad reductions.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_conversion.h>

namespace flash3 {

using namespace cute;

// A WGMMA accumulator fragment is laid out ((2, 2, N/8), MMA_M, MMA_N): within one
// 64 x N atom a thread holds 2 adjacent columns, in 2 rows 8 apart, repeated every 8
// columns. Regroup it as (rows, cols) = ((2, MMA_M), (2, N/8, MMA_N)) so the softmax
// can loop over rows.
template <class Layout>
CUTLASS_HOST_DEVICE constexpr auto accumulator_rowcol(Layout const& acc) {
  static_assert(decltype(rank<0>(acc))::value == 3, "expects a WGMMA accumulator layout");
  auto l = get<0>(acc);
  return make_layout(make_layout(get<1>(l), get<1>(acc)),
                     make_layout(get<0>(l), get<2>(l), get<2>(acc)));
}

// For 16-bit operands the register A fragment of a 64 x N x 16 WGMMA holds, per thread,
// exactly the values the accumulator of the previous GEMM holds for two adjacent
// 8-column groups. So P can feed the next WGMMA without any data movement:
// ((2, 2, N/8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N/16, MMA_N)).
template <class Layout>
CUTLASS_HOST_DEVICE constexpr auto accumulator_as_operand_a(Layout const& acc) {
  auto l = get<0>(acc);
  auto v = logical_divide(get<2>(l), _2{});  // (2, N/16)
  return make_layout(make_layout(get<0>(l), get<1>(l), get<0>(v)),
                     get<1>(acc),
                     make_layout(get<1>(v), get<2>(acc)));
}

// Converts a register tensor element-wise into another of the same size
// (float -> bf16/fp16), through cutlass::Array so that the compiler emits the packed
// two-element conversions.
template <class TensorSrc, class TensorDst>
CUTLASS_DEVICE void convert_into(TensorSrc const& src, TensorDst& dst) {
  using From = typename TensorSrc::value_type;
  using To = typename TensorDst::value_type;
  constexpr int kNumel = decltype(size(src))::value;
  static_assert(kNumel == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<To, From, kNumel> convert;
  *reinterpret_cast<cutlass::Array<To, kNumel>*>(dst.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, kNumel> const*>(src.data()));
}

// ptxas places a WGMMA wait (wgmma.wait_group, WARPGROUP.DEPBAR in SASS) as early as its
// basic block allows, ahead of independent math that the source puts before it. In the
// forward mainloops the wait for O += P V lands ahead of the whole softmax of the next S,
// so the softmax does not run under the PV GEMM (the intra-warpgroup overlap) unless it
// is asked to (kSoftmaxUnderPv). Work meant to run while a WGMMA is in flight goes through
// run_in_own_block: a loop that runs once, from a start (opaque_zero: 0 at run time) that
// neither compiler knows, so the work keeps a basic block of its own ahead of the wait.
// scripts/check_sass.py counts the exponentials between the two waits (EX2|GEMM).
template <class F>
CUTLASS_DEVICE void run_in_own_block(uint32_t opaque_zero, F&& f) {
  CUTLASS_PRAGMA_NO_UNROLL
  for (uint32_t once = opaque_zero; once < 1u; ++once) { f(); }
}

// 0 for a non-negative x (a sequence length), through an asm: the compiler may have derived
// x > 0 from loop bounds (it did so in a backward kernel, where this was tried) and would
// then fold the loop of run_in_own_block away.
CUTLASS_DEVICE uint32_t opaque_zero(int nonneg) {
  uint32_t zero;
  asm("shr.u32 %0, %1, 31;" : "=r"(zero) : "r"(nonneg));
  return zero;
}

// Issues one warpgroup GEMM: tCrC (+)= tCrA * tCrB, K-blocked. With zero_init the first
// K block overwrites the accumulator (scale-out 0), so S needs no clear.
template <bool kZeroInit, class TiledMma, class TensorA, class TensorB, class TensorC>
CUTLASS_DEVICE void warpgroup_gemm(TiledMma& tiled_mma, TensorA const& tCrA, TensorB const& tCrB, TensorC& tCrC) {
  // A from shared memory comes as a tensor of WGMMA descriptors; from registers, as values.
  constexpr bool kAIsRegisters = !std::is_same_v<typename TensorA::engine_type::iterator, GMMA::DescriptorIterator>;
  if constexpr (kAIsRegisters) { warpgroup_fence_operand(const_cast<TensorA&>(tCrA)); }
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (kZeroInit) { tiled_mma.accumulate_ = GMMA::ScaleOut::Zero; }
  CUTE_UNROLL
  for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
    cute::gemm(tiled_mma, tCrA(_, _, k_block), tCrB(_, _, k_block), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tCrC);
  if constexpr (kAIsRegisters) { warpgroup_fence_operand(const_cast<TensorA&>(tCrA)); }
}

// The four threads of a quad (lanes 4r .. 4r+3) hold the columns of the same rows.
template <class Op>
CUTLASS_DEVICE float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  return x;
}

struct MaxOp {
  CUTLASS_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  CUTLASS_DEVICE float operator()(float a, float b) const { return a + b; }
};

}  // namespace flash3
