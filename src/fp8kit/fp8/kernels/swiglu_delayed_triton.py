"""Triton kernel of the delayed-scaling SwiGLU backward: one read of ``g``, ``u``, ``da`` writes every FP8
operand the MLP's backward GEMMs take.

:func:`swiglu_backward_cast` reproduces :func:`fp8kit.fp8.swiglu_delayed.swiglu_backward_cast_reference` (the GPU
test checks the casts bit for bit, given the SwiGLU values the kernel computed): per element, in float32,
``s = sigmoid(g)``, ``dg = da * u * s * (1 + g * (1 - s))``, ``du = da * g * s`` (the derivative of
``silu(g) * u``), each rounded once to the input dtype, then cast per tensor with the known (delayed) scales
to E5M2: ``qg``, ``qu`` ``[M, I]`` (the gate / up dgrad operands) and their transposes ``qgt``, ``qut`` ``[I, M]``
(the wgrad operands), plus each gradient's amax. With ``WITH_A`` the kernel also recomputes the SwiGLU output
``a = silu(g) * u`` (rounded to the input dtype) and writes its E4M3 transpose ``qat`` ``[I, M]`` at the down
projection's input scale: the down projection's wgrad operand, which the forward did not keep.

One program per ``BM x BN`` tile: three tile loads (2 bytes each), up to five 1-byte stores (the transposed ones
staged through shared memory by ``tl.trans``), two tile amaxes into a zero-filled ``partial[programs, 2]``, reduced
by ``torch.amax`` (NaN-propagating). The sigmoid uses the hardware's ``exp`` and division, as Inductor's SiLU
does. Autotuned over the tile and warps (key: ``M``'s power-of-two bucket, ``I``); every configuration computes
the same bits.
``WRITE_VALUES`` (tests only) also stores ``dg``, ``du`` and ``a`` in the input dtype.

Imported only on CUDA (triton is absent from CPU installs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.fp8.kernels.cast_transpose_triton import _max_nan
from fp8kit.fp8.scaling import DTYPE_MAX

_E4M3_MAX = tl.constexpr(DTYPE_MAX[torch.float8_e4m3fn])
_E5M2_MAX = tl.constexpr(DTYPE_MAX[torch.float8_e5m2])

_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn}, num_warps=w)
    for bm, bn, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (64, 128, 8), (128, 128, 8), (32, 128, 4),
                      (128, 64, 8), (64, 256, 8), (32, 256, 4))
]


@triton.jit
def _sat(x, scale, FP8_MAX: tl.constexpr):
    return tl.minimum(tl.maximum(x * scale, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                      propagate_nan=tl.PropagateNan.ALL)


#: The smallest tile of any configuration: sizes the amax partials for every launch.
_MIN_BM, _MIN_BN = min(c.kwargs["BM"] for c in _CONFIGS), min(c.kwargs["BN"] for c in _CONFIGS)


# keyed on M's power-of-two bucket: a run whose token count varies (packed or variable-length batches) tunes once
# per bucket, not once per M
@triton.autotune(configs=_CONFIGS, key=["M_BUCKET", "I", "WITH_A"])
@triton.jit
def _swiglu_bwd_cast_kernel(
    g_ptr, u_ptr, da_ptr, sg_ptr, su_ptr, sa_ptr,
    qg_ptr, qgt_ptr, qu_ptr, qut_ptr, qat_ptr, partial_ptr, vg_ptr, vu_ptr, va_ptr,
    M, I, stride_g, stride_u, stride_da, M_BUCKET,  # noqa: E741 (I: the MLP's intermediate size)
    WITH_A: tl.constexpr, WRITE_VALUES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < I)
    g_in = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    u_in = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    d = tl.load(da_ptr + rows[:, None] * stride_da + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first").to(tl.float32)
    g = g_in.to(tl.float32)
    u = u_in.to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    dg = (d * u * s * (1.0 + g * (1.0 - s))).to(g_in.dtype)
    du = (d * g * s).to(g_in.dtype)
    rm = rows[:, None] * I + cols[None, :]
    tm = cols[:, None] * M + rows[None, :]
    tmask = tl.trans(mask)
    if WRITE_VALUES:
        tl.store(vg_ptr + rm, dg, mask=mask)
        tl.store(vu_ptr + rm, du, mask=mask)
    dgf = dg.to(tl.float32)
    duf = du.to(tl.float32)
    # Convert once, then move bits (as the cast-transpose kernel: the transposed store of FP8 values could be
    # lowered to a second conversion).
    qg = _sat(dgf, tl.load(sg_ptr), _E5M2_MAX).to(tl.float8e5).to(tl.uint8, bitcast=True)
    tl.store(qg_ptr + rm, qg, mask=mask)
    tl.store(qgt_ptr + tm, tl.trans(qg), mask=tmask)
    qu = _sat(duf, tl.load(su_ptr), _E5M2_MAX).to(tl.float8e5).to(tl.uint8, bitcast=True)
    tl.store(qu_ptr + rm, qu, mask=mask)
    tl.store(qut_ptr + tm, tl.trans(qu), mask=tmask)
    if WITH_A:
        a = (g * s * u).to(g_in.dtype)
        if WRITE_VALUES:
            tl.store(va_ptr + rm, a, mask=mask)
        qa = _sat(a.to(tl.float32), tl.load(sa_ptr), _E4M3_MAX).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(qat_ptr + tm, tl.trans(qa), mask=tmask)
    pid = pid_m * tl.num_programs(1) + pid_n
    tl.store(partial_ptr + 2 * pid, tl.reduce(tl.reduce(tl.abs(dgf), 1, _max_nan), 0, _max_nan))
    tl.store(partial_ptr + 2 * pid + 1, tl.reduce(tl.reduce(tl.abs(duf), 1, _max_nan), 0, _max_nan))


def swiglu_backward_cast(g: torch.Tensor, u: torch.Tensor, da: torch.Tensor, scale_g: torch.Tensor,
                         scale_u: torch.Tensor, scale_a: torch.Tensor | None, write_values: bool = False):
    """The kernel's launch (:func:`fp8kit.fp8.swiglu_delayed.swiglu_backward_cast` documents the op).

    Args:
        g, u, da: ``[M, I]`` CUDA bf16 / fp16 tensors of one dtype, unit stride along ``I``.
        scale_g, scale_u: float32 ``[]`` encoding scales of ``dg`` and ``du`` (E5M2).
        scale_a: float32 ``[]`` encoding scale of ``a`` (E4M3), or None: ``qat`` is not written (``[0]``).
        write_values: also return ``(dg, du, a)`` in the input dtype (tests).

    Returns:
        ``(qg, qgt, qu, qut, qat, amax)`` with ``amax`` float32 ``[2]`` (``dg``, ``du``), plus the values when asked.
    """
    m, i = g.shape
    e5, e4 = torch.float8_e5m2, torch.float8_e4m3fn
    dev = g.device
    qg, qu = torch.empty(m, i, dtype=e5, device=dev), torch.empty(m, i, dtype=e5, device=dev)
    qgt, qut = torch.empty(i, m, dtype=e5, device=dev), torch.empty(i, m, dtype=e5, device=dev)
    with_a = scale_a is not None
    qat = torch.empty((i, m) if with_a else (0,), dtype=e4, device=dev)
    values = tuple(torch.empty(m, i, dtype=g.dtype, device=dev) if write_values else qg for _ in range(3))
    if m == 0 or i == 0:
        out = (qg, qgt, qu, qut, qat, torch.zeros(2, dtype=torch.float32, device=dev))
        return out + values if write_values else out
    grid = lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(i, meta["BN"]))  # noqa: E731
    # [programs, 2] tile amaxes, zero-filled for the most programs any configuration launches, reduced whole: an
    # entry the chosen configuration does not write is a zero (below any amax; NaN still wins) or, after the
    # autotuner's trial launches, another configuration's tile amax of the same tensors, so no autotuner state is
    # read back
    most = triton.cdiv(m, _MIN_BM) * triton.cdiv(i, _MIN_BN)
    partial = torch.zeros(most, 2, dtype=torch.float32, device=dev)
    _swiglu_bwd_cast_kernel[grid](
        g, u, da, scale_g, scale_u, scale_a if with_a else scale_g,
        qg.view(torch.uint8), qgt.view(torch.uint8), qu.view(torch.uint8), qut.view(torch.uint8),
        qat.view(torch.uint8), partial, *values, m, i, g.stride(0), u.stride(0), da.stride(0), triton.next_power_of_2(m),
        WITH_A=with_a, WRITE_VALUES=write_values)
    amax = partial.amax(dim=0)
    out = (qg, qgt, qu, qut, qat, amax)
    return out + values if write_values else out
