// The gradients of flash3::fwd and flash3::fwd_varlen, registered with the dispatcher's
// Autograd key. They are C++ so that no Python runs between a layer's call and its
// kernels, in the forward pass or in the backward pass (the autograd engine calls the
// backward op from its own thread, without the GIL).
//
// Each forward op runs below autograd through the dispatcher, and its backward calls
// flash3::bwd / flash3::bwd_varlen through the dispatcher, so torch.compile traces
// both as the ops they are (their fake implementations are in flash3/interface.py and
// flash3/varlen.py).
//
// Gradients are not materialised: when only `out` is used, the backward gets no dlse;
// when only `lse` is used, dout is zeros. The sinks get a gradient only when they
// require one.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Variable;
using torch::autograd::variable_list;
using OptionalTensor = std::optional<at::Tensor>;
using OutLse = std::tuple<at::Tensor, at::Tensor>;
using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

OptionalTensor defined_or_none(at::Tensor const& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; }

// The options every op ends with (api.cpp): window, softcap, sinks.
struct Options {
  int64_t window_left;
  int64_t window_right;
  double softcap;
};

void save_options(AutogradContext* ctx, double softmax_scale, bool causal, bool deterministic, Options options,
                  OptionalTensor const& sinks) {
  ctx->set_materialize_grads(false);
  ctx->saved_data["softmax_scale"] = softmax_scale;
  ctx->saved_data["causal"] = causal;
  ctx->saved_data["deterministic"] = deterministic;
  ctx->saved_data["window_left"] = options.window_left;
  ctx->saved_data["window_right"] = options.window_right;
  ctx->saved_data["softcap"] = options.softcap;
  ctx->saved_data["sinks_grad"] = sinks.has_value() && sinks->requires_grad();
}

Options saved_options(AutogradContext* ctx) {
  return {ctx->saved_data["window_left"].toInt(), ctx->saved_data["window_right"].toInt(),
          ctx->saved_data["softcap"].toDouble()};
}

// dout: zeros when only the lse was used.
at::Tensor dout_of(variable_list const& grads, at::Tensor const& out) {
  return grads[0].defined() ? grads[0] : at::zeros_like(out);
}

class Attention : public torch::autograd::Function<Attention> {
 public:
  static variable_list forward(AutogradContext* ctx, Variable const& q, Variable const& k, Variable const& v,
                               double softmax_scale, bool causal, bool deterministic, int64_t window_left,
                               int64_t window_right, double softcap, OptionalTensor const& sinks) {
    static auto const op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flash3::fwd", "")
                               .typed<OutLse(at::Tensor const&, at::Tensor const&, at::Tensor const&, double, bool,
                                             bool, int64_t, int64_t, double, OptionalTensor const&)>();
    at::AutoDispatchBelowADInplaceOrView const below_autograd;
    auto [out, lse] = op.call(q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap, sinks);
    save_options(ctx, softmax_scale, causal, deterministic, {window_left, window_right, softcap}, sinks);
    ctx->save_for_backward({q, k, v, out, lse, sinks.value_or(at::Tensor())});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto const op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("flash3::bwd", "")
            .typed<Grads(at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&,
                         at::Tensor const&, at::Tensor const&, OptionalTensor const&, double, bool, bool, int64_t,
                         int64_t, double, OptionalTensor const&)>();
    variable_list const saved = ctx->get_saved_variables();
    at::Tensor const &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    Options const options = saved_options(ctx);
    auto [dq, dk, dv, dsinks] =
        op.call(dout_of(grads, out), q, k, v, out, lse, defined_or_none(grads[1]),
                ctx->saved_data["softmax_scale"].toDouble(), ctx->saved_data["causal"].toBool(),
                ctx->saved_data["deterministic"].toBool(), options.window_left, options.window_right,
                options.softcap, defined_or_none(saved[5]));
    // One entry per forward argument: (q, k, v, softmax_scale, causal, deterministic,
    // window_left, window_right, softcap, sinks).
    Variable const none;
    return {dq, dk, dv, none, none, none, none, none, none,
            ctx->saved_data["sinks_grad"].toBool() ? dsinks : none};
  }
};

class AttentionVarlen : public torch::autograd::Function<AttentionVarlen> {
 public:
  static variable_list forward(AutogradContext* ctx, Variable const& q, Variable const& k, Variable const& v,
                               Variable const& cu_seqlens_q, Variable const& cu_seqlens_k,
                               OptionalTensor const& seqused_q, OptionalTensor const& seqused_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic,
                               int64_t window_left, int64_t window_right, double softcap, OptionalTensor const& sinks,
                               OptionalTensor const& page_table, int64_t page_size, int64_t page_rows,
                               int64_t rows_per_query, bool split_keys) {
    static auto const op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("flash3::fwd_varlen", "")
            .typed<OutLse(at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&,
                          at::Tensor const&, OptionalTensor const&, OptionalTensor const&, int64_t, int64_t, double,
                          bool, bool, int64_t, int64_t, double, OptionalTensor const&, OptionalTensor const&, int64_t,
                          int64_t, int64_t, bool)>();
    at::AutoDispatchBelowADInplaceOrView const below_autograd;
    auto [out, lse] = op.call(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                              softmax_scale, causal, deterministic, window_left, window_right, softcap, sinks,
                              page_table, page_size, page_rows, rows_per_query, split_keys);
    save_options(ctx, softmax_scale, causal, deterministic, {window_left, window_right, softcap}, sinks);
    ctx->saved_data["max_seqlen_q"] = max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = max_seqlen_k;
    ctx->saved_data["paged"] = page_table.has_value();
    ctx->saved_data["kv_parts"] = rows_per_query != 1 || split_keys;
    ctx->save_for_backward({q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q.value_or(at::Tensor()),
                            seqused_k.value_or(at::Tensor()), sinks.value_or(at::Tensor())});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK_NOT_IMPLEMENTED(!ctx->saved_data["paged"].toBool(),
                                "flash3: no backward through a page_table (paged K/V is for inference)");
    TORCH_CHECK_NOT_IMPLEMENTED(!ctx->saved_data["kv_parts"].toBool(),
                                "flash3: no backward with rows_per_query or split_keys (the KV-cache call's parts)");
    static auto const op =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("flash3::bwd_varlen", "")
            .typed<Grads(at::Tensor const&, at::Tensor const&, at::Tensor const&, at::Tensor const&,
                         at::Tensor const&, at::Tensor const&, OptionalTensor const&, at::Tensor const&,
                         at::Tensor const&, OptionalTensor const&, OptionalTensor const&, int64_t, int64_t, double,
                         bool, bool, int64_t, int64_t, double, OptionalTensor const&)>();
    variable_list const saved = ctx->get_saved_variables();
    at::Tensor const &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    Options const options = saved_options(ctx);
    auto [dq, dk, dv, dsinks] =
        op.call(dout_of(grads, out), q, k, v, out, lse, defined_or_none(grads[1]), saved[5], saved[6],
                defined_or_none(saved[7]), defined_or_none(saved[8]), ctx->saved_data["max_seqlen_q"].toInt(),
                ctx->saved_data["max_seqlen_k"].toInt(), ctx->saved_data["softmax_scale"].toDouble(),
                ctx->saved_data["causal"].toBool(), ctx->saved_data["deterministic"].toBool(),
                options.window_left, options.window_right, options.softcap, defined_or_none(saved[9]));
    // One entry per forward argument; the sinks are the 16th.
    Variable const none;
    variable_list result(21);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    result[15] = ctx->saved_data["sinks_grad"].toBool() ? dsinks : none;
    return result;
  }
};

OutLse fwd_autograd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v, double softmax_scale, bool causal,
                    bool deterministic, int64_t window_left, int64_t window_right, double softcap,
                    OptionalTensor const& sinks) {
  auto outputs =
      Attention::apply(q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap, sinks);
  return {outputs[0], outputs[1]};
}

OutLse fwd_varlen_autograd(at::Tensor const& q, at::Tensor const& k, at::Tensor const& v,
                           at::Tensor const& cu_seqlens_q, at::Tensor const& cu_seqlens_k,
                           OptionalTensor const& seqused_q, OptionalTensor const& seqused_k, int64_t max_seqlen_q,
                           int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic,
                           int64_t window_left, int64_t window_right, double softcap, OptionalTensor const& sinks,
                           OptionalTensor const& page_table, int64_t page_size, int64_t page_rows,
                           int64_t rows_per_query, bool split_keys) {
  auto outputs = AttentionVarlen::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                        max_seqlen_k, softmax_scale, causal, deterministic, window_left, window_right,
                                        softcap, sinks, page_table, page_size, page_rows, rows_per_query, split_keys);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(flash3, Autograd, m) {
  m.impl("fwd", &fwd_autograd);
  m.impl("fwd_varlen", &fwd_varlen_autograd);
}
