#!/usr/bin/env python3
"""Attention benchmark on the FlashAttention-3 paper's grid: flash3 vs cuDNN / FA2 (torch SDPA) / FA3.

Grid: batch*seqlen = 16384 tokens, hidden 2048 (nheads = 2048 // hdim), hdim in {64, 128, 256},
causal in {False, True}, seqlen in {512 ... 16384}; bf16 by default.

TFLOPs/s: forward FLOPs = 4*b*h*s*s*d (halved when causal); backward FLOPs = 2.5 x forward,
over (time(fwd+bwd) - time(fwd)). Time per call = median of `reps` timings after warm-up:
the headline figures replay CUDA graphs of the calls (kernels alone, no host launch cost,
for every backend alike; --timing events for eager calls instead), and eager calls between
CUDA events are timed beside them and reported in their own tables (labelled "eager").

--fp8: FP8 forward instead (implies --fwd-only): flash3's FP8 kernel on pre-quantised
inputs ("flash3 fp8"), the same end to end on bf16 inputs including the fused quantiser
("flash3 fp8+q"), FA3's FP8 forward when importable, and flash3 bf16 / cuDNN bf16 for
reference. The fused quantiser's own time and bandwidth (bf16 q, k, v read, e4m3 written)
are reported per config (quant_ms, quant_GBps in the JSON).

Outputs under --out-dir: <tag>.json, <tag>.md, <tag>_fwd.png, <tag>_bwd.png.
`--replot results/latest.json` rebuilds the .md and .png files from a JSON (no GPU needed).
See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import traceback
from pathlib import Path

SCRIPT_DIR = Path(__file__).resolve().parent
DEFAULT_OUT_DIR = SCRIPT_DIR / "results"

TOTAL_TOKENS = 16384
HIDDEN = 2048
DEFAULT_HDIMS = [64, 128, 256]
DEFAULT_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
ALL_BACKENDS = ["flash3", "sdpa-cudnn", "sdpa-flash", "fa3"]
FP8_BACKENDS = ["flash3-fp8", "flash3-fp8-e2e", "fa3-fp8", "cudnn-fp8", "flash3", "sdpa-cudnn"]
# Opt-in: flash3 with deterministic=True (measures what bitwise-repeatable dq costs).
EXTRA_BACKENDS = ["flash3-det"]
BACKEND_ALIASES = {
    "flash3": "flash3",
    "flash3-det": "flash3-det", "flash3-deterministic": "flash3-det",
    "sdpa-flash": "sdpa-flash", "fa2": "sdpa-flash", "flash": "sdpa-flash",
    "sdpa-cudnn": "sdpa-cudnn", "cudnn": "sdpa-cudnn",
    "fa3": "fa3", "flash_attn_interface": "fa3",
    "flash3-fp8": "flash3-fp8", "flash3-fp8-e2e": "flash3-fp8-e2e", "fa3-fp8": "fa3-fp8",
    "cudnn-fp8": "cudnn-fp8",
}
# Display labels (also cover implementation names found in the anchor JSON).
LABELS = {
    "flash3": "flash3",
    "flash3-det": "flash3 det.",
    "sdpa-cudnn": "cuDNN",
    "sdpa-flash": "FA2",
    "fa3": "FA3",
    "fa4": "FA4",
    "sdpa-efficient": "mem-eff",
    "fa3-fp8": "FA3 fp8",
    "flash3-fp8": "flash3 fp8",
    "flash3-fp8-e2e": "flash3 fp8+q",
    "cudnn-fp8": "cuDNN fp8",
}
# Column / bar order in tables and plots.
DISPLAY_ORDER = ["flash3", "flash3-det", "sdpa-cudnn", "sdpa-flash", "fa3", "flash3-fp8", "flash3-fp8-e2e", "fa3-fp8",
                 "cudnn-fp8"]
COLORS = {
    "flash3": "#d62728",
    "flash3-det": "#e377c2",
    "sdpa-cudnn": "#2ca02c",
    "sdpa-flash": "#1f77b4",
    "fa3": "#ff7f0e",
    "flash3-fp8": "#9467bd",
    "flash3-fp8-e2e": "#c5b0d5",
    "fa3-fp8": "#ffbb78",
    "cudnn-fp8": "#98df8a",
}
BWD_FLOP_FACTOR = 2.5
MISMATCH_WARN = 0.05  # max |out - ref| above which a progress line flags a mismatch


def label(impl: str) -> str:
    return LABELS.get(impl, impl)


# --------------------------------------------------------------------------------------
# FLOPs / shapes
# --------------------------------------------------------------------------------------

def config_shape(hdim: int, seqlen: int) -> tuple[int, int]:
    """(batch, nheads) for the paper's grid."""
    return max(1, TOTAL_TOKENS // seqlen), HIDDEN // hdim


def flops(batch: int, nheads: int, seqlen: int, hdim: int, causal: bool, kind: str = "fwd") -> float:
    f = 4.0 * batch * nheads * seqlen * seqlen * hdim
    if causal:
        f /= 2
    if kind == "bwd":
        f *= BWD_FLOP_FACTOR
    return f


def tflops_per_s(nflops: float, ms: float | None) -> float | None:
    if ms is None or ms <= 0 or not math.isfinite(ms):
        return None
    return nflops / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------------------
# GPU side (torch imported lazily so that --replot works without torch)
# --------------------------------------------------------------------------------------

class FatalCudaError(RuntimeError):
    """The CUDA context is unusable (sticky error); further measurements are meaningless."""


def _torch():
    import torch  # noqa: WPS433
    return torch


def torch_dtype(name: str):
    torch = _torch()
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def make_inputs(batch, seqlen, nheads, hdim, dtype, requires_grad=True, seed=0):
    """q, k, v in (batch, seqlen, nheads, headdim), plus a fixed random output gradient."""
    torch = _torch()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    shape = (batch, seqlen, nheads, hdim)

    def rnd():
        return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)

    q, k, v, grad = rnd(), rnd(), rnd(), rnd()
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, grad


def free_memory():
    torch = _torch()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def check_cuda_alive():
    torch = _torch()
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
    except Exception as e:  # noqa: BLE001
        raise FatalCudaError(f"CUDA context unusable after an error: {e}") from e


def _gpu_pad():
    """Queue a short GPU sleep before the start event so the host runs ahead of the GPU
    and the events time the kernels, not Python launch overhead."""
    torch = _torch()
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(1_000_000)  # ~0.5 ms at ~2 GHz


def time_fn(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of `reps` eager runs of fn(), each bracketed by CUDA events
    (a GPU sleep queued ahead of each keeps the host's launch time out of the span, but
    not the gaps between the kernels of one call)."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        _gpu_pad()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return statistics.median(times)


def time_graph(fn, reps: int) -> float:
    """Median milliseconds of one call of fn(), timed as `reps` replays of a CUDA graph of
    several calls (bench_varlen.graph_ms, which warms up itself: as many calls as take
    about 2 ms, at most 10): the kernels alone, with no host launch cost on any side.
    Raises if fn cannot be captured."""
    from bench_varlen import graph_ms  # noqa: WPS433  (torch at import; not for --replot)

    return graph_ms(fn, replays=reps)


def measure(fn, args, row: dict, key: str):
    """row[key]: the headline time, CUDA-graph replays (--timing graph, the default) or
    eager calls (--timing events); row[key + "_eager"]: the eager time, always. A backend
    whose calls cannot be captured gets no headline time (key + "_graph_error" says why)."""
    row[key + "_eager"] = time_fn(fn, args.warmup, args.reps)
    if args.timing == "events":
        row[key] = row[key + "_eager"]
        return
    try:
        row[key] = time_graph(fn, args.reps)  # right after the eager calls: already warm
    except Exception as e:  # noqa: BLE001
        check_cuda_alive()
        row[key] = None
        row[key + "_graph_error"] = _err(e)


# ---- backends -----------------------------------------------------------------------

class Backends:
    """Imports optional backends once and remembers why one is unavailable."""

    def __init__(self):
        self.flash3 = None
        self.flash3_error = None
        self.fa3 = None
        self.fa3_error = None
        self.cudnn = None
        self.cudnn_error = None
        try:
            import flash3  # noqa: WPS433
            self.flash3 = flash3
        except Exception as e:  # noqa: BLE001
            self.flash3_error = f"{type(e).__name__}: {e}"
        try:
            import flash_attn_interface  # noqa: WPS433
            self.fa3 = flash_attn_interface
        except Exception as e:  # noqa: BLE001
            self.fa3_error = f"{type(e).__name__}: {e}"
        try:
            # cuDNN's FP8 SDPA through the cudnn-frontend Python wheel (nvidia-cudnn-frontend),
            # on the libcudnn that torch loads.
            import cudnn  # noqa: WPS433
            self.cudnn = cudnn
        except Exception as e:  # noqa: BLE001
            self.cudnn_error = f"{type(e).__name__}: {e}"

    def flash3_info(self) -> dict:
        info = {"available": self.flash3 is not None, "import_error": self.flash3_error}
        if self.flash3 is not None:
            info["version"] = getattr(self.flash3, "__version__", None)
            info["file"] = getattr(self.flash3, "__file__", None)
            try:
                info["build_info"] = _jsonable(self.flash3.build_info())
            except Exception as e:  # noqa: BLE001
                info["build_info_error"] = f"{type(e).__name__}: {e}"
        return info

    def fa3_info(self) -> dict:
        info = {"available": self.fa3 is not None, "import_error": self.fa3_error}
        if self.fa3 is not None:
            info["file"] = getattr(self.fa3, "__file__", None)
            try:
                import importlib.metadata as md  # noqa: WPS433
                for dist in ("flash_attn_3", "flash-attn-3", "flash_attn"):
                    try:
                        info["version"] = md.version(dist)
                        break
                    except md.PackageNotFoundError:
                        pass
            except Exception:  # noqa: BLE001
                pass
        return info

    def unavailable_reason(self, impl: str) -> str | None:
        if impl in ("flash3", "flash3-det") and self.flash3 is None:
            return f"import flash3 failed: {self.flash3_error}"
        if impl in ("fa3", "fa3-fp8") and self.fa3 is None:
            return f"import flash_attn_interface failed: {self.fa3_error}"
        if impl == "cudnn-fp8" and self.cudnn is None:
            return f"import cudnn (nvidia-cudnn-frontend) failed: {self.cudnn_error}"
        return None

    def flash3_supported(self, kind: str, dtype: str, hdim: int, causal: bool) -> bool | None:
        """flash3.is_supported if present; None when it cannot be asked."""
        fn = getattr(self.flash3, "is_supported", None) if self.flash3 is not None else None
        if fn is None:
            return None
        try:
            return bool(fn(kind, dtype, hdim, causal))
        except Exception:  # noqa: BLE001
            return None

    def attention_fn(self, impl: str, causal: bool):
        """Returns (fn(q, k, v) -> out in (b, s, h, d), context manager factory)."""
        import contextlib  # noqa: WPS433

        if impl in ("flash3", "flash3-det"):
            f3 = self.flash3
            deterministic = impl == "flash3-det"

            def fn(q, k, v):
                return _first(f3.attention(q, k, v, causal=causal, deterministic=deterministic))
            return fn, contextlib.nullcontext

        if impl in ("flash3-fp8", "fa3-fp8"):
            # The kernel alone: inputs quantised once (cached per input tensors), outside
            # the timed call. flash3: block scales + incoherent processing (fused
            # quantiser); FA3: a plain cast with unit descales, as its benchmarks do.
            f3, fa3 = self.flash3, self.fa3
            cache = {}

            def quantised(q, k, v):
                key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
                if key not in cache:
                    cache.clear()
                    q, k, v = q.detach(), k.detach(), v.detach()
                    if impl == "flash3-fp8":
                        cache[key] = tuple(f3.fp8.quantize(q, k, v))
                    else:
                        cache[key] = tuple(t.to(_torch().float8_e4m3fn) for t in (q, k, v))
                return cache[key]

            def fn(q, k, v):
                t = quantised(q, k, v)
                if impl == "flash3-fp8":
                    return f3.fp8.attention_fp8(*t, causal=causal)
                return _first(fa3.flash_attn_func(*t, causal=causal))
            return fn, contextlib.nullcontext

        if impl == "cudnn-fp8":
            return cudnn_fp8_fn(self.cudnn, causal), contextlib.nullcontext

        if impl == "flash3-fp8-e2e":
            f3 = self.flash3

            def fn(q, k, v):
                return f3.fp8.attention(q.detach(), k.detach(), v.detach(), causal=causal)
            return fn, contextlib.nullcontext

        if impl == "fa3":
            fa3 = self.fa3

            def fn(q, k, v):
                return _first(fa3.flash_attn_func(q, k, v, causal=causal))
            return fn, contextlib.nullcontext

        if impl in ("sdpa-flash", "sdpa-cudnn"):
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: WPS433
            import torch.nn.functional as F  # noqa: WPS433
            backend = SDPBackend.FLASH_ATTENTION if impl == "sdpa-flash" else SDPBackend.CUDNN_ATTENTION

            def fn(q, k, v):
                # (b, s, h, d) -> (b, h, s, d): free transposed views, as a user would write it.
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
                return out.transpose(1, 2)
            return fn, (lambda: sdpa_kernel([backend]))

        raise ValueError(f"unknown backend {impl}")


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def cudnn_fp8_fn(cudnn, causal: bool):
    """cuDNN's FP8 SDPA forward (cudnn-frontend graph), as the anchors' cuDNN fp8 column:
    e4m3 q, k, v cast once from the inputs (outside the timed call, per-tensor unit
    descales, as for fa3-fp8), P quantised with scale 256 (descale 1/256), e4m3 output
    (cuDNN's FP8 SDPA on Hopper writes FP8 O). The graph is built once per shape, in the
    untimed first call. Returns fn(q, k, v) -> out in (b, s, h, d), e4m3."""
    torch = _torch()
    state = {}
    handle = cudnn.create_handle()

    def build(q, k, v):
        b, s, h, d = q.shape
        dims, strides = [b, h, s, d], [s * h * d, d, h * d, 1]  # (b, s, h, d) memory as (b, h, s, d)
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        tq, tk, tv = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in ("q", "k", "v"))
        names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
        scalars = {n: graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32) for n in names}
        o, _stats, amax_s, amax_o = graph.sdpa_fp8(
            q=tq, k=tk, v=tv, **scalars, is_inference=True, attn_scale=d ** -0.5, use_causal_mask=causal,
            name="sdpa_fp8")
        o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
        for amax in (amax_s, amax_o):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        one = torch.ones(1, 1, 1, 1, device=q.device, dtype=torch.float32)
        values = {"descale_q": one, "descale_k": one, "descale_v": one, "descale_s": one / 256,
                  "scale_s": one * 256, "scale_o": one}
        q8, k8, v8 = (t.detach().to(torch.float8_e4m3fn) for t in (q, k, v))
        out = torch.empty(b, s, h, d, device=q.device, dtype=torch.float8_e4m3fn)
        # Views with the graph's dims and strides; the memory stays (b, s, h, d).
        pack = {tq: q8.transpose(1, 2), tk: k8.transpose(1, 2), tv: v8.transpose(1, 2), o: out.transpose(1, 2),
                **{scalars[n]: values[n] for n in names},
                amax_s: torch.empty_like(one), amax_o: torch.empty_like(one)}
        workspace = torch.empty(graph.get_workspace_size(), device=q.device, dtype=torch.uint8)
        return {"graph": graph, "pack": pack, "workspace": workspace, "out": out}

    def fn(q, k, v):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), tuple(q.shape))
        if state.get("key") != key:
            state.clear()
            state.update(build(q, k, v), key=key)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        state["graph"].execute(state["pack"], state["workspace"], handle=handle)
        return state["out"]
    return fn


def _jsonable(obj):
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        return repr(obj)


def _err(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) < 500 else msg[:500] + "..."


def run_backend(backends: Backends, impl: str, hdim: int, causal: bool, seqlen: int,
                dtype_name: str, inputs, args) -> tuple[dict, object]:
    """Measure one backend on one config. Returns (row, first forward output or None)."""
    torch = _torch()
    q, k, v, grad = inputs
    batch, nheads = config_shape(hdim, seqlen)
    row = {"impl": impl, "hdim": hdim, "causal": causal, "seqlen": seqlen, "batch": batch,
           "nheads": nheads, "dtype": dtype_name,
           "fwd_ms": None, "fwd_tflops": None, "fwdbwd_ms": None, "bwd_ms": None, "bwd_tflops": None}
    want_bwd = not args.fwd_only
    reason = backends.unavailable_reason(impl)
    if reason is not None:
        row["fwd_error"] = reason
        if want_bwd:
            row["bwd_error"] = reason
        return row, None

    fn, ctx = backends.attention_fn(impl, causal)
    out_sample = None
    bwd_possible = want_bwd
    with ctx():
        # ---- forward (grad enabled, inputs require grad: the forward of a training step)
        fwd_ok = True
        if impl.startswith("flash3") and backends.flash3_supported("fwd", dtype_name, hdim, causal) is False:
            row["fwd_error"] = "unsupported (flash3.is_supported('fwd', ...) is False)"
            fwd_ok = False
        if impl.startswith("flash3-fp8") and not backends.flash3.fp8.is_supported(hdim, causal):
            row["fwd_error"] = "unsupported (flash3.fp8.is_supported(...) is False)"
            fwd_ok = False
        if impl == "flash3-fp8" and fwd_ok:
            # The fused quantiser on its own: reads bf16 q, k, v, writes e4m3 and scales.
            try:
                qd, kd, vd = (t.detach() for t in (q, k, v))
                row["quant_ms"] = time_fn(lambda: backends.flash3.fp8.quantize(qd, kd, vd), args.warmup, args.reps)
                row["quant_GBps"] = 3 * q.numel() * 3 / (row["quant_ms"] * 1e-3) / 1e9
            except Exception as e:  # noqa: BLE001
                check_cuda_alive()
                row["quant_error"] = _err(e)
        if fwd_ok:
            try:
                out_sample = fn(q, k, v).detach()
                measure(lambda: fn(q, k, v), args, row, "fwd_ms")
            except Exception as e:  # noqa: BLE001
                check_cuda_alive()
                # Retry once as pure inference (some kernels may refuse inputs needing grad).
                try:
                    with torch.no_grad():
                        out_sample = fn(q, k, v).detach()
                        measure(lambda: fn(q, k, v), args, row, "fwd_ms")
                    row["fwd_mode"] = "no_grad"
                    row["fwd_grad_error"] = _err(e)
                    bwd_possible = False
                    if want_bwd:
                        row["bwd_error"] = "forward with requires_grad failed: " + _err(e)
                except Exception as e2:  # noqa: BLE001
                    check_cuda_alive()
                    row["fwd_error"] = _err(e2)
                    bwd_possible = False
                    if want_bwd:
                        row["bwd_error"] = "forward failed"
                    out_sample = None
        else:
            bwd_possible = False
            if want_bwd:
                row["bwd_error"] = "forward unsupported"

        # ---- forward + backward
        if bwd_possible and impl.startswith("flash3") and \
                backends.flash3_supported("bwd", dtype_name, hdim, causal) is False:
            row["bwd_error"] = "unsupported (flash3.is_supported('bwd', ...) is False)"
            bwd_possible = False
        if bwd_possible:
            def fwd_bwd():
                out = fn(q, k, v)
                torch.autograd.grad(out, (q, k, v), grad)
            try:
                fwd_bwd()
                measure(fwd_bwd, args, row, "fwdbwd_ms")
                for suffix in ("", "_eager"):
                    both, fwd = row.get(f"fwdbwd_ms{suffix}"), row.get(f"fwd_ms{suffix}")
                    row[f"bwd_ms{suffix}"] = both - fwd if both is not None and fwd is not None else None
            except Exception as e:  # noqa: BLE001  (NotImplementedError, RuntimeError, OOM, ...)
                check_cuda_alive()
                row["bwd_error"] = _err(e)

    for kind in ("fwd", "bwd"):
        nflops = flops(batch, nheads, seqlen, hdim, causal, kind)
        row[f"{kind}_tflops"] = tflops_per_s(nflops, row.get(f"{kind}_ms"))
        row[f"{kind}_eager_tflops"] = tflops_per_s(nflops, row.get(f"{kind}_ms_eager"))
    return row, out_sample


def measure_ceilings(warmup: int = 5, reps: int = 20, fp8: bool = False) -> dict:
    """bf16 GEMM 8192^3 TFLOPs/s and device-to-device copy bandwidth (read + write)."""
    torch = _torch()
    res = {}
    try:
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
        ms = time_fn(lambda: torch.matmul(a, b, out=c), warmup, reps)
        res["gemm_bf16_tflops"] = 2.0 * n ** 3 / (ms * 1e-3) / 1e12
        res["gemm_bf16_ms"] = ms
        if fp8:
            # FP8 GEMM ceiling (e4m3 x e4m3 -> bf16, cuBLASLt through torch._scaled_mm).
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
            one = torch.ones((), device="cuda")
            ms8 = time_fn(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), warmup, reps)
            res["gemm_fp8_tflops"] = 2.0 * n ** 3 / (ms8 * 1e-3) / 1e12
            del a8, b8
        del a, b, c
    except Exception as e:  # noqa: BLE001
        res["gemm_error"] = _err(e)
    free_memory()
    try:
        nbytes = 1 << 30
        src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        ms = time_fn(lambda: dst.copy_(src), warmup, reps)
        res["copy_TBps"] = 2.0 * nbytes / (ms * 1e-3) / 1e12
        res["copy_bytes"] = nbytes
        del src, dst
    except Exception as e:  # noqa: BLE001
        res["copy_error"] = _err(e)
    free_memory()
    return res


def machine_info(backends: Backends) -> dict:
    torch = _torch()
    props = torch.cuda.get_device_properties(0)
    info = {
        "device": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "sm_count": getattr(props, "multi_processor_count", None),
        "gpu_memory_GiB": round(props.total_memory / 2 ** 30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "host": platform.node(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "flash3": backends.flash3_info(),
        "fa3": backends.fa3_info(),
    }
    return info


# --------------------------------------------------------------------------------------
# Output writers (pure Python; usable with --replot)
# --------------------------------------------------------------------------------------

def _row_index(rows):
    return {(r["impl"], int(r["hdim"]), bool(r["causal"]), int(r["seqlen"])): r for r in rows}


def _configs(rows):
    return sorted({(int(r["hdim"]), bool(r["causal"]), int(r["seqlen"])) for r in rows})


def _impls_with_data(rows, kind):
    key = f"{kind}_tflops"
    present = {r["impl"] for r in rows if r.get(key) is not None}
    listed = {r["impl"] for r in rows}
    ordered = [i for i in DISPLAY_ORDER if i in listed]
    ordered += sorted(i for i in listed if i not in DISPLAY_ORDER)
    # fa3 only if it produced any number (it is optional); the others always get a column.
    return [i for i in ordered if i != "fa3" or i in present]


def _kinds(data):
    """The tables to write: forward and backward at the headline timing, then, where the
    run recorded them beside it, the same at eager timing."""
    kinds = data.get("kinds") or ["fwd", "bwd"]
    out = [k for k in ("fwd", "bwd") if k in kinds]
    if data.get("args", {}).get("timing", "events") == "graph":
        out += [f"{k}_eager" for k in out if any(r.get(f"{k}_eager_tflops") is not None for r in data["rows"])]
    return out


def load_anchor(path: str | None, impls: list[str]) -> dict | None:
    if not path:
        return None
    with open(path) as f:
        a = json.load(f)
    rows = [r for r in a.get("rows", []) if r.get("impl") in impls]
    return {"path": str(path), "device": a.get("device"), "torch": a.get("torch"),
            "date": a.get("date"), "ceilings": a.get("ceilings", {}), "impls": impls,
            "index": _row_index(rows)}


def _fmt(x, nd=0):
    return "-" if x is None else f"{x:.{nd}f}"


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return None if not xs else math.exp(sum(math.log(x) for x in xs) / len(xs))


def write_json(path: Path, data: dict):
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def markdown_table(data: dict, kind: str, anchor: dict | None) -> list[str]:
    rows = data["rows"]
    idx = _row_index(rows)
    impls = _impls_with_data(rows, kind)
    key = f"{kind}_tflops"
    ratio_pairs = [(a, b) for a, b in (("flash3", "sdpa-cudnn"), ("flash3", "fa3"),
                                       ("flash3-fp8", "cudnn-fp8"), ("flash3-fp8", "fa3-fp8"))
                   if a in impls and b in impls]
    anchor_impls = []
    if anchor:
        anchor_impls = [i for i in anchor["impls"]
                        if any(k[0] == i and r.get(key) is not None for k, r in anchor["index"].items())]
    header = ["hdim", "causal", "seqlen"] + [label(i) for i in impls]
    header += [f"{label(a)}/{label(b)}" for a, b in ratio_pairs]
    header += [f"{label(i)} (anchor)" for i in anchor_impls]
    # An FP8 anchor (fa3-fp8, cudnn-fp8) is compared with flash3's FP8 kernel, the others
    # with the 16-bit one.
    anchor_num = {i: "flash3-fp8" if i.endswith("-fp8") and "flash3-fp8" in impls else "flash3"
                  for i in anchor_impls}
    anchor_impls_ratio = [i for i in anchor_impls if anchor_num[i] in impls]
    header += [f"{label(anchor_num[i])}/{label(i)} (anchor)" for i in anchor_impls_ratio]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ratios = {p: [] for p in ratio_pairs}
    aratios = {i: [] for i in anchor_impls}
    for hdim, causal, seqlen in _configs(rows):
        vals = {i: idx.get((i, hdim, causal, seqlen), {}).get(key) for i in impls}
        cells = [str(hdim), "yes" if causal else "no", str(seqlen)] + [_fmt(vals[i]) for i in impls]
        for p in ratio_pairs:
            r = _ratio(vals[p[0]], vals[p[1]])
            ratios[p].append(r)
            cells.append(_fmt(r, 2))
        avals = {i: anchor["index"].get((i, hdim, causal, seqlen), {}).get(key) for i in anchor_impls}
        cells += [_fmt(avals[i]) for i in anchor_impls]
        for i in anchor_impls_ratio:
            r = _ratio(vals[anchor_num[i]], avals[i])
            aratios[i].append(r)
            cells.append(_fmt(r, 2))
        lines.append("| " + " | ".join(cells) + " |")
    summary = []
    for (a, b), rs in ratios.items():
        g = _geomean(rs)
        if g is not None:
            n = sum(1 for r in rs if r is not None)
            summary.append(f"{label(a)}/{label(b)} geomean {g:.2f} over {n} configs")
    for i, rs in aratios.items():
        g = _geomean(rs)
        if g is not None:
            ahead = sum(1 for r in rs if r is not None and r >= 1.0)
            summary.append(f"{label(anchor_num[i])}/{label(i)} (anchor) geomean {g:.2f}, "
                           f"ahead on {ahead} of {sum(1 for r in rs if r is not None)}")
    if summary:
        lines += ["", "Summary: " + "; ".join(summary) + "."]
    return lines


def write_markdown(path: Path, data: dict, anchor: dict | None = None):
    m = data.get("machine", {})
    f3 = m.get("flash3", {}) or {}
    lines = [f"# Attention benchmark: {data.get('tag', path.stem)}", ""]
    lines.append(f"- GPU: {m.get('device', data.get('device', '?'))} "
                 f"(SMs {m.get('sm_count', '?')}), torch {m.get('torch', data.get('torch', '?'))}, "
                 f"CUDA {m.get('cuda', '?')}, cuDNN {m.get('cudnn', data.get('cudnn', '?'))}, "
                 f"date {m.get('date', '?')}")
    if f3:
        if f3.get("available"):
            bi = f3.get("build_info") or {}
            nk = len(bi.get("kernels", []) or []) if isinstance(bi, dict) else "?"
            lines.append(f"- flash3: version {f3.get('version')}, {nk} kernels in build_info")
        else:
            lines.append(f"- flash3: NOT importable ({f3.get('import_error')})")
    fa3 = m.get("fa3", {}) or {}
    if fa3:
        lines.append("- FA3 (flash_attn_interface): " +
                     ("available" + (f", version {fa3['version']}" if fa3.get("version") else "")
                      if fa3.get("available") else f"not available ({fa3.get('import_error')})"))
    a = data.get("args", {})
    timing = ("CUDA-graph replays (the kernels alone; eager calls in the last tables)"
              if a.get("timing", "events") == "graph" else "eager calls, each between CUDA events")
    lines.append(f"- dtype {data.get('dtype', a.get('dtype', 'bf16'))}, batch*seqlen = {TOTAL_TOKENS}, "
                 f"hidden {HIDDEN}, median of {a.get('reps', '?')} timings after "
                 f"{a.get('warmup', '?')} warm-up runs: {timing}")
    lines.append("- TFLOPs/s: fwd = 4*b*h*s*s*d / t_fwd (halved when causal); "
                 "bwd = 2.5 x fwd FLOPs / (t_fwd+bwd - t_fwd). Labels: cuDNN = torch SDPA cuDNN backend, "
                 "FA2 = torch SDPA flash backend, FA3 = flash_attn_interface.")
    c = data.get("ceilings") or {}
    if c:
        lines.append(f"- Ceilings (same run): bf16 GEMM 8192^3 {_fmt(c.get('gemm_bf16_tflops'))} TFLOPs/s, "
                     f"device copy {_fmt(c.get('copy_TBps'), 2)} TB/s (read+write)")
    if anchor:
        ac = anchor.get("ceilings") or {}
        lines.append(f"- Columns marked **(anchor)** come from a DIFFERENT run ({anchor['path']}: "
                     f"{anchor.get('device')}, torch {anchor.get('torch')}"
                     + (f", bf16 GEMM {_fmt(ac.get('gemm_bf16_tflops'))} TFLOPs/s, copy "
                        f"{_fmt(ac.get('copy_TBps'), 2)} TB/s" if ac else "")
                     + "). Run-to-run spread is ~10%: prefer same-run ratios.")
    titles = {"fwd": "Forward TFLOPs/s", "bwd": "Backward TFLOPs/s",
              "fwd_eager": "Forward TFLOPs/s, eager calls", "bwd_eager": "Backward TFLOPs/s, eager calls"}
    for kind in _kinds(data):
        lines += ["", f"## {titles[kind]}", ""]
        lines += markdown_table(data, kind, anchor)
    errs = _error_summary(data["rows"])
    if errs:
        lines += ["", "## Failures (recorded as -)", ""]
        lines += errs
    path.write_text("\n".join(lines) + "\n")


def _error_summary(rows, limit=40) -> list[str]:
    seen = {}
    keys = {"fwd": "fwd_error", "bwd": "bwd_error", "fwd graph capture": "fwd_ms_graph_error",
            "fwd+bwd graph capture": "fwdbwd_ms_graph_error"}
    for r in rows:
        for kind, key in keys.items():
            e = r.get(key)
            if e:
                seen.setdefault((r["impl"], kind, e), []).append(
                    f"{r['hdim']}/{'c' if r['causal'] else 'nc'}/{r['seqlen']}")
    out = []
    for (impl, kind, e), cfgs in list(seen.items())[:limit]:
        where = ", ".join(cfgs[:6]) + (f", ... ({len(cfgs)} configs)" if len(cfgs) > 6 else "")
        out.append(f"- {label(impl)} {kind} [{where}]: `{e.replace('`', chr(39))[:200]}`")
    return out


def plot(path: Path, data: dict, kind: str, anchor: dict | None = None) -> bool:
    """Paper-style figure: one subplot per (hdim, causal), bars grouped by seqlen."""
    try:
        import matplotlib  # noqa: WPS433
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: WPS433
    except Exception as e:  # noqa: BLE001
        print(f"warning: matplotlib unavailable ({e}); skipping {path.name}", file=sys.stderr)
        return False
    rows = data["rows"]
    key = f"{kind}_tflops"
    idx = _row_index(rows)
    impls = _impls_with_data(rows, kind)
    series = [(i, None) for i in impls]
    if anchor:
        series += [(i, "anchor") for i in anchor["impls"]
                   if any(k[0] == i and r.get(key) is not None for k, r in anchor["index"].items())]
    configs = _configs(rows)
    hdims = sorted({c[0] for c in configs})
    causals = sorted({c[1] for c in configs})
    seqlens = sorted({c[2] for c in configs})
    if not configs or not series:
        return False
    nrow, ncol = len(hdims), len(causals)
    fig, axes = plt.subplots(nrow, ncol, figsize=(max(6.0, 0.35 * len(seqlens) * len(series)) * ncol,
                                                  3.6 * nrow), squeeze=False)
    width = 0.8 / len(series)
    ymax = 0.0
    for r_i, hdim in enumerate(hdims):
        for c_i, causal in enumerate(causals):
            ax = axes[r_i][c_i]
            for s_i, (impl, src) in enumerate(series):
                vals = []
                for s in seqlens:
                    rr = (anchor["index"] if src else idx).get((impl, hdim, causal, s), {})
                    vals.append(rr.get(key))
                xs = [j + (s_i - (len(series) - 1) / 2) * width for j in range(len(seqlens))]
                hs = [v if v is not None else 0 for v in vals]
                name = label(impl) + (" (anchor run)" if src else "")
                color = COLORS.get(impl, None)
                bars = ax.bar(xs, hs, width, label=name, color=color,
                              hatch="//" if src else None, alpha=0.55 if src else 1.0,
                              edgecolor="black" if src else None, linewidth=0.4)
                for bar, v in zip(bars, vals):
                    txt = "n/a" if v is None else f"{v:.0f}"
                    ax.annotate(txt, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                                fontsize=6, rotation=90)
                ymax = max([ymax] + [v for v in vals if v is not None])
            ax.set_xticks(range(len(seqlens)))
            ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_xlabel("Sequence length")
            ax.set_ylabel("Speed (TFLOPs/s)")
            ax.set_title(f"{'Backward' if kind == 'bwd' else 'Forward'}, "
                         f"{'with' if causal else 'without'} causal mask, head dim {hdim}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
    for row_axes in axes:
        for ax in row_axes:
            ax.set_ylim(0, ymax * 1.18 + 1)
    handles, labels_ = axes[0][0].get_legend_handles_labels()
    m = data.get("machine", {})
    fig.legend(handles, labels_, loc="upper center", ncol=len(series), frameon=False,
               bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(f"Attention {kind} speed, {data.get('dtype', 'bf16')}, {m.get('device', data.get('device', ''))}"
                 f" ({data.get('tag', '')})", y=1.03, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return True


def write_outputs(data: dict, out_dir: Path, tag: str, anchor: dict | None, write_js: bool = True):
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    if write_js:
        write_json(out_dir / f"{tag}.json", data)
        files.append(out_dir / f"{tag}.json")
    write_markdown(out_dir / f"{tag}.md", data, anchor)
    files.append(out_dir / f"{tag}.md")
    for kind in _kinds(data):
        if kind.endswith("_eager"):
            continue  # figures of the headline timing only
        p = out_dir / f"{tag}_{kind}.png"
        if plot(p, data, kind, anchor):
            files.append(p)
    return files


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--hdims", type=_int_list, default=DEFAULT_HDIMS, help="comma list, default 64,128,256")
    p.add_argument("--seqlens", type=_int_list, default=DEFAULT_SEQLENS,
                   help="comma list, default 512,...,16384 (batch = 16384 // seqlen)")
    p.add_argument("--causal", choices=["both", "true", "false"], default="both")
    p.add_argument("--backends", type=_backend_list, default=list(ALL_BACKENDS),
                   help="comma list of flash3,sdpa-cudnn,sdpa-flash,fa3 (aliases: cudnn, fa2)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fwd-only", action="store_true", help="skip the backward pass")
    g.add_argument("--bwd-only", action="store_true",
                   help="report only backward (the forward is still timed: bwd = fwd+bwd - fwd)")
    p.add_argument("--fp8", action="store_true",
                   help="benchmark the FP8 forward (backends " + ",".join(FP8_BACKENDS) + "; implies --fwd-only)")
    p.add_argument("--reps", type=int, default=30, help="timed runs per measurement (median)")
    p.add_argument("--timing", choices=["graph", "events"], default="graph",
                   help="headline timing: CUDA-graph replays (default; eager calls are timed beside) "
                        "or eager calls between CUDA events")
    p.add_argument("--warmup", type=int, default=10, help="untimed runs before each measurement")
    p.add_argument("--ceilings", action=argparse.BooleanOptionalAction, default=True,
                   help="measure bf16 GEMM 8192^3 and device copy bandwidth first (default on)")
    p.add_argument("--out-dir", type=Path, default=None, help=f"default {DEFAULT_OUT_DIR}")
    p.add_argument("--tag", default=None, help='output file prefix (default "latest")')
    p.add_argument("--compare-anchor", metavar="PATH", default=None,
                   help="baseline JSON from another run (e.g. /work/shared/anchors/h200-baseline.json); "
                        "adds '(anchor)' columns/bars")
    p.add_argument("--anchor-impls", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                   default=["fa3"], help="impls to take from the anchor JSON (default fa3)")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="no measurements: rebuild .md and .png from this JSON (no GPU needed)")
    return p.parse_args(argv)


def _int_list(s):
    return [int(x) for x in s.split(",") if x.strip()]


def _backend_list(s):
    out = []
    for x in s.split(","):
        x = x.strip().lower()
        if not x:
            continue
        if x not in BACKEND_ALIASES:
            raise argparse.ArgumentTypeError(f"unknown backend {x!r}; choose from {sorted(BACKEND_ALIASES)}")
        if BACKEND_ALIASES[x] not in out:
            out.append(BACKEND_ALIASES[x])
    return out


def replot(args) -> int:
    src = Path(args.replot)
    with open(src) as f:
        data = json.load(f)
    out_dir = args.out_dir or src.parent
    tag = args.tag or src.stem
    anchor = load_anchor(args.compare_anchor, args.anchor_impls)
    files = write_outputs(data, out_dir, tag, anchor, write_js=False)
    for f in files:
        print(f"wrote {f}")
    return 0


def _progress_line(kind, hdim, causal, seqlen, rows_by_impl, backends_order, diffs):
    key = f"{kind}_tflops"
    parts = [f"{kind} hdim={hdim} causal={causal} seqlen={seqlen}"]
    order = [i for i in DISPLAY_ORDER if i in backends_order]
    for impl in order:
        v = rows_by_impl.get(impl, {}).get(key)
        parts.append(f"{label(impl)}={'-' if v is None else f'{v:.1f}'}")
    quant = rows_by_impl.get("flash3-fp8", {}).get("quant_ms")
    if kind == "fwd" and quant is not None:
        parts.append(f"quantise={quant * 1e3:.0f}us ({rows_by_impl['flash3-fp8']['quant_GBps']:.0f} GB/s)")
    if kind == "fwd" and diffs:
        parts.append(diffs)
    return " ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fp8:
        args.fwd_only = True
        if args.backends == list(ALL_BACKENDS):
            args.backends = list(FP8_BACKENDS)
    if args.replot:
        return replot(args)

    try:
        torch = _torch()
    except Exception as e:  # noqa: BLE001
        print(f"no CUDA GPU (torch not importable: {e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2

    out_dir = args.out_dir or DEFAULT_OUT_DIR
    tag = args.tag or "latest"
    anchor = load_anchor(args.compare_anchor, args.anchor_impls)
    dtype = torch_dtype(args.dtype)
    causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    kinds = ["fwd"] if args.fwd_only else (["bwd"] if args.bwd_only else ["fwd", "bwd"])

    backends = Backends()
    info = machine_info(backends)
    print(f"GPU {info['device']} (sm_{''.join(map(str, info['capability']))}, {info['sm_count']} SMs), "
          f"torch {info['torch']}, CUDA {info['cuda']}, cuDNN {info['cudnn']}", flush=True)
    if backends.flash3 is None:
        print(f"warning: import flash3 failed: {backends.flash3_error}", flush=True)
    else:
        bi = info["flash3"].get("build_info")
        nk = len(bi.get("kernels", [])) if isinstance(bi, dict) else "?"
        print(f"flash3 {info['flash3'].get('version')} from {info['flash3'].get('file')}: {nk} kernels", flush=True)
    if "fa3" in args.backends and backends.fa3 is None:
        print(f"note: FA3 (flash_attn_interface) not available: {backends.fa3_error}", flush=True)
    backends_run = [b for b in args.backends if not (b in ("fa3", "fa3-fp8") and backends.fa3 is None)]

    data = {
        "schema": "flash3-bench-v1",
        "tag": tag,
        "device": info["device"], "torch": info["torch"], "cudnn": info["cudnn"],
        "machine": info,
        "dtype": args.dtype,
        "kinds": kinds,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "ceilings": {},
        "rows": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{tag}.json"

    rc = 0
    try:
        if args.ceilings:
            data["ceilings"] = measure_ceilings(fp8=args.fp8)
            c = data["ceilings"]
            if c.get("gemm_fp8_tflops"):
                print(f"ceilings: fp8 GEMM 8192^3 {_fmt(c.get('gemm_fp8_tflops'), 1)} TFLOPs/s", flush=True)
            print(f"ceilings: bf16 GEMM 8192^3 {_fmt(c.get('gemm_bf16_tflops'), 1)} TFLOPs/s, "
                  f"device copy {_fmt(c.get('copy_TBps'), 2)} TB/s", flush=True)
        for hdim in args.hdims:
            for causal in causals:
                for seqlen in args.seqlens:
                    batch, nheads = config_shape(hdim, seqlen)
                    inputs = make_inputs(batch, seqlen, nheads, hdim, dtype)
                    rows_by_impl, outs = {}, {}
                    for impl in backends_run:
                        try:
                            row, out = run_backend(backends, impl, hdim, causal, seqlen, args.dtype, inputs, args)
                        except FatalCudaError:
                            raise
                        except Exception as e:  # noqa: BLE001  (anything unexpected: record, go on)
                            check_cuda_alive()
                            row, out = {"impl": impl, "hdim": hdim, "causal": causal, "seqlen": seqlen,
                                        "batch": batch, "nheads": nheads, "dtype": args.dtype,
                                        "fwd_tflops": None, "bwd_tflops": None, "fwd_error": _err(e)}, None
                            traceback.print_exc()
                        rows_by_impl[impl] = row
                        if out is not None:
                            outs[impl] = out
                    diffs = _compare_outputs(outs, rows_by_impl)
                    data["rows"].extend(rows_by_impl.values())
                    for kind in kinds:
                        print(_progress_line(kind, hdim, causal, seqlen, rows_by_impl, backends_run, diffs),
                              flush=True)
                    del inputs, outs
                    free_memory()
                    write_json(json_path, data)  # partial results survive a crash
    except FatalCudaError as e:
        print(f"FATAL: {e}; writing partial results", file=sys.stderr, flush=True)
        data["fatal_error"] = str(e)
        rc = 3
    except KeyboardInterrupt:
        print("interrupted; writing partial results", file=sys.stderr, flush=True)
        data["interrupted"] = True
        rc = 130
    data["machine"]["date_end"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    for f in write_outputs(data, out_dir, tag, anchor):
        print(f"wrote {f}", flush=True)
    return rc


def _compare_outputs(outs: dict, rows_by_impl: dict) -> str:
    """max |out - ref| of every backend vs a reference (first of FA2, cuDNN, FA3 that ran)."""
    ref = next((i for i in ("sdpa-flash", "sdpa-cudnn", "fa3") if i in outs), None)
    if ref is None:
        return ""
    msgs = []
    for impl, out in outs.items():
        if impl == ref:
            continue
        try:
            d = (out.float() - outs[ref].float()).abs().max().item()
        except Exception:  # noqa: BLE001
            continue
        rows_by_impl[impl]["max_abs_diff"] = d
        rows_by_impl[impl]["diff_ref"] = ref
        if impl == "flash3" or d > MISMATCH_WARN:
            msgs.append(f"maxdiff({label(impl)} vs {label(ref)})={d:.2g}"
                        + (" MISMATCH" if d > MISMATCH_WARN else ""))
    return " ".join(msgs)


if __name__ == "__main__":
    sys.exit(main())
