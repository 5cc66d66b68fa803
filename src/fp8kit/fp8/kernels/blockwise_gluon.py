"""The blockwise activation cast with a 128x1 ``x^T`` copy in Gluon (Triton's explicit-layout language), on CUDA.

Same outputs as :func:`fp8kit.fp8.blockwise.quantize_act` with ``wgrad_x = "128x1"``, bit for bit (the GPU test
checks it), 16-21% faster than the Triton kernel of :mod:`fp8kit.fp8.kernels.blockwise_triton` on the H200 (41.7 vs
52.7 us at 8192x4096, 140.7 vs 166.6 at 8192x14336, 77.5 vs 97.7 at 16384x4096: 80-85% of a bf16 copy's rate
against 64-68%; ``docs/benchmarks.md`` session 47, ``benchmarks/experiments/act_cast_low_regs``). Why a second
language: in Triton the compiler picks the layouts, and for this copy it reduces the column amax across warps and
moves the E4M3 result through shared memory byte by byte; the ablation put 27 of the 52 us in the column amax.
Gluon states them:

- ``L_ROW`` (the loads, the 1x128 row amax and copy): 8 contiguous bf16 per thread (16-byte loads), a row over 16
  lanes: the row amax is in-thread plus 4 shuffle steps; the 1x128 copy is written 8 bytes per thread.
- ``L_COL`` (the 128x1 copy): 16 consecutive rows of one column per thread, a column over 8 lanes of one warp: the
  column amax is in-thread plus 3 shuffle steps (no step across warps), and each thread writes 16 contiguous bytes
  of ``x^T[K, Mp]``.

One program per 128x128 tile, the grid ``(K / 128, Mp / 128)`` (K first, as the Triton cast). Pass 1 reads the tile
for the row amax (taken on the input dtype: max |x| is exact, so it equals the float32 amax); pass 2 reads it again
(L2-resident, which is cheaper than keeping it live across the reduction: 80 registers per thread at 8 warps), writes
the 1x128 copy, and moves the tile as bf16 into ``L_COL`` through shared memory (``gl.convert_layout``: ldmatrix)
for the 128x1 copy. Scale math: :func:`fp8kit.fp8.scaling.scale_from_amax` with the roundings of
``blockwise_triton._scale_of`` (IEEE ``div_rn`` reciprocal, then ``* 448``); clamp to +-448, round to nearest even.
Rows past ``M`` read as zero; a one-row input is launched as two rows (a Triton 3.6 miscompile of ``M`` = 1).

Imported only on CUDA, and only where Triton ships Gluon (``triton.experimental.gluon``, Triton >= 3.4):
:data:`fp8kit.fp8.kernels.blockwise_triton.GLUON` says whether it did.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fp8kit.base.triton_lib import two_rows_if_one
from fp8kit.fp8.blockwise import BLOCK, FP8, padded_rows
from fp8kit.fp8.scaling import AMAX_EPS, DTYPE_MAX, F32_MAX

#: warps per program: 8 with the second read (80 registers per thread) was the fastest at 2 of the 3 Llama-3-8B
#: shapes measured (16 warps without it is 3% faster at 8192x14336)
NUM_WARPS = 8


@gluon.jit
def _scale_of(amax, EPS: gl.constexpr, AMAX_MAX: gl.constexpr, FP8_MAX: gl.constexpr):
    # blockwise_triton._scale_of; a * 0 + 1 is an exact 1.0 of a's layout (a is finite after the clamp)
    a = gl.minimum(gl.maximum(amax, EPS), AMAX_MAX)
    return gl.div_rn(a * 0.0 + 1.0, a) * FP8_MAX


@gluon.jit
def _inv(scale):
    # the decoding scale 1 / scale, IEEE-rounded (scale is finite: at most 448 / 1e-12)
    return gl.div_rn(scale * 0.0 + 1.0, scale)


@gluon.jit
def _clamp(v, FP8_MAX: gl.constexpr):
    return gl.minimum(gl.maximum(v, -FP8_MAX), FP8_MAX)


@gluon.jit
def _act_quant_128x1_kernel(
    x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, M, MP, K, stride_xm,
    EPS: gl.constexpr, AMAX_MAX: gl.constexpr, FP8_MAX: gl.constexpr, W: gl.constexpr,
):
    # The statement order is the one timed in session 47 (call 6; its PTX equals this kernel's): with the s_t store
    # placed between the two reads, the cast took 46.8 instead of 41.7 us at 8192x4096 (call 7).
    B: gl.constexpr = 128
    L_ROW: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])
    L_COL: gl.constexpr = gl.BlockedLayout([16, 1], [8, 4], [1, W], [0, 1])
    pid_k = gl.program_id(0)
    pid_m = gl.program_id(1)

    offs_m = pid_m * B + gl.arange(0, B, layout=gl.SliceLayout(1, L_ROW))
    rows = offs_m.to(gl.int64)
    cols = (pid_k * B + gl.arange(0, B, layout=gl.SliceLayout(0, L_ROW))).to(gl.int64)
    x = gl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                eviction_policy="evict_last")
    scale_r = _scale_of(gl.max(gl.abs(x), axis=1).to(gl.float32), EPS, AMAX_MAX, FP8_MAX)
    # a second read, not the registers of pass 1 (the eviction hint also keeps the compiler from merging the two)
    x = gl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                eviction_policy="evict_first")
    gl.store(q_ptr + rows[:, None] * K + cols[None, :],
             _clamp(x.to(gl.float32) * scale_r[:, None], FP8_MAX).to(gl.float8e4nv))
    gl.store(s_t_ptr + pid_k * MP + rows, _inv(scale_r))

    xc = gl.convert_layout(x, L_COL)
    rows_c = (pid_m * B + gl.arange(0, B, layout=gl.SliceLayout(1, L_COL))).to(gl.int64)
    cols_c = (pid_k * B + gl.arange(0, B, layout=gl.SliceLayout(0, L_COL))).to(gl.int64)
    scale_c = _scale_of(gl.max(gl.abs(xc), axis=0).to(gl.float32), EPS, AMAX_MAX, FP8_MAX)
    gl.store(st_ptr + pid_m * K + cols_c, _inv(scale_c))
    qc = _clamp(xc.to(gl.float32) * scale_c[None, :], FP8_MAX)
    gl.store(qt_ptr + cols_c[None, :] * MP + rows_c[:, None], qc.to(gl.float8e4nv))


def quantize_act_128x1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`fp8kit.fp8.blockwise.quantize_act` with ``wgrad_x = "128x1"``, the same four outputs bit for bit.

    Args:
        x: CUDA ``[M, K]`` bf16 tensor with unit stride along K, ``K % 128 == 0``. A one-row input is launched
            as two rows (:func:`fp8kit.base.triton_lib.two_rows_if_one`: Triton 3.6 miscompiles ``M`` = 1).

    Returns:
        ``(q[Mp, K] E4M3, s_t[K/128, Mp] float32, qt[K, Mp] E4M3, st[Mp/128, K] float32)``, ``Mp`` = ``M`` rounded
        up to 128 (layouts: :mod:`fp8kit.fp8.blockwise`).
    """
    x = two_rows_if_one(x)
    m, k = x.shape
    mp = padded_rows(m)
    q = torch.empty(mp, k, dtype=FP8, device=x.device)
    s_t = torch.empty(k // BLOCK, mp, dtype=torch.float32, device=x.device)
    qt = torch.empty(k, mp, dtype=FP8, device=x.device)
    st = torch.empty(mp // BLOCK, k, dtype=torch.float32, device=x.device)
    if mp:
        _act_quant_128x1_kernel[(k // BLOCK, mp // BLOCK)](
            x, q, s_t, qt, st, m, mp, k, x.stride(0), EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=DTYPE_MAX[FP8],
            W=NUM_WARPS, num_warps=NUM_WARPS)
    return q, s_t, qt, st
