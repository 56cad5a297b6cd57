// TMA descriptors over the (seqlen, headdim, head, batch) view of a (batch, seqlen, nheads,
// headdim) tensor, shared by every kernel that moves Q, K, V, dO or O with TMA.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>

#include "params.h"

namespace flash3 {

using namespace cute;

// Viewed this way one TMA box is a (rows x headdim) tile of one head of one batch. Any
// strides but a contiguous head dim (the binding's tma_ready() sees to that).
using ShapeRowsHead = Shape<int32_t, int32_t, int32_t, int32_t>;
using StrideRowsHead = Stride<int64_t, _1, int64_t, int64_t>;

inline ShapeRowsHead rows_head_shape(int seqlen, int headdim, int nheads, int batch) {
  return make_shape(seqlen, headdim, nheads, batch);
}
inline StrideRowsHead rows_head_stride(int64_t row_stride, int64_t head_stride, int64_t batch_stride) {
  return make_stride(row_stride, _1{}, head_stride, batch_stride);
}

// global[dst .. dst + bytes) += shared[src ..], float32, asynchronously (bulk_group): a
// bulk reduction with no tensor map (dst, src and bytes multiples of 16). The issuing
// thread commits its group (cute::tma_store_arrive) and waits for the reads of shared
// memory (cute::tma_store_wait) before that memory is reused.
CUTLASS_DEVICE void bulk_reduce_add(float* dst, float const* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               ::"l"(dst), "r"(cute::cast_smem_ptr_to_uint(src)), "r"(bytes)
               : "memory");
}

// A TMA copy (load, store or reduction: CopyOp) between global memory and one shared-memory
// box of smem_layout, no cluster multicast.
template <class CopyOp, class T, class GShape, class GStride, class SmemLayout, class Box>
auto make_tma(CopyOp const& op, T* ptr, GShape const& shape, GStride const& stride, SmemLayout const& smem_layout,
              Box const& box) {
  return make_tma_copy(op, make_tensor(make_gmem_ptr(ptr), shape, stride), smem_layout, box, /*cluster_size=*/_1{});
}

// The forward kernels' loads (16-bit and FP8 alike): Q as one (kBlockM x d) box per tile,
// K and V as one (kBlockN x d) box per pipeline stage (V's d: Traits::kHeadDimV). A
// mainloop's Params derive from this.
template <class Traits>
struct FwdLoadsTma {
  using Element = typename Traits::Element;
  using TileShapeMNK = typename Traits::TileShapeMNK;

  static auto make_q(Element const* ptr, ShapeRowsHead const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, typename Traits::SmemLayoutQ{}, select<0, 2>(TileShapeMNK{}));
  }
  static auto make_k(Element const* ptr, ShapeRowsHead const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, take<0, 2>(typename Traits::SmemLayoutK{}),
                    select<1, 2>(TileShapeMNK{}));
  }
  static auto make_v(Element const* ptr, ShapeRowsHead const& shape, StrideRowsHead const& stride) {
    return make_tma(SM90_TMA_LOAD{}, ptr, shape, stride, take<0, 2>(typename Traits::SmemLayoutV{}),
                    Shape<Int<Traits::kBlockN>, Int<Traits::kHeadDimV>>{});
  }
  using TmaQ = decltype(make_q(nullptr, ShapeRowsHead{}, StrideRowsHead{}));
  using TmaK = decltype(make_k(nullptr, ShapeRowsHead{}, StrideRowsHead{}));
  using TmaV = decltype(make_v(nullptr, ShapeRowsHead{}, StrideRowsHead{}));

  TmaQ tma_q;
  TmaK tma_k;
  TmaV tma_v;
  ShapeRowsHead shape_q;
  ShapeRowsHead shape_k;
  ShapeRowsHead shape_v;

  static FwdLoadsTma make(FwdParams const& p) {
    ShapeRowsHead shape_q = rows_head_shape(p.rows_q(), p.headdim, p.nheads, p.tensor_batch());
    ShapeRowsHead shape_k = rows_head_shape(p.rows_k(), p.headdim, p.nheads_k, p.tensor_batch());
    ShapeRowsHead shape_v = rows_head_shape(p.rows_k(), p.headdim_v, p.nheads_k, p.tensor_batch());
    return {make_q(static_cast<Element const*>(p.q_ptr), shape_q,
                   rows_head_stride(p.q_row_stride, p.q_head_stride, p.q_batch_stride)),
            make_k(static_cast<Element const*>(p.k_ptr), shape_k,
                   rows_head_stride(p.k_row_stride, p.k_head_stride, p.k_batch_stride)),
            make_v(static_cast<Element const*>(p.v_ptr), shape_v,
                   rows_head_stride(p.v_row_stride, p.v_head_stride, p.v_batch_stride)),
            shape_q, shape_k, shape_v};
  }

  CUTLASS_DEVICE void prefetch_descriptors() const {
    cute::prefetch_tma_descriptor(tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(tma_v.get_tma_descriptor());
  }
};

}  // namespace flash3
