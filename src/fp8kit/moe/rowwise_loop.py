"""Rowwise FP8 grouped GEMM as a loop of dense rowwise GEMMs, one per expert (``fp8.grouped_gemm = "loop"``).

:func:`loop_scaled_grouped_mm` has the semantics of ``torch._scaled_grouped_mm`` (both of its forms, below) and
runs each expert's group through the dense rowwise ``torch._scaled_mm`` (CUTLASS on sm90) instead of the grouped
kernel. Same operands, same scales, the same products summed in float32 (``use_fast_accum``) per output element,
so the result equals the grouped kernel's up to the accumulation order inside the GEMM.

Why: at large expert shapes the dense FP8 GEMM runs faster than the grouped one (``shared/anchors.md``:
1238 vs 1029 TFLOP/s at Mixtral-8x7B's up projection, 1206 vs 1004 at DeepSeek-V3's), the same observation
that made the blockwise recipe a loop (``moe/grouped_loop.py``). The cost: the group bounds must be on the host
(one device-to-host copy per layer, made by the caller and passed as ``bounds``) and one launch per expert per
GEMM, so with many small experts the host becomes the limit; ``moe/grouped_mm.resolve_grouped_gemm`` picks the
loop only where it was measured faster.

Forms (``offs`` (E,) cumulative group ends, groups starting on multiples of 16 rows; ``bounds`` the same as a
host list of ``(start, end)``):

- 2d x 3d (fprop, dgrad): ``a`` (P, K) row-major E4M3, ``b`` (E, K, N) with ``b[e]`` column-major, ``scale_a``
  (P,), ``scale_b`` (E, N) float32 -> (P, N); rows past the last group are left unwritten (as the grouped kernel).
- 2d x 2d (wgrad): ``a`` (N, P) row-major, ``b`` (P, K) column-major, ``scale_a`` (E*N,), ``scale_b`` (E*K,) ->
  (E, N, K), groups along the shared P; an empty group gives zeros.
"""

from __future__ import annotations

import torch


def loop_scaled_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor,
    out_dtype: torch.dtype, bounds: list[tuple[int, int]],
) -> torch.Tensor:
    """``torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum=True)`` as one dense
    ``torch._scaled_mm`` per group (module docstring for the two forms and their layouts).

    Args:
        bounds: the groups' ``(start, end)`` rows on the host, equal to what ``offs`` holds (not checked: reading
            ``offs`` here would cost a device-to-host copy per GEMM).

    Returns:
        (P, N) for 2d x 3d, (E, N, K) for 2d x 2d, in ``out_dtype``.

    Raises:
        ValueError: ``bounds`` not one entry per group, or operand ranks other than the two forms.
    """
    if len(bounds) != offs.shape[0]:
        raise ValueError(f"loop_scaled_grouped_mm: {len(bounds)} bounds for {offs.shape[0]} groups")
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_empty(a.shape[0], b.shape[-1], dtype=out_dtype)
        for e, (s, t) in enumerate(bounds):
            if t > s:
                torch._scaled_mm(a[s:t], b[e], scale_a[s:t].unsqueeze(1), scale_b[e].unsqueeze(0),
                                 out_dtype=out_dtype, use_fast_accum=True, out=out[s:t])
        return out
    if a.dim() == 2 and b.dim() == 2:
        n, k = a.shape[0], b.shape[1]
        out = a.new_empty(len(bounds), n, k, dtype=out_dtype)
        for e, (s, t) in enumerate(bounds):
            if t > s:
                torch._scaled_mm(a[:, s:t], b[s:t], scale_a[e * n:(e + 1) * n].unsqueeze(1),
                                 scale_b[e * k:(e + 1) * k].unsqueeze(0), out_dtype=out_dtype, use_fast_accum=True,
                                 out=out[e])
            else:
                out[e].zero_()
        return out
    raise ValueError(f"loop_scaled_grouped_mm: operands {tuple(a.shape)} x {tuple(b.shape)} are neither 2d x 3d "
                     "nor 2d x 2d")
