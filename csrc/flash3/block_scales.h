// What the forward mainloop reads besides Q, K and V to turn a key tile's scores into
// logits: nothing for 16-bit inputs (NoBlockScales: one logit scale for the whole kernel),
// the Q, K and V block scales for e4m3 inputs (BlockScalesFp8, params_fp8.h).
// Each is a base of the mainloop's kernel parameters; rows(...) gives a consumer
// warpgroup's view of them for one query tile, and its tile(n_block) the scales of one
// key tile, which the traits' softmax takes (softmax.h, softmax_fp8.h).
#pragma once

#include <numeric>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "params_fp8.h"
#include "softmax.h"
#include "softmax_fp8.h"

namespace flash3 {

struct NoBlockScales {
  static NoBlockScales make(FwdParams const&) { return {}; }
  struct Rows {
    CUTLASS_DEVICE NoTileScales tile(int /*n_block*/) const { return {}; }
  };
  CUTLASS_DEVICE Rows rows(float /*scale_log2*/, int /*batch*/, int /*head*/, int /*head_kv*/, int /*m_block*/,
                           int /*warpgroup*/, int /*thread_idx*/) const {
    return {};
  }
};

// kBlockM / kBlockN: the kernel's tiles. kLaneScales: a key tile's group scales worked out
// one group per lane and shuffled to the warp. kOneScaleOffset: one offset indexes K's and
// V's scales (the binding, api_fp8.cpp, gives both tensors the same strides). Both:
// traits_fp8.h says where and why.
template <int kBlockM, int kBlockN, bool kLaneScales, bool kOneScaleOffset>
struct BlockScalesFp8 {
  // Key tiles and K/V scale blocks: a tile within one block has one (K, V) scale pair;
  // otherwise it splits into groups of kScaleGroupKeys keys, each within one block (the
  // softmax folds V's scale into the exponent, so any split costs no accuracy; softmax_fp8.h).
  static constexpr int kScaleGroupKeys = std::gcd(kBlockN, kScaleBlockK);
  static constexpr int kScaleGroups = kBlockN / kScaleGroupKeys;
  using TileScales = KeyGroupScales<kScaleGroups>;

  BlockScales q_scale, k_scale, v_scale;

  static BlockScalesFp8 make(FwdFp8Params const& p) { return {p.q_scale, p.k_scale, p.v_scale}; }

  // One consumer warpgroup's 64 query rows of a tile: they share one Q scale (a warpgroup
  // wholly past seqlen_q reads none). K/V scales: the pointers and strides stay in the
  // kernel parameters (constant memory; params is a reference to them) and only 32-bit
  // offsets in registers (hdim 256 needs 240 per thread for O, S and P; 64-bit pointers
  // kept live across the loop spilled there). Scale tensors hold fewer than 2^31
  // elements. Groups wholly past seqlen_k (masked) read the last block. A V scale of 0
  // (only a caller's own scales can hold one) is taken as 2^-64, so that P / v stays
  // finite.
  struct Rows {
    BlockScalesFp8 const& params;
    float qk_scale_log2;  // softmax_scale * log2(e) * q_scale
    int k_head_offset;
    int v_head_offset;
    int thread_idx;

    CUTLASS_DEVICE void group(int n_block, int g, float& qk_log2, float& log2_v, float& inv_v) const {
      int64_t const& v_block_stride = kOneScaleOffset ? params.k_scale.block_stride : params.v_scale.block_stride;
      int const block = min((n_block * kBlockN + g * kScaleGroupKeys) / kScaleBlockK, params.k_scale.num_blocks - 1);
      qk_log2 = qk_scale_log2 * params.k_scale.ptr[k_head_offset + block * int(params.k_scale.block_stride)];
      float const v = fmaxf(params.v_scale.ptr[v_head_offset + block * int(v_block_stride)], 0x1p-64f);
      log2_v = __log2f(v);
      inv_v = __fdividef(1.f, v);
    }

    CUTLASS_DEVICE TileScales tile(int n_block) const {
      TileScales t;
      if constexpr (kScaleGroups > 1 && kLaneScales) {
        // Lane g works out group g's scales and the warp reads them from it: one LG2 and
        // one RCP per warp and key tile instead of one per group (MUFU instructions, in
        // the pipe the exponentials keep busy at hdim 128), and one load each of K's and
        // V's scales. The same operations on the same values: bitwise the same scales.
        static_assert(kScaleGroups <= 32);
        float qk_log2, log2_v, inv_v;
        group(n_block, min(thread_idx % 32, kScaleGroups - 1), qk_log2, log2_v, inv_v);
        CUTE_UNROLL
        for (int g = 0; g < kScaleGroups; ++g) {
          t.qk_log2[g] = __shfl_sync(0xffffffff, qk_log2, g);
          t.log2_v[g] = __shfl_sync(0xffffffff, log2_v, g);
          t.inv_v[g] = __shfl_sync(0xffffffff, inv_v, g);
        }
      } else {
        CUTE_UNROLL
        for (int g = 0; g < kScaleGroups; ++g) { group(n_block, g, t.qk_log2[g], t.log2_v[g], t.inv_v[g]); }
      }
      return t;
    }
  };

  CUTLASS_DEVICE Rows rows(float scale_log2, int batch, int head, int head_kv, int m_block, int warpgroup,
                           int thread_idx) const {
    int const q_block = (m_block * kBlockM) / kScaleBlockQ + warpgroup;
    float const q = q_block < q_scale.num_blocks ? q_scale.head_ptr(batch, head)[q_block * q_scale.block_stride] : 1.f;
    int const k_head_offset = int(batch * k_scale.batch_stride + head_kv * k_scale.head_stride);
    int const v_head_offset =
        kOneScaleOffset ? k_head_offset : int(batch * v_scale.batch_stride + head_kv * v_scale.head_stride);
    return {*this, scale_log2 * q, k_head_offset, v_head_offset, thread_idx};
  }
};

}  // namespace flash3
