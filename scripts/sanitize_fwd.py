#!/usr/bin/env python3
"""Runs forward kernels on small shapes, for compute-sanitizer on the GPU machine.

Each case is one launch of one kernel on a problem with more query tiles than SMs, so that
persistent CTAs take several tiles and the short causal kernels deal out their last
rounds on the host (scheduler_tail.h). racecheck and synccheck are slow (hundreds of
times a plain launch), so the shapes are as small as that allows. Prints the largest
difference from the float32 reference per case (a crude check; the tests are the real
one).

  compute-sanitizer --tool racecheck python3 scripts/sanitize_fwd.py --no-reference --cases bf16:64:causal:512
  compute-sanitizer --tool synccheck python3 scripts/sanitize_fwd.py            # every case

A case is dtype:hdim:causal|full:seqlen[:batch:nheads] with dtype bf16, fp16 or e4m3 (the
FP8 kernel on bf16 inputs quantised by flash3.fp8.quantize).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import flash3  # noqa: E402
from flash3 import fp8  # noqa: E402

# 2 x 40 heads of 512 tokens: 320 query tiles of 128 rows on 132 SMs (2.4 rounds); the
# FP8 hdim 64 causal kernel with three warpgroups (1k-8k keys) on 32 heads of 1536 tokens,
# 256 tiles of 192 rows.
DEFAULT_CASES = [f"{dt}:{d}:causal:512" for dt, d in
                 [("bf16", 64), ("bf16", 128), ("bf16", 256), ("e4m3", 64), ("e4m3", 128), ("e4m3", 256)]]
DEFAULT_CASES.append("e4m3:64:causal:1536:1:32")


def run_case(spec: str, reference: bool = True) -> float | None:
    dtype, hdim, mask, seqlen, *rest = spec.split(":")
    hdim, seqlen, causal = int(hdim), int(seqlen), mask == "causal"
    batch, nheads = (int(rest[0]), int(rest[1])) if rest else (2, 40)
    g = torch.Generator(device="cuda").manual_seed(hdim * 31 + seqlen)
    in_dtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    q, k, v = (torch.randn(batch, seqlen, nheads, hdim, device="cuda", generator=g).to(in_dtype) for _ in range(3))
    if dtype == "e4m3":
        out = fp8.attention_fp8(*fp8.quantize(q, k, v), causal=causal)
    else:
        out = flash3.attention(q, k, v, causal=causal)
    torch.cuda.synchronize()
    if not reference:
        return None
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=causal).transpose(1, 2)
    return (out.float() - ref).abs().max().item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma list of dtype:hdim:mask:seqlen[:batch:nheads]")
    ap.add_argument("--no-reference", action="store_true",
                    help="skip the reference (PyTorch's SDPA kernels: racecheck reports their hazards too)")
    args = ap.parse_args()
    for spec in args.cases.split(","):
        start = time.time()
        err = run_case(spec, reference=not args.no_reference)
        err_text = "" if err is None else f"max |out - ref| {err:.3g}, "
        print(f"{spec}: {err_text}{time.time() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
