"""Eager calls of the FP8 all-reduce's passes that skip the op dispatcher on CUDA (same kernels, same bits).

:mod:`fp8kit.comm.allreduce_ops` registers every pass as a ``torch.library`` op, so ``torch.compile`` traces
them; in eager mode each op call also pays the dispatcher, the custom-op wrapper and the argument checks,
tens of microseconds of host time per pass. ``fp8_all_reduce`` builds its buffers itself (contiguous, right
sizes and dtypes), so in eager mode on the current CUDA device these functions launch the Triton kernels of
:mod:`fp8kit.comm.allreduce_triton` directly; everywhere else (CPU, another device, float64, inside
``torch.compile``, triton missing) they call the ops, which check their arguments and run the same kernels or
the PyTorch references. Each function takes the arguments of the op of the same name in ``allreduce_ops``.
"""

from __future__ import annotations

import functools

import torch

from fp8kit.comm import allreduce_ops as ops
from fp8kit.fp8.scaling import DTYPE_MAX


@functools.lru_cache(maxsize=64)
def _inverse_world(world: int) -> float:
    return ops.inverse_world(world)


def _kernels_for(t: torch.Tensor, dtype: torch.dtype):
    """The Triton module when ``t`` lives on the current CUDA device, ``dtype`` is a kernel dtype and we are not
    tracing; else None (then the op runs)."""
    if t.device.type != "cuda" or dtype not in ops.KERNEL_DTYPES or torch.compiler.is_compiling():
        return None
    if t.device.index != torch.cuda.current_device():
        return None
    return ops._kernels()


def quantize_stats(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, out: torch.Tensor, vec: torch.Tensor,
                   fp8: torch.dtype) -> None:
    """``allreduce_ops.quantize_stats_into`` (``g`` non-empty)."""
    k = _kernels_for(g, g.dtype)
    if k is None:
        return ops.quantize_stats_into(g, values, params, out, vec, fp8)
    k.quantize_stats(g, values, params, out.view(fp8), vec, DTYPE_MAX[fp8])


def update_delayed(vecs: torch.Tensor, values: torch.Tensor, params: torch.Tensor,
                   fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``allreduce_ops.scale_update_delayed``."""
    k = _kernels_for(vecs, torch.float32)
    if k is None:
        return ops.scale_update_delayed(vecs, values, params, fp8)
    _, out_scale, new = k.scale_update(vecs, values, params, DTYPE_MAX[fp8], delayed=True)
    return out_scale, new


def quantize(g: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8: torch.dtype) -> None:
    """``allreduce_ops.quantize_into``."""
    k = _kernels_for(g, g.dtype)
    if k is None or out.numel() == 0:
        return ops.quantize_into(g, scale, out, fp8)
    k.quantize(g, scale, out.view(fp8), DTYPE_MAX[fp8])


def sum_requant(recv: torch.Tensor, out: torch.Tensor, world: int, fp8: torch.dtype) -> None:
    """``allreduce_ops.sum_requant_into``."""
    k = _kernels_for(recv, torch.float32)
    if k is None or out.numel() == 0:
        return ops.sum_requant_into(recv, out, world, fp8)
    k.sum_rows(recv.view(fp8), None, out.view(fp8), world, _inverse_world(world), DTYPE_MAX[fp8], requant=True)


def dequantize(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8: torch.dtype) -> None:
    """``allreduce_ops.dequantize_into``."""
    k = _kernels_for(data, out.dtype)
    if k is None or out.numel() == 0:
        return ops.dequantize_into(data, scale, out, fp8)
    k.dequantize(data.view(fp8), scale, out)


def gather_mean(rows: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, world: int, fp8: torch.dtype) -> None:
    """``allreduce_ops.gather_mean_into``."""
    k = _kernels_for(rows, out.dtype)
    if k is None or out.numel() == 0:
        return ops.gather_mean_into(rows, scale, out, world, fp8)
    k.gather_mean(rows.view(fp8), scale, out, world, rows.numel() // world, _inverse_world(world))


def scale_vec(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``allreduce_ops.scale_vec`` (``g`` non-empty)."""
    k = _kernels_for(g, g.dtype)
    if k is None:
        return ops.scale_vec(g, values, params, fp8)
    return k.scale_vec(g, values, params, DTYPE_MAX[fp8])


def scale_update(vec: torch.Tensor, values: torch.Tensor, params: torch.Tensor,
                 fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``allreduce_ops.scale_update``."""
    k = _kernels_for(vec, torch.float32)
    if k is None:
        return ops.scale_update(vec, values, params, fp8)
    return k.scale_update(vec, values, params, DTYPE_MAX[fp8])


def sum_dequant(recv: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, world: int, mul: float,
                fp8: torch.dtype) -> None:
    """``allreduce_ops.sum_dequant_into``."""
    k = _kernels_for(recv, out.dtype)
    if k is None or out.numel() == 0:
        return ops.sum_dequant_into(recv, scale, out, world, mul, fp8)
    k.sum_rows(recv.view(fp8), scale, out, world, torch.tensor(mul, dtype=torch.float32).item(), DTYPE_MAX[fp8],
               requant=False)
