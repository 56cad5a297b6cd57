"""Decoding against a KV cache: flash3.attention_with_kvcache beside FlashAttention-3's
flash_attn_with_kvcache (when importable), in the same run.

Decode grid: hdim 128, bf16, 32 query heads / 8 KV heads, seqlen_q 1 (and 4, causal),
contexts 1k..128k, batch 1..128 (cells up to 1M cached tokens), dense cache and pages of
16 and 128 tokens. Each call is timed as CUDA-graph replays (as serving stacks run decode
steps). The figure is the effective bandwidth: bytes of K and V attended to / time,
against the device-to-device copy bandwidth measured in the same run (read + write of a
4 GiB buffer) and the read bandwidth (a sum over it).

Prefill on a paged cache: 4 sequences of 8k tokens, causal, the call on a page-128 cache
against flash3.attention on the same keys held densely.

    python benchmarks/bench_kvcache.py [--quick] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_varlen import Impl, graph_ms  # noqa: E402

H, HK, D = 32, 8, 128
DT = torch.bfloat16
CONTEXTS = [1024, 8192, 32768, 131072]
BATCHES = [1, 8, 32, 128]
MAX_TOKENS = 1 << 20
LAYOUTS = [None, 16, 128]


def memory_bandwidths():
    """GB/s of a device-to-device copy (bytes read + written / time) and of a read (a sum
    over the buffer) of 4 GiB."""
    n = 1 << 31  # elements: 4 GiB of bf16 per buffer
    a = torch.randn(n // 1024, 1024, dtype=DT, device="cuda").view(-1)
    b = torch.empty_like(a)
    copy_ms = graph_ms(lambda: b.copy_(a), calls=3, replays=5)
    del b
    read_ms = graph_ms(lambda: a.sum(), calls=3, replays=5)
    del a
    return 2 * n * 2 / (copy_ms * 1e-3) / 1e9, n * 2 / (read_ms * 1e-3) / 1e9


def make_cache(batch, context, page_size, gen):
    """A cache of `context` tokens per sequence, full to `context`."""
    if page_size is None:
        k = torch.randn(batch, context, HK, D, device="cuda", dtype=DT, generator=gen)
        return k, torch.randn_like(k), None
    pages = -(-context // page_size)
    k = torch.randn(batch * pages, page_size, HK, D, device="cuda", dtype=DT, generator=gen)
    table = torch.randperm(batch * pages, device="cuda", generator=gen).to(torch.int32).view(batch, pages)
    return k, torch.randn_like(k), table


def decode_row(impl, batch, context, page_size, sq, gen):
    k_cache, v_cache, table = make_cache(batch, context, page_size, gen)
    q = torch.randn(batch, sq, H, D, device="cuda", dtype=DT, generator=gen)
    seqlens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    causal = sq > 1
    kv_bytes = 2 * batch * context * HK * D * 2
    row = {"batch": batch, "context": context, "page_size": page_size, "seqlen_q": sq}

    def f3():
        return impl.flash3.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table,
                                                  causal=causal)
    row["flash3_ms"] = graph_ms(f3)
    row["flash3_gbs"] = kv_bytes / (row["flash3_ms"] * 1e-3) / 1e9
    if impl.fa3 is not None:
        def fa():
            return impl.fa3.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, page_table=table,
                                                    causal=causal)
        try:
            row["fa3_ms"] = graph_ms(fa)
            row["fa3_gbs"] = kv_bytes / (row["fa3_ms"] * 1e-3) / 1e9
        except Exception as exc:  # noqa: BLE001  (a configuration FA3 was not built with)
            row["fa3_error"] = f"{type(exc).__name__}: {exc}"[:200]
    del k_cache, v_cache, table
    return row


def prefill_rows(impl, gen):
    """Paged prefill (page 128) against the dense call on the same keys."""
    batch, seqlen, page = 4, 8192, 128
    q = torch.randn(batch, seqlen, H, D, device="cuda", dtype=DT, generator=gen)
    k = torch.randn(batch, seqlen, HK, D, device="cuda", dtype=DT, generator=gen)
    v = torch.randn_like(k)
    pages = seqlen // page
    table = torch.randperm(batch * pages, device="cuda", generator=gen).to(torch.int32).view(batch, pages)
    k_paged = torch.empty(batch * pages, page, HK, D, device="cuda", dtype=DT)
    v_paged = torch.empty_like(k_paged)
    k_paged[table.long()] = k.view(batch, pages, page, HK, D)
    v_paged[table.long()] = v.view(batch, pages, page, HK, D)
    seqlens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    dense_ms = graph_ms(lambda: impl.flash3.attention(q, k, v, causal=True))
    paged_ms = graph_ms(lambda: impl.flash3.attention_with_kvcache(q, k_paged, v_paged, cache_seqlens=seqlens,
                                                                   page_table=table, causal=True))
    row = {"batch": batch, "seqlen": seqlen, "page_size": page, "dense_ms": dense_ms, "paged_ms": paged_ms}
    if impl.fa3 is not None:
        try:
            row["fa3_paged_ms"] = graph_ms(lambda: impl.fa3.flash_attn_with_kvcache(
                q, k_paged, v_paged, cache_seqlens=seqlens, page_table=table, causal=True))
        except Exception as exc:  # noqa: BLE001
            row["fa3_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return row


def _f(x, fmt="{:.0f}"):
    return "-" if x is None else fmt.format(x)


def markdown(data):
    copy, read = data["copy_gbs"], data["read_gbs"]
    lines = [f"# Decoding against a KV cache (hdim {D}, bf16, {H} query / {HK} KV heads)", "",
             f"GPU: {data['gpu']}. In the same run: copy bandwidth (read + write) {copy:.0f} GB/s, read "
             f"bandwidth (a sum) {read:.0f} GB/s. FlashAttention-3: {data['fa3']}. Effective bandwidth = bytes "
             "of K and V attended to / time (CUDA-graph replays); in brackets, % of the copy bandwidth.", "",
             "| seqlen_q | cache | batch | context | flash3 us | flash3 GB/s (% copy) | FA3 us | FA3 GB/s (% copy) | flash3 / FA3 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in data["decode"]:
        cache = "dense" if r["page_size"] is None else f"page {r['page_size']}"
        fa_gbs = r.get("fa3_gbs")
        lines.append(
            f"| {r['seqlen_q']} | {cache} | {r['batch']} | {r['context'] // 1024}k | {r['flash3_ms'] * 1e3:.1f} | "
            f"{r['flash3_gbs']:.0f} ({100 * r['flash3_gbs'] / copy:.0f}%) | "
            f"{_f(r.get('fa3_ms') and r['fa3_ms'] * 1e3, '{:.1f}')} | "
            f"{_f(fa_gbs)}{'' if fa_gbs is None else f' ({100 * fa_gbs / copy:.0f}%)'} | "
            f"{'-' if fa_gbs is None else f'{r['flash3_gbs'] / fa_gbs:.2f}'} |")
    p = data.get("prefill")
    if p:
        lines += ["", f"Prefill, {p['batch']} x {p['seqlen']} tokens causal: dense call {p['dense_ms']:.2f} ms, "
                      f"page-{p['page_size']} cache {p['paged_ms']:.2f} ms ({p['paged_ms'] / p['dense_ms']:.2f}x); "
                      f"FA3 paged {_f(p.get('fa3_paged_ms'), '{:.2f}')} ms."]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="contexts 8k and 32k, batches 1 and 32 only")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    impl = Impl()
    gen = torch.Generator(device="cuda").manual_seed(0)
    contexts = [8192, 32768] if args.quick else CONTEXTS
    batches = [1, 32] if args.quick else BATCHES
    copy_gbs, read_gbs = memory_bandwidths()
    data = {"gpu": torch.cuda.get_device_name(), "copy_gbs": copy_gbs, "read_gbs": read_gbs,
            "fa3": "in the same run" if impl.fa3 is not None else f"not available ({impl.fa3_error})", "decode": []}
    print(f"copy {copy_gbs:.0f} GB/s, read {read_gbs:.0f} GB/s", flush=True)
    for sq in (1, 4):
        for page in LAYOUTS:
            for context in contexts:
                for batch in batches:
                    if batch * context > MAX_TOKENS:
                        continue
                    row = decode_row(impl, batch, context, page, sq, gen)
                    data["decode"].append(row)
                    print(f"sq {sq} page {page} b {batch} ctx {context}: flash3 {row['flash3_gbs']:.0f} GB/s, "
                          f"FA3 {_f(row.get('fa3_gbs'))} GB/s {row.get('fa3_error', '')}", flush=True)
                    torch.cuda.empty_cache()
    data["prefill"] = prefill_rows(impl, gen)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    card = "h200" if "H200" in data["gpu"] else "h100" if "H100" in data["gpu"] else "gpu"
    (out / f"{card}-kvcache.json").write_text(json.dumps(data, indent=1))
    (out / f"{card}-kvcache.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
