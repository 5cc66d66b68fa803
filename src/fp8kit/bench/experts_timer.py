"""Times one MoE layer's expert MLP, forward + backward, as ``fp8kit train`` runs it: the unit ``experts.mlp`` of
``selective_fp8 = "auto"`` (``selective/auto.py``).

The experts are a transformers ``Qwen3MoeExperts`` (gated SiLU, concatenated halves: the gate the fused path
computes), fed ``P`` routed rows spread evenly over the ``E`` local experts. On one GPU (``whole_layer``) they come
from ``P / topk`` tokens routed to ``topk`` distinct experts each, as the run routes them (from top-2 the dispatch
casts run from the tokens' side, ``moe/rowwise_quant.SCATTER_MIN_TOPK``: a top-1 stand-in would time the other
kernel); under expert parallelism one row per received token (top-1, as the all-to-all delivers them). Each
precision runs the module the run would hold:

- one GPU (``whole_layer``): BF16 experts stay the transformers module (``parallel/convert.py`` swaps only experts with
  an FP8 weight), run through its ``grouped_mm`` experts implementation (:data:`HF_EXPERTS_IMPLEMENTATION`, what
  transformers sets in a model) with its own routing; FP8 experts are a ``Float8GroupedExperts`` run whole (dispatch,
  the fused MLP, combine);
- expert parallel (``whole_layer=False``): every layer is a ``Float8GroupedExperts`` (``parallel/parallelize.py``),
  timed through ``local_experts`` + ``routing.combine`` (the all-to-all is the same in both precisions): BF16
  ``torch._grouped_mm`` against ``moe/fused_experts.fused_rowwise_experts`` (the fused gather + rowwise casts, FP8
  grouped GEMMs for fprop and dgrad, the run's wgrad precision).

The FP8 expert weights are cast in every call (one micro-batch per optimizer step), or with ``accumulate = N`` once
per N micro-batches, as a run with ``train.grad_accum = N`` and the weight cache casts them (the cached step plus a
1/N share of the cast). Call :meth:`ExpertsMLPTimer.close` when done.
Timing: ``bench/timing.time_ms`` (device time, the host's launches hidden where the layer does not wait for the GPU;
the loop of dense GEMMs, ``fp8.grouped_gemm = "loop"``, reads the group bounds on the host in every call, as in
training), compiled with ``torch.compile`` when
``compile`` (as ``train.compile`` compiles the block that holds the experts).
"""

from __future__ import annotations

import torch
from torch import nn

from fp8kit.bench.timing import time_ms, with_weight_cast_share
from fp8kit.moe import routing
from fp8kit.moe.experts import WEIGHTS, Float8GroupedExperts
from fp8kit.moe.grouped_mm import GroupedGemmConfig
from fp8kit.moe.rowwise_quant import quantize_experts_dual

#: The experts implementation transformers gives a MoE model's experts (``config._experts_implementation``, set by
#: ``PreTrainedModel``; a standalone experts module has none): what BF16 experts run on one GPU
#: (``tests/test_auto_selective.py`` checks a built model uses it).
HF_EXPERTS_IMPLEMENTATION = "grouped_mm"


def balanced_ids(rows: int, experts: int, device: torch.device) -> torch.Tensor:
    """``(rows, 1)`` expert of each row: one expert each, ``rows / experts`` per expert, in row order."""
    return (torch.arange(rows, device=device) * experts // max(rows, 1))[:, None]


def balanced_topk_ids(tokens: int, topk: int, experts: int, device: torch.device) -> torch.Tensor:
    """``(tokens, topk)`` experts of each token: ``topk`` distinct experts per token (``topk <= experts``), the
    ``tokens * topk`` pairs spread over the experts within one (``(t * topk + j) mod experts``)."""
    return (torch.arange(tokens * topk, device=device) % experts).view(tokens, topk)


def unit_config(wgrad: str = "auto", gemm: str = "auto", cache_weights: bool = False) -> GroupedGemmConfig:
    """The ``GroupedGemmConfig`` an FP8 ``experts.mlp`` unit runs: the fused rowwise MLP with the run's
    ``fp8.grouped_wgrad`` / ``grouped_gemm`` (``resolve_grouped_kernel`` of it tells whether the device can)."""
    return GroupedGemmConfig(kernel="fused", wgrad=wgrad, gemm=gemm, cache_weights=cache_weights)


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
    return Float8GroupedExperts(src, fp8, unit_config(wgrad, gemm, cache_weights))


class ExpertsMLPTimer:
    """Milliseconds of one forward + backward of ``E`` experts' gated MLP on ``P`` routed rows.

    Args:
        gemms: ``((H, 2I), (I, H))``: gate_up's and down's ``(K, N)`` per expert (``AutoShape.gemms`` of an ``mlp``
            shape).
        experts: local experts ``E``; rows: routed rows ``P``.
        topk: experts per token on one GPU (``whole_layer``): ``P // topk`` tokens routed to ``topk`` distinct
            experts each; ignored under expert parallelism (one row per received token).
        precision: ``"bf16"`` or ``"fp8"`` (fused rowwise FP8 MLP).
        wgrad: the fused path's wgrad precision (``fp8.grouped_wgrad``: ``auto``, ``fp8`` or ``bf16``).
        gemm: how the fused path runs its GEMMs (``fp8.grouped_gemm``: ``auto``, ``grouped`` or ``loop``).
        accumulate: micro-batches per optimizer step whose FP8 expert weights the run casts once
            (``config.prepare_options.weight_cast_accumulation``): the time is then the run's steady state, the
            cached step plus a 1/accumulate share of the weights' cast (:meth:`__call__`); 1: the weights cast in
            every call.
        compile: ``torch.compile`` the timed function.
        whole_layer: time each precision as the module one GPU runs, forward called with the routing (module
            docstring); False: ``local_experts`` + ``combine`` of a ``Float8GroupedExperts`` in both (expert parallel).

    Raises:
        ValueError: ``gemms`` not the two GEMMs of one gated MLP; ``topk`` not in ``[1, experts]``.
        CapabilityError: (when called) FP8 on a GPU without the FP8 grouped GEMM.
    """

    def __init__(self, gemms: tuple[tuple[int, int], ...], experts: int, rows: int, precision: str, *,
                 device: torch.device, wgrad: str = "auto", gemm: str = "auto", compile: bool = False,
                 accumulate: int = 1, whole_layer: bool = False, topk: int = 1):
        if not 1 <= topk <= experts:
            raise ValueError(f"ExpertsMLPTimer: topk {topk} must be in [1, {experts}] (distinct experts per token)")
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
        self.topk = topk if whole_layer else 1
        tokens = max(1, rows // self.topk)
        self.x = torch.randn(tokens, h, generator=g, device=device).to(torch.bfloat16).requires_grad_()
        self.dy = torch.randn(tokens, h, generator=g, device=device).to(torch.bfloat16)
        self.ones = torch.full((tokens, self.topk), 1.0 / self.topk, device=device, dtype=torch.bfloat16)
        self.ids = (balanced_topk_ids(tokens, self.topk, experts, device) if self.topk > 1
                    else balanced_ids(tokens, experts, device))
        self.d = routing.dispatch(self.ids, experts)
        self.fn = torch.compile(self._forward) if compile else self._forward

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole_layer:
            return self.layer(x, self.ids, self.ones)
        return routing.combine(self.layer.local_experts(x, self.d), self.d, self.ones, x.dtype)

    def __call__(self, *, warmup: int, iters: int) -> float:
        """Milliseconds of one micro-batch's forward + backward (``bench/timing.time_ms``). With ``accumulate = N > 1``
        and FP8 weights: the step with the cached weights (cast once, in the first warm-up call) plus the cast of both
        weights (the same kernels as a cache miss, timed alone) divided by N, the exact share of one micro-batch, however
        ``time_ms`` groups its calls. The parts are left in ``self.parts``."""
        leaves = (self.x, self.layer.gate_up_proj, self.layer.down_proj)

        def reset() -> None:
            for t in leaves:
                t.grad = None

        def step() -> None:
            self.fn(self.x).backward(self.dy)

        try:
            ms = time_ms(step, device=self.device, warmup=max(warmup, 1), iters=iters, before=reset)
            share = self.accumulate if getattr(self.layer, "fp8_weights", None) else 1
            ms, self.parts = with_weight_cast_share(ms, self._cast_weights, share, device=self.device, warmup=warmup,
                                                    iters=iters)
            return ms
        finally:
            reset()

    def _cast_weights(self) -> None:
        with torch.no_grad():
            quantize_experts_dual(self.layer.gate_up_proj)
            quantize_experts_dual(self.layer.down_proj)

    def close(self) -> None:
        """Drop the layer, its inputs and the (compiled) function, which refers back to the timer: without this the
        timer's weights, gradients and FP8 copies would outlive the measurement until a garbage collection."""
        self.fn = self.layer = self.x = self.dy = self.d = self.ids = self.ones = None
