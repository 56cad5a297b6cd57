// The backward epilogue: the CTA's dK (scaled by softmax_scale) and dV to global memory,
// straight from the accumulators, rows past seqlen_k skipped. Under GQA every query head
// writes its own float32 dK/dV and the binding sums the heads of a group.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "params.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

template <class Traits>
struct EpilogueBwd {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;

  struct Params {
    void* dk_ptr;
    void* dv_ptr;
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
    int seqlen_k;
    float softmax_scale;
    bool fp32_out;
  };

  static Params to_params(BwdParams const& p) {
    return {p.dk_ptr, p.dv_ptr, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride,
            p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride, p.seqlen_k, p.softmax_scale, p.dkv_is_fp32};
  }

  template <class Out, class TensorAcc, class TensorC>
  CUTLASS_DEVICE static void store_one(TensorAcc const& acc_rowcol, TensorC const& coord_rowcol, Out* tile,
                                       int64_t row_stride, int row0, int seqlen_k, float scale) {
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(acc_rowcol); ++mi) {
      int const row = row0 + get<0>(coord_rowcol(mi, 0));
      if (row >= seqlen_k) { continue; }
      Out* out_row = tile + row * row_stride;
      // Columns come in adjacent pairs: (2, N/8, MMA_N) with the pair innermost.
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(acc_rowcol); ni += 2) {
        int const col = get<1>(coord_rowcol(mi, ni));
        cutlass::Array<Out, 2> pair;
        pair[0] = static_cast<Out>(acc_rowcol(mi, ni) * scale);
        pair[1] = static_cast<Out>(acc_rowcol(mi, ni + 1) * scale);
        *reinterpret_cast<cutlass::Array<Out, 2>*>(out_row + col) = pair;
      }
    }
  }

  template <class TensordKV>
  CUTLASS_DEVICE static void store(Params const& params, TensordKV const& tdKrdK, TensordKV const& tdVrdV,
                                   int thread_idx, int n_block, int head, int batch) {
    typename Traits::TiledMmadKV tiled_mma_dkv;
    auto thr_mma_dkv = tiled_mma_dkv.get_thread_slice(thread_idx);
    Tensor cdKV = make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor tdKVcdKV = thr_mma_dkv.partition_C(cdKV);
    Tensor coord_rowcol = make_tensor(tdKVcdKV.data(), accumulator_rowcol(tdKVcdKV.layout()));
    Tensor dK_rowcol = make_tensor(tdKrdK.data(), accumulator_rowcol(tdKrdK.layout()));
    Tensor dV_rowcol = make_tensor(tdVrdV.data(), accumulator_rowcol(tdVrdV.layout()));
    int const row0 = n_block * kBlockN;
    int64_t const dk_offset = batch * params.dk_batch_stride + head * params.dk_head_stride;
    int64_t const dv_offset = batch * params.dv_batch_stride + head * params.dv_head_stride;
    if (params.fp32_out) {
      store_one(dK_rowcol, coord_rowcol, static_cast<float*>(params.dk_ptr) + dk_offset, params.dk_row_stride, row0,
                params.seqlen_k, params.softmax_scale);
      store_one(dV_rowcol, coord_rowcol, static_cast<float*>(params.dv_ptr) + dv_offset, params.dv_row_stride, row0,
                params.seqlen_k, 1.f);
    } else {
      store_one(dK_rowcol, coord_rowcol, static_cast<Element*>(params.dk_ptr) + dk_offset, params.dk_row_stride, row0,
                params.seqlen_k, params.softmax_scale);
      store_one(dV_rowcol, coord_rowcol, static_cast<Element*>(params.dv_ptr) + dv_offset, params.dv_row_stride, row0,
                params.seqlen_k, 1.f);
    }
  }
};

}  // namespace flash3
