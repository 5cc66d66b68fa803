"""Scaled low-precision storage: ``scale = dtype_max / max(amax, eps)``, per tensor or per block.

This is the one place the scale formula lives; every PyTorch path of fp8kit (the FP8 optimizer
``fp8kit.optim``, the FP8 gradient all-reduce ``fp8kit.comm``, the FP8 grouped GEMM of MoE experts
``fp8kit.moe``) calls :func:`scale_from_amax`, and the Triton kernels call its twin in
``fp8kit.fp8.triton_scale``. Dense FP8 matmuls use torchao's own casts.

The convention is FP8-LM's (Peng et al. 2023, arXiv:2310.18313, section 2): a low-precision tensor is a
pair ``(data, scale)`` whose value is ``data / scale``, with ``scale`` in float32 chosen so the tensor's
amax lands on the format's maximum (dynamic "current" scaling, as in torchao and Transformer Engine).
The ``eps`` floor on amax keeps all-zero and tiny tensors from producing an inf or NaN scale: an
all-zero tensor gets ``scale = dtype_max / eps`` and quantizes to zeros.
"""

from __future__ import annotations

import torch

#: Largest finite value of each storage format (OCP FP8 spec, IEEE half).
DTYPE_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
    torch.float16: 65504.0,
}
#: Default amax floor: below it a tensor counts as zero (scale stays finite).
AMAX_EPS = 1e-12
#: Ceiling of amax: an inf amax (e.g. a squared gradient that overflowed) gives a positive scale, so
#: inf saturates to the format's maximum instead of 0 * inf = NaN.
F32_MAX = torch.finfo(torch.float32).max

_NAMES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


def storage_dtype(name: str, where: str) -> torch.dtype:
    """Map a config name (``e4m3``, ``e5m2``, ``fp16``, ``bf16``, ``fp32``) to a torch dtype.

    Raises:
        ValueError: naming ``where`` and the valid names, for an unknown name.
    """
    try:
        return _NAMES[name]
    except KeyError:
        raise ValueError(f"{where}: unknown precision {name!r}; valid: {', '.join(_NAMES)}") from None


def is_scaled(dtype: torch.dtype) -> bool:
    """True for the formats stored with a scale (FP8 and FP16); bf16 and fp32 are stored as they are."""
    return dtype in DTYPE_MAX


def clamp_amax(amax: torch.Tensor, eps: float = AMAX_EPS) -> torch.Tensor:
    """``amax`` in float32 clamped to ``[eps, F32_MAX]``: the denominator of :func:`scale_from_amax`."""
    return amax.float().clamp(min=eps, max=F32_MAX)


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, eps: float = AMAX_EPS) -> torch.Tensor:
    """``dtype_max / min(max(amax, eps), F32_MAX)`` in float32, one scale per entry of ``amax`` (any shape).

    Args:
        amax: absolute maxima (any float dtype and shape; inf allowed and clamped to ``F32_MAX``).
        dtype: the storage format, a key of :data:`DTYPE_MAX` (E4M3, E5M2 or float16).
        eps: amax floor (default :data:`AMAX_EPS`).

    Raises:
        KeyError: ``dtype`` has no entry in :data:`DTYPE_MAX` (bf16 and fp32 are stored unscaled).

    The Triton twin is ``fp8kit.fp8.triton_scale.scale_from_amax`` (same formula, same float32 ops).
    """
    return DTYPE_MAX[dtype] / clamp_amax(amax, eps)


def round_scale_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round scales down to a power of two (``2 ** floor(log2(scale))``), as torchao's rowwise recipes do.

    A power-of-two scale makes ``x * scale`` and the dequantization ``data / scale`` exact in float32,
    and rounding down never pushes the amax past the format's maximum.
    """
    return torch.exp2(torch.floor(torch.log2(scale)))


def quantize(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x * scale)`` cast to ``dtype`` (a key of :data:`DTYPE_MAX`); ``scale`` broadcasts against ``x``.

    Computed in float32. Values beyond the format's maximum saturate to it (no inf in storage), as
    torchao's casts do. The Triton twin is ``fp8kit.fp8.triton_scale.saturate``.
    """
    m = DTYPE_MAX[dtype]
    return (x.float() * scale).clamp(-m, m).to(dtype)


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data / scale`` in float32."""
    return data.float() / scale
