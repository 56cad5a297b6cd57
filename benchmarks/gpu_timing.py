"""Timing on the GPU for the grid benchmark: CUDA-graph replays (the kernels alone) and eager
calls between CUDA events, and the guards that keep a broken CUDA context from producing
numbers. torch is imported lazily so that the report writers run without it."""

from __future__ import annotations

import gc
import statistics


class FatalCudaError(RuntimeError):
    """The CUDA context is unusable (sticky error); further measurements are meaningless."""


def lazy_torch():
    import torch  # noqa: WPS433
    return torch


def free_memory():
    torch = lazy_torch()
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def check_cuda_alive():
    torch = lazy_torch()
    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
    except Exception as e:  # noqa: BLE001
        raise FatalCudaError(f"CUDA context unusable after an error: {e}") from e


def _gpu_pad():
    """Queue a short GPU sleep before the start event so the host runs ahead of the GPU
    and the events time the kernels, not Python launch overhead."""
    torch = lazy_torch()
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(1_000_000)  # ~0.5 ms at ~2 GHz


def time_fn(fn, warmup: int, reps: int) -> float:
    """Median milliseconds of `reps` eager runs of fn(), each bracketed by CUDA events
    (a GPU sleep queued ahead of each keeps the host's launch time out of the span, but
    not the gaps between the kernels of one call)."""
    torch = lazy_torch()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        _gpu_pad()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return statistics.median(times)


def time_graph(fn, reps: int) -> float:
    """Median milliseconds of one call of fn(), timed as `reps` replays of a CUDA graph of
    several calls (bench_varlen.graph_ms, which warms up itself: as many calls as take
    about 2 ms, at most 10): the kernels alone, with no host launch cost on any side.
    Raises if fn cannot be captured."""
    from bench_varlen import graph_ms  # noqa: WPS433  (torch at import; not for --replot)

    return graph_ms(fn, replays=reps)


def measure(fn, args, row: dict, key: str):
    """row[key]: the headline time, CUDA-graph replays (--timing graph, the default) or
    eager calls (--timing events); row[key + "_eager"]: the eager time, always. A backend
    whose calls cannot be captured gets no headline time (key + "_graph_error" says why)."""
    row[key + "_eager"] = time_fn(fn, args.warmup, args.reps)
    if args.timing == "events":
        row[key] = row[key + "_eager"]
        return
    try:
        row[key] = time_graph(fn, args.reps)  # right after the eager calls: already warm
    except Exception as e:  # noqa: BLE001
        check_cuda_alive()
        row[key] = None
        row[key + "_graph_error"] = error_text(e)


# ---- backends -----------------------------------------------------------------------


def error_text(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) < 500 else msg[:500] + "..."
