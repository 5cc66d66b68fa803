"""Triton kernels of the FP8 expert-parallel dispatch payload (CUDA): pack and unpack in one pass each.

They reproduce :func:`fp8kit.moe.fp8_dispatch.pack_reference` / ``unpack_reference`` bit for bit (the same
1x128 amax, the scale of :func:`fp8kit.fp8.scaling.scale_from_amax` with its two float32 roundings
(IEEE ``1 / a`` then ``* 448``), the same saturating round-to-nearest-even E4M3 conversion, the
decoding scale ``1 / scale``); the GPU test checks it.

- :func:`pack`: one program per ``ROWS`` x 128 tile of ``x[R, H]`` reads the tile once and writes its E4M3
  bytes and the float32 decoding scale of each row's block straight into the payload ``[R, H + H/32]``
  (row ``r``: ``H`` bytes of ``q``, then ``H/128`` float32 scales), so no bf16 or FP8 intermediate and no
  ``torch.cat`` copy exist. Bytes moved per element: 2 read + 1 written (+ 4/128 of scales).
- :func:`unpack`: the reverse, ``q * scale_inv`` in float32 cast to the output dtype; 1 read + 2 written.

The payload is addressed through two views of the same storage: as E4M3 (the data bytes) and as float32
(the scales: ``H + H/32`` is a multiple of 4 for ``H`` a multiple of 128, so every row's scales are
4-byte aligned). Imported only on CUDA (triton is absent from CPU installs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.fp8.blockwise import BLOCK, FP8
from fp8kit.fp8.scaling import AMAX_EPS, DTYPE_MAX, F32_MAX

_FP8_MAX = DTYPE_MAX[FP8]
_ROWS = 32


@triton.jit
def _pack_kernel(x_ptr, q_ptr, s_ptr, R, H, stride_x, P, P4,
                 ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr,
                 FP8_MAX: tl.constexpr):
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    offs_r = pid_r * ROWS + tl.arange(0, ROWS)
    rows = offs_r.to(tl.int64)
    cols = (kb * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    mask = offs_r < R
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    a = tl.minimum(tl.maximum(tl.max(tl.abs(x), axis=1), EPS), AMAX_MAX)
    scale = tl.div_rn(tl.full(a.shape, 1.0, tl.float32), a) * FP8_MAX  # scale_from_amax: 1/a, then * max
    q = tl.clamp(x * scale[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * P + cols[None, :], q, mask=mask[:, None])
    tl.store(s_ptr + rows * P4 + H // 4 + kb, tl.div_rn(tl.full(a.shape, 1.0, tl.float32), scale), mask=mask)


@triton.jit
def _unpack_kernel(q_ptr, s_ptr, y_ptr, R, H, P, P4, ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    pid_r = tl.program_id(0)
    kb = tl.program_id(1)
    offs_r = pid_r * ROWS + tl.arange(0, ROWS)
    rows = offs_r.to(tl.int64)
    cols = (kb * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    mask = offs_r < R
    q = tl.load(q_ptr + rows[:, None] * P + cols[None, :], mask=mask[:, None], other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows * P4 + H // 4 + kb, mask=mask, other=1.0)
    tl.store(y_ptr + rows[:, None] * H + cols[None, :], (q * s[:, None]).to(y_ptr.dtype.element_ty),
             mask=mask[:, None])


def pack(x: torch.Tensor) -> torch.Tensor:
    """``x[R, H]`` (bf16 / fp16 / fp32, CUDA, row-contiguous, ``H % 128 == 0``) -> uint8 ``[R, H + H/32]``."""
    r, h = x.shape
    p = h + 4 * (h // BLOCK)
    payload = torch.empty(r, p, dtype=torch.uint8, device=x.device)
    if r:
        _pack_kernel[(triton.cdiv(r, _ROWS), h // BLOCK)](
            x, payload.view(FP8), payload.view(torch.float32), r, h, x.stride(0), p, p // 4,
            ROWS=_ROWS, BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX,
        )
    return payload


def unpack(payload: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``[R, hidden + hidden/32]`` (contiguous, CUDA) -> ``[R, hidden]`` of ``dtype``."""
    r, p = payload.shape
    y = torch.empty(r, hidden, dtype=dtype, device=payload.device)
    if r:
        _unpack_kernel[(triton.cdiv(r, _ROWS), hidden // BLOCK)](
            payload.view(FP8), payload.view(torch.float32), y, r, hidden, p, p // 4, ROWS=_ROWS, BLOCK_SIZE=BLOCK,
        )
    return y
