#!/usr/bin/env python3
"""Sliding windows, softcap and attention sinks: flash3 beside FlashAttention-3.

Dense bf16 batches of 32k tokens, hidden 2048 (16 heads at hdim 128), forward and backward
(the backward op alone, on the forward's saved outputs), each timed as CUDA-graph replays
(bench_varlen.graph_ms). Configurations, all causal as in the models that use them:

* ``window1024``: a sliding window of 1024 keys (window_size (1023, 0)), Gemma-3-like;
* ``window4096``: 4096 keys, Mistral/Gemma-2-like;
* ``softcap``: softcap 50 over the whole causal mask (Gemma 2's global layers);
* ``window128``, ``window128+sinks``: 128 keys, without and with per-head sinks (gpt-oss);
  FlashAttention-3 has no sinks, so its column for the latter is the same window without
  them (compare flash3's two rows for what the sinks cost).

TFLOPs/s count the (query, key) pairs the mask lets through. Beside them, flash3's causal
kernel on the same shape shows what the options cost relative to plain causal attention.
Writes <out-dir>/<tag>.json and <tag>.md; prints the table.

--fp8: the FP8 forward instead (no backward): flash3's e4m3 kernel on inputs quantised
once outside the timing (block scales, incoherent processing) against FlashAttention-3's
e4m3 forward on a plain cast with unit descales (as bench_attention.py --fp8 times them),
and flash3's FP8 causal kernel on the same shape.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

SCRIPT_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPT_DIR))
from bench_varlen import (BWD_FLOP_FACTOR, Impl, cell, measure, ratio_cell, results_header, tflops,  # noqa: E402
                          write_results)

HIDDEN = 2048
TOKENS = 32768
CONFIGS = {
    # name: (window_left, softcap, sinks)
    "window1024": (1023, 0.0, False),
    "window4096": (4095, 0.0, False),
    "softcap": (-1, 50.0, False),
    "window128": (127, 0.0, False),
    "window128+sinks": (127, 0.0, True),
}


def visible_pairs(s, left):
    """Pairs a causal mask with a left window lets through, for seqlen_q = seqlen_k = s."""
    if left < 0 or left >= s - 1:
        return s * (s + 1) // 2
    w = left + 1  # keys per row once the window is full
    return w * (w + 1) // 2 + (s - w) * w


def fns(impl, name, q, k, v, scale, left, softcap, sinks):
    """(forward fn, backward fn) of one backend on q, k, v, causal with the options."""
    ops = torch.ops.flash3
    if name == "flash3":
        out, lse = ops.fwd(q, k, v, scale, True, False, left, 0, softcap, sinks)
        dout = torch.randn_like(out)
        return (lambda: ops.fwd(q, k, v, scale, True, False, left, 0, softcap, sinks),
                lambda: ops.bwd(dout, q, k, v, out, lse, None, scale, True, False, left, 0, softcap, sinks))
    fa3 = impl.fa3

    def fwd():
        return fa3._flash_attn_forward(q, k, v, softmax_scale=scale, causal=True, window_size_left=left,
                                       window_size_right=0, softcap=softcap)

    out, lse = fwd()[:2]
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return fwd, (lambda: fa3._flash_attn_backward(dout, q, k, v, out, lse, None, None, None, None, None, None,
                                                  dq, dk, dv, scale, True, left, 0, softcap))


def fns_fp8(impl, name, q, k, v, scale, left, softcap, sinks):
    """(forward fn, None) of one backend's FP8 forward, causal with the options; q, k, v
    bf16, quantised here once."""
    if name == "flash3":
        fp8 = impl.flash3.fp8
        t = fp8.quantize(q, k, v)
        return (lambda: fp8.attention_fp8(*t, causal=True, softmax_scale=scale, window_size=(left, 0),
                                          softcap=softcap, sinks=sinks)), None
    q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
    return (lambda: impl.fa3._flash_attn_forward(q8, k8, v8, softmax_scale=scale, causal=True, window_size_left=left,
                                                 window_size_right=0, softcap=softcap)), None


def run(impl, hdims, seqlens, configs, fp8=False):
    rows = []
    kinds = (("fwd", 1.0),) if fp8 else (("fwd", 1.0), ("bwd", BWD_FLOP_FACTOR))
    make = fns_fp8 if fp8 else fns
    for d in hdims:
        h = HIDDEN // d
        for s in seqlens:
            b = max(1, TOKENS // s)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            scale = d ** -0.5
            causal = make(impl, "flash3", q, k, v, scale, -1, 0.0, None)
            causal_ms = (measure(causal[0]), measure(causal[1]) if causal[1] else None)
            for config in configs:
                left, softcap, with_sinks = CONFIGS[config]
                sinks = torch.randn(h, device="cuda", dtype=torch.float32) if with_sinks else None
                flop = 4 * b * h * d * visible_pairs(s, left)
                row = {"hdim": d, "seqlen": s, "batch": b, "config": config}
                f3 = make(impl, "flash3", q, k, v, scale, left, softcap, sinks)
                row["flash3_fwd_ms"] = measure(f3[0])
                row["flash3_bwd_ms"] = measure(f3[1]) if f3[1] else None
                if impl.fa3 is not None:
                    fa = make(impl, "fa3", q, k, v, scale, left, softcap, None)
                    row["fa3_fwd_ms"] = measure(fa[0])
                    row["fa3_bwd_ms"] = measure(fa[1]) if fa[1] else None
                causal_flop = 4 * b * h * d * visible_pairs(s, -1)
                for kind, factor in kinds:
                    for name in ("flash3", "fa3"):
                        ms = row.get(f"{name}_{kind}_ms")
                        row[f"{name}_{kind}_tflops"] = tflops(flop * factor, ms) if ms else None
                    cms = causal_ms[0 if kind == "fwd" else 1]
                    row[f"causal_{kind}_tflops"] = tflops(causal_flop * factor, cms) if cms else None
                rows.append(row)
                print(f"  hdim {d:3d} {s:6d} {config:16s} fwd {cell(row['flash3_fwd_tflops'])} / FA3 "
                      f"{cell(row.get('fa3_fwd_tflops'))} "
                      f"({ratio_cell(row['flash3_fwd_tflops'], row.get('fa3_fwd_tflops'), 2)})"
                      f"  bwd {cell(row.get('flash3_bwd_tflops'))} / FA3 {cell(row.get('fa3_bwd_tflops'))} "
                      f"({ratio_cell(row.get('flash3_bwd_tflops'), row.get('fa3_bwd_tflops'), 2)})", flush=True)
            del q, k, v
    return rows


def markdown(data):
    fp8 = data.get("fp8", False)
    kinds = ("fwd",) if fp8 else ("fwd", "bwd")
    what = "FP8 (e4m3) forward" if fp8 else "bf16"
    lines = [f"# Windows, softcap, sinks ({what}, causal, hidden 2048; CUDA-graph timing)", "",
             f"GPU: {data['device']}. FlashAttention-3: {data['fa3']}.", "",
             "| hdim | seqlen | config | " + " | ".join(
                 f"{k} flash3 | {k} FA3 | flash3/FA3 | {k} flash3 causal" for k in kinds) + " |",
             "|---|---|---|" + "---|---|---|---|" * len(kinds)]
    for r in data["rows"]:
        cells = [str(r["hdim"]), str(r["seqlen"]), r["config"]]
        for kind in kinds:
            cells += [cell(r.get(f"flash3_{kind}_tflops")), cell(r.get(f"fa3_{kind}_tflops")),
                      ratio_cell(r.get(f"flash3_{kind}_tflops"), r.get(f"fa3_{kind}_tflops"), 2),
                      cell(r.get(f"causal_{kind}_tflops"))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "TFLOPs/s over the pairs each mask lets through; 'causal' is flash3's causal kernel on the "
              "same shape (no window, no softcap)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=SCRIPT_DIR / "results")
    ap.add_argument("--tag", default=None, help="file name (default: h100-masks / h200-masks after the GPU)")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="4096,16384,32768")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--fp8", action="store_true", help="the FP8 forward (see above)")
    args = ap.parse_args(argv)
    impl = Impl()
    data = results_header(impl)
    data["fp8"] = args.fp8
    data["rows"] = run(impl, [int(x) for x in args.hdims.split(",")], [int(x) for x in args.seqlens.split(",")],
                       args.configs.split(","), fp8=args.fp8)
    card = "h200" if "H200" in data["device"] else "h100" if "H100" in data["device"] else "gpu"
    write_results(args.out_dir, args.tag or f"{card}-masks" + ("-fp8" if args.fp8 else ""), data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
