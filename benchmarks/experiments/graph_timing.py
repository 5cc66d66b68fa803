"""Shared by the kernel experiments in this folder: a CUDA-graph timer and a bit-equality check.

``timed(fn)`` captures ``reps`` calls of ``fn`` in one CUDA graph (after a warm-up call on a side stream) and returns
the median over ``trials`` replays of the device ms per call: the kernels alone, without host overhead.
"""

from __future__ import annotations

import torch


def timed(fn, reps: int = 20, trials: int = 7) -> float:
    """Median device ms per call of ``fn`` (CUDA graph of ``reps`` calls, replayed ``trials`` times)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    out = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / reps)
    del g
    return sorted(out)[len(out) // 2]


def same_bits(a, b) -> bool:
    """Whether two tuples of tensors are equal bit for bit (1-byte dtypes such as E4M3 compared as bytes)."""
    return all(torch.equal(u.view(torch.uint8) if u.dtype.itemsize == 1 else u,
                           v.view(torch.uint8) if v.dtype.itemsize == 1 else v) for u, v in zip(a, b, strict=True))
