"""Does torchao's FP8 grouped-GEMM path re-tune when the routed row count changes, and does
``fp8kit.moe.grouped_mm.tune_once_for_all_row_counts`` stop it? (One GPU, Hopper.)

Under expert parallelism the rows a rank receives change every step. Shapes: Qwen3-30B-A3B experts, 64
local experts (EP = 2 of 128), hidden 2048, expert width 768, about 65536 routed rows per step (0.8x to 1.2x,
random); each step is forward + backward of the FP8 gate_up and down grouped GEMMs (torchao backend).
Three phases of 8 steps (the last two repeat the nominal 65536 rows): exact padded rows; rows bucketed by
``routing.bucketed_rows``; exact rows after ``tune_once_for_all_row_counts()``. Prints ms per step and a
``RESULT`` JSON line; with ``TRITON_PRINT_AUTOTUNING=1`` Triton names every kernel it tunes.

    TRITON_PRINT_AUTOTUNING=1 python benchmarks/ep_row_count_tuning.py
"""
import json
import time

import torch
import torch.nn.functional as F

from fp8kit.moe import routing
from fp8kit.moe.grouped_mm import fp8_grouped_mm, tune_once_for_all_row_counts

EXPERTS, HIDDEN, WIDTH, NOMINAL_ROWS = 64, 2048, 768, 65536


def step(w1: torch.Tensor, w2: torch.Tensor, pairs: int, bucket: bool) -> tuple[int, float]:
    """Forward + backward of one expert layer for ``pairs`` routed rows; returns (padded rows, ms)."""
    ids = torch.randint(0, EXPERTS, (pairs, 1), device=w1.device)
    rows = routing.bucketed_rows(pairs, EXPERTS, NOMINAL_ROWS) if bucket else None
    d = routing.dispatch(ids, EXPERTS, rows=rows)
    x = torch.randn(d.rows, HIDDEN, device=w1.device, dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gate, up = fp8_grouped_mm(x, w1, d.offs, "torchao").chunk(2, -1)
    y = fp8_grouped_mm((F.silu(gate) * up).contiguous(), w2, d.offs, "torchao")
    y.float().square().mean().backward()
    torch.cuda.synchronize()
    return d.rows, (time.perf_counter() - t0) * 1e3


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    w1 = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device=dev) * HIDDEN**-0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(EXPERTS, HIDDEN, WIDTH, device=dev) * WIDTH**-0.5).bfloat16().requires_grad_()
    gen = torch.Generator().manual_seed(1)
    res = {}
    for phase, bucket, pin in (("exact-rows", False, False), ("bucketed", True, False), ("exact-rows+pinned", False, True)):
        if pin:
            print("tuned once for all row counts:", tune_once_for_all_row_counts(), flush=True)
        counts = [int(NOMINAL_ROWS * (0.8 + 0.4 * torch.rand((), generator=gen).item())) for _ in range(6)]
        out = []
        for pairs in counts + [NOMINAL_ROWS, NOMINAL_ROWS]:
            rows, ms = step(w1, w2, pairs, bucket)
            out.append((rows, round(ms, 1)))
            print(phase, rows, f"{ms:.1f} ms", flush=True)
        res[phase] = out
    print("RESULT", json.dumps(res))


if __name__ == "__main__":
    main()
