"""Prototype (session 25; measured slower than the unfused path in session 26, README): the FP8AdamW step of one
3-D expert weight that also writes the weight's two rowwise E4M3 copies (fprop, dgrad) for the fused MoE experts,
from the registers that hold the new weights, instead of the fused experts reading the bf16 weights back at the
next forward.

Today, per expert-weight element and optimizer step: the per-block FP8AdamW step moves 14 bytes (reads the bf16
gradient 2, m 1, v 2, master 2; writes m 1, v 2, master 2, bf16 weight 2), then the next forward's hinted cast
(``moe.rowwise_weights_triton``) reads the bf16 weight again (2) and writes the two copies (2): 18 bytes. Here the
step writes the copies itself: 16 bytes, about 11% less, ~1.2 GB per Qwen3-30B-A3B layer (0.5 ms at 2.3 TB/s).

The kernel is the per-block step (``optim.triton_step._update`` / ``_store_scaled``, the same bits) on a grid of
``(BN rows x 128 columns)`` tiles of one ``(E, N, K)`` weight, whose every row segment of 128 is one FP8AdamW block
(``K % 128 == 0``, per-block scales of 128), followed by the hinted cast of the new bf16 tile
(``rowwise_weights_triton.hinted_tile_cast``, the one-pass kernel's body) and the same fix pass
(``finish_hinted_cast``). So its outputs are the unfused path's bits: ``check_interpreter.py`` compares them in
Triton's interpreter; ``bench.py`` times both on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp8kit.fp8.scaling import DTYPE_MAX
from fp8kit.moe.rowwise_quant_triton import _KW
from fp8kit.moe.rowwise_weights_triton import (
    expert_tile_grid,
    expert_tile_ids,
    finish_hinted_cast,
    hinted_cast_buffers,
    hinted_tile_cast,
)
from fp8kit.optim.numerics import SR_FORMATS
from fp8kit.optim.triton_step import _store_scaled, _update, advance_states


@triton.jit
def _adamw_expert_cast_kernel(
    gtab, seg_start, m, ms, v, vs, w, ws, work, hp, owner_idx, start, row_hint, col_hint, row_part, col_part,
    fprop, dgrad, N, K,
    BN: tl.constexpr, BLOCK: tl.constexpr, GRAD_VEC: tl.constexpr, NUM_T: tl.constexpr, M_MAX: tl.constexpr,
    V_MAX: tl.constexpr, W_MAX: tl.constexpr, AMAX_EPS: tl.constexpr, M_SR: tl.constexpr, M_MANT: tl.constexpr,
    M_EMIN: tl.constexpr, FP8_MAX: tl.constexpr, K_FASTEST: tl.constexpr,
):
    e, pid_n, pid_k = expert_tile_ids(K_FASTEST)
    r = tl.arange(0, BN)
    c = tl.arange(0, BLOCK)
    # the tile's first element in the flat layout, and each row's FP8AdamW block
    p0 = start + (e * N + pid_n * BN) * K + pid_k * BLOCK
    loc = r[:, None] * K + c[None, :]  # int32 within the tile
    srow = p0 // BLOCK + r * (K // BLOCK)
    owner_r = tl.full((BN,), owner_idx, tl.int64)
    m, v, w, work = advance_states(m, v, w, work, p0)
    mm, vv, ww = _update(work, hp, gtab, seg_start, m, ms, v, vs, w, ws, work, hp, p0, loc, srow, owner_r,
                         True, GRAD_VEC, NUM_T, True, True, BN * K)
    noffs = p0.to(tl.uint32) + loc.to(tl.uint32)
    _store_scaled(mm, m, ms, loc, noffs, srow, hp, M_MAX, AMAX_EPS, True, M_SR, M_MANT, M_EMIN)
    _store_scaled(vv, v, vs, loc, loc, srow, hp, V_MAX, AMAX_EPS, True, False, 0, 0)
    _store_scaled(ww, w, ws, loc, loc, srow, hp, W_MAX, AMAX_EPS, True, False, 0, 0)
    wn = ww.to(work.dtype.element_ty)
    tl.store(work + loc, wn)
    offs_n = (pid_n * BN + r).to(tl.int64)
    offs_k = (pid_k * BLOCK + c).to(tl.int64)
    hinted_tile_cast(wn, e, pid_n, pid_k, N // BN, K // BLOCK, offs_n, offs_k, offs_n < N, offs_k < K, N, K,
                     row_hint, col_hint, row_part, col_part, fprop, dgrad, FP8_MAX)


def adamw_step_with_expert_casts(i, shape, m, m_scale, v, v_scale, master, master_scale, work, hp, spec, grad_table,
                                 seg_start, offset, row_hint, col_hint, bn=16, warps=4, k_fastest=False):
    """Step parameter ``i`` of a flat FP8AdamW group (per-block scales, ``spec.block == 128``), an ``(E, N, K)`` expert
    weight starting at flat ``offset``, and return its two copies as ``rowwise_weights_triton.
    quantize_experts_dual_hinted(new weights, row_hint, col_hint)`` does: ``(fprop, fprop_inv, dgrad, dgrad_inv,
    fixed)``. The other parameters of the group are left to ``adamw_update_triton`` (a caller runs it on the rest).

    ``bn``, ``warps``: the tile's rows and the program's warps. Compiled for sm_90 on the CPU (README): 16 x 4 takes
    155 registers, 8 x 4 89; 64 x 4, the one-pass cast's tile, spills."""
    e, n, k = shape
    if spec.block != 128 or spec.granularity != "block" or k % 128 or n % bn:
        raise ValueError(f"fused step: needs per-block scales of 128, K % 128 == 0 and N % {bn} == 0; got {spec}, "
                         f"shape {shape}")
    w3 = work[offset:offset + e * n * k].view(e, n, k)
    fprop, dgrad, row_part, col_part = hinted_cast_buffers(w3, bn, 128)
    mant, emin = SR_FORMATS.get(m.dtype, (0, 0))
    _adamw_expert_cast_kernel[expert_tile_grid(e, n // bn, k // 128, k_fastest)](
        grad_table, seg_start, m, m_scale, v, v_scale, master, master_scale, work, hp, i, offset, row_hint, col_hint,
        row_part, col_part, fprop, dgrad, n, k,
        BN=bn, BLOCK=128, GRAD_VEC=16 // work.element_size(), NUM_T=spec.num_tensors, M_MAX=DTYPE_MAX[m.dtype],
        V_MAX=DTYPE_MAX[v.dtype], W_MAX=DTYPE_MAX[master.dtype], AMAX_EPS=spec.eps,
        M_SR=spec.m_rounding == "stochastic", M_MANT=mant, M_EMIN=emin, FP8_MAX=_KW["FP8_MAX"], K_FASTEST=k_fastest,
        num_warps=warps, enable_fp_fusion=False)
    return finish_hinted_cast(w3, row_hint, col_hint, fprop, dgrad, row_part, col_part)
