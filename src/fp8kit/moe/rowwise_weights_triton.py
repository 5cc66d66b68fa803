"""Triton kernels of :func:`fp8kit.moe.rowwise_quant.quantize_experts_dual` with scale hints (CUDA): both rowwise E4M3
copies of the expert weights from ONE read of the weights in the common case.

The two-kernel cast (``rowwise_quant_triton.quantize_experts_dual``) reads the weights twice, because a column's
scale is known only once the whole column has been seen. Between two optimizer steps a weight row's or column's
amax moves by about the learning rate, so its power-of-two scale (``moe.quantize``: ``2^floor(log2(448 / amax))``)
almost never changes. Given the previous scales as hints, the copies are written in one pass and then checked:

1. ``_experts_hinted_cast_kernel``, one program per (expert, ``BN x BK`` tile), as the two-kernel cast's second
   kernel: stores the tile's row and column amaxes (partial: ``(E, K / BK, N)`` and ``(E, N / BN, K)`` buffers, 2% of
   the traffic; reduced by ``torch.amax``, exact in any order) and writes both casts of the tile with the HINTED
   scales (``1 / hint``). The tile is transposed once, in the weights' dtype, and the dgrad cast and the column
   amax both read the transposed tile along its rows (4% faster than a float32 column reduction plus a transpose of
   the E4M3 tile). (Atomic maxes into ``(E, N)`` / ``(E, K)`` instead made it 2x slower than the two-kernel cast.)
2. ``_experts_fix_kernel``: light programs, each for ``FB`` rows (or columns) and one ``SEG``-long segment of them.
   Each derives its rows' (columns') scales from their amaxes exactly as the two-kernel cast does (the first
   segment's program writes the ``inv_scale`` outputs) and recasts, in its segment, the rows (fprop copy) or columns
   (dgrad copy, read as ``(columns, rows)`` tiles so that no transpose goes through shared memory) whose
   ``inv_scale`` differs from the hint (``!=``, so a NaN or garbage hint is a change). A program with nothing to fix
   reads only its scales. (Earlier versions, ``benchmarks/experiments/hinted_weight_cast/README.md``: whole rows and
   columns per program left a changed column of a 28672-row weight to one program's serial loop, 0.45 ms; one
   program per 128 x 128 tile, each with the shared memory of a transpose, spent 0.65 ms only checking scales.)

The result is the two-kernel cast's, bit for bit, for ANY hints: where a hint equals the new ``inv_scale`` (a power
of two), ``1 / hint`` is exactly the new scale (IEEE division), so the tile was cast with the right scale; every
other row or column is recast. Hints only decide how much is read twice. Bytes per weight element: read 2, write 2
(+ 2 per element of a changed row or column), against read 4, write 2 for the two-kernel cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.moe.rowwise_quant_triton import _KW, FP8, _cast, _inv, _pow2_scale


@triton.jit
def expert_tile_ids(K_FASTEST: tl.constexpr):
    """``(e (int64), pid_n, pid_k)`` of this program on the grid :func:`expert_tile_grid` launched. Shared with any
    kernel that walks ``(E, N, K)`` expert weights in tiles."""
    if K_FASTEST:  # grid (K / BK, N / BN, E): consecutive programs read consecutive pieces of the same rows
        return tl.program_id(2).to(tl.int64), tl.program_id(1), tl.program_id(0)
    else:  # grid (E, N / BN, K / BK)
        return tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)


def expert_tile_grid(e: int, n_tiles: int, k_tiles: int, k_fastest: bool) -> tuple[int, int, int]:
    """The launch grid of ``(E, N, K)`` expert weights in ``n_tiles x k_tiles`` tiles per expert, tiles along K first
    or experts first (:func:`expert_tile_ids` reads it back)."""
    return (k_tiles, n_tiles, e) if k_fastest else (e, n_tiles, k_tiles)


@triton.jit
def _experts_hinted_cast_kernel(
    w_ptr, row_hint_ptr, col_hint_ptr, row_part_ptr, col_part_ptr, fprop_ptr, dgrad_ptr, N, K, stride_e, stride_n,
    BN: tl.constexpr, BK: tl.constexpr, FP8_MAX: tl.constexpr, K_FASTEST: tl.constexpr = False,
):
    e, pid_n, pid_k = expert_tile_ids(K_FASTEST)
    offs_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    offs_k = (pid_k * BK + tl.arange(0, BK)).to(tl.int64)
    nmask = offs_n < N
    kmask = offs_k < K
    mask = nmask[:, None] & kmask[None, :]
    wn = tl.load(w_ptr + e * stride_e + offs_n[:, None] * stride_n + offs_k[None, :], mask=mask, other=0.0)
    hinted_tile_cast(wn, e, pid_n, pid_k, tl.cdiv(N, BN), tl.cdiv(K, BK), offs_n, offs_k, nmask, kmask, N, K,
                     row_hint_ptr, col_hint_ptr, row_part_ptr, col_part_ptr, fprop_ptr, dgrad_ptr, FP8_MAX)


@triton.jit
def hinted_tile_cast(wn, e, pid_n, pid_k, n_tiles, k_tiles, offs_n, offs_k, nmask, kmask, N, K, row_hint_ptr,
                     col_hint_ptr, row_part_ptr, col_part_ptr, fprop_ptr, dgrad_ptr, FP8_MAX: tl.constexpr):
    """The one-pass kernel's work on one ``(BN, BK)`` tile ``wn`` of expert ``e`` (in the weights' dtype, zeros
    outside ``nmask`` x ``kmask``), tile ``(pid_n, pid_k)`` of ``(n_tiles, k_tiles) = (N / BN, K / BK)``: its partial
    amaxes and both hinted casts. Shared with any kernel that has the tile in registers already."""
    mask = nmask[:, None] & kmask[None, :]
    wt = tl.trans(wn)  # (BK, BN) in the weights' dtype: the dgrad cast and the column amax read it along rows
    # the tile's partial amaxes (abs and max are exact in any dtype), plain stores: atomic maxes into (E, N) / (E, K)
    # made this kernel 2x slower
    tl.store(row_part_ptr + (e * k_tiles + pid_k) * N + offs_n, tl.max(tl.abs(wn), axis=1).to(tl.float32),
             mask=nmask)
    tl.store(col_part_ptr + (e * n_tiles + pid_n) * K + offs_k, tl.max(tl.abs(wt), axis=1).to(tl.float32),
             mask=kmask)
    row_scale = _inv(tl.load(row_hint_ptr + e * N + offs_n, mask=nmask, other=1.0))
    col_scale = _inv(tl.load(col_hint_ptr + e * K + offs_k, mask=kmask, other=1.0))
    out = e * N * K
    tl.store(fprop_ptr + out + offs_n[:, None] * K + offs_k[None, :],
             _cast(wn.to(tl.float32), row_scale[:, None], FP8_MAX), mask=mask)
    tl.store(dgrad_ptr + out + offs_k[:, None] * N + offs_n[None, :],
             _cast(wt.to(tl.float32), col_scale[:, None], FP8_MAX), mask=kmask[:, None] & nmask[None, :])


@triton.jit
def _new_scales(amax_ptr, hint_ptr, inv_ptr, count_ptr, base, offs, mask, first, EPS: tl.constexpr,
                AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr):
    # the lanes' (rows' or columns') new scales from their amaxes, and which differ from their hints (to recast); the
    # program of a lane block's first segment stores the inverse scales and adds the recast lanes to the counter
    scale = _pow2_scale(tl.load(amax_ptr + base + offs, mask=mask, other=0.0), EPS, AMAX_MAX, FP8_MAX)
    inv = _inv(scale)
    redo = mask & (inv != tl.load(hint_ptr + base + offs, mask=mask, other=0.0))
    n_redo = tl.sum(redo.to(tl.int32), axis=0)
    if first:
        tl.store(inv_ptr + base + offs, inv, mask=mask)
        if n_redo > 0:
            tl.atomic_add(count_ptr, n_redo)
    return scale, redo, n_redo


@triton.jit
def _fix_rows(w_ptr, row_hint_ptr, row_amax_ptr, fprop_ptr, fprop_inv_ptr, fixed_ptr, e, pid, N, K, stride_e,
              stride_n, FB: tl.constexpr, FC: tl.constexpr, SEG: tl.constexpr, EPS: tl.constexpr,
              AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr):
    # FB rows x the SEG-column segment s of K: the rows' new scales; the first segment's program writes fprop_inv
    segs = tl.cdiv(K, SEG)
    s = pid % segs
    offs_n = ((pid // segs) * FB + tl.arange(0, FB)).to(tl.int64)
    scale, redo, n_redo = _new_scales(row_amax_ptr, row_hint_ptr, fprop_inv_ptr, fixed_ptr, e * N, offs_n,
                                      offs_n < N, s == 0, EPS, AMAX_MAX, FP8_MAX)
    if n_redo > 0:
        base = w_ptr + e * stride_e + offs_n[:, None] * stride_n
        out = fprop_ptr + e * N * K + offs_n[:, None] * K
        for k0 in range(s * SEG, tl.minimum(K, (s + 1) * SEG), FC):
            offs_k = k0 + tl.arange(0, FC).to(tl.int64)
            mask = redo[:, None] & (offs_k < K)[None, :]
            w = tl.load(base + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(out + offs_k[None, :], _cast(w, scale[:, None], FP8_MAX), mask=mask)


@triton.jit
def _fix_cols(w_ptr, col_hint_ptr, col_amax_ptr, dgrad_ptr, dgrad_inv_ptr, fixed_ptr, e, pid, N, K, stride_e,
              stride_n, FB: tl.constexpr, FC: tl.constexpr, SEG: tl.constexpr, EPS: tl.constexpr,
              AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr):
    # FB columns x the SEG-row segment s of N, read as (columns, rows) tiles: only the changed columns' elements are
    # loaded (strided anyway) and the dgrad rows are stored contiguous, without a transpose in shared memory
    segs = tl.cdiv(N, SEG)
    s = pid % segs
    offs_k = ((pid // segs) * FB + tl.arange(0, FB)).to(tl.int64)
    scale, redo, n_redo = _new_scales(col_amax_ptr, col_hint_ptr, dgrad_inv_ptr, fixed_ptr + 1, e * K, offs_k,
                                      offs_k < K, s == 0, EPS, AMAX_MAX, FP8_MAX)
    if n_redo > 0:
        base = w_ptr + e * stride_e + offs_k[:, None]
        out = dgrad_ptr + e * N * K + offs_k[:, None] * N
        for n0 in range(s * SEG, tl.minimum(N, (s + 1) * SEG), FC):
            offs_n = n0 + tl.arange(0, FC).to(tl.int64)
            mask = redo[:, None] & (offs_n < N)[None, :]
            w = tl.load(base + offs_n[None, :] * stride_n, mask=mask, other=0.0).to(tl.float32)
            tl.store(out + offs_n[None, :], _cast(w, scale[:, None], FP8_MAX), mask=mask)


@triton.jit
def _experts_fix_kernel(
    w_ptr, row_hint_ptr, col_hint_ptr, row_amax_ptr, col_amax_ptr, fprop_ptr, fprop_inv_ptr, dgrad_ptr,
    dgrad_inv_ptr, fixed_ptr, N, K, stride_e, stride_n, ROW_PROGRAMS,
    FB: tl.constexpr, FC: tl.constexpr, SEG: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    if pid < ROW_PROGRAMS:
        _fix_rows(w_ptr, row_hint_ptr, row_amax_ptr, fprop_ptr, fprop_inv_ptr, fixed_ptr, e, pid, N, K, stride_e,
                  stride_n, FB, FC, SEG, EPS, AMAX_MAX, FP8_MAX)
    else:
        _fix_cols(w_ptr, col_hint_ptr, col_amax_ptr, dgrad_ptr, dgrad_inv_ptr, fixed_ptr, e, pid - ROW_PROGRAMS, N,
                  K, stride_e, stride_n, FB, FC, SEG, EPS, AMAX_MAX, FP8_MAX)


#: The one-pass kernel's tile and warps, and the fix kernel's tile. Chosen on the H100
#: (``benchmarks/experiments/hinted_weight_cast/``; docs/benchmarks.md section 4, sessions 22 and 26): with tiles along
#: K first, 64 x 64 was 2.4-3.2% faster than session 22's 64 x 128 at all six expert weights (128 x 64: 1.6-3.2%).
_BN, _BK, _WARPS = 64, 64, 4
#: The one-pass kernel's program order: True, tiles along K first (grid ``(K / BK, N / BN, E)``: consecutive programs
#: read consecutive pieces of the same rows); False, experts first (grid ``(E, N / BN, K / BK)``). Tiles along K first
#: were 3-7% faster at every Qwen3, DeepSeek-V3 and Mixtral expert shape, the same bits (H100,
#: ``benchmarks/experiments/grid_order/``; docs/benchmarks.md section 4, session 26).
_K_FASTEST = True
_FB, _FC, _SEG, _FIX_WARPS = 64, 128, 2048, 4


def quantize_experts_dual_hinted(w: torch.Tensor, row_hint: torch.Tensor, col_hint: torch.Tensor,
                                 tile: tuple[int, int, int] | None = None, k_fastest: bool | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`fp8kit.moe.rowwise_quant.quantize_experts_dual_ref` reading ``w`` once where the
    hints hold (module docstring): ``(fprop (E, N, K) row-major, fprop_inv (E, N), dgrad (E, K, N) row-major,
    dgrad_inv (E, K), fixed)``, ``fixed`` an int32 ``(2,)`` count of the rows and columns recast.

    Args:
        w: CUDA ``(E, N, K)`` float tensor, unit stride along K.
        row_hint, col_hint: float32 ``(E, N)`` and ``(E, K)``, contiguous: the expected ``fprop_inv`` and
            ``dgrad_inv`` (any values: they change the time, not the result).
        tile: ``(BN, BK, warps)`` of the one-pass kernel (measurements only; default ``_BN, _BK, _WARPS``).
        k_fastest: the one-pass kernel's program order (measurements only; default ``_K_FASTEST``).
    """
    e, n, k = w.shape
    bn, bk, warps = tile or (_BN, _BK, _WARPS)
    k_fastest = _K_FASTEST if k_fastest is None else k_fastest
    fprop, dgrad, row_part, col_part = hinted_cast_buffers(w, bn, bk)
    _experts_hinted_cast_kernel[expert_tile_grid(e, triton.cdiv(n, bn), triton.cdiv(k, bk), k_fastest)](
        w, row_hint, col_hint, row_part, col_part, fprop, dgrad, n, k, w.stride(0), w.stride(1),
        BN=bn, BK=bk, num_warps=warps, FP8_MAX=_KW["FP8_MAX"], K_FASTEST=k_fastest)
    return finish_hinted_cast(w, row_hint, col_hint, fprop, dgrad, row_part, col_part)


def hinted_cast_buffers(w: torch.Tensor, bn: int, bk: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs :func:`hinted_tile_cast` writes over the ``(bn, bk)`` tiles of ``(E, N, K)`` weights ``w``:
    ``fprop (E, N, K)``, ``dgrad (E, K, N)`` (E4M3), and the partial amaxes ``(E, K / bk, N)``, ``(E, N / bn, K)``."""
    e, n, k = w.shape
    dev = w.device
    return (torch.empty(e, n, k, dtype=FP8, device=dev), torch.empty(e, k, n, dtype=FP8, device=dev),
            torch.empty(e, triton.cdiv(k, bk), n, dtype=torch.float32, device=dev),
            torch.empty(e, triton.cdiv(n, bn), k, dtype=torch.float32, device=dev))


def finish_hinted_cast(w, row_hint, col_hint, fprop, dgrad, row_part, col_part):
    """After a grid of :func:`hinted_tile_cast` over ``w``: reduce the partial amaxes, derive the scales and recast
    the rows and columns whose hint was wrong (``_experts_fix_kernel``). Returns
    :func:`quantize_experts_dual_hinted`'s ``(fprop, fprop_inv, dgrad, dgrad_inv, fixed)``."""
    e, n, k = w.shape
    dev = w.device
    fprop_inv = torch.empty(e, n, dtype=torch.float32, device=dev)
    dgrad_inv = torch.empty(e, k, dtype=torch.float32, device=dev)
    fixed = torch.zeros(2, dtype=torch.int32, device=dev)
    row_amax, col_amax = row_part.amax(dim=1), col_part.amax(dim=1)  # max is exact: any order gives these bits
    row_programs = triton.cdiv(n, _FB) * triton.cdiv(k, _SEG)
    _experts_fix_kernel[(e, row_programs + triton.cdiv(k, _FB) * triton.cdiv(n, _SEG))](
        w, row_hint, col_hint, row_amax, col_amax, fprop, fprop_inv, dgrad, dgrad_inv, fixed, n, k, w.stride(0),
        w.stride(1), row_programs, FB=_FB, FC=_FC, SEG=_SEG, num_warps=_FIX_WARPS, **_KW)
    return fprop, fprop_inv, dgrad, dgrad_inv, fixed
