"""Blockwise FP8 grouped GEMM as a loop of dense blockwise GEMMs, one per expert (the ``blockwise_loop`` kernel).

``torch._scaled_grouped_mm`` on Hopper takes rowwise scales only; the blockwise recipe of DeepSeek-V3
(arXiv:2412.19437 section 3.3: 1x128 activation tiles, 128x128 weight blocks, E4M3 everywhere) has no grouped
kernel in torch 2.11. This path runs each expert's slice of rows through the dense blockwise machinery of
:mod:`fp8kit.fp8.kernels.ops` (the fused 1x128 + 128x1 Triton activation quantization, the 128x128 weight
quantization, cuBLAS blockwise ``scaled_mm``), the same numerics as ``fp8.linear.blockwise_linear`` applied
to every expert, inside one autograd Function so that the weight gradient is written expert by expert into
one ``(E, N, K)`` tensor (slicing a Parameter per expert would make autograd allocate a full-size zero
gradient per expert).

Why a loop can pay: at large expert shapes a loop of dense FP8 GEMMs runs faster than the grouped kernel
(``shared/anchors.md``: 1206 vs 1004 TFLOP/s at DeepSeek-V3's up projection), and every 128x1 block of the
wgrad operands stays inside one expert's rows (each slice is padded to 128 rows by the quantization), so
no per-group amax reduction is needed. Its costs: the group sizes must be on the host (one device-to-host
copy per layer, read once in the forward and reused by the backward), and about six kernel launches per
expert per weight, so with many small experts (Qwen3-30B-A3B: 128 experts of 768 x 2048) the host is the
limit; ``selective_fp8 = "auto"`` measures that (``benchmarks/moe_layer.py`` records it).

Per GEMM (``y = x @ w[e]^T``; rows of expert e: ``x[a:b]``):

- fprop: ``x[a:b]`` 1x128 along K, ``w[e]`` 128x128;
- dgrad: ``dy[a:b]`` 1x128 along N, ``w[e]^T`` the same 128x128 blocks;
- wgrad: ``dy[a:b]^T`` and ``x[a:b]^T`` 1x128 along the tokens (128x1 blocks of ``dy`` and ``x``); with
  ``wgrad_x="128x128"`` (``fp8.blockwise_wgrad_x``) ``x[a:b]^T`` in 128x128 blocks, as the dense linear does
  (:mod:`fp8kit.fp8.blockwise`).

Saved for the backward: the FP8 ``x^T`` copies (1 byte per element) and the FP8 ``w[e]^T`` copies, not the bf16
input; with ``keep_weight_copy=False`` (what ``prepare_model`` sets under FSDP2, where those copies would be of the
unsharded experts) the weights instead, quantized again per expert in the backward (same bits). With
``cache_weight`` (``fp8kit train`` with ``train.grad_accum > 1``, ``fp8.weight_cache``, not under FSDP2) each
expert's 128x128 copies come from the blockwise weight cache (``ops.quantize_weight(w[e], cache=True)``: one cast
per weight version and optimizer step, shared by the step's micro-batches; :mod:`fp8kit.fp8.weight_cache`).
On the CPU (and with ``emulate``) the same quantized operands are multiplied in float32
(``fp8.blockwise.blockwise_mm_emulated``): CI tests these numerics.
"""

from __future__ import annotations

import torch

from fp8kit.fp8.blockwise import BLOCK, check_wgrad_x, wgrad_x_block
from fp8kit.fp8.kernels import ops


def group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` row ranges of the groups of cumulative ends ``offs`` (E,) (one host copy)."""
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends, strict=True))


class _BlockwiseLoopFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bounds, emulate, keep_weight_copy, wgrad_x="128x1", cache_weight=False):
        p, _ = x.shape
        e, n, k = w.shape
        y = x.new_empty(p, n)
        tail = bounds[-1][1] if bounds else 0
        if tail < p:
            y[tail:].zero_()
        saved, live = [], []
        for i, (a, b) in enumerate(bounds):
            if b == a:
                continue
            xq, xs_t, xtq, xts = ops.quantize_act(x[a:b], wgrad_x)
            wq, ws, wtq, wts = ops.quantize_weight(w[i], cache_weight)
            y[a:b] = ops.blockwise_mm(xq, xs_t, wq, ws, BLOCK, x.dtype, emulate)[: b - a]
            saved += [xtq, xts, wtq, wts] if keep_weight_copy else [xtq, xts]
            live.append(i)
        ctx.save_for_backward(*saved, *(() if keep_weight_copy else (w,)))
        ctx.bounds, ctx.live, ctx.emulate, ctx.keep, ctx.cache = bounds, live, emulate, keep_weight_copy, cache_weight
        ctx.x_block = wgrad_x_block(wgrad_x)  # the wgrad GEMM's blocks of x^T
        ctx.meta = (p, e, n, k, x.dtype, w.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        p, e, n, k, x_dtype, w_dtype = ctx.meta
        saved = ctx.saved_tensors
        dy = dy.contiguous()
        want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = dy.new_zeros(p, k, dtype=x_dtype) if want_dx else None
        dw = torch.zeros(e, n, k, dtype=w_dtype, device=dy.device) if want_dw else None
        per = 4 if ctx.keep else 2  # (xtq, xts, wtq, wts) per expert, or (xtq, xts) and the weights last
        for j, i in enumerate(ctx.live):
            a, b = ctx.bounds[i]
            xtq, xts, *w_copy = saved[per * j: per * j + per]
            dyq, dys_t, dytq, dyts = ops.quantize_act(dy[a:b])
            if want_dx:
                if ctx.keep:
                    wtq, wts = w_copy
                else:  # the weights were saved last
                    wtq, wts = ops.quantize_weight(saved[-1][i], cache=ctx.cache)[2:]
                dx[a:b] = ops.blockwise_mm(dyq, dys_t, wtq, wts, BLOCK, x_dtype, ctx.emulate)[: b - a]
            if want_dw:
                dw[i] = ops.blockwise_mm(dytq, dyts, xtq, xts, ctx.x_block, w_dtype, ctx.emulate)
        return dx, dw, None, None, None, None, None


def blockwise_loop_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, emulate: bool = False,
    bounds: list[tuple[int, int]] | None = None, keep_weight_copy: bool = True, wgrad_x: str = "128x1",
    cache_weight: bool = False,
) -> torch.Tensor:
    """Differentiable blockwise FP8 grouped GEMM ``out[rows of group e] = x[rows] @ w[e]^T`` (module docstring).

    Args:
        x: (P, K) bf16 / fp32 rows grouped by expert (any row alignment; ``moe/routing.py`` pads to 16).
        w: (E, N, K) expert weights, N and K multiples of 128; the gradient comes back in ``w``'s dtype.
        offs: (E,) int32 cumulative end rows of the groups.
        emulate: on CUDA, multiply the quantized operands in float32 (the CPU always does).
        bounds: the groups' ``(start, end)`` rows if already on the host (:func:`group_bounds`), to share
            one device-to-host copy between the layer's GEMMs.
        keep_weight_copy: keep each expert's FP8 ``w[e]^T`` from forward to backward (False: quantize it again
            in the backward; see the module docstring).
        wgrad_x: the blocks of each expert's wgrad copy of ``x``: ``"128x1"`` (DeepSeek-V3) or ``"128x128"``.
        cache_weight: take each expert's FP8 copies from the blockwise weight cache (one cast per weight version and
            optimizer step; module docstring); the same bits as casting each call.

    Returns:
        (P, N) in ``x.dtype``; rows past ``offs[-1]`` are zero.

    Raises:
        ValueError: shapes that do not match, dimensions that are not multiples of 128 (naming them), or an unknown
            ``wgrad_x``.
        CapabilityError: a CUDA GPU without cuBLAS blockwise FP8 GEMMs and ``emulate`` false.
    """
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1 or x.shape[1] != w.shape[2] or offs.shape[0] != w.shape[0]:
        raise ValueError(f"blockwise_loop_mm: need x (P, K), w (E, N, K), offs (E,); got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(offs.shape)}")
    if w.shape[1] % BLOCK or w.shape[2] % BLOCK:
        raise ValueError(f"blockwise_loop_mm: expert weight (E, N, K) = {tuple(w.shape)}: N and K must be multiples "
                         f"of {BLOCK} for blockwise FP8; keep these experts in BF16")
    check_wgrad_x(wgrad_x, "blockwise_loop_mm")
    if bounds is None:
        bounds = group_bounds(offs)
    return _BlockwiseLoopFn.apply(x, w, bounds, emulate, keep_weight_copy, wgrad_x, cache_weight)
