// P, the softmax's probabilities as the register A operand of the forward's O += P V
// (OperandP): for 16-bit inputs S's accumulator converted in place and read through an
// A-operand view; for e4m3 inputs packed into e4m3 in the key order of V^T
// (transpose_v_fp8.h).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include <cstdint>

#include "utils.h"

namespace flash3 {

using namespace cute;

// ---------------------------------------------------------------------------------------
// P to an FP8 A operand.
//
// S accumulator of one 64 x N WGMMA, per thread, flat register index v = i0 + 2 i1 + 4 j:
// row r + 8 i1, column 8 j + 2q + i0 (CLayout_64xN). FP8 A operand (64 x 32 per k-block),
// flat index a = i + 4 h + 8 g within k-block kb: row r + 8 h, k 32 kb + 16 g + 4q + i
// (ALayout_64x32). With V^T's keys stored as above (k position 16 g + 4q + i holds key
// 16 g + [2q, 2q+1, 8+2q, 9+2q][i] of the 32-key chunk), A value a must be S value
//   16 kb + 8 g + [0, 1, 4, 5] [i]  (h = 0, row r)
//   16 kb + 8 g + [2, 3, 6, 7] [i]  (h = 1, row r + 8)
// a permutation inside the thread: no shuffles.
// ---------------------------------------------------------------------------------------

// Two floats to two e4m3 (saturating, round to nearest even): lo in the low byte.
CUTLASS_DEVICE uint32_t cvt_e4m3x2(float lo, float hi) {
  uint16_t out;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(out) : "f"(hi), "f"(lo));
  return out;
}

CUTLASS_DEVICE uint32_t pack_e4m3x4(float b0, float b1, float b2, float b3) {
  return cvt_e4m3x2(b0, b1) | (cvt_e4m3x2(b2, b3) << 16);
}

template <class TensorS, class TensorP>
CUTLASS_DEVICE void convert_p_to_operand_a(TensorS const& tSrS, TensorP& tOrP) {
  constexpr int kNumel = decltype(size(tSrS))::value;
  static_assert(kNumel == decltype(size(tOrP))::value && kNumel % 16 == 0);
  static_assert(sizeof(typename TensorP::value_type) == 1, "P must be an 8-bit operand");
  float const* s = tSrS.data();
  uint32_t* p = reinterpret_cast<uint32_t*>(raw_pointer_cast(tOrP.data()));
  CUTE_UNROLL
  for (int base = 0; base < kNumel; base += 8) {
    p[base / 4 + 0] = pack_e4m3x4(s[base + 0], s[base + 1], s[base + 4], s[base + 5]);
    p[base / 4 + 1] = pack_e4m3x4(s[base + 2], s[base + 3], s[base + 6], s[base + 7]);
  }
}

// make(tiled_mma_pv, tSrS): P's registers; as_operand_a(rP): the view the PV WGMMA takes;
// convert(tSrS, rP): P from the softmax's output.
template <class Element, class TileShapePV, bool kTransposeV>
struct OperandP {
  template <class TiledMmaPV, class TensorS>
  CUTLASS_DEVICE static auto make(TiledMmaPV const& tiled_mma_pv, TensorS const& tSrS) {
    if constexpr (kTransposeV) {
      return make_tensor<Element>(partition_shape_A(tiled_mma_pv, select<0, 2>(TileShapePV{})));
    } else {
      return make_tensor<Element>(tSrS.layout());
    }
  }
  template <class TensorP>
  CUTLASS_DEVICE static auto as_operand_a(TensorP& rP) {
    if constexpr (kTransposeV) {
      return make_tensor(rP.data(), rP.layout());
    } else {
      return make_tensor(rP.data(), accumulator_as_operand_a(rP.layout()));
    }
  }
  template <class TensorS, class TensorP>
  CUTLASS_DEVICE static void convert(TensorS const& tSrS, TensorP& rP) {
    if constexpr (kTransposeV) { convert_p_to_operand_a(tSrS, rP); } else { convert_into(tSrS, rP); }
  }
};

}  // namespace flash3
