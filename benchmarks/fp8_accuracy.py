#!/usr/bin/env python3
"""FP8 attention accuracy: the FlashAttention-3 paper's Table 3 experiment, and a second
distribution with per-channel outliers.

For each head dim, q, k, v are drawn, cast to bf16, and the FP8 output is compared with a
float64 reference of the same bf16 inputs (RMSE over all output elements), for
  (a) per-tensor scales (FlashAttention-3's FP8 baseline),
  (b) block scales only (one per 64 query rows / 128 keys per head),
  (c) block scales + incoherent processing (random-sign Hadamard on Q and K),
plus the bf16 kernel (flash3.attention) as a floor when a GPU is present.

Distributions:
  outliers  the paper's: N(0, 1), with 0.1% of the entries drawn from N(0, 100) instead
            (standard deviation 10), independently for q, k, v.
  channel   LLM-activation-like: per-channel outliers. In K, 2 of every 64 head-dim
            channels carry a large token-consistent offset (+-8, sign per head) and a 4x
            gain, as the massive key channels of LLMs do; V has 5x outlier channels; Q is
            plain N(0, 1). Every token has a log-normal magnitude (sigma 0.3). No model
            weights can be downloaded here, so this stands in for real activations.

Backends: `emulate` runs the PyTorch specification (flash3.fp8.quantize_ref + emulate:
float64 math on the quantised inputs, P rounded to e4m3 as the kernel does) anywhere;
`kernel` runs the fused CUDA quantiser and the FP8 kernel (needs a Hopper GPU).

    python benchmarks/fp8_accuracy.py --backend emulate          # CPU ok
    python benchmarks/fp8_accuracy.py --backend kernel --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flash3  # noqa: E402
from flash3 import fp8  # noqa: E402
from flash3.reference import attention_ref  # noqa: E402

# (batch, seqlen, nheads) per head dim: the anchors' shapes (fp8-accuracy.md) at 64 and 128.
SHAPES = {64: (4, 1024, 16), 128: (2, 2048, 8), 256: (2, 2048, 4)}
METHODS = {
    "a": dict(name="per-tensor", per_tensor=True, incoherent=False),
    "b": dict(name="block", per_tensor=False, incoherent=False),
    "c": dict(name="block+hadamard", per_tensor=False, incoherent=True),
}


def make_inputs(dist: str, b: int, s: int, h: int, d: int, seed: int, device):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def outliers():
        x = torch.randn(b, s, h, d, generator=g)
        pick = torch.rand(b, s, h, d, generator=g) < 1e-3
        return torch.where(pick, torch.randn(b, s, h, d, generator=g) * 10.0, x)

    def channel(gain, offset):
        x = torch.randn(b, s, h, d, generator=g)
        n_out = max(1, d // 32)
        idx = torch.randperm(d, generator=g)[:n_out]
        signs = torch.randn(h, n_out, generator=g).sign()
        x[..., idx] = x[..., idx] * gain + signs * offset
        token_mag = torch.exp(0.3 * torch.randn(b, s, 1, 1, generator=g))
        return x * token_mag

    if dist == "outliers":
        q, k, v = outliers(), outliers(), outliers()
    elif dist == "channel":
        q, k, v = channel(1.0, 0.0), channel(4.0, 8.0), channel(5.0, 0.0)
    else:
        raise ValueError(dist)
    return [t.to(device=device, dtype=torch.bfloat16) for t in (q, k, v)]


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return math.sqrt(((a.double() - b.double()) ** 2).mean().item())


def reference(q, k, v, causal):
    # float64, head-chunked to bound memory.
    outs = []
    for h0 in range(0, q.shape[2], 4):
        out, _ = attention_ref(q[:, :, h0:h0 + 4], k[:, :, h0:h0 + 4], v[:, :, h0:h0 + 4], causal=causal,
                               softmax_scale=1.0 / math.sqrt(q.shape[-1]), upcast=True)
        outs.append(out)
    return torch.cat(outs, dim=2)


def run_method(backend, method, q, k, v, causal, seed):
    m = METHODS[method]
    if backend == "emulate":
        t = fp8.quantize(q, k, v, incoherent=m["incoherent"], per_tensor=m["per_tensor"], seed=seed, use_kernel=False)
        return fp8.emulate(t, causal=causal)
    t = fp8.quantize(q, k, v, incoherent=m["incoherent"], per_tensor=m["per_tensor"], seed=seed,
                     use_kernel=not m["per_tensor"])
    return fp8.attention_fp8(t.q, t.k, t.v, t.q_scale, t.k_scale, t.v_scale, causal=causal)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["emulate", "kernel"], default="kernel" if torch.cuda.is_available() else "emulate")
    p.add_argument("--hdims", default="64,128,256")
    p.add_argument("--dists", default="outliers,channel")
    p.add_argument("--methods", default="a,b,c")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale-shape", type=float, default=1.0,
                   help="multiply seqlen by this (e.g. 0.25 for a quick CPU run)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    device = "cuda" if args.backend == "kernel" else ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    print(f"backend={args.backend} device={device} causal={args.causal}")
    print("| distribution | hdim | shape (b, s, h, d) | bf16 kernel | (a) per-tensor | (b) block | (c) block + Hadamard |")
    print("|---|---|---|---|---|---|---|")
    for dist in args.dists.split(","):
        for d in [int(x) for x in args.hdims.split(",")]:
            b, s, h = SHAPES[d]
            s = max(128, int(s * args.scale_shape))
            q, k, v = make_inputs(dist, b, s, h, d, args.seed, device)
            t0 = time.time()
            ref = reference(q, k, v, args.causal)
            row = {"dist": dist, "hdim": d, "shape": [b, s, h, d], "causal": args.causal, "backend": args.backend}
            if device == "cuda" and flash3.is_supported("fwd", torch.bfloat16, d, args.causal):
                row["bf16"] = rmse(flash3.attention(q, k, v, causal=args.causal), ref)
            for method in args.methods.split(","):
                out = run_method(args.backend, method, q, k, v, args.causal, args.seed)
                row[method] = rmse(out, ref)
            rows.append(row)

            def fmt(key):
                return f"{row[key]:.2e}" if key in row else "-"

            print(f"| {dist} | {d} | ({b}, {s}, {h}, {d}) | {fmt('bf16')} | {fmt('a')} | {fmt('b')} | {fmt('c')} |"
                  f"  <!-- {time.time() - t0:.1f}s -->", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
