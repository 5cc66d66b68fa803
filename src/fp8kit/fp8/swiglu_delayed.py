"""The SwiGLU backward of a delayed-scaling FP8 MLP with its casts fused in (``torch.ops.fp8kit.delayed_swiglu_bwd_cast``).

In a SwiGLU MLP ``down(silu(g) * u)`` with ``g = gate(x)``, ``u = up(x)``, the backward takes ``da`` (the down
projection's dgrad output) and needs, per tensor-scaled FP8 recipe, the gate / up projections' output gradients
``dg``, ``du`` in E5M2 twice (row-major for dgrad, transposed for wgrad) and the SwiGLU output ``a`` in E4M3,
transposed, for the down projection's wgrad. With delayed scaling every scale is known before the cast (it comes
from the amax history), so one read of ``g``, ``u``, ``da`` can write all five FP8 tensors and record the two
gradients' amaxes for the history (Transformer Engine's fused cast-transpose, applied at the SwiGLU).

Numerics (:func:`swiglu_backward_cast_reference`): :func:`fp8kit.fp8.swiglu.swiglu_backward_ref` and
:func:`fp8kit.fp8.swiglu.swiglu_ref` (float32 math, each value rounded once to the input dtype), then
``saturate(value * scale)`` converted to the format (:func:`fp8kit.fp8.scaling.quantize`); amaxes of the rounded
values, NaN-propagating. The Triton kernel (:mod:`fp8kit.fp8.kernels.swiglu_delayed_triton`) computes the sigmoid with
the hardware's ``exp`` and division, as Inductor's SiLU does, so a SwiGLU value can differ from the reference's by
a bf16 ulp; the casts of the values it computed are the reference's casts bit for bit (GPU test).

CUDA runs the Triton kernel, every other device (and CUDA without triton) the reference, so CPU CI runs the
same op. ``register_fake`` gives ``torch.compile`` the output shapes; the op is opaque to Inductor.
"""

from __future__ import annotations

import torch

from fp8kit.base.triton_lib import triton_module
from fp8kit.fp8.scaling import quantize
from fp8kit.fp8.swiglu import swiglu_backward_ref, swiglu_ref

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
Casts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _amax(t: torch.Tensor) -> torch.Tensor:
    return t.abs().amax().float() if t.numel() else t.new_zeros((), dtype=torch.float32)


def swiglu_backward_cast_reference(g: torch.Tensor, u: torch.Tensor, da: torch.Tensor, scale_g: torch.Tensor,
                                   scale_u: torch.Tensor, scale_a: torch.Tensor | None) -> Casts:
    """Plain PyTorch of :func:`swiglu_backward_cast` (same arguments and results)."""
    dg, du = swiglu_backward_ref(da, g, u)
    qg, qu = quantize(dg, scale_g, E5M2), quantize(du, scale_u, E5M2)
    qat = quantize(swiglu_ref(g, u), scale_a, E4M3).t().contiguous() if scale_a is not None else g.new_empty(0, dtype=E4M3)
    return qg, qg.t().contiguous(), qu, qu.t().contiguous(), qat, torch.stack([_amax(dg), _amax(du)])


def _check(g: torch.Tensor, u: torch.Tensor, da: torch.Tensor, scales: tuple[torch.Tensor | None, ...]) -> None:
    where = "fp8kit::delayed_swiglu_bwd_cast"
    for name, t in (("g", g), ("u", u), ("da", da)):
        if t.dim() != 2 or t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{where}: {name} must be a 2-D bf16 / fp16 / fp32 tensor [M, I], got {t.dtype} "
                             f"{tuple(t.shape)}")
        if t.shape != g.shape or t.dtype != g.dtype or t.device != g.device:
            raise ValueError(f"{where}: g, u and da must have one shape, dtype and device, got g {g.dtype} "
                             f"{tuple(g.shape)} on {g.device}, {name} {t.dtype} {tuple(t.shape)} on {t.device}")
    for name, s in zip(("scale_g", "scale_u", "scale_a"), scales, strict=True):
        if s is not None and (s.numel() != 1 or s.dtype != torch.float32):
            raise ValueError(f"{where}: {name} must be one float32 value, got {s.dtype} {tuple(s.shape)}")


@torch.library.custom_op("fp8kit::delayed_swiglu_bwd_cast", mutates_args=())
def _op(g: torch.Tensor, u: torch.Tensor, da: torch.Tensor, scale_g: torch.Tensor, scale_u: torch.Tensor,
        scale_a: torch.Tensor | None) -> Casts:
    return swiglu_backward_cast_reference(g, u, da, scale_g, scale_u, scale_a)


@_op.register_kernel("cuda")
def _(g, u, da, scale_g, scale_u, scale_a):
    kernels = triton_module("fp8kit.fp8.kernels.swiglu_delayed_triton", "delayed SwiGLU backward cast")
    # float32 inputs take the reference: tl.trans of FP8 tiles of float32 loads miscompiled with Triton 3.6
    # (fp8kit.fp8.kernels.cast_transpose_triton's docstring)
    if kernels is None or g.dtype == torch.float32:
        return swiglu_backward_cast_reference(g, u, da, scale_g, scale_u, scale_a)
    g, u, da = (t if t.stride(1) == 1 else t.contiguous() for t in (g, u, da))
    with torch.cuda.device(g.device):
        return kernels.swiglu_backward_cast(g, u, da, scale_g.reshape(()), scale_u.reshape(()),
                                            None if scale_a is None else scale_a.reshape(()))


@_op.register_fake
def _(g, u, da, scale_g, scale_u, scale_a):
    m, i = g.shape
    qa = g.new_empty((i, m) if scale_a is not None else (0,), dtype=E4M3)
    return (g.new_empty(m, i, dtype=E5M2), g.new_empty(i, m, dtype=E5M2), g.new_empty(m, i, dtype=E5M2),
            g.new_empty(i, m, dtype=E5M2), qa, g.new_empty(2, dtype=torch.float32))


def swiglu_backward_cast(g: torch.Tensor, u: torch.Tensor, da: torch.Tensor, scale_g: torch.Tensor,
                         scale_u: torch.Tensor, scale_a: torch.Tensor | None = None) -> Casts:
    """The SwiGLU backward and every FP8 operand of the MLP's backward GEMMs, from one read of ``g``, ``u``, ``da``.

    Args:
        g, u: the gate and up projections' outputs ``[M, I]`` (bf16 / fp16 / fp32, one dtype and device).
        da: the gradient of ``a = silu(g) * u``, ``[M, I]``, same dtype.
        scale_g, scale_u: float32, one element each: the E5M2 encoding scales of ``dg`` and ``du`` (delayed
            scaling: ``fp8kit.fp8.delayed_state``).
        scale_a: float32, one element: the E4M3 encoding scale of ``a`` (the down projection's input scale), or
            None to skip ``a``.

    Returns:
        ``(qg [M, I], qgt [I, M], qu [M, I], qut [I, M], qat, amax)``: ``dg`` / ``du`` in E5M2 row-major and
        transposed (contiguous), ``a`` in E4M3 transposed ``[I, M]`` (``[0]`` when ``scale_a`` is None), and
        ``amax`` float32 ``[2]``: ``max |dg|``, ``max |du|`` of the values before scaling (NaN propagates).

    Raises:
        ValueError: tensors not 2-D floats of one shape, dtype and device, or a scale not one float32 value.
    """
    _check(g, u, da, (scale_g, scale_u, scale_a))
    return torch.ops.fp8kit.delayed_swiglu_bwd_cast(g, u, da, scale_g, scale_u, scale_a)
