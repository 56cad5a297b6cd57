// The torch binding: tensor checks, FwdParams filling (the parts shared with the FP8
// binding are in api_common.h), op registration with the PyTorch dispatcher, and the
// pybind11 module that carries build information.
//
// The Python layer (flash3/interface.py) validates arguments first and raises
// TypeError/ValueError with the supported values; the checks here are the last line of
// defence for direct calls of torch.ops.flash3.fwd, so that bad input is an exception,
// never a launch over invalid memory.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <cutlass/version.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "api_common.h"
#include "sum_kv_heads.h"
#include "flash3/dispatch.h"
#include "flash3/params.h"

namespace {

flash3::DType to_dtype(at::ScalarType type) {
  TORCH_CHECK(type == at::kBFloat16 || type == at::kHalf,
              "flash3: q has dtype ", type, "; supported: torch.bfloat16, torch.float16");
  return type == at::kBFloat16 ? flash3::DType::kBF16 : flash3::DType::kFP16;
}

// The bf16/fp16 half of the checks; api_common.h holds those the FP8 binding shares.
void check_qkv(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale) {
  flash3::api::check_qkv_device(q, k, v);
  to_dtype(q.scalar_type());  // raises for an unsupported dtype
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "flash3: q, k, v must have one dtype");
  flash3::api::check_qkv_shapes(q, k, v, softmax_scale);
}

}  // namespace

namespace flash3::api {

// A key count past any sequence's: windows are not clamped to it.
constexpr int64_t kUnclampedKeys = int64_t(1) << 30;

// Where the sequences of a packed batch are (seqlen.h); the tensors are (total, nheads,
// headdim) viewed as (1, total, nheads, headdim).
struct Varlen {
  at::Tensor cu_seqlens_q, cu_seqlens_k;
  std::optional<at::Tensor> seqused_q, seqused_k;
  int64_t max_seqlen_q, max_seqlen_k;
  // The forward may read K and V through a page table (params.h).
  std::optional<at::Tensor> page_table = std::nullopt;
  int64_t page_size = 0, page_rows = 0;
  // The KV-cache call's GQA-packed split-KV parts (params.h), forward only.
  int64_t rows_per_query = 1;
  bool split_keys = false;
};

void set_varlen(FwdParams& params, Varlen const& varlen) {
  params.cu_seqlens_q = varlen.cu_seqlens_q.data_ptr<int>();
  params.cu_seqlens_k = varlen.cu_seqlens_k.data_ptr<int>();
  params.seqused_q = varlen.seqused_q.has_value() ? varlen.seqused_q->data_ptr<int>() : nullptr;
  params.seqused_k = varlen.seqused_k.has_value() ? varlen.seqused_k->data_ptr<int>() : nullptr;
  params.total_q = params.seqlen_q;  // fill_fwd_params saw one batch entry of all rows
  params.total_k = params.seqlen_k;
  params.batch = static_cast<int>(varlen.cu_seqlens_q.size(0) - 1);
  params.seqlen_q = static_cast<int>(varlen.max_seqlen_q);
  params.seqlen_k = static_cast<int>(varlen.max_seqlen_k);
  if (varlen.page_table.has_value()) {
    params.page_table = varlen.page_table->data_ptr<int>();
    params.page_size = static_cast<int>(varlen.page_size);
    params.page_rows = static_cast<int>(varlen.page_rows);
  }
  params.rows_per_query = static_cast<int>(varlen.rows_per_query);
  params.split_keys = varlen.split_keys;
}

// The tile table of a packed batch (flash3/scheduler_packed.h), sized for the kernels'
// shortest query tiles.
at::Tensor alloc_packed_tiles(FwdParams& params, at::Tensor const& like) {
  int64_t const capacity =
      flash3::packed_tile_bound(params.total_q, params.batch, params.nheads, flash3::kPackedMinBlockRows);
  TORCH_CHECK(capacity < (int64_t(1) << 31), "flash3: a packed batch of ", params.total_q, " rows, ", params.batch,
              " sequences and ", params.nheads, " heads has too many query tiles (at most 2^31)");
  // One entry more: the persistent kernels' claim counter (packed_tile_counter).
  at::Tensor tiles = at::empty({(capacity + 1) * 8}, like.options().dtype(at::kInt));
  params.packed_tiles = tiles.data_ptr<int>();
  params.packed_tiles_capacity = static_cast<int>(capacity);
  return tiles;
}

// The forward pass into out (like q) and lse ((batch, nheads, seqlen_q) float32), on
// (batch, seqlen, nheads, headdim) tensors (v and out: headdim_v; packed batches: one
// batch entry of all rows).
void run_forward(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& out,
                 at::Tensor const& lse, double softmax_scale, bool causal, Options const& options,
                 Varlen const* varlen) {
  flash3::DType const dtype = to_dtype(q.scalar_type());
  int64_t const headdim = q.size(3);
  flash3::api::DeviceInfo const& info = flash3::api::hopper_info(q);
  at::Tensor const q_tma = flash3::api::tma_ready(q);
  at::Tensor const k_tma = flash3::api::tma_ready(k);
  at::Tensor const v_tma = flash3::api::tma_ready(v);

  flash3::FwdParams params;
  flash3::api::fill_fwd_params(params, q_tma, k_tma, v_tma, out, lse, softmax_scale, info);
  at::Tensor packed_tiles;  // alive until the kernels are enqueued (stream-ordered reuse)
  if (varlen != nullptr) {
    set_varlen(params, *varlen);
    // None where every sequence fits one tile (scheduler_packed.h): decoding.
    if (params.seqlen_q > flash3::kPackedMinBlockRows) { packed_tiles = alloc_packed_tiles(params, q); }
  }
  // Split-KV parts align their masks to keys past max_seqlen_k (the keys a part reads):
  // the windows are not clamped to it.
  int64_t const mask_keys = varlen != nullptr && varlen->split_keys ? kUnclampedKeys : params.seqlen_k;
  flash3::MaskKind const mask = options.resolve(causal, params.seqlen_q, mask_keys, params);

  cudaError_t launch_status = cudaSuccess;
  bool const found = flash3::dispatch_fwd(dtype, static_cast<int>(headdim), mask, params,
                                          c10::cuda::getCurrentCUDAStream().stream(), &launch_status);
  TORCH_CHECK(found, "flash3: this build holds no forward kernel for dtype ", flash3::dtype_name(dtype),
              ", headdim ", headdim, ", headdim_v ", params.headdim_v, ", mask ", flash3::mask_name(mask),
              " (see flash3.build_info()['kernels'])");
  TORCH_CHECK(launch_status == cudaSuccess, "flash3: forward kernel launch failed: ",
              cudaGetErrorString(launch_status));
}

// The backward pass on (batch, seqlen, nheads, headdim) tensors (packed batches: one
// batch entry of all rows, with `varlen` saying where each sequence is) and lse
// (batch, nheads, seqlen_q); v, out and dout have headdim_v. Returns dq, dk, dv shaped
// like q, k, v.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run_backward(
    at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& out,
    at::Tensor const& lse, std::optional<at::Tensor> const& dlse, double softmax_scale, bool causal,
    bool deterministic, Options const& options, Varlen const* varlen) {
  flash3::DType const dtype = to_dtype(q.scalar_type());
  int64_t const rows_q = q.size(1), nheads = q.size(2), headdim = q.size(3);
  int64_t const rows_k = k.size(1), nheads_k = k.size(2);
  int64_t const batch = varlen != nullptr ? varlen->cu_seqlens_q.size(0) - 1 : q.size(0);
  int64_t const seqlen_q = varlen != nullptr ? varlen->max_seqlen_q : rows_q;
  int64_t const seqlen_k = varlen != nullptr ? varlen->max_seqlen_k : rows_k;

  // Rows that belong to no sequence (past seqused) get a zero gradient.
  bool const partial = varlen != nullptr && (varlen->seqused_q.has_value() || varlen->seqused_k.has_value());
  auto dq = partial ? at::zeros_like(q, at::MemoryFormat::Contiguous) : at::empty_like(q, at::MemoryFormat::Contiguous);
  auto dk = partial ? at::zeros_like(k, at::MemoryFormat::Contiguous) : at::empty_like(k, at::MemoryFormat::Contiguous);
  auto dv = partial ? at::zeros_like(v, at::MemoryFormat::Contiguous) : at::empty_like(v, at::MemoryFormat::Contiguous);
  // The sinks' gradient: float32 (nheads), or no elements without sinks.
  auto dsinks = options.sinks.has_value() ? at::zeros({nheads}, q.options().dtype(at::kFloat))
                                          : at::empty({0}, q.options().dtype(at::kFloat));
  if (batch == 0 || nheads == 0 || seqlen_q == 0 || seqlen_k == 0 || rows_q == 0 || rows_k == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    if (options.sinks.has_value() && batch > 0 && nheads > 0 && rows_q > 0 && (seqlen_k == 0 || rows_k == 0)) {
      // No keys: every row's probability sits on the sink, lse = sink and out = 0, so
      // d loss / d sink = sum over rows of dlse.
      if (dlse.has_value()) {
        dsinks = dlse->sum(at::IntArrayRef{0, 2});
      }
    }
    return {dq, dk, dv, dsinks};
  }

  flash3::api::DeviceInfo const& info = flash3::api::hopper_info(q);
  at::Tensor const q_tma = flash3::api::tma_ready(q);
  at::Tensor const k_tma = flash3::api::tma_ready(k);
  at::Tensor const v_tma = flash3::api::tma_ready(v);
  at::Tensor const do_tma = flash3::api::tma_ready(dout);
  at::Tensor const out_c = flash3::api::tma_ready(out);  // the preprocess reads it in 16-byte vectors
  at::Tensor const lse_c = lse.contiguous();
  at::Tensor dlse_c;
  if (dlse.has_value()) { dlse_c = dlse->contiguous(); }

  // The row statistics and the dQ workspace, in whole query tiles per sequence (seqlen.h).
  auto const f32 = q.options().dtype(at::kFloat);
  int64_t const pad = flash3::kVarlenRowPad;
  int64_t const seqlen_q_padded =
      varlen != nullptr ? (rows_q + batch * pad + pad - 1) / pad * pad : (seqlen_q + pad - 1) / pad * pad;
  int64_t const ws_batch = varlen != nullptr ? 1 : batch;
  auto lse_log2 = at::empty({ws_batch, nheads, seqlen_q_padded}, f32);
  auto dpsum = at::empty({ws_batch, nheads, seqlen_q_padded}, f32);
  int64_t const block_m = flash3::bwd_block_m(static_cast<int>(headdim));
  int64_t const m_blocks = varlen != nullptr ? seqlen_q_padded / block_m : (seqlen_q + block_m - 1) / block_m;
  auto dq_accum = at::zeros({ws_batch, nheads, m_blocks, block_m * headdim}, f32);
  at::Tensor dq_semaphore;
  if (deterministic) { dq_semaphore = at::zeros({ws_batch, nheads, m_blocks}, q.options().dtype(at::kInt)); }
  // GQA: float32 dK/dV. The query heads of a group add theirs into one zeroed K/V head
  // (bulk reductions or atomics), converted below (against a float32 slice per query head
  // summed by a second kernel: a quarter of the second pass's reads at 4 query heads per
  // K/V head).
  // Deterministic mode keeps a slice per query head, summed below in a fixed order.
  bool const gqa = nheads != nheads_k;
  bool const accumulate = gqa && !deterministic;
  int64_t const nheads_dkv = accumulate ? nheads_k : nheads;
  auto const f32_heads = [&](int64_t dim) {
    return partial || accumulate ? at::zeros({k.size(0), rows_k, nheads_dkv, dim}, f32)
                                 : at::empty({k.size(0), rows_k, nheads_dkv, dim}, f32);
  };
  at::Tensor dk_heads = gqa ? f32_heads(headdim) : dk;
  at::Tensor dv_heads = gqa ? f32_heads(v.size(3)) : dv;

  flash3::BwdParams params;
  flash3::api::fill_fwd_params(params, q_tma, k_tma, v_tma, out_c, lse_c, softmax_scale, info);
  if (varlen != nullptr) { set_varlen(params, *varlen); }
  flash3::MaskKind const mask = options.resolve(causal, params.seqlen_q, params.seqlen_k, params);
  at::Tensor dsink_rows;
  if (options.sinks.has_value()) {
    dsink_rows = at::zeros({ws_batch, nheads, seqlen_q_padded}, f32);
    params.dsink_rows_ptr = dsink_rows.data_ptr<float>();
  }
  using flash3::api::set_tensor;
  set_tensor(params.do_ptr, params.do_batch_stride, params.do_row_stride, params.do_head_stride, do_tma);
  set_tensor(params.dq_ptr, params.dq_batch_stride, params.dq_row_stride, params.dq_head_stride, dq);
  set_tensor(params.dk_ptr, params.dk_batch_stride, params.dk_row_stride, params.dk_head_stride, dk_heads);
  set_tensor(params.dv_ptr, params.dv_batch_stride, params.dv_row_stride, params.dv_head_stride, dv_heads);
  params.dkv_is_fp32 = gqa;
  params.dkv_accumulate = accumulate;
  params.dlse_ptr = dlse.has_value() ? dlse_c.data_ptr<float>() : nullptr;
  params.lse_log2_ptr = lse_log2.data_ptr<float>();
  params.dpsum_ptr = dpsum.data_ptr<float>();
  params.dq_accum_ptr = dq_accum.data_ptr<float>();
  params.dq_semaphore_ptr = deterministic ? dq_semaphore.data_ptr<int>() : nullptr;
  params.seqlen_q_padded = static_cast<int>(seqlen_q_padded);
  params.dq_m_blocks = static_cast<int>(m_blocks);
  params.deterministic = deterministic;

  cudaError_t launch_status = cudaSuccess;
  bool const found = flash3::dispatch_bwd(dtype, static_cast<int>(headdim), mask, params,
                                          c10::cuda::getCurrentCUDAStream().stream(), &launch_status);
  TORCH_CHECK(found, "flash3: this build holds no backward kernel for dtype ", flash3::dtype_name(dtype),
              ", headdim ", headdim, ", headdim_v ", params.headdim_v, ", mask ", flash3::mask_name(mask),
              " (see flash3.build_info()['kernels'])");
  TORCH_CHECK(launch_status == cudaSuccess, "flash3: backward kernel launch failed: ",
              cudaGetErrorString(launch_status));
  if (gqa) { flash3::api::sum_kv_heads(dk_heads, dv_heads, nheads_dkv / nheads_k, dk, dv); }
  if (options.sinks.has_value()) { dsinks = dsink_rows.sum(at::IntArrayRef{0, 2}); }
  return {dq, dk, dv, dsinks};
}

}  // namespace flash3::api

namespace {

// deterministic is the backward's (see bwd); the forward is deterministic either way.
std::tuple<at::Tensor, at::Tensor> fwd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                       double softmax_scale, bool causal, bool /*deterministic*/,
                                       int64_t window_left, int64_t window_right, double softcap,
                                       std::optional<at::Tensor> const& sinks) {
  check_qkv(q, k, v, softmax_scale);
  flash3::api::Options const options{window_left, window_right, softcap, sinks};
  options.check(q, q.size(2));
  c10::cuda::CUDAGuard const device_guard(q.device());
  at::Tensor out, lse;
  if (flash3::api::alloc_fwd_outputs(q, v, q.scalar_type(), out, lse)) {
    // No keys: with sinks, each row's whole probability is the sink's.
    if (sinks.has_value() && k.size(1) == 0) { lse.copy_(sinks->view({1, -1, 1}).expand_as(lse)); }
    return {out, lse};
  }
  flash3::api::run_forward(q, k, v, out, lse, softmax_scale, causal, options, nullptr);
  return {out, lse};
}

// Gradients of out = attention(q, k, v) given dout (and optionally dlse, the gradient of
// the returned lse). deterministic: dQ's per-key-tile partial sums are added in a fixed
// order (key tiles take turns per query tile) instead of as they finish.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd(
    at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& out,
    at::Tensor const& lse, std::optional<at::Tensor> const& dlse, double softmax_scale, bool causal,
    bool deterministic, int64_t window_left, int64_t window_right, double softcap,
    std::optional<at::Tensor> const& sinks) {
  check_qkv(q, k, v, softmax_scale);
  flash3::api::Options const options{window_left, window_right, softcap, sinks};
  options.check(q, q.size(2));
  int64_t const batch = q.size(0), seqlen_q = q.size(1), nheads = q.size(2);
  std::vector<int64_t> const out_shape_v{batch, seqlen_q, nheads, v.size(3)};
  at::IntArrayRef const out_shape(out_shape_v);
  TORCH_CHECK(dout.sizes() == out_shape && out.sizes() == out_shape,
              "flash3: dout and out must be (batch, seqlen_q, nheads, headdim_v) = ", out_shape);
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "flash3: dout and out must have the dtype of q");
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device() && lse.device() == q.device(),
              "flash3: dout, out and lse must be on the device of q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == batch && lse.size(1) == nheads &&
                  lse.size(2) == seqlen_q,
              "flash3: lse must be float32 (batch, nheads, seqlen_q)");
  if (dlse.has_value()) {
    TORCH_CHECK(dlse->sizes() == lse.sizes() && dlse->scalar_type() == at::kFloat && dlse->device() == q.device(),
                "flash3: dlse must be like lse");
  }
  c10::cuda::CUDAGuard const device_guard(q.device());
  return flash3::api::run_backward(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic, options,
                                   nullptr);
}

// Variable-length batches: q (total_q, nheads, headdim), k (total_k, nheads_k, headdim), v
// (total_k, nheads_k, headdim_v), cu_seqlens int32 (batch + 1), seqused int32 (batch) or
// None; out (total_q, nheads, headdim_v), lse float32 (nheads, total_q). The lengths stay on the device (seqlen.h).
void check_varlen(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& cu_seqlens_q,
                  at::Tensor const& cu_seqlens_k, std::optional<at::Tensor> const& seqused_q,
                  std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "flash3: q, k, v of a packed batch must be 3-D (total, nheads, headdim)");
  auto check_index = [&](at::Tensor const& t, char const* name, int64_t size) {
    TORCH_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == size && t.is_contiguous() &&
                    t.device() == q.device(),
                "flash3: ", name, " must be a contiguous int32 tensor of ", size, " elements on the device of q");
  };
  TORCH_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) >= 1, "flash3: cu_seqlens_q must be (batch + 1,)");
  int64_t const batch = cu_seqlens_q.size(0) - 1;
  check_index(cu_seqlens_q, "cu_seqlens_q", batch + 1);
  check_index(cu_seqlens_k, "cu_seqlens_k", batch + 1);
  if (seqused_q.has_value()) { check_index(*seqused_q, "seqused_q", batch); }
  if (seqused_k.has_value()) { check_index(*seqused_k, "seqused_k", batch); }
  TORCH_CHECK(max_seqlen_q >= 0 && max_seqlen_q < (int64_t(1) << 31) && max_seqlen_k >= 0 &&
                  max_seqlen_k < (int64_t(1) << 31),
              "flash3: max_seqlen_q and max_seqlen_k must be in [0, 2^31)");
  TORCH_CHECK(q.size(0) < (int64_t(1) << 31) && k.size(0) < (int64_t(1) << 31), "flash3: total rows must be < 2^31");
}

std::tuple<at::Tensor, at::Tensor> fwd_varlen(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                                              at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                                              std::optional<at::Tensor> const& seqused_q,
                                              std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q,
                                              int64_t max_seqlen_k, double softmax_scale, bool causal,
                                              bool /*deterministic*/, int64_t window_left, int64_t window_right,
                                              double softcap, std::optional<at::Tensor> const& sinks,
                                              std::optional<at::Tensor> const& page_table, int64_t page_size,
                                              int64_t page_rows, int64_t rows_per_query, bool split_keys) {
  check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k);
  TORCH_CHECK(rows_per_query >= 1 && max_seqlen_q % rows_per_query == 0, "flash3: rows_per_query is ",
              rows_per_query, "; supported: >= 1, dividing max_seqlen_q (", max_seqlen_q,
              ") and every sequence's rows");
  TORCH_CHECK(!split_keys || seqused_k.has_value(), "flash3: split_keys needs seqused_k");
  if (page_table.has_value()) {
    // Paged K and V (params.h): cu_seqlens_k holds virtual rows, the table maps them.
    TORCH_CHECK(page_table->scalar_type() == at::kInt && page_table->is_contiguous() &&
                    page_table->device() == q.device(),
                "flash3: page_table must be a contiguous int32 tensor on the device of q");
    TORCH_CHECK(page_size > 0 && page_size % flash3::kPageChunkRows == 0 && page_rows >= page_size &&
                    page_rows % flash3::kPageChunkRows == 0,
                "flash3: with a page_table, page_size (got ", page_size, ") and page_rows (got ", page_rows,
                ") must be positive multiples of ", flash3::kPageChunkRows, ", page_rows >= page_size");
    TORCH_CHECK(seqused_k.has_value(), "flash3: a page_table needs seqused_k");
    TORCH_CHECK(v.size(2) == k.size(2) && v.size(-1) == k.size(-1), "flash3: a paged v has the head dim of k (",
                k.size(-1), "), got ", v.size(-1));
  }
  flash3::api::Options const options{window_left, window_right, softcap, sinks};
  options.check(q, q.size(1));
  at::Tensor const q4 = q.unsqueeze(0);
  at::Tensor k4 = k.unsqueeze(0);
  at::Tensor v4 = v.unsqueeze(0);
  check_qkv(q4, k4, v4, softmax_scale);
  c10::cuda::CUDAGuard const device_guard(q.device());
  int64_t const total_q = q.size(0), nheads = q.size(1), headdim = q.size(2), headdim_v = v.size(2);
  at::Tensor out = at::empty({total_q, nheads, headdim_v}, q.options());
  at::Tensor lse = at::empty({nheads, total_q}, q.options().dtype(at::kFloat));
  if (cu_seqlens_q.size(0) == 1 || total_q == 0 || nheads == 0 || max_seqlen_q == 0) { return {out, lse}; }
  if (k.size(0) == 0) {
    // No key anywhere: every sequence's rows get 0 and lse -inf from the kernel, which
    // needs a row to describe K and V by.
    k4 = at::zeros({1, 1, k.size(1), headdim}, k.options());
    v4 = at::zeros({1, 1, v.size(1), headdim_v}, v.options());
  }
  flash3::api::Varlen const varlen{cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                                   page_table, page_size, page_rows, rows_per_query, split_keys};
  flash3::api::run_forward(q4, k4, v4, out.unsqueeze(0), lse.unsqueeze(0), softmax_scale, causal, options, &varlen);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd_varlen(
    at::Tensor const& dout, at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, at::Tensor const& out,
    at::Tensor const& lse, std::optional<at::Tensor> const& dlse, at::Tensor const& cu_seqlens_q,
    at::Tensor const& cu_seqlens_k, std::optional<at::Tensor> const& seqused_q,
    std::optional<at::Tensor> const& seqused_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
    bool causal, bool deterministic, int64_t window_left, int64_t window_right, double softcap,
    std::optional<at::Tensor> const& sinks) {
  check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k);
  flash3::api::Options const options{window_left, window_right, softcap, sinks};
  options.check(q, q.size(1));
  check_qkv(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale);
  int64_t const total_q = q.size(0), nheads = q.size(1);
  std::vector<int64_t> const out_shape_v{total_q, nheads, v.size(2)};
  at::IntArrayRef const out_shape(out_shape_v);
  TORCH_CHECK(dout.sizes() == out_shape && out.sizes() == out_shape,
              "flash3: dout and out must be (total_q, nheads, headdim_v) = ", out_shape);
  TORCH_CHECK(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "flash3: dout and out must have the dtype of q");
  TORCH_CHECK(dout.device() == q.device() && out.device() == q.device() && lse.device() == q.device(),
              "flash3: dout, out and lse must be on the device of q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == nheads && lse.size(1) == total_q,
              "flash3: lse must be float32 (nheads, total_q)");
  std::optional<at::Tensor> dlse3;
  if (dlse.has_value()) {
    TORCH_CHECK(dlse->sizes() == lse.sizes() && dlse->scalar_type() == at::kFloat && dlse->device() == q.device(),
                "flash3: dlse must be like lse");
    dlse3 = dlse->unsqueeze(0);
  }
  c10::cuda::CUDAGuard const device_guard(q.device());
  flash3::api::Varlen const varlen{cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k};
  auto [dq, dk, dv, dsinks] = flash3::api::run_backward(
      dout.unsqueeze(0), q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0), dlse3,
      softmax_scale, causal, deterministic, options, &varlen);
  return {dq.squeeze(0), dk.squeeze(0), dv.squeeze(0), dsinks};
}

pybind11::dict build_info() {
  pybind11::list kernels;
  for (auto const& kernel : flash3::built_kernels()) {
    pybind11::dict entry;
    entry["kind"] = kernel.kind;
    entry["dtype"] = flash3::dtype_name(kernel.dtype);
    entry["hdim"] = kernel.headdim;
    entry["hdim_v"] = kernel.headdim_v;
    entry["mask"] = flash3::mask_name(kernel.mask);
    entry["causal"] = kernel.mask == flash3::MaskKind::kCausal;
    kernels.append(entry);
  }
  pybind11::dict info;
  info["kernels"] = kernels;
  info["cuda_version"] = CUDART_VERSION;
  info["cutlass_version"] = std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." +
                            std::to_string(CUTLASS_PATCH);
  info["arch"] = "sm_90a";
  return info;
}

}  // namespace


TORCH_LIBRARY(flash3, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, bool deterministic=False, " FLASH3_OPTIONS
      ") -> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, float softmax_scale, "
      "bool causal, bool deterministic, " FLASH3_OPTIONS ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  m.def(
      "fwd_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_q, "
      "Tensor? seqused_k, int max_seqlen_q, int max_seqlen_k, float softmax_scale, bool causal, "
      "bool deterministic=False, " FLASH3_OPTIONS
      ", Tensor? page_table=None, int page_size=0, int page_rows=0, int rows_per_query=1, bool split_keys=False)"
      " -> (Tensor out, Tensor lse)");
  m.def(
      "bwd_varlen(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor? seqused_q, Tensor? seqused_k, int max_seqlen_q, "
      "int max_seqlen_k, float softmax_scale, bool causal, bool deterministic, " FLASH3_OPTIONS
      ") -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
}

TORCH_LIBRARY_IMPL(flash3, CUDA, m) {
  m.impl("fwd", &fwd);
  m.impl("bwd", &bwd);
  m.impl("fwd_varlen", &fwd_varlen);
  m.impl("bwd_varlen", &bwd_varlen);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash3 compiled kernels; the attention ops live in torch.ops.flash3";
  m.def("build_info", &build_info, "Kernels and toolchain of this build");
}
