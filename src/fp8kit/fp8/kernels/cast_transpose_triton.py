"""Triton kernel of the per-tensor (delayed-scaling) FP8 cast: one read, both layouts, and the amax.

:func:`cast_transpose` reproduces :func:`fp8kit.fp8.kernels.cast_ops.cast_transpose_reference` bit for bit
(the GPU test checks it): ``q = saturate(float32(x) * scale) -> FP8`` (round to nearest even, as
``Tensor.to``), its transpose ``qt = q.T`` laid out contiguous, and ``amax = max |x|`` (NaN-propagating,
as ``torch.amax``). It is Transformer Engine's ``cast_transpose`` for a scale known before the cast
(delayed scaling: the scale comes from the amax history, so this step's amax is recorded in the same
pass instead of a separate reduction before it).

One program per ``BM x BN`` tile of ``x[M, N]``: it reads the tile once, converts it once, writes ``q``'s tile
row-major and the same bytes transposed into ``qt[N, M]`` (Triton stages the transposed store through shared memory so both stores
are coalesced), and its tile amax into ``partial[program]``; the host reduces the partials with
``torch.amax`` (one small kernel). Bytes per element: 2 read (bf16) + 2 written (two FP8 copies).
Autotuned over the tile shape and warps (key: ``M``, ``N``); every configuration computes the same bits.

float32 inputs: the kernel writes ``q`` only and ``qt`` is ``q.t().contiguous()`` (one more 1-byte read and
write per element). With Triton 3.6 on the H100, ``tl.trans`` of the FP8 tile of a float32 load stored wrong
bytes into ``qt`` (a quarter to a third of them, every tile configuration; ``q`` exact; bf16 / fp16 exact),
found by the bit-for-bit GPU test (``tests/test_cast_transpose_gpu.py``).

Imported only on CUDA (triton is absent from CPU installs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.fp8.scaling import DTYPE_MAX

_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn}, num_warps=w)
    for bm, bn, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4), (128, 32, 4))
]


_TL_FP8 = {torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5}


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.autotune(configs=_CONFIGS, key=["M", "N", "TRANSPOSE"])
@triton.jit
def _cast_transpose_kernel(
    x_ptr, scale_ptr, q_ptr, qt_ptr, partial_ptr,
    M, N, stride_xm,
    FP8_MAX: tl.constexpr, FP8: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_xm + c64[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    scale = tl.load(scale_ptr)
    y = tl.minimum(tl.maximum(x * scale, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    # Convert once, then move bits: the transposed store of the FP8 values themselves may be lowered to a
    # second conversion in the transposed layout (float32 inputs did round differently there on sm90).
    q = y.to(FP8).to(tl.uint8, bitcast=True)
    tl.store(q_ptr + r64[:, None] * N + c64[None, :], q, mask=mask)
    if TRANSPOSE:
        tl.store(qt_ptr + c64[:, None] * M + r64[None, :], tl.trans(q), mask=tl.trans(mask))
    amax = tl.reduce(tl.reduce(tl.abs(x), 1, _max_nan), 0, _max_nan)
    tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_n, amax)


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   transpose: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q[M, N], qt[N, M] or [0], amax[])`` of a CUDA ``x[M, N]`` with unit stride along N.

    Args:
        x: bf16 / fp16 / fp32 CUDA tensor, 2-D, ``x.stride(1) == 1``.
        scale: float32 CUDA tensor with one element (the encoding scale, ``q = x * scale``).
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: write ``qt``; otherwise ``qt`` is an empty ``[0]`` tensor.
    """
    m, n = x.shape
    q = torch.empty(m, n, dtype=dtype, device=x.device)
    qt = torch.empty((n, m) if transpose else (0,), dtype=dtype, device=x.device)
    if m == 0 or n == 0:
        return q, qt, x.new_zeros((), dtype=torch.float32)
    # The grid's tile counts depend on the autotuned BM / BN: the partials buffer is sized for the smallest tile,
    # left uninitialised, and only the launched grid's entries are reduced (no fill kernel).
    grid = lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]))  # noqa: E731
    partial = torch.empty((triton.cdiv(m, 32) * triton.cdiv(n, 32),), dtype=torch.float32, device=x.device)
    in_kernel = transpose and x.dtype != torch.float32  # float32: see the module docstring
    _cast_transpose_kernel[grid](x, scale, q.view(torch.uint8), qt.view(torch.uint8), partial, m, n, x.stride(0),
                                 FP8_MAX=DTYPE_MAX[dtype], FP8=_TL_FP8[dtype], TRANSPOSE=in_kernel)
    if transpose and not in_kernel:
        qt.copy_(q.t())
    best = _cast_transpose_kernel.best_config.kwargs  # the configuration this launch ran (set by the autotuner)
    return q, qt, partial[: triton.cdiv(m, best["BM"]) * triton.cdiv(n, best["BN"])].amax()
