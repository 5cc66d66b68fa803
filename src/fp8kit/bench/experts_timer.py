"""Times one MoE layer's expert MLP, forward + backward, as ``fp8kit train`` runs it: the unit ``experts.mlp`` of
``selective_fp8 = "auto"`` (``selective/auto.py``).

Both precisions run the same routing and the same ``Float8GroupedExperts.local_experts`` computation
(``moe/experts.py``), on ``P`` routed rows spread evenly over the ``E`` local experts (one expert per row, as the
rows a rank receives under expert parallelism; on one GPU the dispatch gathers ``topk`` rows per token, the same
kernels):

- BF16: ``routing.gather`` -> ``torch._grouped_mm`` (gate_up) -> ``silu(gate) * up`` -> ``torch._grouped_mm`` (down)
  -> ``routing.combine``;
- FP8: ``moe/fused_experts.fused_rowwise_experts`` (the fused gather + rowwise casts, FP8 grouped GEMMs for fprop and
  dgrad, the run's wgrad precision) -> ``routing.combine``.

The expert weights are cast in every call (one micro-batch per optimizer step: the weight cache only pays with
gradient accumulation), so the FP8 time includes the per-step weight casts a run without accumulation pays.
Timing: ``bench/timing.time_ms`` (device time, the host's launches hidden), compiled with ``torch.compile`` when
``compile`` (as ``train.compile`` compiles the block that holds the experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fp8kit.bench.timing import time_ms
from fp8kit.moe import routing
from fp8kit.moe.fused_experts import fused_rowwise_experts
from fp8kit.moe.grouped_mm import bf16_grouped_mm, scaled_grouped_gemm


def balanced_routing(rows: int, experts: int, device: torch.device) -> routing.Dispatch:
    """The dispatch of ``rows`` rows, one expert each, ``rows / experts`` per expert (the first ``rows % experts``
    experts one more), in row order."""
    ids = torch.arange(rows, device=device) * experts // max(rows, 1)
    return routing.dispatch(ids[:, None], experts)


class ExpertsMLPTimer:
    """Milliseconds of one forward + backward of ``E`` experts' gated MLP on ``P`` routed rows.

    Args:
        gemms: ``((H, 2I), (I, H))``: gate_up's and down's ``(K, N)`` per expert (``AutoShape.gemms`` of an ``mlp``
            shape).
        experts: local experts ``E``; rows: routed rows ``P``.
        precision: ``"bf16"`` or ``"fp8"`` (fused rowwise FP8 MLP).
        wgrad: the fused path's wgrad precision (``fp8.grouped_wgrad``: ``auto``, ``fp8`` or ``bf16``).
        compile: ``torch.compile`` the timed function.

    Raises:
        ValueError: ``gemms`` not the two GEMMs of one gated MLP.
    """

    def __init__(self, gemms: tuple[tuple[int, int], ...], experts: int, rows: int, precision: str, *,
                 device: torch.device, wgrad: str = "auto", compile: bool = False):
        if len(gemms) != 2 or gemms[0][1] != 2 * gemms[1][0] or gemms[0][0] != gemms[1][1]:
            raise ValueError(f"ExpertsMLPTimer: gemms {gemms} are not ((H, 2I), (I, H)) of one gated MLP")
        (h, two_i), (inter, _) = gemms
        self.device, self.precision, self.wgrad = device, precision, wgrad
        g = torch.Generator(device=device).manual_seed(0)
        self.w_up = (torch.randn(experts, two_i, h, generator=g, device=device) * h ** -0.5).to(torch.bfloat16)
        self.w_down = (torch.randn(experts, h, inter, generator=g, device=device) * inter ** -0.5).to(torch.bfloat16)
        self.w_up.requires_grad_()
        self.w_down.requires_grad_()
        self.x = torch.randn(rows, h, generator=g, device=device).to(torch.bfloat16).requires_grad_()
        self.dy = torch.randn(rows, h, generator=g, device=device).to(torch.bfloat16)
        self.ones = torch.ones(rows, 1, device=device, dtype=torch.bfloat16)
        self.d = balanced_routing(rows, experts, device)
        self.fn = torch.compile(self._forward) if compile else self._forward

    def _forward(self, x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        d = self.d
        if self.precision == "fp8":
            gemm, out_dtype = scaled_grouped_gemm(x.device)
            y = fused_rowwise_experts(x, w_up, w_down, d.gather_idx, d.pair_rows, d.offs, gemm, out_dtype or x.dtype,
                                      cache_weights=False, wgrad=self.wgrad)
        else:
            hidden = bf16_grouped_mm(routing.gather(x, d), w_up, d.offs)
            gate, up = hidden.chunk(2, dim=-1)
            y = bf16_grouped_mm(F.silu(gate) * up, w_down, d.offs)
        return routing.combine(y, d, self.ones, x.dtype)

    def __call__(self, *, warmup: int, iters: int) -> float:
        leaves = (self.x, self.w_up, self.w_down)

        def reset() -> None:
            for t in leaves:
                t.grad = None

        def step() -> None:
            self.fn(*leaves).backward(self.dy)

        return time_ms(step, device=self.device, warmup=warmup, iters=iters, before=reset)
