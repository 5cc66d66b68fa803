"""The SwiGLU of a blockwise FP8 MLP with its casts fused in: forward and backward (``torch.ops.fp8kit.*``).

A SwiGLU MLP is ``down(silu(gate(x)) * up(x))``. Unfused, the SwiGLU writes ``a`` in bf16 and the down
projection's cast reads it back; in the backward the SwiGLU's gradient writes ``dg`` and ``du`` in bf16 and the
gate / up projections' casts read them back. Fused (the FP8 engine issue: "the SwiGLU activation writes the FP8
input of down_proj"), one read of the SwiGLU's inputs writes the FP8 copies directly:

- :func:`swiglu_quantize_act` (``fp8kit::blockwise_swiglu_quant``): ``a = silu(g) * u`` and
  ``blockwise.quantize_act(a, wgrad_x)``: the down projection's fprop operand (1x128) and wgrad operand
  (``a^T``, ``128x1`` or ``128x128`` blocks).
- :func:`swiglu_backward_quantize` (``fp8kit::blockwise_swiglu_bwd_quant``): ``dg``, ``du`` from ``da`` and
  ``blockwise.quantize_act`` of each: the gate / up projections' dgrad (1x128) and wgrad (128x1) operands.

Numerics (the reference functions below): float32 math on the inputs, each SwiGLU value rounded once to the
input dtype (what the unfused MLP's bf16 tensor holds), then the blockwise cast of :mod:`fp8kit.fp8.blockwise`.
``dg = da * u * s * (1 + g * (1 - s))`` and ``du = da * g * s`` with ``s = sigmoid(g)`` (the derivative of
``g * sigmoid(g) * u``). The Triton kernels (:mod:`fp8kit.fp8.kernels.swiglu_triton`) compute the sigmoid with the
hardware's ``exp`` and division, as Inductor's SiLU does, so a SwiGLU value can differ from the reference's by a
bf16 ulp; the casts of the values they computed are bit for bit :func:`fp8kit.fp8.blockwise.quantize_act`
(checked on the GPU).

Each op: CUDA runs the Triton kernel, every other device (and CUDA without triton) the reference.
"""

from __future__ import annotations

import torch

from fp8kit.base.triton_lib import triton_module
from fp8kit.fp8.blockwise import BLOCK, check_wgrad_x, empty_act_outputs, quantize_act
from fp8kit.fp8.kernels.ops import Quantized

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _check(where: str, **tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values()))
    for name, t in tensors.items():
        if t.dim() != 2 or t.dtype not in _FLOATS or t.shape[1] % BLOCK:
            raise ValueError(f"{where}: {name} must be a 2-D bf16 / fp16 / fp32 tensor [M, I] with I a multiple of "
                             f"{BLOCK}, got {t.dtype} {tuple(t.shape)}")
        if t.shape != first.shape or t.device != first.device:
            raise ValueError(f"{where}: {', '.join(tensors)} must have one shape and device, got "
                             + ", ".join(f"{n} {tuple(x.shape)} on {x.device}" for n, x in tensors.items()))


# --------------------------------------------------------------------------- reference

def swiglu_ref(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` in float32, rounded once to ``g.dtype``."""
    gf = g.float()
    return (gf * torch.sigmoid(gf) * u.float()).to(g.dtype)


def swiglu_backward_ref(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dg, du)``, the gradients of ``a = silu(g) * u`` given ``da`` (module docstring), each in ``g.dtype``."""
    d, gf, uf = da.float(), g.float(), u.float()
    s = torch.sigmoid(gf)
    dg = d * uf * s * (1.0 + gf * (1.0 - s))
    du = d * gf * s
    return dg.to(g.dtype), du.to(g.dtype)


def swiglu_quantize_act_ref(g: torch.Tensor, u: torch.Tensor, wgrad_x: str) -> Quantized:
    """PyTorch reference of :func:`swiglu_quantize_act`."""
    return quantize_act(swiglu_ref(g, u), wgrad_x)


def swiglu_backward_quantize_ref(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """PyTorch reference of :func:`swiglu_backward_quantize`."""
    dg, du = swiglu_backward_ref(da, g, u)
    return (*quantize_act(dg), *quantize_act(du))


# --------------------------------------------------------------------------- ops

def _kernels():
    """:mod:`fp8kit.fp8.kernels.swiglu_triton`, or None (``base.triton_lib.triton_module``)."""
    return triton_module("fp8kit.fp8.kernels.swiglu_triton", "fused SwiGLU quantization")


def _on_cuda(name: str, reference, tensors: tuple[torch.Tensor, ...], *args):
    """The Triton kernel ``name`` of :func:`_kernels` on ``tensors`` (unit stride along the last dim) and ``args``,
    on their GPU; the ``reference`` where triton is missing."""
    kernels = _kernels()
    if kernels is None:
        return reference(*tensors, *args)
    with torch.cuda.device(tensors[0].device):
        return getattr(kernels, name)(*(t if t.stride(1) == 1 else t.contiguous() for t in tensors), *args)


@torch.library.custom_op("fp8kit::blockwise_swiglu_quant", mutates_args=())
def _swiglu_op(g: torch.Tensor, u: torch.Tensor, wgrad_x: str) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_quantize_act_ref(g, u, wgrad_x)


@_swiglu_op.register_kernel("cuda")
def _(g, u, wgrad_x):
    return _on_cuda("swiglu_quantize_act", swiglu_quantize_act_ref, (g, u), wgrad_x)


@_swiglu_op.register_fake
def _(g, u, wgrad_x):
    return empty_act_outputs(g, *g.shape, wgrad_x)


@torch.library.custom_op("fp8kit::blockwise_swiglu_bwd_quant", mutates_args=())
def _swiglu_bwd_op(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_backward_quantize_ref(da, g, u)


@_swiglu_bwd_op.register_kernel("cuda")
def _(da, g, u):
    return _on_cuda("swiglu_backward_quantize", swiglu_backward_quantize_ref, (da, g, u))


@_swiglu_bwd_op.register_fake
def _(da, g, u):
    return (*empty_act_outputs(g, *g.shape), *empty_act_outputs(g, *g.shape))


def swiglu_quantize_act(g: torch.Tensor, u: torch.Tensor, wgrad_x: str = "128x1") -> Quantized:
    """``a = silu(g) * u`` cast to blockwise FP8 in both layouts, without writing ``a``.

    Args:
        g, u: the gate and up projections' outputs, ``[M, I]`` of one float dtype and device, ``I % 128 == 0``.
        wgrad_x: the blocks of the ``a^T`` copy, ``"128x1"`` or ``"128x128"`` (``fp8.blockwise_wgrad_x``).

    Returns:
        ``blockwise.quantize_act(swiglu_ref(g, u), wgrad_x)``: E4M3 ``q[Mp, I]``, float32 ``s_t[I/128, Mp]``,
        E4M3 ``qt[I, Mp]``, float32 ``st`` (``[Mp/128, I]``, or ``[I/128, L4(Mp/128)]`` for ``"128x128"``).

    Raises:
        ValueError: a tensor not 2-D float with I a multiple of 128, mismatched shapes, or an unknown ``wgrad_x``.
    """
    check_wgrad_x(wgrad_x, "fp8kit::blockwise_swiglu_quant")
    _check("fp8kit::blockwise_swiglu_quant", g=g, u=u)
    return torch.ops.fp8kit.blockwise_swiglu_quant(g, u, wgrad_x)


def swiglu_backward_quantize(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The SwiGLU's input gradients cast to blockwise FP8 in both layouts, without writing them in bf16.

    Args:
        da: gradient of ``a = silu(g) * u``, ``[M, I]``.
        g, u: the forward's gate and up outputs, ``[M, I]`` of one float dtype (the gradients get it).

    Returns:
        ``(*quantize_act(dg), *quantize_act(du))`` of :func:`swiglu_backward_ref`: eight tensors, ``dg``'s
        ``(q, s_t, qt, st)`` then ``du``'s, in :func:`fp8kit.fp8.blockwise.quantize_act`'s ``128x1`` layout.

    Raises:
        ValueError: a tensor not 2-D float with I a multiple of 128, or mismatched shapes.
    """
    _check("fp8kit::blockwise_swiglu_bwd_quant", da=da, g=g, u=u)
    return torch.ops.fp8kit.blockwise_swiglu_bwd_quant(da, g, u)
