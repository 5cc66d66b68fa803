"""Timing of a GPU or CPU function: device time with the host's launch overhead hidden.

CUDA: a small site (a few linears, a few hundred tokens) issues its kernels faster than Python and
autograd can launch them, so naive per-iteration events measure the host, not the GPU (the "v1" timing
in docs/benchmarks.md section 2 shows what that did to the first policies). In a training step the
whole compiled block keeps the GPU busy and the host runs ahead, so the device time is what decides.
We therefore hold the GPU with ``torch.cuda._sleep`` while the host enqueues all timed iterations,
then take ``(end - start) / iters`` from one pair of CUDA events: the iterations run back to back on
the device. The sleep is sized from the measured host time of one
iteration. This is repeated ``repeats`` times and the median taken.

CPU: ``time.perf_counter`` around each iteration, median.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

_ASSUMED_CLOCK_HZ = 2.0e9  # GPU cycles per second for sizing the sleep (H100: 1.98 GHz boost)


def time_ms(fn: Callable[[], None], *, device: torch.device, warmup: int, iters: int,
            before: Callable[[], None] | None = None, repeats: int = 3) -> float:
    """Milliseconds per call of ``fn()`` after ``warmup`` calls (see the module docstring).

    ``before`` (if given) runs before each call, outside the timed region on the CPU, and on the host
    only (it must not launch device work) on CUDA.
    """
    for _ in range(warmup):
        if before:
            before()
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            if before:
                before()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    if before:
        before()
    fn()
    host_s = time.perf_counter() - t0  # an upper bound of the host's launch time per iteration
    torch.cuda.synchronize(device)
    results = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int((host_s * iters * 1.5 + 1e-3) * _ASSUMED_CLOCK_HZ))
        start.record()
        for _ in range(iters):
            if before:
                before()
            fn()
        end.record()
        torch.cuda.synchronize(device)
        results.append(start.elapsed_time(end) / iters)
    return statistics.median(results)


def with_weight_cast_share(step_ms: float, cast: Callable[[], None], accumulate: int, *, device: torch.device,
                           warmup: int, iters: int) -> tuple[float, dict]:
    """One micro-batch's milliseconds when ``accumulate`` micro-batches share one cast of the FP8 weights (the weight
    cache with ``train.grad_accum``): ``step_ms`` (timed with the weights cached) plus ``cast`` (the weights' cast,
    timed alone with :func:`time_ms`) divided by ``accumulate``, the exact share of one micro-batch. Returns
    ``(ms, parts)``, ``parts`` = ``{"step_ms"}`` plus ``{"weight_cast_ms", "accumulate"}`` when ``accumulate > 1``
    (``step_ms`` alone otherwise)."""
    parts: dict = {"step_ms": step_ms}
    if accumulate <= 1:
        return step_ms, parts
    cast_ms = time_ms(cast, device=device, warmup=warmup, iters=iters)
    parts.update(weight_cast_ms=cast_ms, accumulate=accumulate)
    return step_ms + cast_ms / accumulate, parts


def suspect_points(tokens: list[int], ms: list[float | None], *, next_tol: float = 1.10,
                   growth_tol: float = 1.25) -> list[int]:
    """Indices of a token sweep's timings that look like spikes, to be timed again.

    A GEMM site's device time grows with the token count, at most about linearly. Point ``i`` (in
    ascending token order) is suspect when it is slower than the next larger token count by more than
    ``next_tol`` (time went down as the work went up), or slower than the previous point scaled linearly
    by the token ratio, times ``growth_tol`` (it grew faster than the work; the slack covers tile waves
    and operands leaving L2). Such points came from a disturbed timing window in the session-14 policy
    reports (for example 1.403 ms at 1024 tokens between 0.086 and 0.268 ms); a real slowdown survives
    re-timing and is kept.

    Args:
        tokens: the sweep's token counts, any order, no duplicates.
        ms: milliseconds per point, aligned with ``tokens``; ``None`` (not timed) is skipped.

    Returns:
        indices into ``tokens`` / ``ms``, ascending by token count.
    """
    order = [i for i in sorted(range(len(tokens)), key=tokens.__getitem__) if ms[i] is not None]
    out = []
    for pos, i in enumerate(order):
        prev = order[pos - 1] if pos > 0 else None
        nxt = order[pos + 1] if pos + 1 < len(order) else None
        above_next = nxt is not None and ms[i] > next_tol * ms[nxt]
        above_growth = prev is not None and ms[i] > growth_tol * ms[prev] * tokens[i] / tokens[prev]
        if above_next or above_growth:
            out.append(i)
    return out
