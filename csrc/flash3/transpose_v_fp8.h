// The FP8 forward's V transpose: the producer warpgroup turns each V tile (keys x head
// dim, as TMA brings it) into V^T in shared memory, the K-major B operand that FP8 WGMMA
// needs for O += P V.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include <cstdint>
#include <utility>

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

}  // namespace flash3
