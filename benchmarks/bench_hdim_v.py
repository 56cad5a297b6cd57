#!/usr/bin/env python3
"""A V head dim of its own (q and k of 192, v of 128, DeepSeek-V3-style prefill and
training): flash3 beside FlashAttention-3 and beside flash3's closest plain kernel (all
three head dims 192).

Dense bf16 batches of 16k tokens, 16 heads, causal and not, forward and backward (the
backward op alone, on the forward's saved outputs), each timed as CUDA-graph replays
(bench_varlen.graph_ms). FLOPs count each GEMM at its own head dim: forward
2 s_q s_k (d + dv) per head (halved when causal), backward 2 s_q s_k (3 d + 2 dv)
(S = Q K^T, dQ, dK at d; dP, dV at dv), so (192, 128) and (192, 192) compare in TFLOPs/s.
Writes <out-dir>/<tag>.json and <tag>.md; prints the table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

SCRIPT_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPT_DIR))
from bench_varlen import Impl, cell, measure, ratio_cell, results_header, tflops, write_results  # noqa: E402

TOKENS = 16384
HEADS = 16
D, DV = 192, 128


def flop(b, s, d, dv, causal, kind):
    per_pair = 2 * (d + dv) if kind == "fwd" else 2 * (3 * d + 2 * dv)
    return b * HEADS * s * s * per_pair * (0.5 if causal else 1.0)


def fns(impl, name, q, k, v, causal):
    """(forward fn, backward fn) of one backend."""
    scale = q.shape[-1] ** -0.5
    if name == "flash3":
        ops = torch.ops.flash3
        out, lse = ops.fwd(q, k, v, scale, causal)
        dout = torch.randn_like(out)
        return (lambda: ops.fwd(q, k, v, scale, causal),
                lambda: ops.bwd(dout, q, k, v, out, lse, None, scale, causal, False))
    fa3 = impl.fa3

    def fwd():
        return fa3._flash_attn_forward(q, k, v, softmax_scale=scale, causal=causal)

    out, lse = fwd()[:2]
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return fwd, (lambda: fa3._flash_attn_backward(dout, q, k, v, out, lse, None, None, None, None, None, None,
                                                  dq, dk, dv, scale, causal))


def run(impl, seqlens, kinds):
    rows = []
    for causal in (False, True):
        for s in seqlens:
            b = max(1, TOKENS // s)
            q, k = (torch.randn(b, s, HEADS, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            v = torch.randn(b, s, HEADS, DV, device="cuda", dtype=torch.bfloat16)
            v_plain = torch.randn(b, s, HEADS, D, device="cuda", dtype=torch.bfloat16)
            row = {"seqlen": s, "batch": b, "causal": causal}
            cells = {"flash3": fns(impl, "flash3", q, k, v, causal),
                     "flash3_plain": fns(impl, "flash3", q, k, v_plain, causal)}
            if impl.fa3 is not None:
                cells["fa3"] = fns(impl, "fa3", q, k, v, causal)
            for name, (f, g) in cells.items():
                dv = D if name == "flash3_plain" else DV
                for kind, fn in (("fwd", f), ("bwd", g)):
                    if kind not in kinds:
                        continue
                    ms = measure(fn)
                    row[f"{name}_{kind}_ms"] = ms
                    row[f"{name}_{kind}_tflops"] = tflops(flop(b, s, D, dv, causal, kind), ms) if ms else None
            rows.append(row)
            measured = " ".join(f"{k}={cell(v)}" for k, v in row.items() if "tflops" in k)
            print(f"  seqlen={s} causal={causal} {measured}", flush=True)
            del q, k, v, v_plain, cells
    return rows


def markdown(data):
    lines = [f"# q/k head dim {D}, v head dim {DV} (bf16, H200, {TOKENS} tokens, {HEADS} heads; CUDA-graph timing)",
             "", f"FlashAttention-3: {data['fa3']}", "",
             "| causal | seqlen | fwd flash3 | fwd FA3 | flash3/FA3 | fwd flash3 192/192 | ratio to 192/192 | "
             "bwd flash3 | bwd FA3 | flash3/FA3 | bwd flash3 192/192 | ratio to 192/192 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        cells = ["yes" if r["causal"] else "no", str(r["seqlen"])]
        for kind in ("fwd", "bwd"):
            mine, fa3, plain = (r.get(f"{n}_{kind}_tflops") for n in ("flash3", "fa3", "flash3_plain"))
            cells += [cell(mine), cell(fa3), ratio_cell(mine, fa3, 2), cell(plain), ratio_cell(mine, plain, 2)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"TFLOPs/s with each GEMM counted at its head dim ({D} or {DV}); '192/192' is flash3 with v of "
              f"head dim {D} on the same q and k."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=SCRIPT_DIR / "results")
    ap.add_argument("--tag", default="h200-hdim-v")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--kinds", default="fwd,bwd", help="fwd, bwd or both")
    args = ap.parse_args(argv)
    impl = Impl()
    data = results_header(impl)
    data["rows"] = run(impl, [int(x) for x in args.seqlens.split(",")], args.kinds.split(","))
    write_results(args.out_dir, args.tag, data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
