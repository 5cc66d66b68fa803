"""Triton kernels of the fused SwiGLU MLP (:mod:`fp8kit.fp8.swiglu`, CUDA): the SwiGLU and its backward with
the blockwise casts of their outputs, in one read of their inputs.

Both walk ``[M, I]`` in 128x128 tiles as :func:`fp8kit.fp8.kernels.blockwise_triton._act_quant_kernel` does
(one program per tile, ``CHUNK``-row slices; pass 1 writes the 1x128 copy and keeps the column amax, pass 2
re-reads the slices from L2 for the transposed copy), with the same tile helpers, so the FP8 bits are those of
:func:`fp8kit.fp8.blockwise.quantize_act` of the rounded SwiGLU values:

- :func:`swiglu_quantize_act`: ``a = silu(g) * u`` in float32 (:func:`fp8kit.fp8.silu.sigmoid_f32`'s
  operations), rounded to the input dtype, then both FP8 copies of ``a``: the down projection's fprop operand
  and its wgrad operand (``128x1`` blocks or, ``T_2D``, one scale per 128x128 tile). ``a`` itself is never
  written.
- :func:`swiglu_backward_quantize`: ``dg = da * u * s * (1 + g * (1 - s))`` and ``du = da * g * s`` with
  ``s = sigmoid(g)``, each rounded to the input dtype, then both FP8 copies of each (1x128 for the gate / up
  dgrad GEMM, 128x1 for their wgrad GEMMs). Neither gradient is written in bf16.

Launched with ``enable_fp_fusion=False`` (no multiply-add contracted to an FMA), so the float32 arithmetic is
the reference's operation for operation. Autotuned over ``CHUNK`` and ``num_warps`` keyed on ``I``; every
configuration computes the same bits. Imported only on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.fp8.blockwise import BLOCK, FP8, padded_rows, round_up4
from fp8kit.fp8.kernels.blockwise_triton import _col_scale, _quant_cols, _quant_rows, _sigmoid, _tile_scale
from fp8kit.fp8.scaling import AMAX_EPS, DTYPE_MAX, F32_MAX

_FP8_MAX = DTYPE_MAX[FP8]
_CONFIGS = [triton.Config({"CHUNK": c}, num_warps=w) for c in (16, 32, 64) for w in (4, 8)]


@triton.jit
def _load(ptr, rows, cols, mask, stride, POLICY: tl.constexpr):
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0,
                   eviction_policy=POLICY).to(tl.float32)


@triton.jit
def _swiglu(g_ptr, u_ptr, offs_m, cols, M, stride_g, stride_u, POLICY: tl.constexpr):
    # a = silu(g) * u in float32, rounded to g's dtype (RTNE) and back; rows >= M read as zero (a = 0).
    rows = offs_m.to(tl.int64)
    mask = offs_m[:, None] < M
    g = _load(g_ptr, rows, cols, mask, stride_g, POLICY)
    u = _load(u_ptr, rows, cols, mask, stride_u, POLICY)
    return (g * _sigmoid(g) * u).to(g_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _dswiglu(da_ptr, g_ptr, u_ptr, offs_m, cols, M, stride_d, stride_g, stride_u, POLICY: tl.constexpr):
    # (dg, du) of a = silu(g) * u, each rounded to g's dtype and back (fp8kit.fp8.swiglu.swiglu_backward_ref).
    rows = offs_m.to(tl.int64)
    mask = offs_m[:, None] < M
    d = _load(da_ptr, rows, cols, mask, stride_d, POLICY)
    g = _load(g_ptr, rows, cols, mask, stride_g, POLICY)
    u = _load(u_ptr, rows, cols, mask, stride_u, POLICY)
    s = _sigmoid(g)
    dg = d * u * s * (1.0 + g * (1.0 - s))
    du = d * g * s
    dt = g_ptr.dtype.element_ty
    return dg.to(dt).to(tl.float32), du.to(dt).to(tl.float32)


@triton.autotune(configs=_CONFIGS, key=["K", "T_2D"])
@triton.jit
def _swiglu_quant_kernel(
    g_ptr, u_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr,
    M, MP, K, stride_g, stride_u, ST_LD,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    CHUNK: tl.constexpr, T_2D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    col_amax = tl.zeros((BLOCK_SIZE,), tl.float32)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        a = _swiglu(g_ptr, u_ptr, offs_m, cols, M, stride_g, stride_u, "evict_last")
        amax = _quant_rows(a, offs_m.to(tl.int64), cols, q_ptr, s_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX, CHUNK)
        col_amax = tl.maximum(col_amax, amax)
    if T_2D:
        scale_t = _tile_scale(col_amax, st_ptr, pid_m, pid_k, MP, ST_LD, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    else:
        scale_c = _col_scale(col_amax, st_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        rows = offs_m.to(tl.int64)
        a = _swiglu(g_ptr, u_ptr, offs_m, cols, M, stride_g, stride_u, "evict_first")
        if T_2D:
            qc = tl.clamp(a * scale_t, -FP8_MAX, FP8_MAX).to(qt_ptr.dtype.element_ty)
            tl.store(qt_ptr + cols[:, None] * MP + rows[None, :], tl.trans(qc))
        else:
            _quant_cols(a, rows, cols, scale_c, qt_ptr, MP, FP8_MAX)


@triton.autotune(configs=_CONFIGS, key=["K"])
@triton.jit
def _swiglu_bwd_quant_kernel(
    da_ptr, g_ptr, u_ptr,
    gq_ptr, gs_t_ptr, gqt_ptr, gst_ptr, uq_ptr, us_t_ptr, uqt_ptr, ust_ptr,
    M, MP, K, stride_d, stride_g, stride_u,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    g_amax = tl.zeros((BLOCK_SIZE,), tl.float32)
    u_amax = tl.zeros((BLOCK_SIZE,), tl.float32)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        rows = offs_m.to(tl.int64)
        dg, du = _dswiglu(da_ptr, g_ptr, u_ptr, offs_m, cols, M, stride_d, stride_g, stride_u, "evict_last")
        amax = _quant_rows(dg, rows, cols, gq_ptr, gs_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX, CHUNK)
        g_amax = tl.maximum(g_amax, amax)
        amax = _quant_rows(du, rows, cols, uq_ptr, us_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX, CHUNK)
        u_amax = tl.maximum(u_amax, amax)
    g_scale = _col_scale(g_amax, gst_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    u_scale = _col_scale(u_amax, ust_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        rows = offs_m.to(tl.int64)
        dg, du = _dswiglu(da_ptr, g_ptr, u_ptr, offs_m, cols, M, stride_d, stride_g, stride_u, "evict_first")
        _quant_cols(dg, rows, cols, g_scale, gqt_ptr, MP, FP8_MAX)
        _quant_cols(du, rows, cols, u_scale, uqt_ptr, MP, FP8_MAX)


def _act_outputs(m: int, k: int, device, t2d: bool = False) -> tuple[torch.Tensor, ...]:
    """Empty ``(q, s_t, qt, st)`` in :func:`fp8kit.fp8.blockwise.quantize_act`'s layout."""
    mp = padded_rows(m)
    st_shape = (k // BLOCK, round_up4(mp // BLOCK)) if t2d else (mp // BLOCK, k)
    return (torch.empty(mp, k, dtype=FP8, device=device), torch.empty(k // BLOCK, mp, dtype=torch.float32, device=device),
            torch.empty(k, mp, dtype=FP8, device=device), torch.empty(st_shape, dtype=torch.float32, device=device))


def swiglu_quantize_act(g: torch.Tensor, u: torch.Tensor, wgrad_x: str) -> tuple[torch.Tensor, ...]:
    """Triton version of :func:`fp8kit.fp8.swiglu.swiglu_quantize_act_ref` (same outputs, bit for bit).

    Args:
        g, u: CUDA ``[M, I]`` tensors of one float dtype, unit stride along I, ``I % 128 == 0``.
        wgrad_x: ``"128x1"`` or ``"128x128"``, the blocks of the ``a^T`` copy.
    """
    m, k = g.shape
    t2d = wgrad_x == "128x128"
    q, s_t, qt, st = _act_outputs(m, k, g.device, t2d)
    mp = q.shape[0]
    if mp:
        _swiglu_quant_kernel[(mp // BLOCK, k // BLOCK)](
            g, u, q, s_t, qt, st, m, mp, k, g.stride(0), u.stride(0), st.shape[1],
            BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX, T_2D=t2d, enable_fp_fusion=False,
        )
    return q, s_t, qt, st


def swiglu_backward_quantize(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Triton version of :func:`fp8kit.fp8.swiglu.swiglu_backward_quantize_ref` (same outputs, bit for bit).

    Args:
        da, g, u: CUDA ``[M, I]`` tensors (``g`` and ``u`` of one float dtype), unit stride along I,
            ``I % 128 == 0``.
    """
    m, k = g.shape
    gouts = _act_outputs(m, k, g.device)
    uouts = _act_outputs(m, k, g.device)
    mp = gouts[0].shape[0]
    if mp:
        _swiglu_bwd_quant_kernel[(mp // BLOCK, k // BLOCK)](
            da, g, u, *gouts, *uouts, m, mp, k, da.stride(0), g.stride(0), u.stride(0),
            BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX, enable_fp_fusion=False,
        )
    return (*gouts, *uouts)
