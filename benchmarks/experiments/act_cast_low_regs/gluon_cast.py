"""The blockwise activation cast in Gluon (Triton's explicit-layout language), for the experiment in ``bench.py``.

Why Gluon: Triton chooses the layouts of the cast itself, and for the 128x1 copy it reduces the column amax across
warps and converts the E4M3 result through shared memory byte by byte (``bench.py``'s ablation: the column amax is
27 of the 52 us at 8192x4096). Here the layouts are stated:

- ``L_ROW`` (the load, the row amax, the 1x128 copy): 8 contiguous bf16 per thread (16-byte loads), a row spread
  over 16 lanes, so the row amax is in-thread plus 4 shuffle steps;
- ``L_COL`` (the 128x1 copy): 16 consecutive rows of one column per thread, a column over 8 lanes of one warp, so
  the column amax is in-thread plus 3 shuffle steps (no step across warps) and each thread writes 16 contiguous
  bytes of ``x^T``.

The tile goes from one to the other once, as bf16, through shared memory (``gl.convert_layout``). The math is
:mod:`fp8kit.fp8.blockwise`'s (the same scale formula and roundings as ``blockwise_triton._scale_of``); ``bench.py``
checks every output bit for bit against the reference. The shipped kernel (``fp8kit.fp8.kernels.blockwise_gluon``)
is this one's 128x1 path with ``RELOAD`` at 8 warps; this copy keeps the variants timed in session 47 (warps,
``RELOAD``, the 128x128 copy). Session 47's call 5 timed an earlier version that kept the tile in float32 across the
row amax (198-255 registers at 4 warps, no faster than the Triton kernel); calls 6-7 this one.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fp8kit.fp8.kernels.blockwise_gluon import _clamp, _inv, _scale_of


@gluon.jit
def gluon_act_quant_kernel(
    x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, M, MP, K, stride_xm, ST_LD,
    EPS: gl.constexpr, AMAX_MAX: gl.constexpr, FP8_MAX: gl.constexpr, T_2D: gl.constexpr, W: gl.constexpr,
    RELOAD: gl.constexpr = False,
):
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
    # the amaxes taken on bf16 (max |x| is exact in bf16): no float32 copy of the tile stays live across a reduction
    row_amax = gl.max(gl.abs(x), axis=1).to(gl.float32)
    scale_r = _scale_of(row_amax, EPS, AMAX_MAX, FP8_MAX)
    if RELOAD:
        # pass 2 reads the tile again (L2-resident) instead of keeping it across the reduction
        x = gl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                    eviction_policy="evict_first")
    gl.store(q_ptr + rows[:, None] * K + cols[None, :],
             _clamp(x.to(gl.float32) * scale_r[:, None], FP8_MAX).to(gl.float8e4nv))
    gl.store(s_t_ptr + pid_k * MP + rows, _inv(scale_r))

    xc = gl.convert_layout(x, L_COL)
    rows_c = (pid_m * B + gl.arange(0, B, layout=gl.SliceLayout(1, L_COL))).to(gl.int64)
    cols_c = (pid_k * B + gl.arange(0, B, layout=gl.SliceLayout(0, L_COL))).to(gl.int64)
    if T_2D:
        scale_t = _scale_of(gl.max(row_amax, axis=0), EPS, AMAX_MAX, FP8_MAX)
        gl.store(st_ptr + pid_k * ST_LD + pid_m, _inv(scale_t))
        if pid_m == 0:
            pad = gl.arange(0, 4, layout=gl.BlockedLayout([1], [32], [W], [0]))
            gl.store(st_ptr + pid_k * ST_LD + MP // B + pad, gl.full([4], 1.0, gl.float32, layout=pad.type.layout),
                     mask=MP // B + pad < ST_LD)
        qc = _clamp(xc.to(gl.float32) * scale_t, FP8_MAX)
    else:
        scale_c = _scale_of(gl.max(gl.abs(xc), axis=0).to(gl.float32), EPS, AMAX_MAX, FP8_MAX)
        gl.store(st_ptr + pid_m * K + cols_c, _inv(scale_c))
        qc = _clamp(xc.to(gl.float32) * scale_c[None, :], FP8_MAX)
    gl.store(qt_ptr + cols_c[None, :] * MP + rows_c[:, None], qc.to(gl.float8e4nv))
