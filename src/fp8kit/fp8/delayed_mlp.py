"""A SwiGLU MLP whose three projections are delayed-scaling FP8 linears, run as one autograd function with the
SwiGLU backward's casts in one kernel (``fp8.delayed_fused_mlp``).

``y = down(silu(gate(x)) * up(x))``, each projection a :class:`fp8kit.fp8.delayed.Float8DelayedLinear`. Formats,
scales, GEMMs and the amax histories are those of the three delayed linears (:mod:`fp8kit.fp8.delayed`); what
changes is where the casts happen:

- forward: ``x`` is cast once for gate and up, at gate's input scale, which once both have started is the smaller
  of their two input scales (the group's, ``DelayedEntry.group_scale``; the rule of
  :mod:`fp8kit.fp8.delayed_siblings`, which the unfused projections follow too). The two input histories
  record the same ``max |x|`` every step, so the scales are equal in a run; they can differ for a while after a
  checkpoint that lacked one of the entries, or precision phases that switched only one projection, and then the
  smaller scale saturates neither (the larger one's projection gets coarser steps). ``a = silu(g) * u`` and its
  E4M3 cast are plain tensor ops, fused by ``torch.compile`` into one kernel;
- backward: ``da`` (the down projection's dgrad) and the saved ``g``, ``u`` go through one kernel
  (:func:`fp8kit.fp8.swiglu_delayed.swiglu_backward_cast`) that writes ``dg`` and ``du`` in E5M2 in both layouts
  (gate / up dgrad and wgrad operands), their amaxes for the histories, and the E4M3 transpose of ``a`` for the
  down projection's wgrad. Unfused, Inductor writes the transposed copies from a row-reduction kernel, column by
  column, and recomputes ``a`` and ``x``'s wgrad copy per projection.

Saved for the backward: ``x`` (bf16; cast again in the backward under ``torch.compile``, as the delayed linear
does) or, eagerly, its FP8 copy; ``g`` and ``u`` (as the unfused SwiGLU saves them); the weights' column-major FP8
copies; scales and amaxes. Numerics: each SwiGLU value is computed in float32 and rounded once to bf16
(:func:`fp8kit.fp8.swiglu.swiglu_ref`, :func:`~fp8kit.fp8.swiglu.swiglu_backward_ref`); on the GPU the kernel's sigmoid is
the hardware's, so a value can differ from the reference by a bf16 ulp before its cast (and the down projection's
wgrad copy of ``a``, made by the kernel, from the forward's fprop copy by one E4M3 step in such an element; the
unfused linear under ``torch.compile`` recomputes its wgrad copy too).

The function runs when all three projections have a recorded history (the warm-start steps, whose scales
come from its own tensors, runs the three linears), in training with grad enabled (evaluation runs the linears:
same scales, nothing recorded), on bf16 / fp16 activations (float32 ones, from FP32 weights under autocast, run the
linears: the kernel takes no float32), and when every projection's history would advance in the backward as its
linear's would (``x`` requires grad, or all three weights do) (:func:`can_run_fused`);
:func:`fp8kit.fp8.swiglu_mlp.fused_mlp_blocker` lists what else keeps an MLP unfused. Each projection's record
is written as its linear's would be (input and weight amax in the forward, output gradient's in the backward), and
the state's roll takes it into the history.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8kit.fp8.delayed import Float8DelayedLinear, _cast_both, _recast_col_major, _weight_both, scaled_mm
from fp8kit.fp8.delayed_state import E4M3, E5M2, record_
from fp8kit.fp8.swiglu_delayed import swiglu_backward_cast

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class _DelayedSwiGLUMLPFn(torch.autograd.Function):
    """Inputs: ``x`` ``[M, H]``, weights gate / up ``[I, H]``, down ``[H_out, I]``, ``group``, ``fused``
    (``fp8.delayed_fused_cast``'s operands), ``fast_accum`` (the GEMMs with fast accumulation,
    ``DelayedScaling.fast_accum``), ``cache_weight`` (``DelayedScaling.cache_weights``: the weights' casts from the
    once-per-step cache), then 22 state tensors: 16 float32 ``[]`` scales and reciprocals, as
    ``Float8DelayedLinear._scales_and_inverses`` gives them (gate: input, weight, output gradient; up: weight, output
    gradient, its input scale being gate's, the group's smaller one, at which ``x`` is cast once:
    fp8.delayed_siblings; down: input, weight, output gradient), then the three entries' ``forward_amax`` ``[2]``
    and their three ``grad_amax`` ``[1]``. Output ``[M, H_out]`` in ``x``'s
    dtype."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, group, fused, fast_accum, cache_weight, *state):
        sx, ix, swg, iwg, sgg, igg, swu, iwu, sgu, igu, sa, ia, swd, iwd, sy, iy = state[:16]
        records, grad_records = state[16:19], state[19:22]
        dgrad, wgrad_x = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        recast_x = wgrad_x and "input" not in fused and torch.compiler.is_compiling()
        x8, x8_cm, _, ax = _cast_both(x, sx, E4M3, None, wgrad_x and not recast_x, "input" in fused)
        w_fused = "weight" in fused
        wg8, wg8_cm, _, awg = _weight_both(w_gate, swg, None, dgrad, w_fused, cache_weight)
        wu8, wu8_cm, _, awu = _weight_both(w_up, swu, None, dgrad, w_fused, cache_weight)
        wd8, wd8_cm, _, awd = _weight_both(w_down, swd, None, True, w_fused, cache_weight)
        g = scaled_mm(x8, wg8.t(), ix, iwg, x.dtype, "fprop", fast_accum)
        u = scaled_mm(x8, wu8.t(), ix, iwu, x.dtype, "fprop", fast_accum)
        gf = g.float()
        a = (gf * torch.sigmoid(gf) * u.float()).to(x.dtype)  # fp8.swiglu.swiglu_ref
        a8, _, _, aa = _cast_both(a, sa, E4M3, None, False, False)
        y = scaled_mm(a8, wd8.t(), ia, iwd, x.dtype, "fprop", fast_accum)
        # as in the delayed linear: these writes keep the amaxes in the forward under torch.compile
        for rec, (a_in, a_w) in zip(records, ((ax, awg), (ax, awu), (aa, awd)), strict=True):
            record_(rec, 0, a_in)
            if a_w is not None:  # (an all-gathered E4M3 weight's amax was recorded at its all-gather)
                record_(rec, 1, a_w)
        ctx.save_for_backward(x if recast_x else x8_cm, g, u, wg8_cm, wu8_cm, wd8_cm, sx, ix, iwg, sgg, igg, iwu,
                              sgu, igu, sa, ia, iwd, sy, iy)
        ctx.recast_x = recast_x
        # state the backward writes, not saved values (as in the delayed linear)
        ctx.records, ctx.group, ctx.fused, ctx.fast_accum = grad_records, group, fused, fast_accum
        ctx.dtypes = (x.dtype, w_gate.dtype, w_up.dtype, w_down.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x8_cm, g, u, wg8_cm, wu8_cm, wd8_cm, sx, ix, iwg, sgg, igg, iwu, sgu, igu, sa, ia, iwd, sy, iy = ctx.saved_tensors
        x_dtype, dt_gate, dt_up, dt_down = ctx.dtypes
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad[:4]
        dy8, dy8_cm, _, ay = _cast_both(dy, sy, E5M2, None, True, "grad_output" in ctx.fused)
        # the down projection's dgrad: [M, H_out] @ [H_out, I] -> da [M, I]
        fast = ctx.fast_accum
        da = scaled_mm(dy8, wd8_cm, iy, iwd, x_dtype, "dgrad", fast)
        qg, qgt, qu, qut, qat, amax_gu = swiglu_backward_cast(g, u, da, sgg, sgu, sa)
        dx = d_gate = d_up = d_down = None
        if need_down:  # [H_out, M] @ [M, I]
            d_down = scaled_mm(dy8_cm.t(), qat.t(), iy, ia, dt_down, "wgrad", fast)
        if need_x:  # dgrad of gate and up: [M, I] @ [I, H], summed
            dx = (scaled_mm(qg, wg8_cm, igg, iwg, x_dtype, "dgrad", fast)
                  + scaled_mm(qu, wu8_cm, igu, iwu, x_dtype, "dgrad", fast))
        if need_gate or need_up:  # wgrad of gate and up: [I, M] @ [M, H]
            if ctx.recast_x:
                x8_cm = _recast_col_major(x8_cm, sx)
            if need_gate:
                d_gate = scaled_mm(qgt, x8_cm, igg, ix, dt_gate, "wgrad", fast)
            if need_up:
                d_up = scaled_mm(qut, x8_cm, igu, ix, dt_up, "wgrad", fast)
        # the three projections' output-gradient amaxes complete their records (the roll reduces them)
        for rec, a_out in zip(ctx.records, (amax_gu[0], amax_gu[1], ay), strict=True):
            record_(rec, 0, a_out)
        return (dx, d_gate, d_up, d_down, None, None, None, None) + (None,) * 22


def can_run_fused(projections: list[Float8DelayedLinear], x: torch.Tensor) -> bool:
    """Whether this call on input ``x`` runs the fused function (module docstring: training with grad, every
    history recorded at least once, bf16 / fp16 ``x``, every history advancing in the backward); otherwise the three
    linears run (the first step's dynamic scales, evaluation, float32 activations, frozen weights on a frozen
    input)."""
    return (projections[0].training and torch.is_grad_enabled() and x.dtype in (torch.bfloat16, torch.float16)
            and (x.requires_grad or all(p.weight.requires_grad for p in projections))
            and all(p._entry.started for p in projections))


def delayed_swiglu_mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The fused forward of a SwiGLU ``mlp`` whose projections pass ``swiglu_mlp.fused_mlp_blocker`` and
    :func:`can_run_fused`: ``[..., H]`` -> ``[..., H_out]`` in ``x``'s dtype.

    Raises:
        ValueError: ``x``'s last dimension is not the gate projection's ``in_features``.
    """
    projs = [getattr(mlp, n) for n in _PROJECTIONS]
    h = projs[0].in_features
    if x.shape[-1] != h:
        raise ValueError(f"fused delayed MLP: input of shape {tuple(x.shape)} does not match gate_proj "
                         f"({h} input features)")
    state = projs[0].state
    for p in projs:
        if p._entry.history.device != x.device:
            state.place(p._entry, x.device)
    state.ensure_rolled(mlp)
    gate, up, down = (p._scales_and_inverses() for p in projs)  # started: can_run_fused
    scales = [*gate, *up[2:], *down]  # up's input scale is gate's (one tensor: passed once)
    records = [p._entry.forward_amax for p in projs] + [p._entry.grad_amax for p in projs]
    # one operand set for the whole MLP (its projections share the state): down_proj's, whose output gradient it casts
    y = _DelayedSwiGLUMLPFn.apply(x.reshape(-1, h), projs[0].weight, projs[1].weight, projs[2].weight, state.group,
                                  projs[2]._fused_casts(), state.config.fast_accum, state.config.cache_weights,
                                  *scales, *records)
    return y.reshape(*x.shape[:-1], projs[2].out_features)
