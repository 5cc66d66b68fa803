"""Rowwise E4M3 quantization for the three GEMMs of an FP8 grouped linear layer.

Every function returns ``(data, inv_scale)``: ``data`` in ``torch.float8_e4m3fn`` and ``inv_scale`` in
float32 with ``value ~= data * inv_scale`` -- the dequantization factors that ``torch._scaled_grouped_mm``
takes as ``scale_a`` / ``scale_b``. Scales follow ``fp8/scaling.py`` (``scale = 448 / max(amax, eps)``)
rounded down to a power of two (torchao's rowwise recipe), so ``inv_scale`` is exact.

Why every operand is E4M3: ``torch._scaled_grouped_mm`` on Hopper accepts only E4M3 operands (an E5M2
``mat_a`` is refused: "Expected mat_a to be Float8_e4m3"), so output gradients are E4M3 here, as in
torchao's FP8 grouped GEMM, unlike the E4M3/E5M2 hybrid of the dense recipes (``fp8/recipes.py``).

Which axis each operand is scaled along (K: input features, N: output features, P: padded token rows,
E: experts):

==============  =====================  ============================  ===================================
GEMM            left operand            right operand                 scales
==============  =====================  ============================  ===================================
fprop  y = xW^T  x (P, K) per row        W (E, N, K) per (e, n) over K  (P,), (E, N)
dgrad  dx = gW   g (P, N) per row        W per (e, k) over N            (P,), (E, K)
wgrad  dW = g^Tx g^T (N, P) per (group, n) x (P, K) per (group, k)      (E*N,), (E*K,) group-major
==============  =====================  ============================  ===================================

Row ``p`` belongs to group ``group_ids[p]``; rows past the last group (id ``E``) get their own dummy
group, so whatever a kernel left there cannot reach a real scale.
"""

from __future__ import annotations

import torch

from fp8kit.fp8.scaling import AMAX_EPS, quantize, round_scale_pow2, scale_from_amax

FP8 = torch.float8_e4m3fn


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return round_scale_pow2(scale_from_amax(amax, FP8, AMAX_EPS))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of a 2-D ``x`` (M, K) over its last dim.

    Returns ``(data (M, K) row-major E4M3, inv_scale (M,) float32)``.
    """
    scale = _scale(x.detach().abs().amax(dim=-1, keepdim=True))
    return quantize(x, scale, FP8), scale.reciprocal().squeeze(-1)


def quantize_experts(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights ``w`` (E, N, K) scaled along ``dim`` (-1: over K, fprop; -2: over N, dgrad).

    Returns the right operand of ``torch._scaled_grouped_mm`` in the column-major layout it needs:
    ``dim=-1``: ``data`` (E, K, N) = the E4M3 copy of ``w`` transposed (a view), ``inv_scale`` (E, N);
    ``dim=-2``: ``data`` (E, N, K) column-major, ``inv_scale`` (E, K).
    """
    scale = _scale(w.detach().abs().amax(dim=dim, keepdim=True))
    inv = scale.reciprocal().squeeze(dim)
    if dim == -1:
        return quantize(w, scale, FP8).transpose(-2, -1), inv
    return quantize(w.transpose(-2, -1), scale.transpose(-2, -1), FP8).contiguous().transpose(-2, -1), inv


def group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Group index (0..E) of each of ``rows`` rows for cumulative group ends ``offs`` (E,); E past the end."""
    return torch.searchsorted(offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True)


def quantize_group_cols(
    x: torch.Tensor, gid: torch.Tensor, num_groups: int, *, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per (group, column) of a 2-D ``x`` (P, C): the wgrad operands.

    Args:
        x: (P, C) activations or output gradients, rows grouped by ``gid``.
        gid: (P,) group of each row, from :func:`group_ids` (``num_groups`` for rows past the end).
        num_groups: E.
        transposed: ``True`` for the left operand ``g^T``: data (C, P) row-major; ``False`` for the right
            operand ``x``: data (P, C) column-major.

    Returns:
        ``(data, inv_scale (E*C,) float32, group-major)``.
    """
    p, c = x.shape
    amax = torch.zeros(num_groups + 1, c, device=x.device, dtype=torch.float32)
    amax.scatter_reduce_(0, gid[:, None].expand(p, c), x.detach().abs().float(), "amax", include_self=True)
    scale = _scale(amax)
    data = quantize(x, scale[gid], FP8)
    inv = scale[:num_groups].reciprocal().reshape(-1)
    if transposed:
        return data.t().contiguous(), inv
    return data.t().contiguous().t(), inv
