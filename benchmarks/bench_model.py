#!/usr/bin/env python3
"""Training step of a small Llama-style model in Hugging Face transformers, per attention
implementation: "sdpa", flash3 ("hopper_attention", flash3.integrations.transformers) and
FlashAttention-3 ("flash_attention_3", when transformers finds it), in one run.

Model: random-initialised, bf16, hidden 2048, 16 query / 4 KV heads (head dim 128), 4
layers, vocab 32000. A step is forward + cross-entropy loss + backward (no optimiser),
timed with CUDA events from an idle GPU to the step's end; batch 1 at --seqlens tokens
(default 4096, 16384), causal. One model per implementation (the same weights). The
implementations take turns step by step (the order rotating), so that drift of the
host's or the GPU's clocks touches each alike; a figure is the median over --steps steps,
and the ratio to sdpa the median of the step-by-step ratios. Eager PyTorch: at 4k tokens
the host's time to issue the step's ~600 kernels is close to the GPU's time to run them,
so the host CPU (printed) matters. Prints a table and writes JSON.

transformers takes FlashAttention-3 when the `flash_attn_interface` module imports and
belongs to an installed `flash-attn-3` distribution.

  python3 benchmarks/bench_model.py --out-dir benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

SCRIPT_DIR = Path(__file__).resolve().parent


def build_model(transformers, impl):
    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=32768, attn_implementation=impl,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)


def make_step(model, ids):
    def step():
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def timed_ms(step):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def quartiles(values):
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return [round(q[0], 3), round(q[2], 3)]


def host_cpu():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", default="4096,16384")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=SCRIPT_DIR / "results")
    ap.add_argument("--tag", default="h200-model-step")
    args = ap.parse_args(argv)
    import transformers
    from flash3.integrations.transformers import register

    name = register()
    impls = ["sdpa", name, "flash_attention_3"]
    cpu = host_cpu()
    print(f"host CPU: {cpu}; GPU: {torch.cuda.get_device_name()}; transformers {transformers.__version__}")
    rows = []
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        ids = torch.randint(0, 32000, (1, seqlen), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        row = {"seqlen": seqlen}
        models = {}
        for impl in impls:  # the same weights (one seed) for each implementation
            try:
                models[impl] = build_model(transformers, impl)
            except Exception as exc:  # noqa: BLE001 (an implementation transformers cannot load)
                row[f"{impl}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        steps = {impl: make_step(model, ids) for impl, model in models.items()}
        for impl in list(steps):
            try:
                for _ in range(args.warmup):
                    steps[impl]()
            except Exception as exc:  # noqa: BLE001 (e.g. out of memory at a long sequence)
                row[f"{impl}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                del steps[impl]
        order = list(steps)
        times = {impl: [] for impl in order}
        for i in range(args.steps):
            for impl in order[i % len(order):] + order[: i % len(order)]:
                times[impl].append(timed_ms(steps[impl]))
        for impl in impls:
            row[impl] = statistics.median(times[impl]) if times.get(impl) else None
            row[f"{impl}_quartiles"] = quartiles(times[impl]) if times.get(impl) else None
            if times.get(impl) and times.get("sdpa"):
                row[f"{impl}_over_sdpa"] = statistics.median(a / b for a, b in zip(times[impl], times["sdpa"]))
        models = None
        torch.cuda.empty_cache()
        rows.append(row)
        cells = "  ".join(f"{impl} {row[impl]:.2f} ms" if row[impl] else f"{impl} -" for impl in impls)
        print(f"seqlen {seqlen}: {cells}", flush=True)
    lines = ["| tokens | " + " | ".join(impls) + f" | {name}/sdpa | {name}/FA3 |", "|---" * (len(impls) + 3) + "|"]
    for row in rows:
        over = lambda a: f"{row[f'{a}_over_sdpa']:.3f}" if row.get(f"{a}_over_sdpa") else "-"  # noqa: E731
        to_fa3 = f"{row[name] / row['flash_attention_3']:.3f}" if row.get(name) and row.get("flash_attention_3") else "-"
        lines.append(f"| {row['seqlen']} | " + " | ".join(f"{row[i]:.2f} ms" if row[i] else "-" for i in impls)
                     + f" | {over(name)} | {to_fa3} |")
    table = "\n".join(lines)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.tag}.json").write_text(json.dumps(rows, indent=1))
    (args.out_dir / f"{args.tag}.md").write_text(
        "# Training step of a Llama-style model (bf16, 4 layers, hidden 2048, 16/4 heads), ms (lower is better)\n\n"
        f"Median over {args.steps} steps per implementation, taken in turn; {name}/sdpa is the median of the "
        f"step-by-step ratios. Host CPU: {cpu}.\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
