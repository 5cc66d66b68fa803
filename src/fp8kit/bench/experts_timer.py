"""Times one MoE layer's expert MLP, forward + backward, as ``fp8kit train`` runs it: the unit ``experts.mlp`` of
``selective_fp8 = "auto"`` (``selective/auto.py``).

Both precisions run a ``Float8GroupedExperts`` (``moe/experts.py``) built on a transformers ``Qwen3MoeExperts``
(gated SiLU, concatenated halves: the gate the fused path computes) through the layer's own
``local_experts`` + ``routing.combine``, on ``P`` routed rows spread evenly over the ``E`` local experts (one
expert per row, as the rows a rank receives under expert parallelism; on one GPU the dispatch gathers ``topk``
rows per token, the same kernels):

- BF16 (no FP8 weight): ``routing.gather`` -> ``torch._grouped_mm`` (gate_up) -> the experts' gate ->
  ``torch._grouped_mm`` (down);
- FP8 (both weights, kernel ``fused``): ``moe/fused_experts.fused_rowwise_experts`` (the fused gather + rowwise casts,
  FP8 grouped GEMMs for fprop and dgrad, the run's wgrad precision).

The expert weights are cast in every call (one micro-batch per optimizer step: the weight cache only pays with
gradient accumulation), so the FP8 time includes the per-step weight casts a run without accumulation pays.
Timing: ``bench/timing.time_ms`` (device time, the host's launches hidden), compiled with ``torch.compile`` when
``compile`` (as ``train.compile`` compiles the block that holds the experts).
"""

from __future__ import annotations

import torch
from torch import nn

from fp8kit.bench.timing import time_ms
from fp8kit.moe import routing
from fp8kit.moe.experts import WEIGHTS, Float8GroupedExperts
from fp8kit.moe.grouped_mm import GroupedGemmConfig


def balanced_routing(rows: int, experts: int, device: torch.device) -> routing.Dispatch:
    """The dispatch of ``rows`` rows, one expert each, ``rows / experts`` per expert (the first ``rows % experts``
    experts one more), in row order."""
    ids = torch.arange(rows, device=device) * experts // max(rows, 1)
    return routing.dispatch(ids[:, None], experts)


def experts_layer(w_up: torch.Tensor, w_down: torch.Tensor, precision: str, wgrad: str,
                  gemm: str = "auto") -> Float8GroupedExperts:
    """A ``Float8GroupedExperts`` over ``w_up`` (E, 2I, H) and ``w_down`` (E, H, I) (taken over as its Parameters):
    both weights FP8 on the ``fused`` kernel with ``wgrad`` and ``gemm`` for ``precision = "fp8"``, else BF16."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, two_i, h = w_up.shape
    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=two_i // 2, num_experts=e, hidden_act="silu")
    with torch.device("meta"):
        src = Qwen3MoeExperts(cfg)
    src.gate_up_proj, src.down_proj = nn.Parameter(w_up), nn.Parameter(w_down)
    fp8 = frozenset(WEIGHTS) if precision == "fp8" else frozenset()
    return Float8GroupedExperts(src, fp8, GroupedGemmConfig(kernel="fused", wgrad=wgrad, gemm=gemm))


class ExpertsMLPTimer:
    """Milliseconds of one forward + backward of ``E`` experts' gated MLP on ``P`` routed rows.

    Args:
        gemms: ``((H, 2I), (I, H))``: gate_up's and down's ``(K, N)`` per expert (``AutoShape.gemms`` of an ``mlp``
            shape).
        experts: local experts ``E``; rows: routed rows ``P``.
        precision: ``"bf16"`` or ``"fp8"`` (fused rowwise FP8 MLP).
        wgrad: the fused path's wgrad precision (``fp8.grouped_wgrad``: ``auto``, ``fp8`` or ``bf16``).
        gemm: how the fused path runs its GEMMs (``fp8.grouped_gemm``: ``auto``, ``grouped`` or ``loop``).
        compile: ``torch.compile`` the timed function.

    Raises:
        ValueError: ``gemms`` not the two GEMMs of one gated MLP.
        CapabilityError: (when called) FP8 on a GPU without the FP8 grouped GEMM.
    """

    def __init__(self, gemms: tuple[tuple[int, int], ...], experts: int, rows: int, precision: str, *,
                 device: torch.device, wgrad: str = "auto", gemm: str = "auto", compile: bool = False):
        if len(gemms) != 2 or gemms[0][1] != 2 * gemms[1][0] or gemms[0][0] != gemms[1][1]:
            raise ValueError(f"ExpertsMLPTimer: gemms {gemms} are not ((H, 2I), (I, H)) of one gated MLP")
        (h, two_i), (inter, _) = gemms
        self.device = device
        g = torch.Generator(device=device).manual_seed(0)
        w_up = (torch.randn(experts, two_i, h, generator=g, device=device) * h ** -0.5).to(torch.bfloat16)
        w_down = (torch.randn(experts, h, inter, generator=g, device=device) * inter ** -0.5).to(torch.bfloat16)
        self.layer = experts_layer(w_up, w_down, precision, wgrad, gemm)
        self.x = torch.randn(rows, h, generator=g, device=device).to(torch.bfloat16).requires_grad_()
        self.dy = torch.randn(rows, h, generator=g, device=device).to(torch.bfloat16)
        self.ones = torch.ones(rows, 1, device=device, dtype=torch.bfloat16)
        self.d = balanced_routing(rows, experts, device)
        self.fn = torch.compile(self._forward) if compile else self._forward

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return routing.combine(self.layer.local_experts(x, self.d), self.d, self.ones, x.dtype)

    def __call__(self, *, warmup: int, iters: int) -> float:
        leaves = (self.x, self.layer.gate_up_proj, self.layer.down_proj)

        def reset() -> None:
            for t in leaves:
                t.grad = None

        def step() -> None:
            self.fn(self.x).backward(self.dy)

        return time_ms(step, device=self.device, warmup=warmup, iters=iters, before=reset)
