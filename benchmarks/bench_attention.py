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
import json
import platform
import sys
import traceback
from pathlib import Path

from attention_backends import ALL_BACKENDS, BACKEND_ALIASES, FP8_BACKENDS, Backends
from gpu_timing import FatalCudaError, check_cuda_alive, error_text, free_memory, lazy_torch, measure, time_fn
from grid_report import DISPLAY_ORDER, fmt_num, label, load_anchor, write_json, write_outputs
from paper_grid import DEFAULT_HDIMS, DEFAULT_SEQLENS, config_shape, flops, tflops_per_s

SCRIPT_DIR = Path(__file__).resolve().parent
DEFAULT_OUT_DIR = SCRIPT_DIR / "results"
MISMATCH_WARN = 0.05  # max |out - ref| above which a progress line flags a mismatch


def torch_dtype(name: str):
    torch = lazy_torch()
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def make_inputs(batch, seqlen, nheads, hdim, dtype, requires_grad=True, seed=0):
    """q, k, v in (batch, seqlen, nheads, headdim), plus a fixed random output gradient."""
    torch = lazy_torch()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    shape = (batch, seqlen, nheads, hdim)

    def rnd():
        return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)

    q, k, v, grad = rnd(), rnd(), rnd(), rnd()
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v, grad


def run_backend(backends: Backends, impl: str, hdim: int, causal: bool, seqlen: int,
                dtype_name: str, inputs, args) -> tuple[dict, object]:
    """Measure one backend on one config. Returns (row, first forward output or None)."""
    torch = lazy_torch()
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
                row["quant_error"] = error_text(e)
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
                    row["fwd_grad_error"] = error_text(e)
                    bwd_possible = False
                    if want_bwd:
                        row["bwd_error"] = "forward with requires_grad failed: " + error_text(e)
                except Exception as e2:  # noqa: BLE001
                    check_cuda_alive()
                    row["fwd_error"] = error_text(e2)
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
                row["bwd_error"] = error_text(e)

    for kind in ("fwd", "bwd"):
        nflops = flops(batch, nheads, seqlen, hdim, causal, kind)
        row[f"{kind}_tflops"] = tflops_per_s(nflops, row.get(f"{kind}_ms"))
        row[f"{kind}_eager_tflops"] = tflops_per_s(nflops, row.get(f"{kind}_ms_eager"))
    return row, out_sample


def measure_ceilings(warmup: int = 5, reps: int = 20, fp8: bool = False) -> dict:
    """bf16 GEMM 8192^3 TFLOPs/s and device-to-device copy bandwidth (read + write)."""
    torch = lazy_torch()
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
        res["gemm_error"] = error_text(e)
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
        res["copy_error"] = error_text(e)
    free_memory()
    return res


def machine_info(backends: Backends) -> dict:
    torch = lazy_torch()
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
        torch = lazy_torch()
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
                print(f"ceilings: fp8 GEMM 8192^3 {fmt_num(c.get('gemm_fp8_tflops'), 1)} TFLOPs/s", flush=True)
            print(f"ceilings: bf16 GEMM 8192^3 {fmt_num(c.get('gemm_bf16_tflops'), 1)} TFLOPs/s, "
                  f"device copy {fmt_num(c.get('copy_TBps'), 2)} TB/s", flush=True)
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
                                        "fwd_tflops": None, "bwd_tflops": None, "fwd_error": error_text(e)}, None
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
