"""Triton kernels of :mod:`fp8kit.moe.token_quant` (CUDA): gather + blockwise cast, SwiGLU + blockwise cast.

Both are :func:`fp8kit.fp8.kernels.blockwise_triton._act_quant_kernel` with a different way of getting
the 128x128 tile: one program per tile of the output ``[M, K]``, walked in ``CHUNK``-row slices; pass 1
writes the 1x128 copy ``q[Mp, K]`` + ``s_t[K/128, Mp]`` and keeps the column amax, pass 2 re-reads the
slices (L2-resident) for the transposed 128x1 copy ``qt[K, Mp]`` + ``st[Mp/128, K]``, or, with one slice
(``CHUNK = 128``), casts it from the tile still in registers. Same scale
(the tile helpers of :mod:`fp8kit.fp8.kernels.blockwise_triton`, imported), same saturating E4M3 conversion, same ``1 / scale``: the bits of
:func:`fp8kit.fp8.blockwise.quantize_act`.

- :func:`gather_quantize_act`: a tile row ``m`` is ``src[index[m]]`` (zero when ``index[m] == T`` or
  ``m >= M``), read through the index; the gathered copy never exists.
- :func:`swiglu_quantize_act`: a tile row is ``a = silu(gate) * up`` rounded to ``h.dtype`` (the reference's
  op sequence, :func:`fp8kit.moe.token_quant.sigmoid_f32`, launched with ``enable_fp_fusion=False`` so no
  multiply-add is contracted to an FMA); pass 1 also writes ``a``, pass 2 recomputes it from ``h`` (with one slice it keeps pass 1's).

Autotuned over ``CHUNK`` and ``num_warps`` keyed on the feature dimension; every configuration computes the
same bits. Imported only on CUDA (inside the ops' CUDA implementations).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.fp8.blockwise import BLOCK, FP8, padded_rows
from fp8kit.fp8.kernels.blockwise_triton import (
    _col_amax,
    _col_scale,
    _max_init,
    _quant_cols,
    _quant_rows,
)
from fp8kit.fp8.scaling import AMAX_EPS, DTYPE_MAX, F32_MAX
from fp8kit.moe import token_quant as tq

_FP8_MAX = DTYPE_MAX[FP8]
_LOG2E = tl.constexpr(tq.EXP_LOG2E)
_C1 = tl.constexpr(tq.EXP_C1)
_C2 = tl.constexpr(tq.EXP_C2)
_P0, _P1, _P2, _P3, _P4, _P5 = (tl.constexpr(p) for p in tq.EXP_P)
_CLAMP = tl.constexpr(tq.SILU_CLAMP)

_CONFIGS = [triton.Config({"CHUNK": c}, num_warps=w) for c in (16, 32, 64, 128) for w in (4, 8)]


@triton.jit
def _gathered(src_ptr, idx_ptr, offs_m, cols, T, M, stride_src, POLICY: tl.constexpr):
    src_row = tl.load(idx_ptr + offs_m, mask=offs_m < M, other=0).to(tl.int64)
    valid = (offs_m < M) & (src_row < T)  # index T: the zero row; rows past M: padding
    return tl.load(src_ptr + src_row[:, None] * stride_src + cols[None, :], mask=valid[:, None], other=0.0,
                   eviction_policy=POLICY).to(tl.float32)


@triton.autotune(configs=_CONFIGS, key=["K"])
@triton.jit
def _gather_act_quant_kernel(
    src_ptr, idx_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr,
    T, M, MP, K, stride_src,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    abs_max = _max_init(CHUNK, BLOCK_SIZE)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        x = _gathered(src_ptr, idx_ptr, offs_m, cols, T, M, stride_src, "evict_last")
        abs_max = _quant_rows(x, offs_m.to(tl.int64), cols, q_ptr, s_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX, abs_max,
                              CHUNK, BLOCK_SIZE)
    scale_c = _col_scale(_col_amax(abs_max, CHUNK, BLOCK_SIZE), st_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    if CHUNK == BLOCK_SIZE:  # one slice: the gathered tile of pass 1 is still in registers (no second gather)
        _quant_cols(x, offs_m.to(tl.int64), cols, scale_c, qt_ptr, MP, FP8_MAX)
    else:
        for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
            offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
            x = _gathered(src_ptr, idx_ptr, offs_m, cols, T, M, stride_src, "evict_first")
            _quant_cols(x, offs_m.to(tl.int64), cols, scale_c, qt_ptr, MP, FP8_MAX)


@triton.jit
def _sigmoid(g):
    # fp8kit.moe.token_quant.sigmoid_f32, operation for operation (Cephes expf, IEEE reciprocal).
    t = tl.minimum(tl.maximum(-g, -_CLAMP), _CLAMP)
    n = tl.floor(t * _LOG2E + 0.5)
    r = t - n * _C1
    r = r - n * _C2
    y = r * _P0 + _P1
    y = y * r + _P2
    y = y * r + _P3
    y = y * r + _P4
    y = y * r + _P5
    y = y * (r * r) + r + 1.0
    e = y * ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    s = tl.div_rn(tl.full(e.shape, 1.0, tl.float32), e + 1.0)
    return tl.where(-g > _CLAMP, 0.0, s)


@triton.jit
def _swiglu(h_ptr, offs_m, cols, pid_k, M, INTER, stride_hm, INTERLEAVED: tl.constexpr, POLICY: tl.constexpr,
            CHUNK: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # a = silu(gate) * up in float32 for rows offs_m, columns cols (tile pid_k) of a; rows >= M read as zero.
    rows = offs_m.to(tl.int64)
    mask = offs_m[:, None] < M
    if INTERLEAVED:  # gate = h[:, 0::2], up = h[:, 1::2]: read the 2 x 128 columns contiguously, split
        c2 = (pid_k * 2 * BLOCK_SIZE + tl.arange(0, 2 * BLOCK_SIZE)).to(tl.int64)
        gu = tl.load(h_ptr + rows[:, None] * stride_hm + c2[None, :], mask=mask, other=0.0, eviction_policy=POLICY)
        g, u = tl.split(tl.reshape(gu, (CHUNK, BLOCK_SIZE, 2)))
    else:  # gate = h[:, :INTER], up = h[:, INTER:]
        ptr = h_ptr + rows[:, None] * stride_hm + cols[None, :]
        g = tl.load(ptr, mask=mask, other=0.0, eviction_policy=POLICY)
        u = tl.load(ptr + INTER, mask=mask, other=0.0, eviction_policy=POLICY)
    g = g.to(tl.float32)
    return g * _sigmoid(g) * u.to(tl.float32)


@triton.autotune(configs=_CONFIGS, key=["INTER", "INTERLEAVED"])
@triton.jit
def _swiglu_act_quant_kernel(
    h_ptr, a_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr,
    M, MP, INTER, stride_hm,
    INTERLEAVED: tl.constexpr, BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr,
    FP8_MAX: tl.constexpr, CHUNK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    abs_max = _max_init(CHUNK, BLOCK_SIZE)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        rows = offs_m.to(tl.int64)
        a = _swiglu(h_ptr, offs_m, cols, pid_k, M, INTER, stride_hm, INTERLEAVED, "evict_last", CHUNK, BLOCK_SIZE)
        a = a.to(a_ptr.dtype.element_ty)  # round to h.dtype (RTNE) as the reference; the FP8 copies quantize these

        tl.store(a_ptr + rows[:, None] * INTER + cols[None, :], a, mask=offs_m[:, None] < M)
        abs_max = _quant_rows(a.to(tl.float32), rows, cols, q_ptr, s_t_ptr, pid_k, MP, INTER, EPS, AMAX_MAX, FP8_MAX, abs_max,
                              CHUNK, BLOCK_SIZE)
    scale_c = _col_scale(_col_amax(abs_max, CHUNK, BLOCK_SIZE), st_ptr, pid_m, cols, INTER, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    if CHUNK == BLOCK_SIZE:  # one slice: pass 1's rounded values are still in registers (no re-read, no second SwiGLU)
        _quant_cols(a.to(tl.float32), rows, cols, scale_c, qt_ptr, MP, FP8_MAX)
    else:
        for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
            offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
            a = _swiglu(h_ptr, offs_m, cols, pid_k, M, INTER, stride_hm, INTERLEAVED, "evict_first", CHUNK, BLOCK_SIZE)
            a = a.to(a_ptr.dtype.element_ty).to(tl.float32)
            _quant_cols(a, offs_m.to(tl.int64), cols, scale_c, qt_ptr, MP, FP8_MAX)


def _outputs(like: torch.Tensor, m: int, k: int):
    mp = padded_rows(m)
    dev = like.device
    return (mp, torch.empty(mp, k, dtype=FP8, device=dev), torch.empty(k // BLOCK, mp, dtype=torch.float32, device=dev),
            torch.empty(k, mp, dtype=FP8, device=dev), torch.empty(mp // BLOCK, k, dtype=torch.float32, device=dev))


def gather_quantize_act(src: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Triton version of :func:`fp8kit.moe.token_quant.gather_quantize_act_ref` (same outputs, bit for bit).

    Args:
        src: CUDA ``[T, K]`` float tensor, unit stride along K, ``K % 128 == 0``.
        index: CUDA ``[M]`` contiguous int64 / int32, values in ``[0, T]`` (unchecked).
    """
    t, k = src.shape
    m = index.shape[0]
    mp, q, s_t, qt, st = _outputs(src, m, k)
    if t == 0:  # every index is the zero row: give the kernel one real zero row to point at (T=1, index 0)
        src, t = src.new_zeros(1, k), 1
    if mp:
        _gather_act_quant_kernel[(mp // BLOCK, k // BLOCK)](
            src, index, q, s_t, qt, st, t, m, mp, k, src.stride(0),
            BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX,
        )
    return q, s_t, qt, st


def swiglu_quantize_act(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, ...]:
    """Triton version of :func:`fp8kit.moe.token_quant.swiglu_quantize_act_ref` (same outputs, bit for bit).

    Args:
        h: CUDA ``[M, 2I]`` float tensor, unit stride along the last dim, ``I % 128 == 0``.
        interleaved: gate / up in even / odd columns instead of halves.
    """
    m, i = h.shape[0], h.shape[1] // 2
    a = torch.empty(m, i, dtype=h.dtype, device=h.device)
    mp, q, s_t, qt, st = _outputs(h, m, i)
    if mp:
        _swiglu_act_quant_kernel[(mp // BLOCK, i // BLOCK)](
            h, a, q, s_t, qt, st, m, mp, i, h.stride(0),
            INTERLEAVED=interleaved, BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX,
            enable_fp_fusion=False,
        )
    return a, q, s_t, qt, st
