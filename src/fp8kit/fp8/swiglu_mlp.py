"""A SwiGLU MLP whose three projections are blockwise FP8, run as one autograd function with the casts fused into
the SwiGLU (``fp8.blockwise_fused_mlp``; the FP8 engine issue's "the SwiGLU activation writes the FP8 input of
down_proj").

``y = down(silu(gate(x)) * up(x))``, each projection a :class:`fp8kit.fp8.linear.Float8BlockwiseLinear`. Per
projection the GEMMs, operands and scales are exactly those of the blockwise linear (:mod:`fp8kit.fp8.blockwise`);
what changes is where the SwiGLU's tensors are cast:

- forward: ``x`` is cast once for gate and up (as the compiled unfused block does); the SwiGLU reads the gate and
  up outputs ``g``, ``u`` and writes the down projection's two FP8 operands directly
  (:func:`fp8kit.fp8.swiglu.swiglu_quantize_act`), never ``a`` in bf16;
- backward: the SwiGLU's gradient reads ``da`` (the down projection's dgrad output), ``g`` and ``u`` and writes
  the gate and up projections' FP8 dgrad and wgrad operands directly
  (:func:`fp8kit.fp8.swiglu.swiglu_backward_quantize`), never ``dg`` / ``du`` in bf16. ``dx`` is the sum of the
  gate and up dgrad GEMMs.

Saved for the backward: the FP8 ``x^T`` copy, ``g`` and ``u`` (bf16, as the unfused SwiGLU backward saves them),
the FP8 ``a^T`` copy, and the FP8 ``w^T`` copies (or the weights, ``keep_weight_copy=False``). Numerics: each
SwiGLU value is rounded to bf16 before its cast, as the unfused MLP's bf16 tensor is; the sigmoid is computed with
the hardware's ``exp`` on the GPU (as Inductor's), so an element can differ from the unfused MLP's by one bf16 ulp
before the cast.

:func:`install_fused_mlps` gives the SwiGLU MLP modules of the HF Llama / Qwen2 / Qwen3 / Mistral families
(:data:`FUSABLE_MLPS`) a forward that runs this function whenever its projections allow it
(:func:`fused_mlp_blocker`) and the module's own forward otherwise: a projection that is not blockwise FP8
(a policy kept it BF16, or the precision schedule switched it back), tensor-parallel (DTensor) weights, hooks on a
projection (``fp8.stats_every``'s health statistics measure each linear's operands), a bias, or projections
with different blockwise settings. Parameters, their names and the ``state_dict`` are unchanged. The same
forward runs the delayed recipe's fused MLP (:mod:`fp8kit.fp8.delayed_mlp`, ``fp8.delayed_fused_mlp``) when the
three projections are delayed-scaling FP8 linears: the installer records which recipes' fused functions a module
may run.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fp8kit.fp8.blockwise import BLOCK, check_wgrad_x, wgrad_x_block
from fp8kit.fp8.delayed import Float8DelayedLinear
from fp8kit.fp8.delayed_mlp import can_run_fused, delayed_swiglu_mlp_forward
from fp8kit.fp8.kernels import ops
from fp8kit.fp8.linear import Float8BlockwiseLinear
from fp8kit.fp8.swiglu import swiglu_backward_quantize, swiglu_quantize_act

#: The transformers MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.
FUSABLE_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_ORIGINAL = "_fp8kit_unfused_forward"
_RECIPES = "_fp8kit_fused_recipes"  # the recipes whose fused function an installed MLP may run


class _BlockwiseSwiGLUMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, cache_weight: bool, emulate: bool, keep_weight_copy: bool,
                wgrad_x: str):
        i, k = w_gate.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        xq, xs_t, xtq, xts = ops.quantize_act(x2, wgrad_x)
        gq, gs, gtq, gts = ops.quantize_weight(w_gate, cache_weight)
        uq, us, utq, uts = ops.quantize_weight(w_up, cache_weight)
        dq, ds, dtq, dts = ops.quantize_weight(w_down, cache_weight)
        g = ops.blockwise_mm(xq, xs_t, gq, gs, BLOCK, x.dtype, emulate)[:m]
        u = ops.blockwise_mm(xq, xs_t, uq, us, BLOCK, x.dtype, emulate)[:m]
        aq, as_t, atq, ats = swiglu_quantize_act(g, u, wgrad_x)
        y = ops.blockwise_mm(aq, as_t, dq, ds, BLOCK, x.dtype, emulate)[:m]
        ctx.keep = keep_weight_copy or cache_weight  # a cached copy lives in the cache anyway
        weights = (gtq, gts, utq, uts, dtq, dts) if ctx.keep else (w_gate, w_up, w_down)
        ctx.save_for_backward(xtq, xts, g, u, atq, ats, *weights)
        ctx.shape = (lead, m, k)
        ctx.dtypes = (w_gate.dtype, w_up.dtype, w_down.dtype)
        ctx.emulate, ctx.wgrad_x = emulate, wgrad_x
        return y.reshape(*lead, w_down.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xtq, xts, g, u, atq, ats, *w = ctx.saved_tensors
        lead, m, k = ctx.shape
        emulate, x_block = ctx.emulate, wgrad_x_block(ctx.wgrad_x)
        if ctx.keep:
            gtq, gts, utq, uts, dtq, dts = w
        else:  # FSDP2 / fp8.blockwise_recompute: the dgrad layouts from the (re-gathered) weights
            (gtq, gts), (utq, uts), (dtq, dts) = (ops.quantize_weight_dgrad(t) for t in w)
        dyq, dys_t, dytq, dyts = ops.quantize_act(dy.reshape(-1, dy.shape[-1]))
        d_gate = d_up = d_down = dx = None
        if ctx.needs_input_grad[3]:
            d_down = ops.blockwise_mm(dytq, dyts, atq, ats, x_block, ctx.dtypes[2], emulate)
        if any(ctx.needs_input_grad[:3]):
            da = ops.blockwise_mm(dyq, dys_t, dtq, dts, BLOCK, g.dtype, emulate)[:m]
            gq, gs_t, g_tq, g_ts, uq, us_t, u_tq, u_ts = swiglu_backward_quantize(da, g, u)
            if ctx.needs_input_grad[0]:
                dx = (ops.blockwise_mm(gq, gs_t, gtq, gts, BLOCK, g.dtype, emulate)[:m]
                      + ops.blockwise_mm(uq, us_t, utq, uts, BLOCK, g.dtype, emulate)[:m]).reshape(*lead, k)
            if ctx.needs_input_grad[1]:
                d_gate = ops.blockwise_mm(g_tq, g_ts, xtq, xts, x_block, ctx.dtypes[0], emulate)
            if ctx.needs_input_grad[2]:
                d_up = ops.blockwise_mm(u_tq, u_ts, xtq, xts, x_block, ctx.dtypes[1], emulate)
        return dx, d_gate, d_up, d_down, None, None, None, None


def blockwise_swiglu_mlp(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, *,
    cache_weight: bool = True, emulate: bool = False, keep_weight_copy: bool = True, wgrad_x: str = "128x1",
) -> torch.Tensor:
    """``down(silu(x @ w_gate^T) * (x @ w_up^T))`` in blockwise FP8 with the SwiGLU's casts fused (module docstring).

    Args:
        x: ``[..., H]`` bf16 (or fp16 / fp32) input; the output has its dtype.
        w_gate, w_up: ``[I, H]``; w_down: ``[H_out, I]``; every dimension a multiple of 128.
        cache_weight, emulate, keep_weight_copy, wgrad_x: as for :func:`fp8kit.fp8.linear.blockwise_linear`.

    Returns:
        ``[..., H_out]`` tensor of ``x.dtype``, differentiable in ``x`` and the three weights.

    Raises:
        ValueError: weights that are not 2-D multiples of 128 of matching shapes, ``x`` not ending in ``H``, or an
            unknown ``wgrad_x``.
        CapabilityError: on a CUDA GPU without blockwise FP8 GEMMs and ``emulate`` false.
    """
    check_wgrad_x(wgrad_x, "blockwise_swiglu_mlp")
    shapes = [tuple(w.shape) for w in (w_gate, w_up, w_down)]
    ok = (all(len(s) == 2 and s[0] % BLOCK == 0 and s[1] % BLOCK == 0 for s in shapes)
          and shapes[0] == shapes[1] and shapes[2][1] == shapes[0][0])
    if not ok:
        raise ValueError(f"blockwise_swiglu_mlp: weights must be gate [I, H], up [I, H], down [H_out, I] with every "
                         f"dimension a multiple of {BLOCK}, got gate {shapes[0]}, up {shapes[1]}, down {shapes[2]}")
    if x.shape[-1] != shapes[0][1]:
        raise ValueError(f"blockwise_swiglu_mlp: input of shape {tuple(x.shape)} does not match gate weight "
                         f"{shapes[0]} (last dimension must be {shapes[0][1]})")
    return _BlockwiseSwiGLUMLPFn.apply(x, w_gate, w_up, w_down, cache_weight, emulate, keep_weight_copy, wgrad_x)


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def fused_mlp_blocker(mlp: nn.Module) -> str | None:
    """Why ``mlp`` cannot run its fused function now (:func:`blockwise_swiglu_mlp`, or
    :mod:`fp8kit.fp8.delayed_mlp`'s for delayed-scaling projections), or None when it can (module docstring)."""
    if type(mlp).__name__ not in FUSABLE_MLPS:
        return f"{type(mlp).__name__} is not one of {', '.join(FUSABLE_MLPS)}"
    if not _is_silu(getattr(mlp, "act_fn", None)):
        return "its activation is not SiLU"
    projs = [getattr(mlp, n, None) for n in _PROJECTIONS]
    enabled = getattr(mlp, _RECIPES, None)  # None: not installed; the question is only whether it could run
    delayed = any(isinstance(p, Float8DelayedLinear) for p in projs)
    recipe, kind = ("delayed", Float8DelayedLinear) if delayed else ("blockwise", Float8BlockwiseLinear)
    if not all(isinstance(p, kind) for p in projs):
        return f"not all of gate_proj / up_proj / down_proj are {'delayed-scaling' if delayed else 'blockwise'} FP8"
    if enabled is not None and recipe not in enabled:
        return f"fp8.{recipe}_fused_mlp is off"
    if any(p.bias is not None for p in projs):
        return "a projection has a bias"
    if any(isinstance(p.weight, DTensor) for p in projs):
        return "tensor-parallel (DTensor) weights"
    if any(p._forward_hooks or p._forward_pre_hooks or getattr(p, "health_probe", None) is not None for p in projs):
        return "a projection has forward hooks or a health probe (e.g. fp8.stats_every)"
    if delayed:
        if len({id(p.state) for p in projs}) > 1:
            return "the projections keep their histories in different DelayedScalingStates"
        return None
    settings = {(p.cache_weight, p.emulate, p.keep_weight_copy, p.wgrad_x) for p in projs}
    if len(settings) > 1 or not all(p.keep_input_copy for p in projs):
        return "the projections' blockwise settings differ or keep no input copy (fp8.blockwise_recompute)"
    return None


def _fused_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if fused_mlp_blocker(self) is not None:
        return getattr(self, _ORIGINAL)(x)
    gate = self.gate_proj
    if isinstance(gate, Float8DelayedLinear):
        if can_run_fused([self.gate_proj, self.up_proj, self.down_proj], x):
            return delayed_swiglu_mlp_forward(self, x)
        return getattr(self, _ORIGINAL)(x)  # the first recorded step, evaluation, ... (fp8.delayed_mlp)
    return _BlockwiseSwiGLUMLPFn.apply(x, gate.weight, self.up_proj.weight, self.down_proj.weight, gate.cache_weight,
                                       gate.emulate, gate.keep_weight_copy, gate.wgrad_x)


def _mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, mod) for name, mod in model.named_modules() if type(mod).__name__ in FUSABLE_MLPS]


def install_fused_mlps(model: nn.Module, recipe: str = "blockwise") -> None:
    """Give every :data:`FUSABLE_MLPS` module of ``model`` the fused forward for projections of ``recipe``
    (``"blockwise"``: ``fp8.blockwise_fused_mlp``; ``"delayed"``: ``fp8.delayed_fused_mlp``). Idempotent, and
    cumulative over recipes; each call of the forward re-checks :func:`fused_mlp_blocker` and runs the module's own
    forward while it names a reason.

    Raises:
        ValueError: ``recipe`` is neither ``"blockwise"`` nor ``"delayed"``.
    """
    if recipe not in ("blockwise", "delayed"):
        raise ValueError(f"install_fused_mlps: recipe must be 'blockwise' or 'delayed', got {recipe!r}")
    for _, mod in _mlps(model):
        if not hasattr(mod, _ORIGINAL):
            setattr(mod, _ORIGINAL, mod.forward)
            mod.forward = types.MethodType(_fused_forward, mod)
            setattr(mod, _RECIPES, set())
        getattr(mod, _RECIPES).add(recipe)


def fused_mlp_report(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """``(fused, blocked)``: the names of the installed MLPs of ``model`` that run fused now, and ``{name: reason}``
    for those that run their own forward now (:func:`fused_mlp_blocker`)."""
    fused, blocked = [], {}
    for name, mod in _mlps(model):
        if not hasattr(mod, _ORIGINAL):
            continue
        reason = fused_mlp_blocker(mod)
        if reason is None:
            fused.append(name)
        else:
            blocked[name] = reason
    return fused, blocked
