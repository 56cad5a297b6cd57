// The forward epilogue: the normalised O accumulator to global memory in the element
// type, and the logsumexp per query row.
//
// O goes straight from registers: each thread stores pairs of adjacent columns
// (4 bytes), rows past seqlen_q are skipped. A staged store through shared memory with
// TMA would coalesce better; this path costs one pass over O per query tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "params.h"
#include "utils.h"

namespace flash3 {

using namespace cute;

// ElementO: the output type (the FP8 kernel writes bf16; the 16-bit ones their input type).
template <class Traits, class ElementO = typename Traits::Element>
struct EpilogueFwd {
  using Element = ElementO;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;

  struct Params {
    Element* o_ptr;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    float* lse_ptr;
    int seqlen_q;
    int nheads;
  };

  static Params to_params(FwdParams const& p) {
    return {static_cast<Element*>(p.o_ptr), p.o_batch_stride, p.o_row_stride, p.o_head_stride,
            p.lse_ptr, p.seqlen_q, p.nheads};
  }

  template <class TensorO, class TensorLse>
  CUTLASS_DEVICE static void store(Params const& params, TensorO const& tOrO, TensorLse const& lse,
                                   int thread_idx, int m_block, int head, int batch) {
    typename Traits::TiledMmaPV tiled_mma_pv;
    auto thr_mma_pv = tiled_mma_pv.get_thread_slice(thread_idx);
    Tensor cO = make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{});
    Tensor tOcO = thr_mma_pv.partition_C(cO);
    Tensor tOcO_rowcol = make_tensor(tOcO.data(), accumulator_rowcol(tOcO.layout()));

    Tensor rO = make_tensor<Element>(tOrO.layout());
    convert_into(tOrO, rO);
    Tensor rO_rowcol = make_tensor(rO.data(), accumulator_rowcol(rO.layout()));

    Element* o_tile = params.o_ptr + batch * params.o_batch_stride + head * params.o_head_stride;
    float* lse_rows = params.lse_ptr + (int64_t(batch) * params.nheads + head) * params.seqlen_q;
    int const row0 = m_block * kBlockM;

    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(rO_rowcol); ++mi) {
      int const row = row0 + get<0>(tOcO_rowcol(mi, 0));
      if (row >= params.seqlen_q) { continue; }
      Element* o_row = o_tile + row * params.o_row_stride;
      // Columns come in adjacent pairs: (2, N/8, MMA_N) with the pair innermost.
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(rO_rowcol); ni += 2) {
        int const col = get<1>(tOcO_rowcol(mi, ni));
        cutlass::Array<Element, 2> pair;
        pair[0] = rO_rowcol(mi, ni);
        pair[1] = rO_rowcol(mi, ni + 1);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(o_row + col) = pair;
      }
      // The four threads of a quad hold the same row; the first one writes its lse.
      if (thread_idx % 4 == 0) { lse_rows[row] = lse(mi); }
    }
  }
};

}  // namespace flash3
