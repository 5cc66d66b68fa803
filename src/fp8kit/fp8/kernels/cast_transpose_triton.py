"""Triton kernel of the per-tensor (delayed-scaling) FP8 cast: one read, both layouts, and the amax.

:func:`cast_transpose` reproduces :func:`fp8kit.fp8.kernels.cast_ops.cast_transpose_reference` bit for bit
(the GPU test checks it): ``q = saturate(float32(x) * scale) -> FP8`` (round to nearest even, as
``Tensor.to``), its transpose ``qt = q.T`` laid out contiguous, and ``amax = max |x|`` (NaN-propagating,
as ``torch.amax``). It is Transformer Engine's ``cast_transpose`` for a scale known before the cast
(delayed scaling: the scale comes from the amax history, so this step's amax is recorded in the same
pass instead of a separate reduction before it).

One program per ``BM x BN`` tile of ``x[M, N]``: it reads the tile once, converts it once, writes ``q``'s tile
row-major and the same bytes transposed into ``qt[N, M]`` (Triton stages the transposed store through shared memory so both stores
are coalesced), and joins its tile amax to the tensor's with an integer atomic max on the float bits into a zeroed scalar (one cast
kernel and a one-element fill, which Inductor may merge into another small kernel; the partial amaxes and their
``torch.amax`` launch of sessions 20-51 are gone). Bytes per element: 2 read (bf16) + 2
written (two FP8 copies).
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


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.autotune(configs=_CONFIGS, key=["M", "N", "TRANSPOSE"])
@triton.jit
def _cast_transpose_kernel(
    x_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr,
    M, N, stride_xm,
    FP8_MAX: tl.constexpr, E5M2: tl.constexpr, TRANSPOSE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
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
    if E5M2:
        q = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(q_ptr + r64[:, None] * N + c64[None, :], q, mask=mask)
    if TRANSPOSE:
        tl.store(qt_ptr + c64[:, None] * M + r64[None, :], tl.trans(q), mask=tl.trans(mask))
    # The tile's amax joins the tensor's by an integer atomic max of its bits: |x| >= 0 (or a NaN with its sign
    # cleared by abs), whose int32 bit patterns order as the values do, NaN above +inf, so a NaN wins as in
    # torch.amax; max is exact and idempotent, so the autotuner's repeated launches leave the same value.
    amax = tl.reduce(tl.reduce(tl.abs(x), 1, _max_nan), 0, _max_nan)
    tl.atomic_max(amax_ptr, amax.to(tl.int32, bitcast=True), sem="relaxed")


@torch.library.triton_op("fp8kit::cast_transpose_triton", mutates_args=())
def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   transpose: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q[M, N], qt[N, M] or [0], amax[])`` of a CUDA ``x[M, N]`` with unit stride along N: one cast kernel (and
    the zero fill of the amax scalar).

    A ``torch.library.triton_op``: eagerly a plain launch; under ``torch.compile`` Inductor launches the kernel
    from its generated code, with no Python custom-op call around it (the host time of those calls left the
    GPU idle: 25 ms of gaps per llama3-1b step with every cast fused, session 52, ``docs/benchmarks.md``).

    Args:
        x: bf16 / fp16 / fp32 CUDA tensor, 2-D, ``x.stride(1) == 1``.
        scale: float32 CUDA tensor with one element (the encoding scale, ``q = x * scale``), shape ``[]``.
        dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        transpose: write ``qt``; otherwise ``qt`` is an empty ``[0]`` tensor.
    """
    m, n = x.shape
    # The kernel writes bytes (it converts once, then moves bits); the outputs are their FP8 views. No view is
    # passed to the launch: wrap_triton's functionalization then sees plain buffers.
    q = torch.empty(m, n, dtype=torch.uint8, device=x.device)
    in_kernel = transpose and x.dtype != torch.float32  # float32: see the module docstring
    qt = torch.empty((n, m) if in_kernel else (0,), dtype=torch.uint8, device=x.device)
    # amax's float32 bits as int32, zero (+0.0) before the tiles' atomic max
    amax_bits = torch.zeros((), dtype=torch.int32, device=x.device)
    if m and n:
        grid = lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]))  # noqa: E731
        torch.library.wrap_triton(_cast_transpose_kernel)[grid](
            x, scale, q, qt, amax_bits, m, n, x.stride(0),
            FP8_MAX=DTYPE_MAX[dtype], E5M2=dtype == torch.float8_e5m2, TRANSPOSE=in_kernel)
    q8 = q.view(dtype)
    # float32: a fresh copy of q.T (a contiguous() of a one-row or empty q.T would be q itself, an output
    # aliasing another, which a custom op may not return)
    qt8 = q8.t().clone(memory_format=torch.contiguous_format) if transpose and not in_kernel else qt.view(dtype)
    return q8, qt8, amax_bits.view(torch.float32)
