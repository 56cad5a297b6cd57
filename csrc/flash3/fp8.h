// The pieces the FP8 (e4m3) forward adds to the 16-bit one: its params, the in-smem V
// transpose, P converted to an FP8 WGMMA A operand, the online softmax with per-tile
// (block-quantised) scales, and the consumers' pingpong turn-taking.
//
// Block quantisation: one float scale per 64 query rows (kScaleBlockQ) and per 128 keys
// (kScaleBlockK), per head; x = x8 * scale. The scales enter the kernel as strided
// (batch, head, block) tensors, so a per-(batch, head) or per-tensor scale is the same
// tensor with a zero block (and head) stride.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

#include <cstdint>
#include <utility>

#include "barriers.h"
#include "params_fp8.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

// ---------------------------------------------------------------------------------------
// V transpose in shared memory.
//
// FP8 WGMMA reads its B operand only K-major; for O += P V the K dimension is the keys,
// so V (keys x head dim, head dim contiguous, as TMA brings it) must become V^T (head dim
// x keys, keys contiguous). The producer warpgroup does this per tile, a 16-key x 32-column
// block per warp and step: LDSM.T (ldmatrix .trans on 16-bit pairs) loads four 8x8 u16
// matrices, two byte permutes per pair of registers regroup the bytes by column, STSM
// stores four 8x8 u16 matrices of V^T.
//
// After ldmatrix.trans, thread t = 4c + q of a warp holds, for the matrix of keys
// key0 .. key0+7 and columns d0 .. d0+15: bytes (V[2q][2c], V[2q][2c+1], V[2q+1][2c],
// V[2q+1][2c+1]) (rows relative to key0, columns to d0). With r0 from keys 0..7 and r1
// from keys 8..15 of the same columns,
//   byte_perm(r0, r1, 0x6420) = (V[2q][2c], V[2q+1][2c], V[8+2q][2c], V[9+2q][2c])
// is row 2c of V^T at keys (2q, 2q+1, 8+2q, 9+2q), and 0x7531 gives row 2c+1. stmatrix
// puts thread t's word at row c, bytes 4q .. 4q+3 of its matrix; so byte 4q + i of each
// 16-key group of a V^T row holds key [2q, 2q+1, 8+2q, 9+2q][i] of the group. That key
// order within 16 keys is exactly the order in which a thread's S accumulator holds its
// columns, which is what makes P's conversion to an A operand permutation-free across
// threads (see convert_p_to_operand_a).
// ---------------------------------------------------------------------------------------

CUTLASS_DEVICE void ldsm_x4_trans(uint32_t smem_addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(smem_addr));
}

CUTLASS_DEVICE void stsm_x4(uint32_t smem_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n"
               :
               : "r"(smem_addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// SmemLayoutV: (keys, head dim, stage), head dim contiguous; SmemLayoutVt: (head dim,
// keys, stage), keys contiguous. Both byte-addressed (8-bit elements), swizzled in 16-byte
// units, so every 16 bytes a lane addresses are contiguous.
//
// Work split: a block is 16 keys x 32 head-dim columns. Warp w owns the column groups
// w, w + kWarps, ... (or, when there are fewer column groups than warps, one column group
// and a contiguous share of the key groups) and walks its key groups. That keeps the
// address arithmetic out of the loop: along the keys the source offset only grows by
// whole swizzle atoms (an immediate), and the destination's 16-key chunk index is the
// lane's base chunk XOR the step (the step's bits are disjoint from the warp's base
// chunk), so a step costs one LOP3. verify_lane() checks both formulas against the
// layouts at compile time, for every lane, warp and step and for the first two stages
// (a stage adds a multiple of 128 bytes, asserted below).
// kInFlight: 16 x 32 blocks loaded before the first is stored (2 needs 40 registers per
// producer thread, 1 fits in 24).
template <class SmemLayoutV, class SmemLayoutVt, int kBlockN, int kHeadDim, int kThreads, int kInFlight = 2>
struct TransposeV {
  static_assert(kInFlight == 1 || kInFlight == 2);
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kKeyGroups = kBlockN / 16;
  static constexpr int kColGroups = kHeadDim / 32;
  static_assert(kBlockN % 16 == 0 && kHeadDim % 32 == 0, "V tile must split into 16 x 32 blocks");
  static constexpr int kColGroupsPerWarp = kColGroups >= kWarps ? kColGroups / kWarps : 1;
  static constexpr int kWarpsPerColGroup = kColGroups >= kWarps ? 1 : kWarps / kColGroups;
  static constexpr int kKeyGroupsPerWarp = kKeyGroups / kWarpsPerColGroup;
  static_assert(kColGroupsPerWarp * kWarps == kColGroups || kWarpsPerColGroup * kColGroups == kWarps,
                "column groups must split evenly over the warps");
  static_assert(kKeyGroupsPerWarp * kWarpsPerColGroup == kKeyGroups, "key groups must split evenly");
  // A V^T swizzle atom's row (128 or 64 bytes) holds kChunksPerRow chunks of 16 keys; a
  // warp's key steps XOR into its base chunk within a row, and steps past the row move to
  // the next swizzle atom along the keys, a whole-atom (immediate) offset.
  static constexpr int chunks_per_row() {
    int chunks = 1;
    while (16 * chunks < kBlockN && SmemLayoutVt{}(0, 16 * chunks, 0) - SmemLayoutVt{}(0, 0, 0) == 16 * chunks) {
      ++chunks;
    }
    return chunks;
  }
  static constexpr int kChunksPerRow = chunks_per_row();
  static_assert((kChunksPerRow & (kChunksPerRow - 1)) == 0, "a swizzle atom's row holds a power of two of chunks");
  static_assert(kKeyGroupsPerWarp % kChunksPerRow == 0 ||
                    (kKeyGroupsPerWarp < kChunksPerRow && (kKeyGroupsPerWarp & (kKeyGroupsPerWarp - 1)) == 0),
                "a warp's key steps XOR into its base chunk");

  // Which (key, column) a lane addresses for ldmatrix / stmatrix at step (s, j): matrices
  // 0 = keys 0..7 x cols 0..15, 1 = keys 8..15 x cols 0..15, 2 and 3 the same at cols
  // 16..31; stmatrix's matrix m holds V^T rows d0 + 16 (m / 2) + 2 r + m % 2, r = 0..7.
  static constexpr int key_group(int warp, int s) { return (warp / (kWarps / kWarpsPerColGroup)) * kKeyGroupsPerWarp + s; }
  static constexpr int col_group(int warp, int j) { return warp % (kWarps / kWarpsPerColGroup) + j * kWarps; }
  static constexpr int src_offset(int lane, int warp, int s, int j, int stage) {
    return SmemLayoutV{}(16 * key_group(warp, s) + 8 * ((lane / 8) % 2) + lane % 8,
                         32 * col_group(warp, j) + 16 * (lane / 16), stage);
  }
  static constexpr int dst_offset(int lane, int warp, int s, int j, int stage) {
    return SmemLayoutVt{}(32 * col_group(warp, j) + 16 * (lane / 16) + 2 * (lane % 8) + (lane / 8) % 2,
                          16 * key_group(warp, s), stage);
  }
  // The loop's offsets, relative to the lane's (s, j, stage) = (0, 0, 0) offsets.
  static constexpr int src_add(int s, int j) { return src_offset(0, 0, s, j, 0) - src_offset(0, 0, 0, 0, 0); }
  static constexpr int dst_add(int s, int j) {
    return dst_offset(0, 0, s - s % kChunksPerRow, j, 0) - dst_offset(0, 0, 0, 0, 0);
  }
  static constexpr uint32_t dst_xor(int s) { return uint32_t(16 * (s % kChunksPerRow)); }
  static constexpr int kStageBytesV = cute::cosize_v<SmemLayoutV> / size<2>(SmemLayoutV{});
  static constexpr int kStageBytesVt = cute::cosize_v<SmemLayoutVt> / size<2>(SmemLayoutVt{});

  // One lane, every warp, step and the first two stages (the compiler bounds the work of
  // one constant expression, so the check runs per lane).
  static constexpr bool verify_lane(int lane) {
    for (int warp = 0; warp < kWarps; ++warp) {
      int const src0 = src_offset(lane, warp, 0, 0, 0);
      int const dst0 = dst_offset(lane, warp, 0, 0, 0);
      for (int stage = 0; stage < 2; ++stage) {
        for (int j = 0; j < kColGroupsPerWarp; ++j) {
          for (int s = 0; s < kKeyGroupsPerWarp; ++s) {
            if (src_offset(lane, warp, s, j, stage) != src0 + src_add(s, j) + stage * kStageBytesV) { return false; }
            if (dst_offset(lane, warp, s, j, stage) != int((dst0 ^ dst_xor(s)) + dst_add(s, j) + stage * kStageBytesVt)) {
              return false;
            }
          }
        }
      }
    }
    return true;
  }
  template <int kLane>
  struct LaneCheck {
    static_assert(verify_lane(kLane), "the transposer's address formulas do not match the shared-memory layouts");
    static constexpr bool value = true;
  };
  template <int... kLanes>
  static constexpr bool verify(std::integer_sequence<int, kLanes...>) {
    return (LaneCheck<kLanes>::value && ...);
  }
  static_assert(verify(std::make_integer_sequence<int, 32>{}));

  struct Addresses {
    uint32_t src;  // the lane's (0, 0, stage 0) ldmatrix address
    uint32_t dst;  // the lane's (0, 0, stage 0) stmatrix offset within V^T; run() adds the base
  };
  CUTLASS_DEVICE static Addresses addresses(uint8_t const* smem_v, int thread_idx) {
    int const warp = thread_idx / 32;
    int const lane = thread_idx % 32;
    return {cast_smem_ptr_to_uint(smem_v) + uint32_t(src_offset(lane, warp, 0, 0, 0)),
            uint32_t(dst_offset(lane, warp, 0, 0, 0))};
  }

  // smem_vt is 1024-byte aligned and a stage is a multiple of 128 bytes, so the stage's
  // base never touches the chunk bits (4..6) that the key step XORs: adding it before
  // the XOR is exact, and nothing loop-invariant is left for the compiler to hoist into
  // registers across tiles (the producer runs on 40).
  static_assert(kStageBytesVt % 128 == 0 && kStageBytesV % 128 == 0);
  CUTLASS_DEVICE static void run(Addresses const& addr, uint8_t* smem_vt, int stage_v, int stage_vt) {
    uint32_t const src = addr.src + uint32_t(stage_v * kStageBytesV);
    uint32_t const dst = cast_smem_ptr_to_uint(smem_vt) + uint32_t(stage_vt * kStageBytesVt) + addr.dst;
    if constexpr (kInFlight == 1) {
      // Key steps outer, column groups inner: one XORed address is live at a time (the
      // other order kept all eight, 7 of the producer's 24 registers at hdim 256, which
      // pushed its loop state into local memory).
      CUTE_UNROLL
      for (int s = 0; s < kKeyGroupsPerWarp; ++s) {
        uint32_t const step_dst = dst ^ dst_xor(s);
        CUTE_UNROLL
        for (int j = 0; j < kColGroupsPerWarp; ++j) {
          uint32_t a0, a1, a2, a3;
          ldsm_x4_trans(src + src_add(s, j), a0, a1, a2, a3);
          stsm_x4(step_dst + dst_add(s, j), __byte_perm(a0, a1, 0x6420), __byte_perm(a0, a1, 0x7531),
                  __byte_perm(a2, a3, 0x6420), __byte_perm(a2, a3, 0x7531));
        }
      }
      return;
    }
    CUTE_UNROLL
    for (int j = 0; j < kColGroupsPerWarp; ++j) {
      // Both loads before both stores (the asm statements are volatile, so they keep this
      // order), with 8 data registers.
      CUTE_UNROLL
      for (int s = 0; s < kKeyGroupsPerWarp; s += 2) {
        uint32_t a0, a1, a2, a3, b0, b1, b2, b3;
        ldsm_x4_trans(src + src_add(s, j), a0, a1, a2, a3);
        if (s + 1 < kKeyGroupsPerWarp) { ldsm_x4_trans(src + src_add(s + 1, j), b0, b1, b2, b3); }
        stsm_x4((dst ^ dst_xor(s)) + dst_add(s, j), __byte_perm(a0, a1, 0x6420), __byte_perm(a0, a1, 0x7531),
                __byte_perm(a2, a3, 0x6420), __byte_perm(a2, a3, 0x7531));
        if (s + 1 < kKeyGroupsPerWarp) {
          stsm_x4((dst ^ dst_xor(s + 1)) + dst_add(s + 1, j), __byte_perm(b0, b1, 0x6420),
                  __byte_perm(b0, b1, 0x7531), __byte_perm(b2, b3, 0x6420), __byte_perm(b2, b3, 0x7531));
        }
      }
    }
  }
};

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

// ---------------------------------------------------------------------------------------
// Online softmax with K and V scales per key block, V's folded into the exponent.
//
// S as computed is Q8 K8^T. A key tile splits into kGroups column groups, each within one
// K/V scale block (one group when the tile lies in one block). In group g the factor
// c_g = softmax_scale * log2(e) * q_scale * k_scale(g) turns raw scores into true scores
// in the log2 domain, t = S * c_g. The running max is kept over the *V-weighted* scores
// w = t + log2 v_scale(g), and
//   P = 2^(w - max_w + kMaxOffset) = 2^(t - max_w + kMaxOffset) * v_scale(g)   (<= 256)
// goes to the PV GEMM with the raw V8, so O = sum P V8 carries V's scale already, and
// the row sum adds P / v_scale(g) (the true exponentials, same factor). out = O / sum:
// V's scale never touches O, and a tile may span V scale blocks at no cost in accuracy:
// the largest P V products of a row get e4m3's full range. (Scaling P of a group by
// v_scale(g) / v_ref instead pushes small products into e4m3's subnormals: on the Table 3
// inputs that costs 5% RMSE with 192-key tiles over 128-key scale blocks, emulated and
// measured.) 2^kMaxOffset keeps small probabilities within e4m3's normal range; it
// cancels in O / sum. Each exponent is one FFMA, exp2(S * c_g - (shift - log2 v_scale(g))).
// ---------------------------------------------------------------------------------------
// kSplitChains: the row max and the row sum each run as four independent chains instead
// of one chain of kBlockN / 4 dependent FMNMX / FADD per row (traits_fp8.h says where;
// with kIntRowMax the max is a tree instead).
// kLazyRescale: as in softmax.h, with kRescaleThreshold below. kIntRowMax: as in softmax.h.
template <int kRows, bool kSplitChains, bool kLazyRescale = false, bool kIntRowMax = false>
struct OnlineSoftmaxFp8 {
  static constexpr float kMaxOffset = 8.f;
  // kLazyRescale: how far (log2) a tile may raise a row's max before O and the sum are
  // rescaled. P is then at most 2^(kMaxOffset + 0.75) = 431, within e4m3's 448, and O's
  // rescale is skipped in the tiles that raise no max by more (any_rescale).
  static constexpr float kRescaleThreshold = 0.75f;
  Tensor<ArrayEngine<float, kRows>, Layout<Int<kRows>>> row_max;  // V-weighted, log2 domain; -inf: no key yet
  Tensor<ArrayEngine<float, kRows>, Layout<Int<kRows>>> row_sum;  // this thread's partial sums

  CUTLASS_DEVICE OnlineSoftmaxFp8() {
    fill(row_max, -INFINITY);
    fill(row_sum, 0.f);
  }

  // The subtrahend of the exponent: max - offset, with -inf (nothing visible) mapped to 0
  // so that exp2(-inf - 0) = 0 rather than NaN.
  CUTLASS_DEVICE float shift(int mi) const { return row_max(mi) == -INFINITY ? 0.f : row_max(mi) - kMaxOffset; }

  // Column ni of the row-col view is key 8 (ni / 2) + 2 q + ni % 2 of the tile, so group g
  // holds the columns [g, g + 1) * kCols / kGroups.
  static constexpr int kChains = kSplitChains ? 4 : 1;

  // This thread's part of row mi's tile max (V-weighted, log2 domain), by FMNMX: in
  // kChains dependent chains (the kernels without kIntRowMax), or as a pairwise tree (the
  // fallback of update_row_maxes).
  template <bool kTree, int kGroups, class TensorS>
  CUTLASS_DEVICE static float thread_tile_max(TensorS const& tSrS_rowcol, int mi, float const (&scale_log2)[kGroups],
                                              float const (&log2_v)[kGroups]) {
    constexpr int kGroupCols = decltype(size<1>(tSrS_rowcol))::value / kGroups;
    static_assert(kGroupCols * kGroups == decltype(size<1>(tSrS_rowcol))::value && kGroupCols % kChains == 0);
    float tile_max = -INFINITY;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      float group_max;
      if constexpr (kTree) {
        group_max = row_max_float<kGroupCols>(tSrS_rowcol, mi, g * kGroupCols);
      } else {
        float part[kChains];
        CUTE_UNROLL
        for (int c = 0; c < kChains; ++c) { part[c] = -INFINITY; }
        CUTE_UNROLL
        for (int ni = 0; ni < kGroupCols; ++ni) {
          part[ni % kChains] = fmaxf(part[ni % kChains], tSrS_rowcol(mi, g * kGroupCols + ni));
        }
        group_max = part[0];
        CUTE_UNROLL
        for (int c = 1; c < kChains; ++c) { group_max = fmaxf(group_max, part[c]); }
      }
      tile_max = fmaxf(tile_max, fmaf(group_max, scale_log2[g], log2_v[g]));
    }
    return tile_max;
  }

  // The same from the integer max of the scores' bits (utils.h row_max_bits); exact is
  // cleared where a group's part holds no score >= +0 (its result is then not its max).
  template <int kGroups, class TensorS>
  CUTLASS_DEVICE static float thread_tile_max_int(TensorS const& tSrS_rowcol, int mi,
                                                  float const (&scale_log2)[kGroups],
                                                  float const (&log2_v)[kGroups], bool& exact) {
    constexpr int kGroupCols = decltype(size<1>(tSrS_rowcol))::value / kGroups;
    float tile_max = -INFINITY;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      int const bits = row_max_bits<kGroupCols>(tSrS_rowcol, mi, g * kGroupCols);
      exact &= bits >= 0;
      tile_max = fmaxf(tile_max, fmaf(__int_as_float(bits), scale_log2[g], log2_v[g]));
    }
    return tile_max;
  }

  // Row mi's running (V-weighted) max updated with the thread's part of the tile max;
  // returns the factor by which its row of O must be rescaled.
  template <bool kFirstTile>
  CUTLASS_DEVICE float merge_row_max(float thread_max, int mi) {
    float const tile_max = quad_allreduce(thread_max, MaxOp{});
    float const prev_shift = kFirstTile ? 0.f : shift(mi);
    bool const had_keys = !kFirstTile && row_max(mi) != -INFINITY;
    // The max in use stays unless the tile raises it by more than kRescaleThreshold: a
    // row with no visible key yet (-inf) takes any new max (+inf or NaN difference).
    bool const keep = kLazyRescale && !kFirstTile && tile_max - row_max(mi) <= kRescaleThreshold;
    row_max(mi) = keep ? row_max(mi) : fmaxf(row_max(mi), tile_max);
    // No visible key so far: the accumulator and the sum are 0, any factor will do.
    return had_keys && !keep ? exp2f(prev_shift - shift(mi)) : 1.f;
  }

  // Every row's running max updated with tile S; correction(mi) gets row mi's O rescale.
  // The thread's parts come from the scores' integer max, and a warp where any part was
  // not exact (all its scores negative: rare for real scores) takes FMNMX for all its
  // rows, as do tiles under the mask (masked: warp-uniform); both give the same bits
  // where both are exact.
  template <bool kFirstTile, int kGroups, class TensorS, class TensorCorrection>
  CUTLASS_DEVICE void update_row_maxes(TensorS const& tSrS_rowcol, float const (&scale_log2)[kGroups],
                                       float const (&log2_v)[kGroups], TensorCorrection& correction, bool masked) {
    float thread_max[kRows];
    if constexpr (kIntRowMax) {
      bool exact = false;
      if (!masked) {
        exact = true;
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          thread_max[mi] = thread_tile_max_int(tSrS_rowcol, mi, scale_log2, log2_v, exact);
        }
        exact = __all_sync(0xffffffffu, exact);
      }
      if (!exact) {
        CUTE_UNROLL
        for (int mi = 0; mi < kRows; ++mi) {
          thread_max[mi] = thread_tile_max</*kTree=*/true>(tSrS_rowcol, mi, scale_log2, log2_v);
        }
      }
    } else {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        thread_max[mi] = thread_tile_max</*kTree=*/false>(tSrS_rowcol, mi, scale_log2, log2_v);
      }
    }
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) { correction(mi) = merge_row_max<kFirstTile>(thread_max[mi], mi); }
  }

  // Whether any row of this warp's part of O has a factor other than 1 (a warp-uniform
  // branch around the rescale); always where the rescale is not lazy.
  template <class TensorCorrection>
  CUTLASS_DEVICE static bool any_rescale(TensorCorrection const& correction) {
    if constexpr (!kLazyRescale) { return true; }
    bool any = false;
    CUTE_UNROLL
    for (int mi = 0; mi < size(correction); ++mi) { any |= correction(mi) != 1.f; }
    return __any_sync(0xffffffffu, any);
  }

  // Row mi of S turned into P in place, and its sum (over P / v) added.
  template <int kGroups, class TensorS>
  CUTLASS_DEVICE void exponentiate_row(TensorS& tSrS_rowcol, int mi, float const (&scale_log2)[kGroups],
                                       float const (&log2_v)[kGroups], float const (&inv_v)[kGroups],
                                       float correction) {
    constexpr int kGroupCols = decltype(size<1>(tSrS_rowcol))::value / kGroups;
    float const cur_shift = shift(mi);
    float sum = 0.f;
    CUTE_UNROLL
    for (int g = 0; g < kGroups; ++g) {
      float const group_shift = cur_shift - log2_v[g];
      float sums[kChains];
      CUTE_UNROLL
      for (int c = 0; c < kChains; ++c) { sums[c] = 0.f; }
      CUTE_UNROLL
      for (int ni = 0; ni < kGroupCols; ++ni) {
        float const p = exp2f(tSrS_rowcol(mi, g * kGroupCols + ni) * scale_log2[g] - group_shift);
        tSrS_rowcol(mi, g * kGroupCols + ni) = p;
        sums[ni % kChains] += p;
      }
      float group_sum = sums[0];
      CUTE_UNROLL
      for (int c = 1; c < kChains; ++c) { group_sum += sums[c]; }
      sum = fmaf(group_sum, inv_v[g], sum);
    }
    row_sum(mi) = row_sum(mi) * correction + sum;
  }

  // Both, row by row. Returns the O rescale per row.
  template <bool kFirstTile, int kGroups, class TensorS>
  CUTLASS_DEVICE auto online_update(TensorS& tSrS_rowcol, float const (&scale_log2)[kGroups],
                                    float const (&log2_v)[kGroups], float const (&inv_v)[kGroups], bool masked) {
    static_assert(decltype(size<0>(tSrS_rowcol))::value == kRows);
    Tensor correction = make_tensor<float>(Layout<Int<kRows>>{});
    if constexpr (kIntRowMax) {
      update_row_maxes<kFirstTile>(tSrS_rowcol, scale_log2, log2_v, correction, masked);
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) { exponentiate_row(tSrS_rowcol, mi, scale_log2, log2_v, inv_v, correction(mi)); }
    } else {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        correction(mi) = merge_row_max<kFirstTile>(
            thread_tile_max</*kTree=*/false>(tSrS_rowcol, mi, scale_log2, log2_v), mi);
        exponentiate_row(tSrS_rowcol, mi, scale_log2, log2_v, inv_v, correction(mi));
      }
    }
    return correction;
  }

  // O / row sum (V's scale is inside both). Returns the natural-log logsumexp of the true
  // scores (-inf for an empty row): log2 of it is max_w - kMaxOffset + log2(sum).
  template <class TensorO>
  CUTLASS_DEVICE auto finalize(TensorO& tOrO_rowcol) {
    Tensor lse = make_tensor<float>(Layout<Int<kRows>>{});
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      float const sum = quad_allreduce(row_sum(mi), SumOp{});
      bool const empty = sum == 0.f || sum != sum;
      float const factor = empty ? 0.f : 1.f / sum;
      lse(mi) = empty ? -INFINITY : (row_max(mi) - kMaxOffset) * 0.693147180559945309f + __logf(sum);
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(tOrO_rowcol); ++ni) { tOrO_rowcol(mi, ni) *= factor; }
    }
    return lse;
  }
};

}  // namespace flash3
