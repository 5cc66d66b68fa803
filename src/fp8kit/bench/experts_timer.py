"""Times one MoE layer's expert MLP, forward + backward, as ``fp8kit train`` runs it: the unit ``experts.mlp`` of
``selective_fp8 = "auto"`` (``selective/auto.py``).

The experts are a transformers ``Qwen3MoeExperts`` (gated SiLU, concatenated halves: the gate the fused path
computes), fed ``P`` routed rows spread evenly over the ``E`` local experts (one expert per row; on one GPU the
dispatch gathers ``topk`` rows per token, the same kernels). Each precision runs the module the run would hold:

- one GPU (``whole_layer``): BF16 experts stay the transformers module (``parallel/convert.py`` swaps only experts with
  an FP8 weight), run through its ``grouped_mm`` experts implementation (:data:`HF_EXPERTS_IMPLEMENTATION`, what
  transformers sets in a model) with its own routing; FP8 experts are a ``Float8GroupedExperts`` run whole (dispatch,
  the fused MLP, combine);
- expert parallel (``whole_layer=False``): every layer is a ``Float8GroupedExperts`` (``parallel/parallelize.py``),
  timed through ``local_experts`` + ``routing.combine`` (the all-to-all is the same in both precisions): BF16
  ``torch._grouped_mm`` against ``moe/fused_experts.fused_rowwise_experts`` (the fused gather + rowwise casts, FP8
  grouped GEMMs for fprop and dgrad, the run's wgrad precision).

The FP8 expert weights are cast in every call (one micro-batch per optimizer step), or with ``accumulate = N`` once
every N calls, as a run with ``train.grad_accum = N`` and the weight cache casts them (the mean over the calls is
that run's steady state).
Timing: ``bench/timing.time_ms`` (device time, the host's launches hidden), compiled with ``torch.compile`` when
``compile`` (as ``train.compile`` compiles the block that holds the experts).
"""

from __future__ import annotations

import torch
from torch import nn

from fp8kit.bench.timing import time_ms
from fp8kit.fp8.weight_cache import mark_optimizer_step
from fp8kit.moe import routing
from fp8kit.moe.experts import WEIGHTS, Float8GroupedExperts
from fp8kit.moe.grouped_mm import GroupedGemmConfig


#: The experts implementation transformers gives a MoE model's experts (``config._experts_implementation``, set by
#: ``PreTrainedModel``; a standalone experts module has none): what BF16 experts run on one GPU
#: (``tests/test_auto_selective.py`` checks a built model uses it).
HF_EXPERTS_IMPLEMENTATION = "grouped_mm"


def balanced_ids(rows: int, experts: int, device: torch.device) -> torch.Tensor:
    """``(rows, 1)`` expert of each row: one expert each, ``rows / experts`` per expert, in row order."""
    return (torch.arange(rows, device=device) * experts // max(rows, 1))[:, None]


def balanced_routing(rows: int, experts: int, device: torch.device) -> routing.Dispatch:
    """The dispatch of :func:`balanced_ids`."""
    return routing.dispatch(balanced_ids(rows, experts, device), experts)


def experts_layer(w_up: torch.Tensor, w_down: torch.Tensor, precision: str, wgrad: str,
                  gemm: str = "auto", cache_weights: bool = False, hf_bf16: bool = False) -> nn.Module:
    """A ``Float8GroupedExperts`` over ``w_up`` (E, 2I, H) and ``w_down`` (E, H, I) (taken over as its Parameters):
    both weights FP8 on the ``fused`` kernel with ``wgrad`` and ``gemm`` for ``precision = "fp8"``, else BF16; with
    ``hf_bf16`` a BF16 layer is the transformers experts module itself (:data:`HF_EXPERTS_IMPLEMENTATION`)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, two_i, h = w_up.shape
    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=two_i // 2, num_experts=e, hidden_act="silu")
    with torch.device("meta"):
        src = Qwen3MoeExperts(cfg)
    src.gate_up_proj, src.down_proj = nn.Parameter(w_up), nn.Parameter(w_down)
    if hf_bf16 and precision != "fp8":
        cfg._experts_implementation = HF_EXPERTS_IMPLEMENTATION
        return src
    fp8 = frozenset(WEIGHTS) if precision == "fp8" else frozenset()
    return Float8GroupedExperts(src, fp8, GroupedGemmConfig(kernel="fused", wgrad=wgrad, gemm=gemm,
                                                                  cache_weights=cache_weights))


class ExpertsMLPTimer:
    """Milliseconds of one forward + backward of ``E`` experts' gated MLP on ``P`` routed rows.

    Args:
        gemms: ``((H, 2I), (I, H))``: gate_up's and down's ``(K, N)`` per expert (``AutoShape.gemms`` of an ``mlp``
            shape).
        experts: local experts ``E``; rows: routed rows ``P``.
        precision: ``"bf16"`` or ``"fp8"`` (fused rowwise FP8 MLP).
        wgrad: the fused path's wgrad precision (``fp8.grouped_wgrad``: ``auto``, ``fp8`` or ``bf16``).
        gemm: how the fused path runs its GEMMs (``fp8.grouped_gemm``: ``auto``, ``grouped`` or ``loop``).
        accumulate: micro-batches per optimizer step whose FP8 expert weights the run casts once
            (``train.grad_accum`` where the weight cache applies, ``parallel.prepare.weight_cache_applies``): the
            timed calls then cast the weights once every ``accumulate`` calls, so the mean is the run's steady state
            (1: cast every call).
        compile: ``torch.compile`` the timed function.
        whole_layer: time each precision as the module one GPU runs, forward called with the routing (module
            docstring); False: ``local_experts`` + ``combine`` of a ``Float8GroupedExperts`` in both (expert parallel).

    Raises:
        ValueError: ``gemms`` not the two GEMMs of one gated MLP.
        CapabilityError: (when called) FP8 on a GPU without the FP8 grouped GEMM.
    """

    def __init__(self, gemms: tuple[tuple[int, int], ...], experts: int, rows: int, precision: str, *,
                 device: torch.device, wgrad: str = "auto", gemm: str = "auto", compile: bool = False,
                 accumulate: int = 1, whole_layer: bool = False):
        if len(gemms) != 2 or gemms[0][1] != 2 * gemms[1][0] or gemms[0][0] != gemms[1][1]:
            raise ValueError(f"ExpertsMLPTimer: gemms {gemms} are not ((H, 2I), (I, H)) of one gated MLP")
        (h, two_i), (inter, _) = gemms
        self.device = device
        g = torch.Generator(device=device).manual_seed(0)
        w_up = (torch.randn(experts, two_i, h, generator=g, device=device) * h ** -0.5).to(torch.bfloat16)
        w_down = (torch.randn(experts, h, inter, generator=g, device=device) * inter ** -0.5).to(torch.bfloat16)
        self.layer = experts_layer(w_up, w_down, precision, wgrad, gemm, cache_weights=accumulate > 1,
                                   hf_bf16=whole_layer)
        self.accumulate = max(1, accumulate)
        self.whole_layer = whole_layer
        self.x = torch.randn(rows, h, generator=g, device=device).to(torch.bfloat16).requires_grad_()
        self.dy = torch.randn(rows, h, generator=g, device=device).to(torch.bfloat16)
        self.ones = torch.ones(rows, 1, device=device, dtype=torch.bfloat16)
        self.ids = balanced_ids(rows, experts, device)
        self.d = routing.dispatch(self.ids, experts)
        self.fn = torch.compile(self._forward) if compile else self._forward

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole_layer:
            return self.layer(x, self.ids, self.ones)
        return routing.combine(self.layer.local_experts(x, self.d), self.d, self.ones, x.dtype)

    def __call__(self, *, warmup: int, iters: int) -> float:
        leaves = (self.x, self.layer.gate_up_proj, self.layer.down_proj)

        calls = [0]

        def reset() -> None:
            for t in leaves:
                t.grad = None
            if calls[0] % self.accumulate == 0:  # a new optimizer step: the cached FP8 weights are cast again
                mark_optimizer_step()
            calls[0] += 1

        def step() -> None:
            self.fn(self.x).backward(self.dy)

        return time_ms(step, device=self.device, warmup=warmup, iters=iters, before=reset)
