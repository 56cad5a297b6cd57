#!/usr/bin/env python3
"""A/B timing of forward builds on the GPU machine.

Each tree's flash3 module (a folder holding the flash3 package with its _C*.so) runs in a
process of its own, the passes in rotating order (base, new, new, base, ...), so that
drift of the card's clocks touches every tree alike. Every pass also times the references
(--refs: cuDNN through PyTorch SDPA by default; `fa3`, `fa3-fp8` for FlashAttention-3 where
flash_attn_interface imports) on the same inputs: the same-run references the benchmark
compares with. Prints, per cell, each tree's median TFLOPs/s over its passes, the ratio of
every tree to the first, each tree over each reference, and whether the trees' outputs
are bitwise identical; writes the raw passes as JSON.

  python3 dev/ab_fwd.py --trees base=.,new=.ab/new --cells 64:causal:512,1024 \\
      --cells 64:full:512 --passes 3 --out $OUT/ab.json

A tree may carry environment settings for its processes (path:NAME=VALUE:...), e.g. to time
one module against itself under another setting (--trees a=.,b=.:CUDA_MODULE_LOADING=EAGER);
--impl flash3-fp8 times the FP8 kernel on inputs quantised once (benchmarks/bench_attention.py).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_cells(specs):
    """'64:causal:512,1024' -> [(64, True, 512), (64, True, 1024)]."""
    cells = []
    for spec in specs:
        hdim, mask, seqlens = spec.split(":")
        if mask not in ("causal", "full"):
            raise SystemExit(f"--cells {spec!r}: the mask is 'causal' or 'full'")
        cells += [(int(hdim), mask == "causal", int(s)) for s in seqlens.split(",")]
    return cells


def worker(tree: str, cells, dtype: str, warmup: int, reps: int, impl: str, refs: list[str]) -> dict:
    sys.path.insert(0, str(Path(tree).resolve()))
    sys.path.insert(1, str(ROOT / "benchmarks"))
    import torch  # noqa: WPS433
    import flash3  # noqa: WPS433
    import bench_attention as bench  # noqa: WPS433

    if not str(Path(flash3.__file__).resolve()).startswith(str(Path(tree).resolve())):
        raise SystemExit(f"flash3 came from {flash3.__file__}, not from {tree}")
    backends = bench.Backends()
    results = []
    for hdim, causal, seqlen in cells:
        batch, nheads = bench.config_shape(hdim, seqlen)
        q, k, v, _ = bench.make_inputs(batch, seqlen, nheads, hdim, bench.torch_dtype(dtype), requires_grad=False,
                                       seed=hdim * 100003 + seqlen * 7 + causal)
        nflops = bench.flops(batch, nheads, seqlen, hdim, causal)
        row = {"hdim": hdim, "causal": causal, "seqlen": seqlen}
        for name in (impl, *refs):
            fn, ctx = backends.attention_fn(name, causal)
            with ctx():
                ms = bench.time_fn(lambda: fn(q, k, v), warmup, reps)
                if name == impl:
                    out = fn(q, k, v)
                    torch.cuda.synchronize()
                    row["digest"] = hashlib.sha1(out.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
            row["flash3" if name == impl else name] = bench.tflops_per_s(nflops, ms)
        results.append(row)
        del q, k, v
        bench.free_memory()
    return {"tree": tree, "rows": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", help="name=path,name=path (the first is the base)")
    ap.add_argument("--cells", action="append", required=True, help="hdim:causal|full:seqlen,seqlen,...")
    ap.add_argument("--passes", type=int, default=3, help="passes per tree")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--impl", default="flash3", choices=["flash3", "flash3-fp8"])
    ap.add_argument("--refs", default="sdpa-cudnn",
                    help="comma list of backends timed beside each pass (bench_attention.py names: sdpa-cudnn, fa3)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None, help="raw passes as JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cells = parse_cells(args.cells)
    refs = [r for r in args.refs.split(",") if r]

    if args.worker is not None:
        print(json.dumps(worker(args.worker, cells, args.dtype, args.warmup, args.reps, args.impl, refs)))
        return 0

    if not args.trees:
        ap.error("--trees is required")
    trees = [tuple(t.split("=", 1)) for t in args.trees.split(",")]
    order = []
    for p in range(args.passes):  # base, new, new, base, base, new, ...
        order += trees if p % 2 == 0 else trees[::-1]
    passes = []
    for name, spec in order:
        path, *settings = spec.split(":")
        # The tree's module comes first on the worker's path (checked there); PYTHONPATH
        # stays for the references (FlashAttention-3's build).
        env = dict(os.environ, **dict(x.split("=", 1) for x in settings))
        cmd = [sys.executable, __file__, "--worker", path, "--dtype", args.dtype, "--warmup", str(args.warmup),
               "--reps", str(args.reps), "--impl", args.impl, "--refs", args.refs] + [x for c in args.cells for x in ("--cells", c)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            print(f"pass of {name} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        passes.append({"name": name, **json.loads(done.stdout.strip().splitlines()[-1])})
        print(f"pass {len(passes)}/{len(order)}: {name}", file=sys.stderr, flush=True)
    if args.out:
        args.out.write_text(json.dumps({"cells": cells, "passes": passes}, indent=1))

    names = [n for n, _ in trees]
    header = ["hdim", "mask", "seqlen"] + names + [f"{n}/{names[0]}" for n in names[1:]] + \
        [f"{n}/{r}" for r in refs for n in names] + ["bitwise"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for i, (hdim, causal, seqlen) in enumerate(cells):
        med = {n: statistics.median(p["rows"][i]["flash3"] for p in passes if p["name"] == n) for n in names}
        ref = {(r, n): statistics.median(p["rows"][i][r] for p in passes if p["name"] == n) for r in refs for n in names}
        digests = {p["rows"][i]["digest"] for p in passes}
        cols = [str(hdim), "causal" if causal else "full", str(seqlen)] + [f"{med[n]:.1f}" for n in names]
        cols += [f"{med[n] / med[names[0]]:.3f}" for n in names[1:]]
        cols += [f"{med[n] / ref[r, n]:.3f}" for r in refs for n in names]
        cols.append("yes" if len(digests) == 1 else "no")
        print("| " + " | ".join(cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
