"""Timing of a GPU or CPU function: warm-up, then the median of per-iteration times.

CUDA: one pair of CUDA events around each iteration (work is asynchronous; events time the device),
one synchronisation at the end. CPU: ``time.perf_counter`` around each iteration. The median (not
the mean) resists the odd slow iteration (a clock change, another process).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], None], *, device: torch.device, warmup: int, iters: int,
            before: Callable[[], None] | None = None) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup`` runs.

    ``before`` (if given) runs before each call, outside the timed region.
    """
    for _ in range(warmup):
        if before:
            before()
        fn()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = []
        for _ in range(iters):
            if before:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(iters):
            if before:
                before()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
