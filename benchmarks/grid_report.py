"""Tables and figures of the grid benchmark from its JSON (pure Python: `bench_attention.py
--replot` rebuilds them without a GPU)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

from paper_grid import HIDDEN, TOTAL_TOKENS

LABELS = {
    "flash3": "flash3",
    "flash3-det": "flash3 det.",
    "sdpa-cudnn": "cuDNN",
    "sdpa-flash": "FA2",
    "fa3": "FA3",
    "fa4": "FA4",
    "sdpa-efficient": "mem-eff",
    "fa3-fp8": "FA3 fp8",
    "flash3-fp8": "flash3 fp8",
    "flash3-fp8-e2e": "flash3 fp8+q",
    "cudnn-fp8": "cuDNN fp8",
}
# Column / bar order in tables and plots.
DISPLAY_ORDER = ["flash3", "flash3-det", "sdpa-cudnn", "sdpa-flash", "fa3", "flash3-fp8", "flash3-fp8-e2e", "fa3-fp8",
                 "cudnn-fp8"]
COLORS = {
    "flash3": "#d62728",
    "flash3-det": "#e377c2",
    "sdpa-cudnn": "#2ca02c",
    "sdpa-flash": "#1f77b4",
    "fa3": "#ff7f0e",
    "flash3-fp8": "#9467bd",
    "flash3-fp8-e2e": "#c5b0d5",
    "fa3-fp8": "#ffbb78",
    "cudnn-fp8": "#98df8a",
}


def label(impl: str) -> str:
    return LABELS.get(impl, impl)


def _row_index(rows):
    return {(r["impl"], int(r["hdim"]), bool(r["causal"]), int(r["seqlen"])): r for r in rows}


def _configs(rows):
    return sorted({(int(r["hdim"]), bool(r["causal"]), int(r["seqlen"])) for r in rows})


def _impls_with_data(rows, kind):
    key = f"{kind}_tflops"
    present = {r["impl"] for r in rows if r.get(key) is not None}
    listed = {r["impl"] for r in rows}
    ordered = [i for i in DISPLAY_ORDER if i in listed]
    ordered += sorted(i for i in listed if i not in DISPLAY_ORDER)
    # fa3 only if it produced any number (it is optional); the others always get a column.
    return [i for i in ordered if i != "fa3" or i in present]


def _kinds(data):
    """The tables to write: forward and backward at the headline timing, then, where the
    run recorded them beside it, the same at eager timing."""
    kinds = data.get("kinds") or ["fwd", "bwd"]
    out = [k for k in ("fwd", "bwd") if k in kinds]
    if data.get("args", {}).get("timing", "events") == "graph":
        out += [f"{k}_eager" for k in out if any(r.get(f"{k}_eager_tflops") is not None for r in data["rows"])]
    return out


def load_anchor(path: str | None, impls: list[str]) -> dict | None:
    if not path:
        return None
    with open(path) as f:
        a = json.load(f)
    rows = [r for r in a.get("rows", []) if r.get("impl") in impls]
    return {"path": str(path), "device": a.get("device"), "torch": a.get("torch"),
            "date": a.get("date"), "ceilings": a.get("ceilings", {}), "impls": impls,
            "index": _row_index(rows)}


def fmt_num(x, nd=0):
    return "-" if x is None else f"{x:.{nd}f}"


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _geomean(xs):
    xs = [x for x in xs if x is not None and x > 0]
    return None if not xs else math.exp(sum(math.log(x) for x in xs) / len(xs))


def write_json(path: Path, data: dict):
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def markdown_table(data: dict, kind: str, anchor: dict | None) -> list[str]:
    rows = data["rows"]
    idx = _row_index(rows)
    impls = _impls_with_data(rows, kind)
    key = f"{kind}_tflops"
    ratio_pairs = [(a, b) for a, b in (("flash3", "sdpa-cudnn"), ("flash3", "fa3"),
                                       ("flash3-fp8", "cudnn-fp8"), ("flash3-fp8", "fa3-fp8"))
                   if a in impls and b in impls]
    anchor_impls = []
    if anchor:
        anchor_impls = [i for i in anchor["impls"]
                        if any(k[0] == i and r.get(key) is not None for k, r in anchor["index"].items())]
    header = ["hdim", "causal", "seqlen"] + [label(i) for i in impls]
    header += [f"{label(a)}/{label(b)}" for a, b in ratio_pairs]
    header += [f"{label(i)} (anchor)" for i in anchor_impls]
    # An FP8 anchor (fa3-fp8, cudnn-fp8) is compared with flash3's FP8 kernel, the others
    # with the 16-bit one.
    anchor_num = {i: "flash3-fp8" if i.endswith("-fp8") and "flash3-fp8" in impls else "flash3"
                  for i in anchor_impls}
    anchor_impls_ratio = [i for i in anchor_impls if anchor_num[i] in impls]
    header += [f"{label(anchor_num[i])}/{label(i)} (anchor)" for i in anchor_impls_ratio]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    ratios = {p: [] for p in ratio_pairs}
    aratios = {i: [] for i in anchor_impls}
    for hdim, causal, seqlen in _configs(rows):
        vals = {i: idx.get((i, hdim, causal, seqlen), {}).get(key) for i in impls}
        cells = [str(hdim), "yes" if causal else "no", str(seqlen)] + [fmt_num(vals[i]) for i in impls]
        for p in ratio_pairs:
            r = _ratio(vals[p[0]], vals[p[1]])
            ratios[p].append(r)
            cells.append(fmt_num(r, 2))
        avals = {i: anchor["index"].get((i, hdim, causal, seqlen), {}).get(key) for i in anchor_impls}
        cells += [fmt_num(avals[i]) for i in anchor_impls]
        for i in anchor_impls_ratio:
            r = _ratio(vals[anchor_num[i]], avals[i])
            aratios[i].append(r)
            cells.append(fmt_num(r, 2))
        lines.append("| " + " | ".join(cells) + " |")
    summary = []
    for (a, b), rs in ratios.items():
        g = _geomean(rs)
        if g is not None:
            n = sum(1 for r in rs if r is not None)
            summary.append(f"{label(a)}/{label(b)} geomean {g:.2f} over {n} configs")
    for i, rs in aratios.items():
        g = _geomean(rs)
        if g is not None:
            ahead = sum(1 for r in rs if r is not None and r >= 1.0)
            summary.append(f"{label(anchor_num[i])}/{label(i)} (anchor) geomean {g:.2f}, "
                           f"ahead on {ahead} of {sum(1 for r in rs if r is not None)}")
    if summary:
        lines += ["", "Summary: " + "; ".join(summary) + "."]
    return lines


def write_markdown(path: Path, data: dict, anchor: dict | None = None):
    m = data.get("machine", {})
    f3 = m.get("flash3", {}) or {}
    lines = [f"# Attention benchmark: {data.get('tag', path.stem)}", ""]
    lines.append(f"- GPU: {m.get('device', data.get('device', '?'))} "
                 f"(SMs {m.get('sm_count', '?')}), torch {m.get('torch', data.get('torch', '?'))}, "
                 f"CUDA {m.get('cuda', '?')}, cuDNN {m.get('cudnn', data.get('cudnn', '?'))}, "
                 f"date {m.get('date', '?')}")
    if f3:
        if f3.get("available"):
            bi = f3.get("build_info") or {}
            nk = len(bi.get("kernels", []) or []) if isinstance(bi, dict) else "?"
            lines.append(f"- flash3: version {f3.get('version')}, {nk} kernels in build_info")
        else:
            lines.append(f"- flash3: NOT importable ({f3.get('import_error')})")
    fa3 = m.get("fa3", {}) or {}
    if fa3:
        lines.append("- FA3 (flash_attn_interface): " +
                     ("available" + (f", version {fa3['version']}" if fa3.get("version") else "")
                      if fa3.get("available") else f"not available ({fa3.get('import_error')})"))
    a = data.get("args", {})
    timing = ("CUDA-graph replays (the kernels alone; eager calls in the last tables)"
              if a.get("timing", "events") == "graph" else "eager calls, each between CUDA events")
    lines.append(f"- dtype {data.get('dtype', a.get('dtype', 'bf16'))}, batch*seqlen = {TOTAL_TOKENS}, "
                 f"hidden {HIDDEN}, median of {a.get('reps', '?')} timings after "
                 f"{a.get('warmup', '?')} warm-up runs: {timing}")
    lines.append("- TFLOPs/s: fwd = 4*b*h*s*s*d / t_fwd (halved when causal); "
                 "bwd = 2.5 x fwd FLOPs / (t_fwd+bwd - t_fwd). Labels: cuDNN = torch SDPA cuDNN backend, "
                 "FA2 = torch SDPA flash backend, FA3 = flash_attn_interface.")
    c = data.get("ceilings") or {}
    if c:
        lines.append(f"- Ceilings (same run): bf16 GEMM 8192^3 {fmt_num(c.get('gemm_bf16_tflops'))} TFLOPs/s, "
                     f"device copy {fmt_num(c.get('copy_TBps'), 2)} TB/s (read+write)")
    if anchor:
        ac = anchor.get("ceilings") or {}
        lines.append(f"- Columns marked **(anchor)** come from a DIFFERENT run ({anchor['path']}: "
                     f"{anchor.get('device')}, torch {anchor.get('torch')}"
                     + (f", bf16 GEMM {fmt_num(ac.get('gemm_bf16_tflops'))} TFLOPs/s, copy "
                        f"{fmt_num(ac.get('copy_TBps'), 2)} TB/s" if ac else "")
                     + "). Run-to-run spread is ~10%: prefer same-run ratios.")
    titles = {"fwd": "Forward TFLOPs/s", "bwd": "Backward TFLOPs/s",
              "fwd_eager": "Forward TFLOPs/s, eager calls", "bwd_eager": "Backward TFLOPs/s, eager calls"}
    for kind in _kinds(data):
        lines += ["", f"## {titles[kind]}", ""]
        lines += markdown_table(data, kind, anchor)
    errs = _error_summary(data["rows"])
    if errs:
        lines += ["", "## Failures (recorded as -)", ""]
        lines += errs
    path.write_text("\n".join(lines) + "\n")


def _error_summary(rows, limit=40) -> list[str]:
    seen = {}
    keys = {"fwd": "fwd_error", "bwd": "bwd_error", "fwd graph capture": "fwd_ms_graph_error",
            "fwd+bwd graph capture": "fwdbwd_ms_graph_error"}
    for r in rows:
        for kind, key in keys.items():
            e = r.get(key)
            if e:
                seen.setdefault((r["impl"], kind, e), []).append(
                    f"{r['hdim']}/{'c' if r['causal'] else 'nc'}/{r['seqlen']}")
    out = []
    for (impl, kind, e), cfgs in list(seen.items())[:limit]:
        where = ", ".join(cfgs[:6]) + (f", ... ({len(cfgs)} configs)" if len(cfgs) > 6 else "")
        out.append(f"- {label(impl)} {kind} [{where}]: `{e.replace('`', chr(39))[:200]}`")
    return out


def plot(path: Path, data: dict, kind: str, anchor: dict | None = None) -> bool:
    """Paper-style figure: one subplot per (hdim, causal), bars grouped by seqlen."""
    try:
        import matplotlib  # noqa: WPS433
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: WPS433
    except Exception as e:  # noqa: BLE001
        print(f"warning: matplotlib unavailable ({e}); skipping {path.name}", file=sys.stderr)
        return False
    rows = data["rows"]
    key = f"{kind}_tflops"
    idx = _row_index(rows)
    impls = _impls_with_data(rows, kind)
    series = [(i, None) for i in impls]
    if anchor:
        series += [(i, "anchor") for i in anchor["impls"]
                   if any(k[0] == i and r.get(key) is not None for k, r in anchor["index"].items())]
    configs = _configs(rows)
    hdims = sorted({c[0] for c in configs})
    causals = sorted({c[1] for c in configs})
    seqlens = sorted({c[2] for c in configs})
    if not configs or not series:
        return False
    nrow, ncol = len(hdims), len(causals)
    fig, axes = plt.subplots(nrow, ncol, figsize=(max(6.0, 0.35 * len(seqlens) * len(series)) * ncol,
                                                  3.6 * nrow), squeeze=False)
    width = 0.8 / len(series)
    ymax = 0.0
    for r_i, hdim in enumerate(hdims):
        for c_i, causal in enumerate(causals):
            ax = axes[r_i][c_i]
            for s_i, (impl, src) in enumerate(series):
                vals = []
                for s in seqlens:
                    rr = (anchor["index"] if src else idx).get((impl, hdim, causal, s), {})
                    vals.append(rr.get(key))
                xs = [j + (s_i - (len(series) - 1) / 2) * width for j in range(len(seqlens))]
                hs = [v if v is not None else 0 for v in vals]
                name = label(impl) + (" (anchor run)" if src else "")
                color = COLORS.get(impl, None)
                bars = ax.bar(xs, hs, width, label=name, color=color,
                              hatch="//" if src else None, alpha=0.55 if src else 1.0,
                              edgecolor="black" if src else None, linewidth=0.4)
                for bar, v in zip(bars, vals):
                    txt = "n/a" if v is None else f"{v:.0f}"
                    ax.annotate(txt, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                                fontsize=6, rotation=90)
                ymax = max([ymax] + [v for v in vals if v is not None])
            ax.set_xticks(range(len(seqlens)))
            ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_xlabel("Sequence length")
            ax.set_ylabel("Speed (TFLOPs/s)")
            ax.set_title(f"{'Backward' if kind == 'bwd' else 'Forward'}, "
                         f"{'with' if causal else 'without'} causal mask, head dim {hdim}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
    for row_axes in axes:
        for ax in row_axes:
            ax.set_ylim(0, ymax * 1.18 + 1)
    handles, labels_ = axes[0][0].get_legend_handles_labels()
    m = data.get("machine", {})
    fig.legend(handles, labels_, loc="upper center", ncol=len(series), frameon=False,
               bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(f"Attention {kind} speed, {data.get('dtype', 'bf16')}, {m.get('device', data.get('device', ''))}"
                 f" ({data.get('tag', '')})", y=1.03, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return True


def write_outputs(data: dict, out_dir: Path, tag: str, anchor: dict | None, write_js: bool = True):
    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    if write_js:
        write_json(out_dir / f"{tag}.json", data)
        files.append(out_dir / f"{tag}.json")
    write_markdown(out_dir / f"{tag}.md", data, anchor)
    files.append(out_dir / f"{tag}.md")
    for kind in _kinds(data):
        if kind.endswith("_eager"):
            continue  # figures of the headline timing only
        p = out_dir / f"{tag}_{kind}.png"
        if plot(p, data, kind, anchor):
            files.append(p)
    return files


# --------------------------------------------------------------------------------------
# Main
