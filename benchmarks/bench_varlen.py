#!/usr/bin/env python3
"""Variable-length (packed) batches: flash3.attention_varlen beside FlashAttention-3's varlen call.

Two grids, bf16, all timed as kernels (each call captured ten times in a CUDA graph, the
graph replayed; median over replays / 10; the implementations of a cell timed in turns,
`--passes` times in alternating order, the median reported), forward and backward (the backward op alone,
on the forward's saved outputs):

* equal: the paper grid (16k tokens, hidden 2048, hdim 64/128/256, causal or not, 512 to
  16k tokens per sequence) sent through the varlen call, against flash3's dense call on
  the same tensors (the ratio must stay >= 0.97), and FA3's varlen call.
* mix: lengths drawn with a fixed seed, log-uniform between 32 and 16384 tokens (many
  short sequences, a few long ones), 65536 tokens per batch, hidden 2048: flash3 varlen,
  FA3 varlen (when `flash_attn_interface` imports), and on the batch padded to its
  longest sequence flash3's dense call and PyTorch SDPA (cuDNN; timing only, the padding
  unmasked). TFLOPs/s count only the real (query, key) pairs of the sequences.

Writes <out-dir>/<tag>.json and <tag>.md; prints the tables.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

import torch

SCRIPT_DIR = Path(__file__).resolve().parent
HIDDEN = 2048
BWD_FLOP_FACTOR = 2.5


def graph_ms(fn, calls=None, replays=None):
    """Median milliseconds of one call of fn, timed as CUDA-graph replays of `calls` calls
    (by default as many as take about 2 ms, at most 10; fewer replays for long calls, such
    as those on padded batches)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = start.elapsed_time(end)
    if calls is None:
        calls = max(1, min(10, int(2.0 / max(once, 1e-3))))
    if replays is None:
        replays = 15 if once < 5 else 5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def pairs(sq, sk, causal):
    """(query, key) pairs attended; causal is bottom-right aligned (row i sees i + sk - sq + 1 keys)."""
    if not causal:
        return sq * sk
    return sum(min(max(i + sk - sq + 1, 0), sk) for i in range(sq))


def tflops(flop, ms):
    return flop / (ms * 1e-3) / 1e12 if ms else None


def long_tailed_lengths(total, lo=32, hi=16384, seed=0):
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
    excess = sum(lengths) - total
    lengths[-1] -= excess
    if lengths[-1] < lo:
        lengths[-2] += lengths.pop()
    rng.shuffle(lengths)
    return lengths


class Impl:
    def __init__(self):
        import flash3
        self.flash3 = flash3
        try:
            import flash_attn_interface as fa3  # noqa: WPS433
            self.fa3 = fa3
        except Exception as exc:  # noqa: BLE001
            self.fa3 = None
            self.fa3_error = f"{type(exc).__name__}: {exc}"


def results_header(impl):
    """The fields every result file starts with: the device, torch, and whether
    FlashAttention-3 ran beside flash3."""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "fa3": "in the same run" if impl.fa3 is not None else f"not available ({impl.fa3_error})"}


def write_results(out_dir, tag, data, md):
    """<out_dir>/<tag>.json (data) and <tag>.md (md); prints md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{tag}.json").write_text(json.dumps(data, indent=1))
    (out_dir / f"{tag}.md").write_text(md)
    print(md)


def cu_of(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


def varlen_fns(impl, name, q, k, v, cu, max_len, causal, scale):
    """(forward fn, backward fn) of one varlen backend on packed q, k, v."""
    ops = torch.ops.flash3
    if name == "flash3":
        out, lse = ops.fwd_varlen(q, k, v, cu, cu, None, None, max_len, max_len, scale, causal, False)
        dout = torch.randn_like(out)
        return (lambda: ops.fwd_varlen(q, k, v, cu, cu, None, None, max_len, max_len, scale, causal, False),
                lambda: ops.bwd_varlen(dout, q, k, v, out, lse, None, cu, cu, None, None, max_len, max_len, scale,
                                       causal, False))
    fa3 = impl.fa3

    def fwd():
        return fa3._flash_attn_forward(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                       max_seqlen_k=max_len, softmax_scale=scale, causal=causal)

    out, lse = fwd()[:2]
    dout = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return fwd, (lambda: fa3._flash_attn_backward(dout, q, k, v, out, lse, cu, cu, None, None, max_len, max_len,
                                                  dq, dk, dv, scale, causal))


def dense_fns(q, k, v, causal, scale):
    ops = torch.ops.flash3
    out, lse = ops.fwd(q, k, v, scale, causal, False)
    dout = torch.randn_like(out)
    return (lambda: ops.fwd(q, k, v, scale, causal, False),
            lambda: ops.bwd(dout, q, k, v, out, lse, None, scale, causal, False))


def sdpa_fns(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))

    def fwd():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    return fwd, None


def measure(fn):
    try:
        return graph_ms(fn)
    except Exception as exc:  # noqa: BLE001
        print(f"    failed: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def measure_in_turns(fns, passes):
    """({name: milliseconds}, {name: [milliseconds per pass]}) for the functions compared in
    one cell: each timed once per pass, in the given order in even passes and in reverse in
    odd ones; the median over the passes.
    Timed first, right after the previous cell's long calls, a call read up to 18% slower
    than in turns (docs/performance.md); rotating the order keeps whatever causes that from
    always falling on the same side."""
    names = list(fns)
    times = {name: [] for name in names}
    for p in range(passes):
        for name in (names if p % 2 == 0 else names[::-1]):
            ms = measure(fns[name])
            if ms is not None:
                times[name].append(ms)
    return {name: (statistics.median(t) if t else None) for name, t in times.items()}, times


def grid_equal(impl, hdims, seqlens, causals, passes=2):
    rows = []
    for d in hdims:
        h = HIDDEN // d
        for causal in causals:
            for s in seqlens:
                b = max(1, 16384 // s)
                g = torch.Generator(device="cuda").manual_seed(s + d)
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(3))
                scale = d ** -0.5
                flop = 4.0 * b * h * d * pairs(s, s, causal)
                row = {"hdim": d, "causal": causal, "seqlen": s, "batch": b}
                fns = {}
                fns["dense_fwd"], fns["dense_bwd"] = dense_fns(q, k, v, causal, scale)
                cu = cu_of([s] * b)
                qp, kp, vp = (t.flatten(0, 1) for t in (q, k, v))
                fns["varlen_fwd"], fns["varlen_bwd"] = varlen_fns(impl, "flash3", qp, kp, vp, cu, s, causal, scale)
                if impl.fa3 is not None:
                    fns["fa3_fwd"], fns["fa3_bwd"] = varlen_fns(impl, "fa3", qp, kp, vp, cu, s, causal, scale)
                for kind in ("fwd", "bwd"):
                    ms, _ = measure_in_turns({k_: f for k_, f in fns.items() if k_.endswith(kind)}, passes)
                    row.update({f"{k_}_ms": t for k_, t in ms.items()})
                for key in [k_ for k_ in row if k_.endswith("_ms")]:
                    kind = "bwd" if "bwd" in key else "fwd"
                    row[key.replace("_ms", "_tflops")] = tflops(flop * (BWD_FLOP_FACTOR if kind == "bwd" else 1),
                                                                row[key])
                rows.append(row)
                print(_line_equal(row), flush=True)
                del q, k, v, qp, kp, vp
    return rows


def cell(x, nd=0):
    """A table cell: x with nd decimals, or '-' where it was not measured."""
    return "-" if x is None else f"{x:.{nd}f}"


def ratio_cell(a, b, nd=3):
    """A table cell: a / b with nd decimals, or '-' where either is missing."""
    return "-" if a is None or b is None or not b else f"{a / b:.{nd}f}"


def _line_equal(r):
    return (f"  equal hdim {r['hdim']:3d} {'causal' if r['causal'] else 'full  '} {r['seqlen']:5d}: "
            f"fwd varlen/dense {ratio_cell(r['varlen_fwd_tflops'], r['dense_fwd_tflops'])} "
            f"/fa3 {ratio_cell(r['varlen_fwd_tflops'], r.get('fa3_fwd_tflops'))}  "
            f"bwd varlen/dense {ratio_cell(r['varlen_bwd_tflops'], r['dense_bwd_tflops'])} "
            f"/fa3 {ratio_cell(r['varlen_bwd_tflops'], r.get('fa3_bwd_tflops'))}")


def grid_mix(impl, hdims, causals, total=65536, seed=0, passes=2):
    lengths = long_tailed_lengths(total, seed=seed)
    rows = []
    for d in hdims:
        h = HIDDEN // d
        for causal in causals:
            g = torch.Generator(device="cuda").manual_seed(d)
            q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(3))
            cu = cu_of(lengths)
            longest = max(lengths)
            scale = d ** -0.5
            flop = 4.0 * h * d * sum(pairs(n, n, causal) for n in lengths)
            row = {"hdim": d, "causal": causal, "sequences": len(lengths), "longest": longest, "tokens": total}
            fns = {}
            for name in ("flash3", "fa3"):
                if name == "fa3" and impl.fa3 is None:
                    continue
                fns[f"{name}_fwd"], fns[f"{name}_bwd"] = varlen_fns(impl, name, q, k, v, cu, longest, causal, scale)
            for kind in ("fwd", "bwd"):
                ms, per_pass = measure_in_turns({k_: f for k_, f in fns.items() if k_.endswith(kind)}, passes)
                row.update({f"{k_}_ms": t for k_, t in ms.items()})
                row.update({f"{k_}_ms_passes": t for k_, t in per_pass.items()})
            row["flop"] = flop
            rows.append(row)
            del q, k, v, fns
    # The padded batch (batch, longest, h, d), after every packed comparison: these calls
    # run for up to 200 ms each, and calls timed right after them read slower.
    for row in rows:
        d, causal, longest, h = row["hdim"], row["causal"], row["longest"], HIDDEN // row["hdim"]
        pad_tokens = len(lengths) * longest
        if pad_tokens * h * d * 2 * 3 < 24e9:
            qd, kd, vd = (torch.randn(len(lengths), longest, h, d, device="cuda", dtype=torch.bfloat16)
                          for _ in range(3))
            fwd, bwd = dense_fns(qd, kd, vd, causal, d ** -0.5)
            row["flash3_padded_fwd_ms"], row["flash3_padded_bwd_ms"] = measure(fwd), measure(bwd)
            fwd, _ = sdpa_fns(qd, kd, vd, causal)
            row["sdpa_padded_fwd_ms"] = measure(fwd)
            del qd, kd, vd
        flop = row.pop("flop")
        for key in [k_ for k_ in row if k_.endswith("_ms")]:
            kind = "bwd" if "bwd" in key else "fwd"
            row[key.replace("_ms", "_tflops")] = tflops(flop * (BWD_FLOP_FACTOR if kind == "bwd" else 1), row[key])
        print(f"  mix hdim {d:3d} {'causal' if causal else 'full  '}: "
              f"fwd flash3 {cell(row['flash3_fwd_tflops'])} fa3 {cell(row.get('fa3_fwd_tflops'))} "
              f"({ratio_cell(row['flash3_fwd_tflops'], row.get('fa3_fwd_tflops'))})"
              f"  bwd flash3 {cell(row['flash3_bwd_tflops'])} fa3 {cell(row.get('fa3_bwd_tflops'))} "
              f"({ratio_cell(row['flash3_bwd_tflops'], row.get('fa3_bwd_tflops'))})", flush=True)
    return rows, lengths


def markdown(data):
    lines = [f"# Variable-length batches (bf16, {data['device']}, CUDA-graph timing)", ""]
    lines += [f"FlashAttention-3: {data['fa3']}", ""]
    if data.get("mix"):
        lines += [f"## Mixed lengths: {data['mix_sequences']} sequences, 32-16384 tokens (log-uniform, seed 0), "
                  f"65536 tokens, hidden 2048; TFLOPs/s on the real pairs", ""]
        lines += ["| hdim | causal | pass | flash3 varlen | FA3 varlen | flash3/FA3 | flash3 dense, padded | "
                  "SDPA cuDNN, padded |", "|---|---|---|---|---|---|---|---|"]
        for r in data["mix"]:
            for kind in ("fwd", "bwd"):
                lines.append(
                    f"| {r['hdim']} | {'yes' if r['causal'] else 'no'} | {kind} | "
                    f"{cell(r.get(f'flash3_{kind}_tflops'))} "
                    f"| {cell(r.get(f'fa3_{kind}_tflops'))} | "
                    f"{ratio_cell(r.get(f'flash3_{kind}_tflops'), r.get(f'fa3_{kind}_tflops'))} | "
                    f"{cell(r.get(f'flash3_padded_{kind}_tflops'))} | {cell(r.get(f'sdpa_padded_{kind}_tflops'))} |")
        lines.append("")
    if data.get("equal"):
        lines += ["## Equal lengths (paper grid through the varlen call), TFLOPs/s", "",
                  "| hdim | causal | seqlen | fwd dense | fwd varlen | varlen/dense | FA3 varlen | varlen/FA3 | "
                  "bwd dense | bwd varlen | varlen/dense | FA3 varlen | varlen/FA3 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in data["equal"]:
            cells = [str(r["hdim"]), "yes" if r["causal"] else "no", str(r["seqlen"])]
            for kind in ("fwd", "bwd"):
                cells += [cell(r.get(f"dense_{kind}_tflops")), cell(r.get(f"varlen_{kind}_tflops")),
                          ratio_cell(r.get(f"varlen_{kind}_tflops"), r.get(f"dense_{kind}_tflops")),
                          cell(r.get(f"fa3_{kind}_tflops")),
                          ratio_cell(r.get(f"varlen_{kind}_tflops"), r.get(f"fa3_{kind}_tflops"))]
            lines.append("| " + " | ".join(cells) + " |")
        ratios = {kind: [r[f"varlen_{kind}_tflops"] / r[f"dense_{kind}_tflops"] for r in data["equal"]
                         if r.get(f"varlen_{kind}_tflops") and r.get(f"dense_{kind}_tflops")]
                  for kind in ("fwd", "bwd")}
        lines.append("")
        for kind, xs in ratios.items():
            if xs:
                gm = math.exp(sum(math.log(x) for x in xs) / len(xs))
                lines.append(f"- {kind}: varlen/dense geomean {gm:.3f}, min {min(xs):.3f}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=SCRIPT_DIR / "results")
    ap.add_argument("--tag", default="h200-varlen")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--grids", default="mix,equal")
    ap.add_argument("--passes", type=int, default=2,
                    help="timings per call and cell, in alternating order; the median is reported")
    args = ap.parse_args(argv)
    hdims = [int(x) for x in args.hdims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    impl = Impl()
    data = results_header(impl)
    grids = args.grids.split(",")
    if "mix" in grids:
        data["mix"], lengths = grid_mix(impl, hdims, [False, True], passes=args.passes)
        data["mix_sequences"], data["mix_lengths"] = len(lengths), lengths
    if "equal" in grids:
        data["equal"] = grid_equal(impl, hdims, seqlens, [False, True], passes=args.passes)
    write_results(args.out_dir, args.tag, data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
