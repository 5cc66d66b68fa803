"""Triton kernels of the fused SwiGLU MLP (:mod:`fp8kit.fp8.swiglu`, CUDA): the SwiGLU and its backward with
the blockwise casts of their outputs, in one read of their inputs.

Both walk ``[M, I]`` in 128x128 tiles as :func:`fp8kit.fp8.kernels.blockwise_triton._act_quant_kernel` does
(one program per tile, ``CHUNK``-row slices; pass 1 writes the 1x128 copy and keeps the column amax, pass 2
re-reads the slices from L2 for the transposed copy, or, with one 128-row slice, casts the values still in
registers), with the same tile helpers, so the FP8 copies are :func:`fp8kit.fp8.blockwise.quantize_act` of the
rounded SwiGLU values the kernel computed:

- :func:`swiglu_quantize_act`: ``a = silu(g) * u`` in float32, rounded to the input dtype, then both FP8 copies of
  ``a``: the down projection's fprop operand and its wgrad operand (``128x1`` blocks or, ``T_2D``, one scale per
  128x128 tile). ``a`` itself is not written.
- :func:`swiglu_backward_quantize`: ``dg = da * u * s * (1 + g * (1 - s))`` and ``du = da * g * s`` with
  ``s = sigmoid(g)``, each rounded to the input dtype, then both FP8 copies of each (1x128 for the gate / up
  dgrad GEMM, 128x1 for their wgrad GEMMs). Neither gradient is written in bf16.

The sigmoid is the hardware's (``exp`` as ``ex2.approx``, fast division, FMA contraction on), as Inductor's SiLU
is. A first version computed the sigmoid as the MoE SwiGLU kernel does (Cephes ``expf`` in IEEE operations, bit-equal
to a PyTorch reference) and was compute-bound: slower than the unfused MLP on the H100 (docs/benchmarks.md
section 6). So a SwiGLU value can differ from :func:`fp8kit.fp8.swiglu.swiglu_ref`'s by a bf16 ulp; the GPU test
checks that, and the FP8 copies bit for bit against ``quantize_act`` of the values the kernel computed
(``values=True`` returns them). Autotuned over ``CHUNK`` and ``num_warps`` keyed on ``I``; every configuration
computes the same bits (tests/test_kernels_in_interpreter.py). Imported only on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.fp8.blockwise import BLOCK, FP8, empty_act_outputs
from fp8kit.fp8.kernels.blockwise_triton import (
    _col_amax,
    _col_scale,
    _max_init,
    _quant_cols,
    _quant_cols_or_tile,
    _quant_rows,
    _t_scale,
)
from fp8kit.fp8.scaling import AMAX_EPS, DTYPE_MAX, F32_MAX

_FP8_MAX = DTYPE_MAX[FP8]
# CHUNK = 128: the whole tile in one slice, cast from the values still in registers (no second read; the
# L2-resident re-read of two or three input tiles per program is what limits the smaller slices).
_CONFIGS = ([triton.Config({"CHUNK": c}, num_warps=w) for c in (16, 32, 64) for w in (4, 8)]
            + [triton.Config({"CHUNK": 128}, num_warps=w) for w in (8, 16)])


@triton.jit
def _load(ptr, rows, cols, mask, stride, POLICY: tl.constexpr):
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=mask, other=0.0,
                   eviction_policy=POLICY).to(tl.float32)


@triton.jit
def _sigmoid(g):
    # the hardware's exp (ex2.approx) and division, as Inductor's sigmoid: a few instructions per element (an
    # IEEE-exact sigmoid made these kernels compute-bound, 3-7x slower than the bytes they move)
    return 1.0 / (1.0 + tl.exp(-g))


@triton.jit
def _swiglu(g_ptr, u_ptr, offs_m, cols, M, stride_g, stride_u, POLICY: tl.constexpr):
    # a = silu(g) * u in float32, rounded to g's dtype (RTNE) and back; rows >= M read as zero (a = 0).
    rows = offs_m.to(tl.int64)
    mask = offs_m[:, None] < M
    g = _load(g_ptr, rows, cols, mask, stride_g, POLICY)
    u = _load(u_ptr, rows, cols, mask, stride_u, POLICY)
    return (g * _sigmoid(g) * u).to(g_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _store_values(v_ptr, v, offs_m, cols, M, K):
    # the rounded SwiGLU values themselves (STORE_VALUES: the GPU test's view of what the casts quantized)
    tl.store(v_ptr + offs_m.to(tl.int64)[:, None] * K + cols[None, :], v.to(v_ptr.dtype.element_ty),
             mask=offs_m[:, None] < M)


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


@triton.autotune(configs=_CONFIGS, key=["K", "T_2D", "STORE_VALUES"])
@triton.jit
def _swiglu_quant_kernel(
    g_ptr, u_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, a_ptr,
    M, MP, K, stride_g, stride_u, ST_LD,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    CHUNK: tl.constexpr, T_2D: tl.constexpr, STORE_VALUES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    abs_max = _max_init(CHUNK, BLOCK_SIZE)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        a = _swiglu(g_ptr, u_ptr, offs_m, cols, M, stride_g, stride_u, "evict_last")
        if STORE_VALUES:
            _store_values(a_ptr, a, offs_m, cols, M, K)
        abs_max = _quant_rows(a, offs_m.to(tl.int64), cols, q_ptr, s_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX, abs_max,
                              CHUNK, BLOCK_SIZE)
    scale = _t_scale(_col_amax(abs_max, CHUNK, BLOCK_SIZE), st_ptr, pid_m, pid_k, cols, MP, K, ST_LD, EPS, AMAX_MAX,
                     FP8_MAX, BLOCK_SIZE, T_2D)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        rows = offs_m.to(tl.int64)
        if CHUNK != BLOCK_SIZE:  # one slice: a of pass 1 is still live
            a = _swiglu(g_ptr, u_ptr, offs_m, cols, M, stride_g, stride_u, "evict_first")
        _quant_cols_or_tile(a, rows, cols, scale, qt_ptr, MP, FP8_MAX, T_2D)


@triton.autotune(configs=_CONFIGS, key=["K", "STORE_VALUES"])
@triton.jit
def _swiglu_bwd_quant_kernel(
    da_ptr, g_ptr, u_ptr,
    gq_ptr, gs_t_ptr, gqt_ptr, gst_ptr, uq_ptr, us_t_ptr, uqt_ptr, ust_ptr, dg_ptr, du_ptr,
    M, MP, K, stride_d, stride_g, stride_u,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    CHUNK: tl.constexpr, STORE_VALUES: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    g_max = _max_init(CHUNK, BLOCK_SIZE)
    u_max = _max_init(CHUNK, BLOCK_SIZE)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        rows = offs_m.to(tl.int64)
        dg, du = _dswiglu(da_ptr, g_ptr, u_ptr, offs_m, cols, M, stride_d, stride_g, stride_u, "evict_last")
        if STORE_VALUES:
            _store_values(dg_ptr, dg, offs_m, cols, M, K)
            _store_values(du_ptr, du, offs_m, cols, M, K)
        g_max = _quant_rows(dg, rows, cols, gq_ptr, gs_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX, g_max,
                            CHUNK, BLOCK_SIZE)
        u_max = _quant_rows(du, rows, cols, uq_ptr, us_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX, u_max,
                            CHUNK, BLOCK_SIZE)
    g_scale = _col_scale(_col_amax(g_max, CHUNK, BLOCK_SIZE), gst_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    u_scale = _col_scale(_col_amax(u_max, CHUNK, BLOCK_SIZE), ust_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        rows = offs_m.to(tl.int64)
        if CHUNK != BLOCK_SIZE:  # one slice: dg, du of pass 1 are still live
            dg, du = _dswiglu(da_ptr, g_ptr, u_ptr, offs_m, cols, M, stride_d, stride_g, stride_u, "evict_first")
        _quant_cols(dg, rows, cols, g_scale, gqt_ptr, MP, FP8_MAX)
        _quant_cols(du, rows, cols, u_scale, uqt_ptr, MP, FP8_MAX)


def swiglu_quantize_act(g: torch.Tensor, u: torch.Tensor, wgrad_x: str,
                        values: bool = False) -> tuple[torch.Tensor, ...]:
    """Triton version of :func:`fp8kit.fp8.swiglu.swiglu_quantize_act_ref` (module docstring: the SwiGLU values
    within a bf16 ulp, their casts bit for bit).

    Args:
        g, u: CUDA ``[M, I]`` tensors of one float dtype, unit stride along I, ``I % 128 == 0``.
        wgrad_x: ``"128x1"`` or ``"128x128"``, the blocks of the ``a^T`` copy.
        values: also return ``a`` itself (rounded to ``g.dtype``) as a fifth output (the GPU test).
    """
    m, k = g.shape
    t2d = wgrad_x == "128x128"
    q, s_t, qt, st = empty_act_outputs(g, m, k, wgrad_x)
    a = torch.empty(m, k, dtype=g.dtype, device=g.device) if values else q
    mp = q.shape[0]
    if mp:
        _swiglu_quant_kernel[(mp // BLOCK, k // BLOCK)](
            g, u, q, s_t, qt, st, a, m, mp, k, g.stride(0), u.stride(0), st.shape[1],
            BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX, T_2D=t2d, STORE_VALUES=values,
        )
    return (q, s_t, qt, st, a) if values else (q, s_t, qt, st)


def swiglu_backward_quantize(da: torch.Tensor, g: torch.Tensor, u: torch.Tensor,
                             values: bool = False) -> tuple[torch.Tensor, ...]:
    """Triton version of :func:`fp8kit.fp8.swiglu.swiglu_backward_quantize_ref` (module docstring: the gradients
    within a bf16 ulp, their casts bit for bit).

    Args:
        da, g, u: CUDA ``[M, I]`` tensors (``g`` and ``u`` of one float dtype), unit stride along I,
            ``I % 128 == 0``.
        values: also return ``dg`` and ``du`` themselves (rounded to ``g.dtype``) as outputs 9 and 10.
    """
    m, k = g.shape
    gouts = empty_act_outputs(g, m, k)
    uouts = empty_act_outputs(g, m, k)
    dg, du = ((torch.empty(m, k, dtype=g.dtype, device=g.device) for _ in range(2)) if values
              else (gouts[0], uouts[0]))
    mp = gouts[0].shape[0]
    if mp:
        _swiglu_bwd_quant_kernel[(mp // BLOCK, k // BLOCK)](
            da, g, u, *gouts, *uouts, dg, du, m, mp, k, da.stride(0), g.stride(0), u.stride(0),
            BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX, STORE_VALUES=values,
        )
    return (*gouts, *uouts, dg, du) if values else (*gouts, *uouts)
