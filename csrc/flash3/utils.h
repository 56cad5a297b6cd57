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
//
// How much of the softmax of key tile j + 1 a warpgroup computes while its own
// O += P(j) V(j) is in flight (the traits' kSoftmaxUnderPv; mainloop_fwd.h): none, the
// row max and half the rows' exponentials, or all of it.
enum class SoftmaxUnderPv { kNone, kHalf, kWhole };

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

// threadIdx.x through a volatile asm, which the compiler cannot merge with an earlier read.
CUTLASS_DEVICE uint32_t reread_thread_idx_x() {
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
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

// One 64-row slice of a warpgroup GEMM: the M atom kSlice of this thread's share (mode 1
// of A and C), so that the slices of one accumulator can be issued, waited for and used
// one at a time.
template <bool kZeroInit, int kSlice, class TiledMma, class TensorA, class TensorB, class TensorC>
CUTLASS_DEVICE void warpgroup_gemm_slice(TiledMma& tiled_mma, TensorA const& tCrA, TensorB const& tCrB,
                                         TensorC& tCrC) {
  constexpr int kSlices = decltype(size<1>(tCrC))::value;
  static_assert(kSlice < kSlices && decltype(size<1>(tCrA))::value == kSlices);
  auto tCrA_slice = logical_divide(tCrA, Shape<Underscore, Int<kSlices>>{})(_, make_coord(Int<kSlice>{}, _), _);
  auto tCrC_slice = logical_divide(tCrC, Shape<Underscore, Int<kSlices>>{})(_, make_coord(Int<kSlice>{}, _), _);
  warpgroup_gemm<kZeroInit>(tiled_mma, tCrA_slice, tCrB, tCrC_slice);
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

// The row max on the scores' bits (kIntRowMax in traits.h / traits_fp8.h). Read as signed
// integers, the bit patterns of non-negative floats are in float order, and every
// negative float (-0 and -inf too) is a negative integer. So the integer max of a set of
// floats is bitwise their float max when one of them is >= +0, and negative otherwise
// (the callers then take the float max). Hopper's 3-input integer max (VIMNMX3,
// __vimax3_s32) takes one instruction per two scores where FMNMX takes one per score.
// The scores' bits are read through volatile asm: a plain bit cast of a WGMMA accumulator
// is hoisted by the compiler to right after the WGMMA is issued, ahead of its wait, and
// ptxas then serialises every WGMMA (C7514) to make the read safe.
CUTLASS_DEVICE int float_bits(float a) {
  int m;
  asm volatile("mov.b32 %0, %1;" : "=r"(m) : "f"(a));
  return m;
}
CUTLASS_DEVICE int float_bits_max3(float a, float b, float c) {
  int m;
  asm volatile(
      "{\n.reg .s32 a, b, c;\nmov.b32 a, %1;\nmov.b32 b, %2;\nmov.b32 c, %3;\nmax.s32 a, a, b;\nmax.s32 %0, a, c;\n}"
      : "=r"(m) : "f"(a), "f"(b), "f"(c));
  return m;
}

// The max of kCount integers as a 3-ary tree (depth log3).
template <int kCount, class Values>
CUTLASS_DEVICE int int_max_tree(Values const& v) {
  if constexpr (kCount == 1) {
    return v[0];
  } else if constexpr (kCount == 2) {
    return max(v[0], v[1]);
  } else {
    constexpr int kNext = (kCount + 2) / 3;
    int next[kNext];
    CUTE_UNROLL
    for (int i = 0; i < kNext; ++i) {
      if (3 * i + 2 < kCount) {
        next[i] = __vimax3_s32(v[3 * i], v[3 * i + 1], v[3 * i + 2]);
      } else if (3 * i + 1 < kCount) {
        next[i] = max(v[3 * i], v[3 * i + 1]);
      } else {
        next[i] = v[3 * i];
      }
    }
    return int_max_tree<kNext>(next);
  }
}

// The integer max of the bits of row mi's columns [begin, begin + kCount) of a (rows,
// cols) float tensor: level one of the tree reads the floats (through the asm above).
template <int kCount, class TensorRowCol>
CUTLASS_DEVICE int row_max_bits(TensorRowCol const& t, int mi, int begin) {
  constexpr int kFirst = (kCount + 2) / 3;
  int first[kFirst];
  CUTE_UNROLL
  for (int i = 0; i < kFirst; ++i) {
    int const c = begin + 3 * i;
    if (3 * i + 2 < kCount) {
      first[i] = float_bits_max3(t(mi, c), t(mi, c + 1), t(mi, c + 2));
    } else if (3 * i + 1 < kCount) {
      first[i] = max(float_bits(t(mi, c)), float_bits(t(mi, c + 1)));
    } else {
      first[i] = float_bits(t(mi, c));
    }
  }
  return int_max_tree<kFirst>(first);
}

// The float max of row mi's columns [begin, begin + kCount), as a pairwise tree (depth
// log2, where a running fmaxf is a dependent chain as long as the row).
template <int kCount, class TensorRowCol>
CUTLASS_DEVICE float row_max_float(TensorRowCol const& t, int mi, int begin) {
  if constexpr (kCount == 1) {
    return t(mi, begin);
  } else {
    constexpr int kHalf = kCount / 2;
    return fmaxf(row_max_float<kHalf>(t, mi, begin), row_max_float<kCount - kHalf>(t, mi, begin + kHalf));
  }
}

// Softcap's tanh (MUFU.TANH, as FlashAttention-3's): the scores become tanh(s * prescale)
// in place; the softmax then scales them by softcap (params.h logit_scale).
CUTLASS_DEVICE float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
template <class TensorS>
CUTLASS_DEVICE void apply_tanh(TensorS& tSrS, float prescale) {
  CUTE_UNROLL
  for (int i = 0; i < size(tSrS); ++i) { tSrS(i) = tanh_approx(tSrS(i) * prescale); }
}

}  // namespace flash3
