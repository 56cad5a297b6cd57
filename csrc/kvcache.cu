// The KV-cache call's bookkeeping around the packed-batch forward kernels
// (flash3/kvcache.py): where each split of each sequence's keys lies in the cache, and the
// merge of the splits' partial results. One small kernel each, so that a decode step is
// three launches (the splits' layout with the packed queries, attention, merge) rather
// than dozens of elementwise operations.
//
// kvcache_splits: sequence b's keys [lo, seqlens[b]) (lo: where a left window starts for
// its first query, seqlens[b] - seqlen_q - window_left) are cut into `splits` parts; part
// j of b is packed-batch sequence b * splits + j. A dense cache: parts of `size` keys (a
// fixed size, or ceil(span / (splits * align)) * align), part j's first row b * per_batch
// + lo + j * size, its length clamp(span - j * size, 0, size). With split_keys (the
// kernels' split-KV parts, flash3/params.h) lo is rounded down to kPageChunkRows and part
// j's length counts the keys to the end of the span, span - j * size (or 0), of which it
// reads its slot. A paged cache (page_table given): part j is page j of the sequence
// (splits = max_pages), its keys [j, j + 1) * page_size within [lo, seqlens[b]), at row
// page_table[b][j] * per_batch (the rows from one page to the next) + their offset in
// the page.
//
// kvcache_pack: the same layout for a split-KV call, with the queries packed for it (GQA
// packing: query head kvh * group + g at position t is row t * group + g of K/V head kvh,
// once per split) and each part's query offset, in the same launch.
//
// kvcache_combine: out_partial (batch, splits, rows, nheads_k, d) and lse_partial
// (nheads_k, batch, splits, rows), rows = seqlen_q * group (query head kvh * group + i at
// position t is row t * group + i of K/V head kvh). Writes out (batch, seqlen_q, nheads, d)
// and lse (batch, nheads, seqlen_q): lse = log(sum_s exp(lse_s)) (with the head's sink
// logit in the sum where sinks are given) and out = sum_s exp(lse_s - lse) * out_s, in
// float32. A row no split saw (and no sink) gets 0 and -inf.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "flash3/grid_dependency.h"
#include "flash3/params.h"

namespace flash3 {
namespace {

// Part i = b * splits + j of the key ranges (the header's layout): its first row and length.
__device__ __forceinline__ void kvcache_split(int const* __restrict__ seqlens, int const* __restrict__ page_table,
                                              int page_size, int64_t per_batch, int window_left, int splits,
                                              int align, int fixed_size, int seqlen_q, bool split_keys, int i,
                                              int* __restrict__ cu_k, int* __restrict__ used) {
  int const b = i / splits, j = i % splits;
  int const len = seqlens[b];
  int lo = window_left >= 0 ? max(0, len - seqlen_q - window_left) : 0;
  if (split_keys) { lo = lo / kPageChunkRows * kPageChunkRows; }
  if (page_table != nullptr) {
    int64_t const page_begin = int64_t(j) * page_size;
    int64_t const first = max(page_begin, int64_t(lo));
    int64_t const last = min(page_begin + page_size, int64_t(len));
    bool const any = last > first;
    // Pages past the length are not read (their entries may be anything).
    cu_k[i] = any ? int(int64_t(page_table[i]) * per_batch + (first - page_begin)) : 0;
    used[i] = any ? int(last - first) : 0;
    return;
  }
  int const span = max(0, len - lo);
  int64_t const unit = int64_t(splits) * align;
  int const size = fixed_size > 0 ? fixed_size : int((span + unit - 1) / unit) * align;
  int64_t const start = int64_t(j) * size;
  cu_k[i] = int(b * per_batch + lo + start);
  int64_t const rest = max(int64_t(span) - start, int64_t(0));
  used[i] = int(split_keys ? rest : min(rest, int64_t(size)));
}

__global__ void kvcache_splits_kernel(int const* __restrict__ seqlens, int const* __restrict__ page_table,
                                      int page_size, int batch, int64_t per_batch, int window_left, int splits,
                                      int align, int fixed_size, int total_rows, int seqlen_q, bool split_keys,
                                      int* __restrict__ cu_k, int* __restrict__ used) {
  wait_for_prior_grids();  // (grid_dependency.h)
  allow_dependent_grids();
  int const i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i == 0) { cu_k[batch * splits] = total_rows; }
  if (i >= batch * splits) { return; }
  kvcache_split(seqlens, page_table, page_size, per_batch, window_left, splits, align, fixed_size, seqlen_q, split_keys,
                i, cu_k, used);
}

// kvcache_pack: the splits' layout as kvcache_splits_kernel writes it, their query offsets
// (cu_q[i] = i * rows), and the queries packed for them, in one launch: q_rows[(b * splits
// + j) * rows + t * group + g][kvh] = q[b][t][kvh * group + g] for every split j, in
// vectors of Vec (the head dim and q's strides, in Vec units, divide evenly).
template <class Vec>
__global__ void kvcache_pack_kernel(int const* __restrict__ seqlens, int batch, int64_t per_batch, int window_left,
                                    int splits, int align, int fixed_size, int total_rows, int seqlen_q,
                                    bool split_keys, int* __restrict__ cu_k, int* __restrict__ used,
                                    int* __restrict__ cu_q, Vec const* __restrict__ q, int64_t stride_b,
                                    int64_t stride_t, int64_t stride_h, Vec* __restrict__ q_rows, int nheads_k,
                                    int group, int vecs_per_head, int64_t total_vecs) {
  wait_for_prior_grids();  // (grid_dependency.h)
  allow_dependent_grids();
  int64_t const i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int const parts = batch * splits;
  int const rows = seqlen_q * group;
  if (i <= parts) { cu_q[i] = int(i) * rows; }
  if (i == 0) { cu_k[parts] = total_rows; }
  if (i < parts) {
    kvcache_split(seqlens, nullptr, 0, per_batch, window_left, splits, align, fixed_size, seqlen_q, split_keys, int(i),
                  cu_k, used);
  }
  for (int64_t o = i; o < total_vecs; o += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = o;
    int const v = int(rest % vecs_per_head);
    rest /= vecs_per_head;
    int const kvh = int(rest % nheads_k);
    rest /= nheads_k;
    int const r = int(rest % rows);
    int const b = int(rest / rows / splits);
    int const t = r / group, h = kvh * group + r % group;
    q_rows[o] = q[b * stride_b + t * stride_t + h * stride_h + v];
  }
}

template <class T>
__device__ __forceinline__ float to_float(T x) { return static_cast<float>(x); }
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float(float x) { return __float2half(x); }

__device__ __forceinline__ float2 to_float2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 to_float2(__half2 x) { return __half22float2(x); }
template <class T2>
__device__ __forceinline__ T2 from_float2(float2 x);
template <>
__device__ __forceinline__ __nv_bfloat162 from_float2(float2 x) { return __float22bfloat162_rn(x); }
template <>
__device__ __forceinline__ __half2 from_float2(float2 x) { return __float22half2_rn(x); }

// One CTA per (batch, row, K/V head), kCombineWarps warps: the splits are shared out
// among the warps (split s to warp s % kCombineWarps), each lane a column strip of the
// head dim; the warps' partial sums meet in shared memory. With many splits (a page per
// split) and few rows, one thread per feature looping over every split was slow.
constexpr int kCombineWarps = 8;

template <class T>
__global__ void __launch_bounds__(kCombineWarps * 32)
    kvcache_combine_kernel(T const* __restrict__ out_partial, float const* __restrict__ lse_partial,
                           float const* __restrict__ sinks, T* __restrict__ out, float* __restrict__ lse, int batch,
                           int splits, int rows, int nheads_k, int headdim, int group) {
  wait_for_prior_grids();  // (grid_dependency.h)
  allow_dependent_grids();
  __shared__ float reduce[kCombineWarps];
  __shared__ float partial[kCombineWarps][256];
  int const kvh = blockIdx.x % nheads_k;
  int const r = (blockIdx.x / nheads_k) % rows;
  int const b = blockIdx.x / (nheads_k * rows);
  int const t = r / group, h = kvh * group + r % group;
  int const seqlen_q = rows / group, nheads = nheads_k * group;
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // lse_partial[kvh][b][s][r]
  float const* lse_s = lse_partial + (int64_t(kvh) * batch + b) * splits * rows + r;
  // The rows' max over the splits (and the sink), then the sum of exponentials.
  float m = -INFINITY;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) { m = fmaxf(m, lse_s[int64_t(s) * rows]); }
  for (int offset = 16; offset > 0; offset /= 2) { m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset)); }
  if (lane == 0) { reduce[warp] = m; }
  __syncthreads();
  m = reduce[0];
  for (int w = 1; w < kCombineWarps; ++w) { m = fmaxf(m, reduce[w]); }
  float const sink = sinks != nullptr ? sinks[h] : -INFINITY;
  float const top = fmaxf(m, sink);
  __syncthreads();
  float sum = 0.f;
  if (top != -INFINITY) {
    for (int s = threadIdx.x; s < splits; s += blockDim.x) { sum += expf(lse_s[int64_t(s) * rows] - top); }
  }
  for (int offset = 16; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffffu, sum, offset); }
  if (lane == 0) { reduce[warp] = sum; }
  __syncthreads();
  float total = -INFINITY;
  if (top != -INFINITY) {
    sum = sink != -INFINITY ? expf(sink - top) : 0.f;
    for (int w = 0; w < kCombineWarps; ++w) { sum += reduce[w]; }
    total = top + logf(sum);
  }
  // Each warp's splits, weighted, per column.
  for (int c = lane; c < headdim; c += 32) {
    float acc = 0.f;
    if (total != -INFINITY) {
      for (int s = warp; s < splits; s += kCombineWarps) {
        float const l = lse_s[int64_t(s) * rows];
        if (l == -INFINITY) { continue; }
        int64_t const at = (((int64_t(b) * splits + s) * rows + r) * nheads_k + kvh) * headdim + c;
        acc += expf(l - total) * to_float(out_partial[at]);
      }
    }
    partial[warp][c] = acc;
  }
  __syncthreads();
  int64_t const out_row = ((int64_t(b) * seqlen_q + t) * nheads + h) * headdim;
  for (int c = threadIdx.x; c < headdim; c += blockDim.x) {
    float acc = 0.f;
    for (int w = 0; w < kCombineWarps; ++w) { acc += partial[w][c]; }
    out[out_row + c] = from_float<T>(acc);
  }
  if (threadIdx.x == 0) { lse[(int64_t(b) * nheads + h) * seqlen_q + t] = total; }
}

// With at most kCombineWarps splits (decoding at batch 32 and more runs one), a warp per
// (batch, row, K/V head) instead: the CTA kernel's warps past the split count idle and its
// three barriers set the pace, 16k CTAs of 256 threads taking ~99 us for a 4 MB output
// (H200, batch 128, 4 queries x 4 query heads per K/V head, 8 K/V heads, one split). Each
// lane holds two adjacent columns of every 64, in float32, over the splits in order.
constexpr int kCombineRowsPerCta = 4;

template <class T>
__global__ void __launch_bounds__(kCombineRowsPerCta * 32)
    kvcache_combine_rows_kernel(T const* __restrict__ out_partial, float const* __restrict__ lse_partial,
                                float const* __restrict__ sinks, T* __restrict__ out, float* __restrict__ lse,
                                int batch, int splits, int rows, int nheads_k, int headdim, int group) {
  wait_for_prior_grids();  // (grid_dependency.h)
  allow_dependent_grids();
  using T2 = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
  // (batch * rows * nheads_k < 2^31: the launch checks it.)
  int const row = int(blockIdx.x) * kCombineRowsPerCta + int(threadIdx.x) / 32;
  if (row >= batch * rows * nheads_k) { return; }
  int const lane = threadIdx.x % 32;
  int const kvh = row % nheads_k;
  int const r = (row / nheads_k) % rows;
  int const b = row / (nheads_k * rows);
  int const t = r / group, h = kvh * group + r % group;
  int const seqlen_q = rows / group, nheads = nheads_k * group;
  float const* lse_s = lse_partial + (int64_t(kvh) * batch + b) * splits * rows + r;
  float m = -INFINITY;
  for (int s = lane; s < splits; s += 32) { m = fmaxf(m, lse_s[int64_t(s) * rows]); }
  for (int offset = 16; offset > 0; offset /= 2) { m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset)); }
  float const sink = sinks != nullptr ? sinks[h] : -INFINITY;
  float const top = fmaxf(m, sink);
  float sum = 0.f;
  if (top != -INFINITY) {
    for (int s = lane; s < splits; s += 32) { sum += expf(lse_s[int64_t(s) * rows] - top); }
  }
  for (int offset = 16; offset > 0; offset /= 2) { sum += __shfl_xor_sync(0xffffffffu, sum, offset); }
  float total = -INFINITY;
  if (top != -INFINITY) { total = top + logf(sum + (sink != -INFINITY ? expf(sink - top) : 0.f)); }
  constexpr int kMaxPairs = 256 / 64;  // column pairs per lane at the largest head dim
  float2 acc[kMaxPairs];
  #pragma unroll
  for (int i = 0; i < kMaxPairs; ++i) { acc[i] = make_float2(0.f, 0.f); }
  if (total != -INFINITY) {
    for (int s = 0; s < splits; ++s) {
      float const l = lse_s[int64_t(s) * rows];
      float const w = l == -INFINITY ? 0.f : expf(l - total);
      T2 const* src = reinterpret_cast<T2 const*>(
          out_partial + (((int64_t(b) * splits + s) * rows + r) * nheads_k + kvh) * headdim);
      #pragma unroll
      for (int i = 0; i < kMaxPairs; ++i) {
        int const c2 = lane + 32 * i;  // column pair: columns 2 * c2, 2 * c2 + 1
        if (2 * c2 < headdim && w != 0.f) {
          float2 const x = to_float2(src[c2]);
          acc[i].x += w * x.x;
          acc[i].y += w * x.y;
        }
      }
    }
  }
  T2* dst = reinterpret_cast<T2*>(out + ((int64_t(b) * seqlen_q + t) * nheads + h) * headdim);
  #pragma unroll
  for (int i = 0; i < kMaxPairs; ++i) {
    int const c2 = lane + 32 * i;
    if (2 * c2 < headdim) {
      dst[c2] = from_float2<T2>(acc[i]);
    }
  }
  if (lane == 0) { lse[(int64_t(b) * nheads + h) * seqlen_q + t] = total; }
}

std::tuple<at::Tensor, at::Tensor> kvcache_splits(at::Tensor const& seqlens, std::optional<at::Tensor> const& page_table,
                                                  int64_t page_size, int64_t per_batch, int64_t window_left,
                                                  int64_t splits, int64_t align, int64_t fixed_size,
                                                  int64_t total_rows, int64_t seqlen_q, bool split_keys) {
  TORCH_CHECK(seqlens.is_cuda() && seqlens.scalar_type() == at::kInt && seqlens.dim() == 1 && seqlens.is_contiguous(),
              "flash3: kvcache_splits: seqlens must be a contiguous int32 CUDA tensor (batch,)");
  TORCH_CHECK(splits >= 1 && align >= 1 && fixed_size >= 0 && per_batch >= 0 && total_rows >= 0 &&
                  total_rows < (int64_t(1) << 31),
              "flash3: kvcache_splits: splits ", splits, ", align ", align, ", fixed_size ", fixed_size,
              ", per_batch ", per_batch, ", total_rows ", total_rows, " out of range");
  TORCH_CHECK(seqlen_q >= 1 && seqlen_q < (int64_t(1) << 31), "flash3: kvcache_splits: seqlen_q ", seqlen_q,
              " out of range");
  TORCH_CHECK(!(split_keys && page_table.has_value()), "flash3: kvcache_splits: split_keys with a dense key layout only");
  int64_t const batch = seqlens.size(0);
  if (page_table.has_value()) {
    TORCH_CHECK(page_table->is_cuda() && page_table->scalar_type() == at::kInt && page_table->is_contiguous() &&
                    page_table->dim() == 2 && page_table->size(0) == batch && page_table->size(1) == splits &&
                    page_size >= 1,
                "flash3: kvcache_splits: page_table must be contiguous int32 (batch, splits), page_size >= 1");
  }
  c10::cuda::CUDAGuard const guard(seqlens.device());
  at::Tensor cu_k = at::empty({batch * splits + 1}, seqlens.options());
  at::Tensor used = at::empty({batch * splits}, seqlens.options());
  int const n = int(batch * splits) + 1;
  C10_CUDA_CHECK(launch_after_prior_grid(
      &kvcache_splits_kernel, dim3((n + 255) / 256), dim3(256), 0, c10::cuda::getCurrentCUDAStream().stream(),
      seqlens.data_ptr<int>(), page_table.has_value() ? page_table->data_ptr<int>() : nullptr, int(page_size),
      int(batch), per_batch, int(window_left), int(splits), int(align), int(fixed_size),
      int(total_rows), int(seqlen_q), split_keys, cu_k.data_ptr<int>(), used.data_ptr<int>()));
  return {cu_k, used};
}

// The query side of a split-KV call (flash3/kvcache.py _attend_packed) and the splits'
// layout: q (batch, seqlen_q, nheads_k * group, d) with a contiguous head dim.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> kvcache_pack(
    at::Tensor const& q, at::Tensor const& seqlens, int64_t per_batch, int64_t window_left, int64_t splits,
    int64_t align, int64_t fixed_size, int64_t total_rows, int64_t group, bool split_keys) {
  TORCH_CHECK(seqlens.is_cuda() && seqlens.scalar_type() == at::kInt && seqlens.dim() == 1 && seqlens.is_contiguous(),
              "flash3: kvcache_pack: seqlens must be a contiguous int32 CUDA tensor (batch,)");
  TORCH_CHECK(q.is_cuda() && q.device() == seqlens.device() && q.dim() == 4 && q.stride(3) == 1 &&
                  q.size(0) == seqlens.size(0),
              "flash3: kvcache_pack: q must be a CUDA tensor (batch, seqlen_q, nheads, headdim) on seqlens' device, "
              "head dim contiguous, batch ", seqlens.size(0));
  TORCH_CHECK(splits >= 1 && align >= 1 && fixed_size >= 0 && per_batch >= 0 && total_rows >= 0 &&
                  total_rows < (int64_t(1) << 31) && group >= 1 && q.size(2) % group == 0,
              "flash3: kvcache_pack: splits ", splits, ", align ", align, ", fixed_size ", fixed_size,
              ", per_batch ", per_batch, ", total_rows ", total_rows, ", group ", group, " (nheads ", q.size(2),
              ") out of range");
  int64_t const batch = q.size(0), seqlen_q = q.size(1), nheads = q.size(2), headdim = q.size(3);
  int64_t const nheads_k = nheads / group, rows = seqlen_q * group, parts = batch * splits;
  TORCH_CHECK(parts * std::max<int64_t>(rows, 1) < (int64_t(1) << 31), "flash3: kvcache_pack: ", parts,
              " parts of ", rows, " rows exceed int32");
  c10::cuda::CUDAGuard const guard(seqlens.device());
  auto const ints = seqlens.options();
  at::Tensor cu_k = at::empty({parts + 1}, ints);
  at::Tensor used = at::empty({parts}, ints);
  at::Tensor cu_q = at::empty({parts + 1}, ints);
  at::Tensor q_rows = at::empty({parts * rows, nheads_k, headdim}, q.options());
  int64_t const elem = q.element_size();
  // 16-byte vectors where the head dim, q's strides and its address allow, else elements.
  bool const wide = (headdim * elem) % 16 == 0 && (q.stride(0) * elem) % 16 == 0 && (q.stride(1) * elem) % 16 == 0 &&
                    (q.stride(2) * elem) % 16 == 0 && reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0;
  int64_t const unit = wide ? 16 / elem : 1;
  int64_t const total_vecs = parts * rows * nheads_k * (headdim / unit);
  constexpr int kThreads = 256;
  int64_t const blocks = std::min<int64_t>(std::max<int64_t>((std::max(total_vecs, parts + 1) + kThreads - 1) / kThreads, 1),
                                           int64_t(1) << 20);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  auto launch = [&](auto vec) {
    using Vec = decltype(vec);
    C10_CUDA_CHECK(launch_after_prior_grid(&kvcache_pack_kernel<Vec>, dim3(unsigned(blocks)), dim3(kThreads), 0, stream,
        seqlens.data_ptr<int>(), int(batch), per_batch, int(window_left), int(splits), int(align), int(fixed_size),
        int(total_rows), int(seqlen_q), split_keys, cu_k.data_ptr<int>(), used.data_ptr<int>(), cu_q.data_ptr<int>(),
        reinterpret_cast<Vec const*>(q.data_ptr()), q.stride(0) / unit, q.stride(1) / unit, q.stride(2) / unit,
        reinterpret_cast<Vec*>(q_rows.data_ptr()), int(nheads_k), int(group), int(headdim / unit), total_vecs));
  };
  if (wide) {
    launch(uint4{});
  } else {
    TORCH_CHECK(elem == 2, "flash3: kvcache_pack: q must be bf16 or fp16");
    launch(uint16_t{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q_rows, cu_q, cu_k, used};
}

std::tuple<at::Tensor, at::Tensor> kvcache_combine(at::Tensor const& out_partial, at::Tensor const& lse_partial,
                                                   std::optional<at::Tensor> const& sinks, int64_t group) {
  TORCH_CHECK(out_partial.is_cuda() && out_partial.dim() == 5 && out_partial.is_contiguous(),
              "flash3: kvcache_combine: out_partial must be a contiguous CUDA tensor (batch, splits, rows, nheads_k, d)");
  TORCH_CHECK(out_partial.scalar_type() == at::kBFloat16 || out_partial.scalar_type() == at::kHalf,
              "flash3: kvcache_combine: out_partial must be bf16 or fp16");
  int64_t const batch = out_partial.size(0), splits = out_partial.size(1), rows = out_partial.size(2);
  int64_t const nheads_k = out_partial.size(3), headdim = out_partial.size(4);
  TORCH_CHECK(lse_partial.is_cuda() && lse_partial.scalar_type() == at::kFloat && lse_partial.is_contiguous() &&
                  lse_partial.dim() == 4 && lse_partial.size(0) == nheads_k && lse_partial.size(1) == batch &&
                  lse_partial.size(2) == splits && lse_partial.size(3) == rows,
              "flash3: kvcache_combine: lse_partial must be contiguous float32 (nheads_k, batch, splits, rows)");
  TORCH_CHECK(group >= 1 && rows % group == 0 && headdim <= 256 && headdim % 2 == 0,
              "flash3: kvcache_combine: group ", group, " must divide rows ", rows, "; headdim ", headdim,
              " even and <= 256");
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->is_cuda() && sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->numel() == nheads_k * group,
                "flash3: kvcache_combine: sinks must be contiguous float32 (nheads,)");
  }
  int64_t const seqlen_q = rows / group, nheads = nheads_k * group;
  c10::cuda::CUDAGuard const guard(out_partial.device());
  at::Tensor out = at::empty({batch, seqlen_q, nheads, headdim}, out_partial.options());
  at::Tensor lse = at::empty({batch, nheads, seqlen_q}, lse_partial.options());
  int64_t const blocks = batch * rows * nheads_k;
  if (blocks == 0) { return {out, lse}; }
  TORCH_CHECK(blocks < (int64_t(1) << 31), "flash3: kvcache_combine: too many rows");
  int const threads = kCombineWarps * 32;
  float const* sinks_ptr = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  if (splits <= kCombineWarps) {
    int64_t const ctas = (blocks + kCombineRowsPerCta - 1) / kCombineRowsPerCta;
    if (out_partial.scalar_type() == at::kBFloat16) {
      C10_CUDA_CHECK(launch_after_prior_grid(&kvcache_combine_rows_kernel<__nv_bfloat16>, dim3(unsigned(ctas)),
                                            dim3(kCombineRowsPerCta * 32), 0, stream,
          reinterpret_cast<__nv_bfloat16 const*>(out_partial.data_ptr()), lse_partial.data_ptr<float>(), sinks_ptr,
          reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), lse.data_ptr<float>(), int(batch), int(splits),
          int(rows), int(nheads_k), int(headdim), int(group)));
    } else {
      C10_CUDA_CHECK(launch_after_prior_grid(&kvcache_combine_rows_kernel<__half>, dim3(unsigned(ctas)),
                                            dim3(kCombineRowsPerCta * 32), 0, stream,
          reinterpret_cast<__half const*>(out_partial.data_ptr()), lse_partial.data_ptr<float>(), sinks_ptr,
          reinterpret_cast<__half*>(out.data_ptr()), lse.data_ptr<float>(), int(batch), int(splits), int(rows),
          int(nheads_k), int(headdim), int(group)));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {out, lse};
  }
  if (out_partial.scalar_type() == at::kBFloat16) {
    C10_CUDA_CHECK(launch_after_prior_grid(&kvcache_combine_kernel<__nv_bfloat16>, dim3(unsigned(blocks)), dim3(threads), 0,
                                          stream,
        reinterpret_cast<__nv_bfloat16 const*>(out_partial.data_ptr()), lse_partial.data_ptr<float>(), sinks_ptr,
        reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), lse.data_ptr<float>(), int(batch), int(splits), int(rows),
        int(nheads_k), int(headdim), int(group)));
  } else {
    C10_CUDA_CHECK(launch_after_prior_grid(&kvcache_combine_kernel<__half>, dim3(unsigned(blocks)), dim3(threads), 0,
                                          stream,
        reinterpret_cast<__half const*>(out_partial.data_ptr()), lse_partial.data_ptr<float>(), sinks_ptr,
        reinterpret_cast<__half*>(out.data_ptr()), lse.data_ptr<float>(), int(batch), int(splits), int(rows),
        int(nheads_k), int(headdim), int(group)));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

}  // namespace
}  // namespace flash3

TORCH_LIBRARY_FRAGMENT(flash3, m) {
  m.def("kvcache_splits(Tensor seqlens, Tensor? page_table, int page_size, int per_batch, int window_left, "
        "int splits, int align, int fixed_size, int total_rows, int seqlen_q=1, bool split_keys=False) "
        "-> (Tensor cu_k, Tensor used)");
  m.def("kvcache_pack(Tensor q, Tensor seqlens, int per_batch, int window_left, int splits, int align, "
        "int fixed_size, int total_rows, int group, bool split_keys) -> (Tensor q_rows, Tensor cu_q, Tensor cu_k, "
        "Tensor used)");
  m.def("kvcache_combine(Tensor out_partial, Tensor lse_partial, Tensor? sinks, int group) -> (Tensor out, Tensor lse)");
}

TORCH_LIBRARY_IMPL(flash3, CUDA, m) {
  m.impl("kvcache_splits", &flash3::kvcache_splits);
  m.impl("kvcache_pack", &flash3::kvcache_pack);
  m.impl("kvcache_combine", &flash3::kvcache_combine);
}
