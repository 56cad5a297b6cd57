#!/usr/bin/env python3
"""A/B timing of whole flash3 builds, forward and backward, on the paper grid.

Each tree (a folder holding the flash3 package with its _C*.so) runs in a process of its
own, the passes in rotating order, every call timed as a CUDA-graph replay (the kernels
alone; benchmarks/bench_varlen.py graph_ms). Prints per cell each tree's median forward
and backward TFLOPs/s, the ratio of every tree to the first, the geomeans, and whether
the outputs (out, lse, dq, dk, dv) are bitwise identical across trees.

  python3 dev/ab_passes.py --trees old=/tmp/old,new=. --passes 2 --out $OUT/ab.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GRID = [(d, c, s) for d in (64, 128, 256) for c in (False, True) for s in (512, 1024, 2048, 4096, 8192, 16384)]


def worker(tree, dtype_name):
    sys.path.insert(0, str(Path(tree).resolve()))
    sys.path.insert(1, str(ROOT / "benchmarks"))
    import torch
    import flash3
    from bench_varlen import graph_ms

    assert str(Path(flash3.__file__).resolve()).startswith(str(Path(tree).resolve())), flash3.__file__
    dtype = getattr(torch, dtype_name)
    rows = []
    for d, causal, s in GRID:
        b, h = max(1, 16384 // s), 2048 // d
        g = torch.Generator(device="cuda").manual_seed(d * 100003 + s * 7 + causal)
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
        scale = d ** -0.5
        ops = torch.ops.flash3
        out, lse = ops.fwd(q, k, v, scale, causal, False)
        grads = ops.bwd(dout, q, k, v, out, lse, None, scale, causal, True)
        digest = hashlib.sha1()
        for t in (out, lse, *grads):
            digest.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
        fwd_ms = graph_ms(lambda: ops.fwd(q, k, v, scale, causal, False))
        bwd_ms = graph_ms(lambda: ops.bwd(dout, q, k, v, out, lse, None, scale, causal, False))
        flop = 4.0 * b * h * s * s * d / (2 if causal else 1)
        rows.append({"hdim": d, "causal": causal, "seqlen": s, "fwd": flop / fwd_ms / 1e9,
                     "bwd": 2.5 * flop / bwd_ms / 1e9, "digest": digest.hexdigest()})
    print(json.dumps(rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", help="name=folder,... (the first is the base)")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out")
    ap.add_argument("--worker")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.dtype)
        return
    if not args.trees:
        ap.error("--trees is required")
    trees = dict(t.split("=", 1) for t in args.trees.split(","))
    names = list(trees)
    runs = {n: [] for n in names}
    for p in range(args.passes):
        order = names[p % len(names):] + names[:p % len(names)]
        for n in order:
            res = subprocess.run([sys.executable, __file__, "--worker", trees[n], "--dtype", args.dtype],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr[-3000:])
                raise SystemExit(f"tree {n} failed")
            runs[n].append(json.loads(res.stdout.strip().splitlines()[-1]))
    base = names[0]
    table = []
    ratios = {n: {"fwd": [], "bwd": []} for n in names[1:]}
    print("| hdim | causal | seqlen | " + " | ".join(f"{n} fwd | {n} bwd" for n in names) + " | bitwise |")
    for i, (d, c, s) in enumerate(GRID):
        med = {n: {k: statistics.median(r[i][k] for r in runs[n]) for k in ("fwd", "bwd")} for n in names}
        same = len({runs[n][0][i]["digest"] for n in names}) == 1
        for n in names[1:]:
            for k in ("fwd", "bwd"):
                ratios[n][k].append(med[n][k] / med[base][k])
        cells = " | ".join(f"{med[n]['fwd']:.0f} | {med[n]['bwd']:.0f}" for n in names)
        print(f"| {d} | {'yes' if c else 'no'} | {s} | {cells} | {'yes' if same else 'NO'} |")
        table.append({"hdim": d, "causal": c, "seqlen": s, "median": med, "bitwise": same})
    for n in names[1:]:
        for k in ("fwd", "bwd"):
            xs = ratios[n][k]
            gm = math.exp(sum(map(math.log, xs)) / len(xs))
            print(f"{n}/{base} {k}: geomean {gm:.4f}, min {min(xs):.3f}, max {max(xs):.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "table": table}, indent=1))


if __name__ == "__main__":
    main()
