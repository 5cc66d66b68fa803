"""Scaled low-precision storage: ``scale = dtype_max / max(amax, eps)``, per tensor or per block.

The convention is FP8-LM's (Peng et al. 2023, arXiv:2310.18313, section 2; the seed
``003_f6166ad1663d4d19``): a low-precision tensor is a pair ``(data, scale)`` whose value is
``data / scale``, with ``scale`` in float32 chosen so the tensor's amax lands on the format's maximum.
The ``eps`` floor on amax (the seeds' ``FP8_QUANT_*_AMAX_EPS`` idea) keeps all-zero and tiny tensors
from producing an inf or NaN scale: an all-zero tensor gets ``scale = dtype_max / eps`` and quantizes to
zeros. Used by the FP8 optimizer (``fp8kit.optim``) and the FP8 gradient all-reduce
(``fp8kit.distributed``) and the FP8 grouped GEMM of MoE experts (``fp8kit.moe``); dense FP8 matmuls
use torchao's own casts.
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


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, eps: float = AMAX_EPS) -> torch.Tensor:
    """``dtype_max / max(amax, eps)`` in float32 (any shape; one scale per amax entry)."""
    return DTYPE_MAX[dtype] / amax.float().clamp(min=eps, max=F32_MAX)


def round_scale_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Round scales down to a power of two (``2 ** floor(log2(scale))``), as torchao's rowwise recipes do.

    A power-of-two scale makes ``x * scale`` and the dequantization ``data / scale`` exact in float32,
    and rounding down never pushes the amax past the format's maximum.
    """
    return torch.exp2(torch.floor(torch.log2(scale)))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x * scale)`` cast to ``dtype``; ``scale`` broadcasts against ``x``.

    Values beyond the format's maximum saturate to it (no inf in storage), as torchao's casts do.
    """
    m = DTYPE_MAX[dtype]
    return (x.float() * scale).clamp(-m, m).to(dtype)


def dequantize(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``data / scale`` in float32."""
    return data.float() / scale


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, eps: float = AMAX_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor. Returns ``(data, scale)`` with ``scale`` a 0-d float32 tensor."""
    scale = scale_from_amax(x.detach().abs().amax(), dtype, eps)
    return quantize(x, scale, dtype), scale


def quantize_blockwise(
    x: torch.Tensor, dtype: torch.dtype, block: int, eps: float = AMAX_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per ``block`` consecutive elements of a 1-D tensor whose length is a multiple of ``block``.

    Returns ``(data, scales)``: ``data`` with ``x``'s shape, ``scales`` of shape ``(len(x) // block,)``.

    Raises:
        ValueError: when ``x`` is not 1-D or its length is not a multiple of ``block``.
    """
    if x.dim() != 1 or x.numel() % block:
        raise ValueError(f"quantize_blockwise: need a 1-D tensor with length divisible by {block}, got {tuple(x.shape)}")
    xb = x.view(-1, block)
    scales = scale_from_amax(xb.detach().abs().amax(dim=1), dtype, eps)
    return quantize(xb, scales[:, None], dtype).view(-1), scales
