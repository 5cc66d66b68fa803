"""Triton kernels of :mod:`fp8kit.moe.rowwise_quant` (CUDA): fused rowwise E4M3 casts for the FP8 grouped GEMM.

Every kernel computes the bits of its reference in :mod:`fp8kit.moe.quantize`:

- scale: ``_scale_of`` (``fp8.kernels.blockwise_triton``: IEEE ``1 / clamp(amax, eps, f32_max)`` times 448,
  the two roundings of ``scaling.scale_from_amax``), then ``exp2(floor(log2(scale)))`` with libdevice's
  ``__nv_log2f`` / ``__nv_exp2f``, the functions torch's CUDA ``log2`` / ``exp2`` call
  (``scaling.round_scale_pow2``). Triton's own ``tl.log2`` is ``lg2.approx`` and could floor a scale a few
  ulps below a power of two differently;
- cast: ``clamp(x * scale, -448, 448)`` then the RTNE E4M3 conversion (``scaling.quantize``);
- ``inv_scale = 1 / scale`` by an IEEE division (exact: ``scale`` is a power of two).

Kernels (the wrappers below expect non-empty inputs; the ops run the reference on empty ones):

- :func:`gather_quantize_rows`: one program per ``ROWS`` output rows, each read through ``index`` (one
  read when the row fits one ``BLOCK_K`` chunk, else a second pass over the chunks, L1/L2-resident). With
  ``weight``: each row times its weight, rounded to the source dtype first (the combine's backward; optionally
  written out too, ``keep_rows``).
- :func:`scatter_quantize_rows`: the same rows from the tokens' side: one program per ``ROWS`` tokens reads each
  once and stores it at its ``topk`` rows (through ``pair_rows``), tail programs zero the padding rows. With
  top-8 routing it reads 8x fewer token bytes than the gather (alone 1.35-2.3x faster at Qwen3 / DeepSeek-V3 shapes on
  the H100, 1.1-1.7x at top-4, 1.17-1.57x at Mixtral's top-2 with the session-27 tile:
  ``benchmarks/experiments/scatter_rows/``);
  ``rowwise_quant.SCATTER_MIN_TOPK`` picks it by top-k.
- :func:`swiglu_quantize_rows`: one program per ``ROWS`` rows of ``h``, the same way: ``a = silu(gate) * up`` with
  :func:`fp8kit.moe.token_quant_triton._sigmoid` (launched with ``enable_fp_fusion=False``, as token_quant).
- :func:`swiglu_backward_quantize_rows`: the SwiGLU backward ``dh = (dgate | dup)`` from ``h`` and ``da``, written in
  ``h``'s dtype, and its rowwise cast (one pass when a row's half fits one chunk, else the cast re-reads ``dh``);
  the sigmoid is the hardware's (``tl.exp``, fast division, FMA contraction on), so ``dh`` is the reference's within
  a bf16 ulp, and the cast is exactly ``quantize_rows`` of the ``dh`` written.
- :func:`quantize_group_cols`: one program per (group ``0..E``, ``BC``-column block): pass 1 the column amax over
  the group's rows ``[offs[g-1], offs[g])`` (group ``E`` = the rows past ``offs[-1]``, the reference's
  dummy group), pass 2 re-reads them (mostly from HBM: a persistent launch that kept the strips in L2 was
  slower, and so was holding a whole strip in registers for one read: ``benchmarks/experiments/group_cols*``) and
  writes the ``(C, P)`` row-major cast. The dual launch serves ``g`` and ``x`` from one grid (the program's column
  block says which); ``g`` may be read through an index with per-row weights (the combine's backward), ``x``
  through the dispatch index.
- :func:`quantize_experts_dual`: two kernels. ``_experts_amax_kernel``, per (expert, ``BN`` rows of ``N``):
  walks ``K``, keeps the row amax (written with the fprop ``inv_scale``) and atomically maxes the column
  amax into an ``(E, K)`` buffer; ``_experts_cast_kernel``, per (expert, ``BN x BK`` tile): both casts of
  the tile, from one read. ``atomic_max`` is order-independent, so the result is deterministic.

Imported only on CUDA (inside the ops' CUDA implementations); validated bit for bit in Triton's CPU
interpreter too (with ``_round_pow2`` swapped for ``tl.log2`` / ``tl.exp2``: the interpreter has no libdevice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp8kit.fp8.kernels.blockwise_triton import _scale_of
from fp8kit.fp8.scaling import AMAX_EPS, DTYPE_MAX, F32_MAX
from fp8kit.moe.token_quant_triton import _sigmoid

FP8 = torch.float8_e4m3fn
_FP8_MAX = DTYPE_MAX[FP8]
#: Largest row chunk of the row kernels (a longer row is walked in chunks, twice).
_MAX_BLOCK_K = 8192
#: The SwiGLU kernel's largest chunk: a row of ``a`` up to this long is computed once, in registers (8 warps), instead
#: of twice (amax pass, then cast pass reading ``h`` again): Mixtral-8x7B's 14336-wide experts.
_MAX_SWIGLU_BLOCK = 16384
_KW = dict(EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX)


# --------------------------------------------------------------------------- scale and cast

@triton.jit
def _round_pow2(scale):
    # scaling.round_scale_pow2: torch.exp2(torch.floor(torch.log2(scale))), same libdevice functions as torch CUDA.
    return libdevice.exp2(tl.floor(libdevice.log2(scale)))


@triton.jit
def _pow2_scale(amax, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr):
    # moe.quantize._scale: round_scale_pow2(scale_from_amax(amax, e4m3, AMAX_EPS)).
    return _round_pow2(_scale_of(amax, EPS, AMAX_MAX, FP8_MAX))


@triton.jit
def _inv(scale):
    return tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


@triton.jit
def _cast(x, scale, FP8_MAX: tl.constexpr):
    # scaling.quantize: saturate(x * scale) in float32, then RTNE to E4M3.
    return tl.clamp(x * scale, -FP8_MAX, FP8_MAX).to(tl.float8e4nv)


# --------------------------------------------------------------------------- rows (fprop / dgrad left operand)

@triton.jit
def _weighted(x, w, dtype: tl.constexpr):
    # routing.combine_rows_grad: (g.float() * w.float()).to(dtype), one float32 product rounded to the rows' dtype.
    return (x * w[:, None]).to(dtype).to(tl.float32)


@triton.jit
def _gather_chunk(src_ptr, src_row, valid, w, c0, K, stride_src, HAS_W: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = c0 + tl.arange(0, BLOCK_K)
    mask = valid[:, None] & (cols < K)[None, :]
    x = tl.load(src_ptr + src_row[:, None] * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_W:
        x = _weighted(x, w, src_ptr.dtype.element_ty)
    return x


@triton.jit
def _store_plain(rows_ptr, x, rows, pmask, c0, K, STORE: tl.constexpr, BLOCK_K: tl.constexpr):
    # the weighted rows themselves (the bf16 wgrad GEMM's operand), in the source's dtype (exact: already rounded)
    if STORE:
        cols = c0 + tl.arange(0, BLOCK_K)
        tl.store(rows_ptr + rows[:, None] * K + cols[None, :], x.to(rows_ptr.dtype.element_ty),
                 mask=pmask[:, None] & (cols < K)[None, :])


@triton.jit
def _store_rows(q_ptr, x, scale, rows, pmask, c0, K, stride_q, FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = c0 + tl.arange(0, BLOCK_K)
    mask = pmask[:, None] & (cols < K)[None, :]
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], _cast(x, scale[:, None], FP8_MAX), mask=mask)


@triton.jit
def _gather_rows_kernel(
    src_ptr, idx_ptr, q_ptr, inv_ptr, T, P, K, stride_src, stride_q, stride_inv, w_ptr, rows_ptr,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr, HAS_W: tl.constexpr, STORE_ROWS: tl.constexpr,
    EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    offs_p = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pmask = offs_p < P
    rows = offs_p.to(tl.int64)
    src_row = tl.load(idx_ptr + offs_p, mask=pmask, other=0).to(tl.int64)
    valid = pmask & (src_row < T)  # index T: the zero row
    w = tl.load(w_ptr + offs_p, mask=pmask, other=0.0).to(tl.float32) if HAS_W else 0.0
    if CHUNKS == 1:
        x = _gather_chunk(src_ptr, src_row, valid, w, 0, K, stride_src, HAS_W, BLOCK_K)
        _store_plain(rows_ptr, x, rows, pmask, 0, K, STORE_ROWS, BLOCK_K)
        scale = _pow2_scale(tl.max(tl.abs(x), axis=1), EPS, AMAX_MAX, FP8_MAX)
        _store_rows(q_ptr, x, scale, rows, pmask, 0, K, stride_q, FP8_MAX, BLOCK_K)
    else:
        amax = tl.zeros((ROWS,), tl.float32)
        for c in range(CHUNKS):
            x = _gather_chunk(src_ptr, src_row, valid, w, c * BLOCK_K, K, stride_src, HAS_W, BLOCK_K)
            _store_plain(rows_ptr, x, rows, pmask, c * BLOCK_K, K, STORE_ROWS, BLOCK_K)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = _pow2_scale(amax, EPS, AMAX_MAX, FP8_MAX)
        for c in range(CHUNKS):
            x = _gather_chunk(src_ptr, src_row, valid, w, c * BLOCK_K, K, stride_src, HAS_W, BLOCK_K)
            _store_rows(q_ptr, x, scale, rows, pmask, c * BLOCK_K, K, stride_q, FP8_MAX, BLOCK_K)
    tl.store(inv_ptr + rows * stride_inv, _inv(scale), mask=pmask)


@triton.jit
def _scatter_rows_kernel(
    src_ptr, pair_rows_ptr, idx_ptr, q_ptr, inv_ptr, rows_ptr, w_ptr, T, P, K, stride_src, stride_q, stride_inv,
    TOKEN_PROGRAMS, TOPK: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PAD_ROWS: tl.constexpr,
    HAS_W: tl.constexpr, STORE_ROWS: tl.constexpr, CAST: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    # The gather kernel's rows written from the tokens' side: programs [0, TOKEN_PROGRAMS) read ROWS token rows once
    # and store each at its TOPK padded rows (pair_rows, pair order); the others zero the padding rows (index T).
    # CAST False: only the rows (the plain gather, for a bf16 wgrad's input).
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    cmask = cols < K
    if pid < TOKEN_PROGRAMS:
        offs_t = pid * ROWS + tl.arange(0, ROWS)
        tmask = offs_t < T
        mask = tmask[:, None] & cmask[None, :]
        x = tl.load(src_ptr + offs_t.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        scale = _pow2_scale(tl.max(tl.abs(x), axis=1), EPS, AMAX_MAX, FP8_MAX)
        q = _cast(x, scale[:, None], FP8_MAX)  # the same for every slot without weights: cast once
        for j in tl.static_range(TOPK):
            p = tl.load(pair_rows_ptr + offs_t * TOPK + j, mask=tmask, other=0).to(tl.int64)
            xj = x
            if HAS_W:  # each slot its router weight: a row of its own
                w = tl.load(w_ptr + offs_t * TOPK + j, mask=tmask, other=0.0).to(tl.float32)
                xj = _weighted(x, w, src_ptr.dtype.element_ty)
                scale = _pow2_scale(tl.max(tl.abs(xj), axis=1), EPS, AMAX_MAX, FP8_MAX)
                q = _cast(xj, scale[:, None], FP8_MAX)
            if STORE_ROWS:
                tl.store(rows_ptr + p[:, None] * K + cols[None, :], xj.to(rows_ptr.dtype.element_ty), mask=mask)
            if CAST:
                tl.store(q_ptr + p[:, None] * stride_q + cols[None, :], q, mask=mask)
                tl.store(inv_ptr + p * stride_inv, _inv(scale), mask=tmask)
    else:
        offs_p = (pid - TOKEN_PROGRAMS) * PAD_ROWS + tl.arange(0, PAD_ROWS)
        pm = offs_p < P
        pad = pm & (tl.load(idx_ptr + offs_p, mask=pm, other=0) >= T)
        prow = offs_p.to(tl.int64)
        zero = tl.zeros((PAD_ROWS, BLOCK_K), tl.float32)
        for c in range(0, K, BLOCK_K):
            cc = c + cols
            m = pad[:, None] & (cc < K)[None, :]
            if CAST:
                tl.store(q_ptr + prow[:, None] * stride_q + cc[None, :], zero.to(tl.float8e4nv), mask=m)
            if STORE_ROWS:
                tl.store(rows_ptr + prow[:, None] * K + cc[None, :], zero.to(rows_ptr.dtype.element_ty), mask=m)
        # the inv_scale of an all-zero row, by the same math as the gather kernel's (amax floored at EPS)
        if CAST:
            zero_scale = _pow2_scale(tl.zeros((PAD_ROWS,), tl.float32), EPS, AMAX_MAX, FP8_MAX)
            tl.store(inv_ptr + prow * stride_inv, _inv(zero_scale), mask=pad)


@triton.jit
def _swiglu_chunk(h_ptr, a_ptr, rows, pmask, c0, INTER, stride_h,
                  STORE_A: tl.constexpr, INTERLEAVED: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    # a = silu(gate) * up of columns [c0, c0 + BLOCK_K) of a, rounded to a's dtype (token_quant.swiglu_ref).
    cols = c0 + tl.arange(0, BLOCK_K)
    cmask = cols < INTER
    if INTERLEAVED:  # gate = h[:, 0::2], up = h[:, 1::2]: read 2 x BLOCK_K columns contiguously, split
        c2 = 2 * c0 + tl.arange(0, 2 * BLOCK_K)
        gu = tl.load(h_ptr + rows[:, None] * stride_h + c2[None, :], mask=pmask[:, None] & (c2 < 2 * INTER)[None, :],
                     other=0.0)
        g, u = tl.split(tl.reshape(gu, (ROWS, BLOCK_K, 2)))
    else:  # gate = h[:, :INTER], up = h[:, INTER:]
        mask = pmask[:, None] & cmask[None, :]
        ptr = h_ptr + rows[:, None] * stride_h + cols[None, :]
        g = tl.load(ptr, mask=mask, other=0.0)
        u = tl.load(ptr + INTER, mask=mask, other=0.0)
    g = g.to(tl.float32)
    a = (g * _sigmoid(g) * u.to(tl.float32)).to(a_ptr.dtype.element_ty)
    if STORE_A:
        tl.store(a_ptr + rows[:, None] * INTER + cols[None, :], a, mask=pmask[:, None] & cmask[None, :])
    return a.to(tl.float32)


@triton.jit
def _swiglu_rows_kernel(
    h_ptr, a_ptr, q_ptr, inv_ptr, P, INTER, stride_h,
    INTERLEAVED: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
    EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    offs_p = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pmask = offs_p < P
    rows = offs_p.to(tl.int64)
    if CHUNKS == 1:
        a = _swiglu_chunk(h_ptr, a_ptr, rows, pmask, 0, INTER, stride_h, True, INTERLEAVED, ROWS, BLOCK_K)
        scale = _pow2_scale(tl.max(tl.abs(a), axis=1), EPS, AMAX_MAX, FP8_MAX)
        _store_rows(q_ptr, a, scale, rows, pmask, 0, INTER, INTER, FP8_MAX, BLOCK_K)
    else:
        amax = tl.zeros((ROWS,), tl.float32)
        for c in range(CHUNKS):
            a = _swiglu_chunk(h_ptr, a_ptr, rows, pmask, c * BLOCK_K, INTER, stride_h, True, INTERLEAVED, ROWS, BLOCK_K)
            amax = tl.maximum(amax, tl.max(tl.abs(a), axis=1))
        scale = _pow2_scale(amax, EPS, AMAX_MAX, FP8_MAX)
        for c in range(CHUNKS):
            a = _swiglu_chunk(h_ptr, a_ptr, rows, pmask, c * BLOCK_K, INTER, stride_h, False, INTERLEAVED, ROWS,
                              BLOCK_K)
            _store_rows(q_ptr, a, scale, rows, pmask, c * BLOCK_K, INTER, INTER, FP8_MAX, BLOCK_K)
    tl.store(inv_ptr + offs_p, _inv(scale), mask=pmask)


@triton.jit
def _dswiglu_chunk(h_ptr, da_ptr, dh_ptr, rows, pmask, c0, INTER, stride_h, stride_da, BLOCK_K: tl.constexpr):
    # columns [c0, c0 + BLOCK_K) of dgate = da * up * s * (1 + g (1 - s)) and dup = da * g * s, s = sigmoid(g) with
    # the hardware's exp and division (as Inductor's sigmoid, which this replaces; an IEEE-exact sigmoid made the dense
    # SwiGLU backward kernel compute-bound, fp8/kernels/swiglu_triton.py), each rounded to h's dtype, written to dh
    # (gate half, up half) and returned in float32.
    cols = c0 + tl.arange(0, BLOCK_K)
    mask = pmask[:, None] & (cols < INTER)[None, :]
    ptr = h_ptr + rows[:, None] * stride_h + cols[None, :]
    g = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(ptr + INTER, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(da_ptr + rows[:, None] * stride_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    dt = dh_ptr.dtype.element_ty
    dg = (d * u * s * (1.0 + g * (1.0 - s))).to(dt)
    du = (d * g * s).to(dt)
    out = dh_ptr + rows[:, None] * (2 * INTER) + cols[None, :]
    tl.store(out, dg, mask=mask)
    tl.store(out + INTER, du, mask=mask)
    return dg.to(tl.float32), du.to(tl.float32)


@triton.jit
def _load_half(dh_ptr, rows, pmask, c0, off, INTER, BLOCK_K: tl.constexpr):
    cols = c0 + tl.arange(0, BLOCK_K)
    return tl.load(dh_ptr + rows[:, None] * (2 * INTER) + off + cols[None, :],
                   mask=pmask[:, None] & (cols < INTER)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store_half(q_ptr, x, scale, rows, pmask, c0, off, INTER, FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    cols = c0 + tl.arange(0, BLOCK_K)
    tl.store(q_ptr + rows[:, None] * (2 * INTER) + off + cols[None, :], _cast(x, scale[:, None], FP8_MAX),
             mask=pmask[:, None] & (cols < INTER)[None, :])


@triton.jit
def _swiglu_bwd_rows_kernel(
    h_ptr, da_ptr, dh_ptr, q_ptr, inv_ptr, P, INTER, stride_h, stride_da,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, CHUNKS: tl.constexpr,
    EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    offs_p = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pmask = offs_p < P
    rows = offs_p.to(tl.int64)
    if CHUNKS == 1:
        dg, du = _dswiglu_chunk(h_ptr, da_ptr, dh_ptr, rows, pmask, 0, INTER, stride_h, stride_da, BLOCK_K)
        scale = _pow2_scale(tl.maximum(tl.max(tl.abs(dg), axis=1), tl.max(tl.abs(du), axis=1)), EPS, AMAX_MAX,
                            FP8_MAX)
        _store_half(q_ptr, dg, scale, rows, pmask, 0, 0, INTER, FP8_MAX, BLOCK_K)
        _store_half(q_ptr, du, scale, rows, pmask, 0, INTER, INTER, FP8_MAX, BLOCK_K)
    else:  # pass 1 writes dh and takes the amax; pass 2 casts dh read back (L2-resident, the values just written)
        amax = tl.zeros((ROWS,), tl.float32)
        for c in range(CHUNKS):
            dg, du = _dswiglu_chunk(h_ptr, da_ptr, dh_ptr, rows, pmask, c * BLOCK_K, INTER, stride_h, stride_da,
                                    BLOCK_K)
            amax = tl.maximum(amax, tl.maximum(tl.max(tl.abs(dg), axis=1), tl.max(tl.abs(du), axis=1)))
        scale = _pow2_scale(amax, EPS, AMAX_MAX, FP8_MAX)
        tl.debug_barrier()  # this program's dh stores before its loads of them
        for c in range(CHUNKS):
            for off in tl.static_range(2):
                x = _load_half(dh_ptr, rows, pmask, c * BLOCK_K, off * INTER, INTER, BLOCK_K)
                _store_half(q_ptr, x, scale, rows, pmask, c * BLOCK_K, off * INTER, INTER, FP8_MAX, BLOCK_K)
    tl.store(inv_ptr + offs_p, _inv(scale), mask=pmask)


def _row_blocks(k: int, max_block: int = _MAX_BLOCK_K) -> tuple[int, int, int, int]:
    """``(ROWS, BLOCK_K, CHUNKS, num_warps)`` for rows of ``k`` elements (about 2-16K elements per program, chunks of
    at most ``max_block``)."""
    block_k = min(triton.next_power_of_2(max(k, 1)), max_block)
    rows = max(1, 2048 // block_k)
    chunks = triton.cdiv(k, block_k)
    # 16 warps only for rows walked twice in chunks of 8192 or more (Mixtral's 28672-wide dh: 1.53 -> 1.12 ms with
    # 16 warps instead of 8); one 16384-wide chunk (Mixtral's SwiGLU) runs best on 8 (1.21 ms against 1.55 on 16).
    # H100, the same bits: benchmarks/experiments/row_casts/.
    warps = 16 if chunks > 1 and block_k >= 8192 else 8 if block_k >= 4096 else 4
    return rows, block_k, chunks, warps


def gather_quantize_rows(src: torch.Tensor, index: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                         weight: torch.Tensor | None = None, keep_rows: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`fp8kit.moe.rowwise_quant.gather_quantize_rows_ref` (same bits), and with ``weight``
    (one per row) and ``keep_rows`` of :func:`fp8kit.moe.rowwise_quant.dispatch_quantize_rows_ref` (whose weights are
    per pair: the caller maps them to rows).

    Args:
        src: CUDA ``(T, K)`` float tensor, unit stride along K.
        index: CUDA ``(P,)`` contiguous int64 / int32, values in ``[0, T]`` (unchecked).
        out: ``(q (P, K) E4M3, inv (P,) float32)`` to write into, each row of ``q`` contiguous and any row strides
            (the rowwise dispatch payload: both are views of one uint8 buffer); default new contiguous tensors.
        weight: optional CUDA ``(P,)`` contiguous float: each gathered row multiplied by its weight in float32 and
            rounded to ``src``'s dtype before the cast (the combine's backward, ``routing.combine_rows_grad``).
        keep_rows: also return the gathered rows ``(P, K)`` in ``src``'s dtype as a third output (with ``weight``
            those rounded rows; without, the plain gather: zeros where ``index == T``).
    """
    t, k = src.shape
    p = index.shape[0]
    if out is None:
        out = (torch.empty(p, k, dtype=FP8, device=src.device), torch.empty(p, dtype=torch.float32, device=src.device))
    q, inv = out
    rows_out = torch.empty(p, k, dtype=src.dtype, device=src.device) if keep_rows else None
    if t == 0:  # every index is the zero row: give the kernel one real row to point at
        src = src.new_zeros(1, k)
    rows, block_k, chunks, warps = _row_blocks(k)
    _gather_rows_kernel[(triton.cdiv(p, rows),)](
        src, index, q, inv, t, p, k, src.stride(0), q.stride(0), inv.stride(0),
        inv if weight is None else weight, q if rows_out is None else rows_out,
        ROWS=rows, BLOCK_K=block_k, CHUNKS=chunks, HAS_W=weight is not None, STORE_ROWS=keep_rows,
        num_warps=warps, **_KW)
    return (q, inv) if weight is None and not keep_rows else (q, inv, rows_out)


#: (token rows per program, warps) of :func:`scatter_quantize_rows` for every row width, overriding
#: :func:`_scatter_tile`: a measurement hook (``benchmarks/experiments/scatter_rows/layer.py`` sets it; ``(0, 0)``:
#: ``_row_blocks``'s tile, the one before session 27). Any tile gives the same bits.
_SCATTER_TILE: tuple[int, int] | None = None


def _scatter_tile(block_k: int) -> tuple[int, int]:
    """``(ROWS, num_warps)`` of the scatter kernel for rows padded to ``block_k``: 64 elements per thread, at least
    4096 elements per program. Alone on the H100 the three scatter calls of a Qwen3-30B-A3B layer (hidden 2048) take
    1.21 ms at (2, 2) against 1.31 ms at ``_row_blocks``' (1, 4); DeepSeek-V3's cast (7168) 0.52 ms at (1, 4) against
    0.65 at (1, 8); the same bits (``benchmarks/experiments/scatter_rows/``, session 27)."""
    rows = max(1, 4096 // block_k)
    return rows, max(1, rows * block_k // 2048)


def scatter_quantize_rows(src: torch.Tensor, index: torch.Tensor, pair_rows: torch.Tensor,
                          weight: torch.Tensor | None = None, keep_rows: bool = False, cast: bool = True,
                          tile: tuple[int, int] | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None:
    """:func:`gather_quantize_rows` of ``index`` computed from the tokens' side: each row of ``src`` read once and
    stored at its ``topk`` rows ``pair_rows``, padding rows (``index == T``) zeroed by the same launch; with
    ``weight`` (one per pair) each stored row times its pair's weight (the combine's backward). The same bits as
    the gather kernel when ``index[pair_rows[i]] == i // topk`` for every pair ``i`` and ``index == T`` elsewhere
    (``routing.dispatch``'s layout; not checked). None (the caller gathers) for rows longer than one chunk.

    Args:
        src: CUDA ``(T, K)`` float tensor, unit stride along K, ``T >= 1``.
        index: CUDA ``(P,)`` contiguous int64 / int32 (``routing.Dispatch.gather_idx``).
        pair_rows: CUDA ``(T * topk,)`` contiguous int64 / int32 (``routing.Dispatch.pair_rows``).
        weight: optional CUDA ``(T * topk,)`` contiguous float, pair order (``top_k_weights.reshape(-1)``).
        keep_rows: also return the ``(P, K)`` rows in ``src``'s dtype (weighted and rounded with ``weight``).
        cast: False: only the rows (``keep_rows`` implied; ``(None, None, rows)``): the plain gather from the
            tokens' side.
        tile: ``(ROWS, num_warps)``, token rows per program (a power of two) and its warps (measurements only,
            ``benchmarks/experiments/scatter_rows/tiles.py``; default ``_SCATTER_TILE`` where set, else
            :func:`_scatter_tile`; ``(0, 0)``: ``_row_blocks``'). Any tile gives the same bits.
        out: ``(q (P, K) E4M3, inv (P,) float32)`` to write into (with ``cast``), each row of ``q`` contiguous and any
            row strides (the rowwise dispatch payload's views, as :func:`gather_quantize_rows`' ``out``); default new
            contiguous tensors. Not written when None is returned.
    """
    keep_rows = keep_rows or not cast
    t, k = src.shape
    p = index.shape[0]
    rows, block_k, chunks, warps = _row_blocks(k)
    if chunks > 1:
        return None
    tile = _SCATTER_TILE if tile is None else tile
    if tile is None:
        rows, warps = _scatter_tile(block_k)
    elif tile != (0, 0):
        if tile[0] < 1 or tile[0] & (tile[0] - 1):
            raise ValueError(f"scatter_quantize_rows: tile rows must be a power of two, got {tile}")
        rows, warps = tile
    if out is not None and cast:
        q, inv = out
    else:
        q = torch.empty(p if cast else 0, k, dtype=FP8, device=src.device)
        inv = torch.empty(p if cast else 0, dtype=torch.float32, device=src.device)
    rows_out = torch.empty(p, k, dtype=src.dtype, device=src.device) if keep_rows else None
    token_programs, pad_rows = triton.cdiv(t, rows), 64
    _scatter_rows_kernel[(token_programs + triton.cdiv(p, pad_rows),)](
        src, pair_rows, index, q, inv, q if rows_out is None else rows_out, inv if weight is None else weight,
        t, p, k, src.stride(0), q.stride(0), inv.stride(0) if cast else 1, token_programs,
        TOPK=pair_rows.shape[0] // t, ROWS=rows, BLOCK_K=block_k, PAD_ROWS=pad_rows, HAS_W=weight is not None,
        STORE_ROWS=keep_rows, CAST=cast, num_warps=warps, **_KW)
    return (q, inv, rows_out) if cast else (None, None, rows_out)


def swiglu_quantize_rows(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`fp8kit.moe.rowwise_quant.swiglu_quantize_rows_ref` (same bits).

    Args:
        h: CUDA ``(P, 2I)`` float tensor, unit stride along the last dim.
        interleaved: gate / up in even / odd columns instead of halves.
    """
    p, i = h.shape[0], h.shape[1] // 2
    a = torch.empty(p, i, dtype=h.dtype, device=h.device)
    q = torch.empty(p, i, dtype=FP8, device=h.device)
    inv = torch.empty(p, dtype=torch.float32, device=h.device)
    rows, block_k, chunks, warps = _row_blocks(i, _MAX_SWIGLU_BLOCK)
    _swiglu_rows_kernel[(triton.cdiv(p, rows),)](
        h, a, q, inv, p, i, h.stride(0),
        INTERLEAVED=interleaved, ROWS=rows, BLOCK_K=block_k, CHUNKS=chunks, num_warps=warps,
        enable_fp_fusion=False, **_KW)
    return a, q, inv


def swiglu_backward_quantize_rows(h: torch.Tensor, da: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`fp8kit.moe.rowwise_quant.swiglu_backward_quantize_rows_ref`: ``(dh (P, 2I) h.dtype,
    q (P, 2I) E4M3, inv (P,) float32)``; ``dh`` within a bf16 ulp of the reference's (the hardware's sigmoid),
    ``(q, inv)`` exactly ``quantize_rows(dh)`` of the ``dh`` written.

    Args:
        h: CUDA ``(P, 2I)`` float tensor (gate half, up half), unit stride along the last dim.
        da: CUDA ``(P, I)`` float tensor, unit stride along the last dim.
    """
    p, i = h.shape[0], h.shape[1] // 2
    dh = torch.empty(p, 2 * i, dtype=h.dtype, device=h.device)
    q = torch.empty(p, 2 * i, dtype=FP8, device=h.device)
    inv = torch.empty(p, dtype=torch.float32, device=h.device)
    rows, block_k, chunks, warps = _row_blocks(i)
    _swiglu_bwd_rows_kernel[(triton.cdiv(p, rows),)](
        h, da, dh, q, inv, p, i, h.stride(0), da.stride(0),
        ROWS=rows, BLOCK_K=block_k, CHUNKS=chunks, num_warps=warps, **_KW)
    return dh, q, inv


# --------------------------------------------------------------------------- group columns (wgrad operands)

@triton.jit
def _group_rows(x_ptr, idx_ptr, w_ptr, offs_p, end, cols, cmask, T, stride_x,
                GATHER: tl.constexpr, HAS_W: tl.constexpr):
    in_group = offs_p < end
    pmask = in_group
    if GATHER:
        src_row = tl.load(idx_ptr + offs_p, mask=pmask, other=0).to(tl.int64)
        pmask = pmask & (src_row < T)
    else:
        src_row = offs_p.to(tl.int64)
    x = tl.load(x_ptr + src_row[:, None] * stride_x + cols[None, :], mask=pmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    if HAS_W:
        x = _weighted(x, tl.load(w_ptr + offs_p, mask=in_group, other=0.0).to(tl.float32), x_ptr.dtype.element_ty)
    return x


@triton.jit
def _group_cols_block(
    x_ptr, idx_ptr, w_ptr, offs_ptr, data_ptr, inv_ptr, pid_g, pid_c, T, P, C, E, stride_x,
    GATHER: tl.constexpr, HAS_W: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    # Group pid_g's rows [start, end) (group E: the rows past offs[-1]), columns [pid_c * BC, + BC).
    start = tl.minimum(tl.load(offs_ptr + pid_g - 1, mask=pid_g > 0, other=0), P)
    end = tl.minimum(tl.load(offs_ptr + pid_g, mask=pid_g < E, other=P), P)
    cols = (pid_c * BC + tl.arange(0, BC)).to(tl.int64)
    cmask = cols < C
    amax = tl.zeros((BC,), tl.float32)
    for r in range(start, end, BR):
        x = _group_rows(x_ptr, idx_ptr, w_ptr, r + tl.arange(0, BR), end, cols, cmask, T, stride_x, GATHER, HAS_W)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=0))
    scale = _pow2_scale(amax, EPS, AMAX_MAX, FP8_MAX)
    tl.store(inv_ptr + pid_g * C + cols, _inv(scale), mask=cmask & (pid_g < E))
    for r in range(start, end, BR):
        offs_p = r + tl.arange(0, BR)
        x = _group_rows(x_ptr, idx_ptr, w_ptr, offs_p, end, cols, cmask, T, stride_x, GATHER, HAS_W)
        q = tl.trans(_cast(x, scale[None, :], FP8_MAX))  # (BC, BR): data[c, p], p contiguous
        tl.store(data_ptr + cols[:, None] * P + offs_p[None, :], q, mask=cmask[:, None] & (offs_p < end)[None, :])


@triton.jit
def _group_cols_kernel(
    x_ptr, idx_ptr, offs_ptr, data_ptr, inv_ptr, T, P, C, E, stride_x,
    GATHER: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    _group_cols_block(x_ptr, idx_ptr, x_ptr, offs_ptr, data_ptr, inv_ptr, tl.program_id(0), tl.program_id(1),
                      T, P, C, E, stride_x, GATHER, False, BR, BC, EPS, AMAX_MAX, FP8_MAX)


@triton.jit
def _group_cols_dual_kernel(
    g_ptr, g_idx_ptr, g_w_ptr, g_data_ptr, g_inv_ptr, N, stride_g, TG,
    x_ptr, idx_ptr, x_data_ptr, x_inv_ptr, K, stride_x, T,
    offs_ptr, P, E, NB_G,
    G_GATHER: tl.constexpr, GATHER: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    # Column blocks [0, NB_G) are g's, the rest x's. G_GATHER: g's rows read through g_idx and weighted by g_w.
    pid_g = tl.program_id(0)
    pid_c = tl.program_id(1)
    if pid_c < NB_G:
        _group_cols_block(g_ptr, g_idx_ptr, g_w_ptr, offs_ptr, g_data_ptr, g_inv_ptr, pid_g, pid_c, TG, P, N, E,
                          stride_g, G_GATHER, G_GATHER, BR, BC, EPS, AMAX_MAX, FP8_MAX)
    else:
        _group_cols_block(x_ptr, idx_ptr, x_ptr, offs_ptr, x_data_ptr, x_inv_ptr, pid_g, pid_c - NB_G, T, P, K, E,
                          stride_x, GATHER, False, BR, BC, EPS, AMAX_MAX, FP8_MAX)


#: 256-row slices of 64 columns, 4 warps: the fastest of 20 tile shapes and 9 persistent launches at the Qwen3-30B-A3B,
#: DeepSeek-V3 and Mixtral-8x7B expert shapes on the H100, 14-21% faster than 64 x 64 (same bits;
#: ``benchmarks/experiments/group_cols/``). A taller slice has more bytes in flight per program.
_BR, _BC, _GROUP_WARPS = 256, 64, 4


def _group_out(like: torch.Tensor, p: int, c: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(c, p, dtype=FP8, device=like.device),
            torch.empty(e * c, dtype=torch.float32, device=like.device))


def quantize_group_cols(
    x: torch.Tensor, offs: torch.Tensor, index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`fp8kit.moe.rowwise_quant.quantize_group_cols_ref`: ``(data (C, P) row-major,
    inv_scale (E*C,))``; the caller views ``data`` as it needs (``.t()`` for the right operand).

    Args:
        x: CUDA ``(P, C)`` (``(T, C)`` with ``index``) float tensor, unit stride along C.
        offs: CUDA ``(E,)`` contiguous int32 / int64 cumulative group ends (sorted; unchecked).
        index: None, or CUDA ``(P,)`` contiguous int64 / int32 row of ``x`` per row, ``T`` = zero row.
    """
    rows, c = x.shape
    p = rows if index is None else index.shape[0]
    e = offs.shape[0]
    data, inv = _group_out(x, p, c, e)
    x, t = _gather_source(x)
    _group_cols_kernel[(e + 1, triton.cdiv(c, _BC))](
        x, x if index is None else index, offs, data, inv, t, p, c, e, x.stride(0),
        GATHER=index is not None, BR=_BR, BC=_BC, num_warps=_GROUP_WARPS, **_KW)
    return data, inv


def quantize_group_cols_dual(
    g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, index_x: torch.Tensor | None,
    index_g: torch.Tensor | None = None, weight_g: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Both wgrad operands in one launch: ``(g_data (N, P), g_inv (E*N,), x_data (K, P), x_inv (E*K,))``, row-major
    ``(C, P)`` buffers as :func:`quantize_group_cols` returns them. ``g``: CUDA ``(P, N)``, or ``(T_g, N)`` read
    through ``index_g (P,)`` with each row multiplied by ``weight_g (P,)`` (float32 product rounded to ``g``'s dtype:
    the combine's backward, never written); ``x``: ``(P, K)``, or ``(T, K)`` read through ``index_x``."""
    n = g.shape[1]
    p = g.shape[0] if index_g is None else index_g.shape[0]
    k = x.shape[1]
    e = offs.shape[0]
    g_data, g_inv = _group_out(g, p, n, e)
    x_data, x_inv = _group_out(x, p, k, e)
    nb_g, nb_x = triton.cdiv(n, _BC), triton.cdiv(k, _BC)
    x, t = _gather_source(x)
    g, tg = _gather_source(g)
    _group_cols_dual_kernel[(e + 1, nb_g + nb_x)](
        g, g if index_g is None else index_g, g if weight_g is None else weight_g, g_data, g_inv, n, g.stride(0), tg,
        x, x if index_x is None else index_x, x_data, x_inv, k, x.stride(0), t,
        offs, p, e, nb_g,
        G_GATHER=index_g is not None, GATHER=index_x is not None, BR=_BR, BC=_BC, num_warps=_GROUP_WARPS, **_KW)
    return g_data, g_inv, x_data, x_inv


def _gather_source(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(x, T)``; a zero-row ``x`` gets one real row to point at (every index is then the zero row, T = 0)."""
    if x.shape[0] == 0:
        return x.new_zeros(1, x.shape[1]), 0
    return x, x.shape[0]


# --------------------------------------------------------------------------- expert weights (both right operands)

@triton.jit
def _experts_amax_kernel(
    w_ptr, row_amax_ptr, col_amax_ptr, fprop_inv_ptr, N, K, stride_e, stride_n,
    BN: tl.constexpr, BK: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    e = tl.program_id(0)
    offs_n = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    nmask = offs_n < N
    base = w_ptr + e.to(tl.int64) * stride_e + offs_n[:, None] * stride_n
    row_amax = tl.zeros((BN,), tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < K
        a = tl.abs(tl.load(base + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32))
        row_amax = tl.maximum(row_amax, tl.max(a, axis=1))
        tl.atomic_max(col_amax_ptr + e * K + offs_k, tl.max(a, axis=0), mask=kmask)
    tl.store(row_amax_ptr + e * N + offs_n, row_amax, mask=nmask)
    tl.store(fprop_inv_ptr + e * N + offs_n, _inv(_pow2_scale(row_amax, EPS, AMAX_MAX, FP8_MAX)), mask=nmask)


@triton.jit
def _experts_cast_kernel(
    w_ptr, row_amax_ptr, col_amax_ptr, fprop_ptr, dgrad_ptr, dgrad_inv_ptr, N, K, stride_e, stride_n,
    BN: tl.constexpr, BK: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    e = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    offs_k = (tl.program_id(2) * BK + tl.arange(0, BK)).to(tl.int64)
    nmask = offs_n < N
    kmask = offs_k < K
    mask = nmask[:, None] & kmask[None, :]
    w = tl.load(w_ptr + e.to(tl.int64) * stride_e + offs_n[:, None] * stride_n + offs_k[None, :], mask=mask,
                other=0.0).to(tl.float32)
    row_scale = _pow2_scale(tl.load(row_amax_ptr + e * N + offs_n, mask=nmask, other=0.0), EPS, AMAX_MAX, FP8_MAX)
    col_scale = _pow2_scale(tl.load(col_amax_ptr + e * K + offs_k, mask=kmask, other=0.0), EPS, AMAX_MAX, FP8_MAX)
    out = e.to(tl.int64) * N * K
    tl.store(fprop_ptr + out + offs_n[:, None] * K + offs_k[None, :], _cast(w, row_scale[:, None], FP8_MAX), mask=mask)
    dq = tl.trans(_cast(w, col_scale[None, :], FP8_MAX))  # (BK, BN): dgrad[e, k, n] row-major, n contiguous
    tl.store(dgrad_ptr + out + offs_k[:, None] * N + offs_n[None, :], dq, mask=kmask[:, None] & nmask[None, :])
    tl.store(dgrad_inv_ptr + e * K + offs_k, _inv(col_scale), mask=kmask & (pid_n == 0))


_BN, _BK, _EXPERT_WARPS = 64, 128, 8
#: The amax kernel's tile (rows x columns per step) and warps. Taller tiles mean fewer column atomics (one per column
#: per BN rows): (256, 64, 4) reads the weights at 2.3-2.7 TB/s where (64, 128, 8) read them at 1.3-1.4 (H100, Qwen3 /
#: DeepSeek-V3 / Mixtral expert shapes, the same bits; docs/benchmarks.md section 4, session 16).
_AMAX_BN, _AMAX_BK, _AMAX_WARPS = 256, 64, 4


def quantize_experts_dual(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`fp8kit.moe.rowwise_quant.quantize_experts_dual_ref`: ``(fprop (E, N, K) row-major,
    fprop_inv (E, N), dgrad (E, K, N) row-major, dgrad_inv (E, K))``; the caller takes the transposed views.

    Args:
        w: CUDA ``(E, N, K)`` float tensor, unit stride along K.
    """
    e, n, k = w.shape
    dev = w.device
    fprop = torch.empty(e, n, k, dtype=FP8, device=dev)
    dgrad = torch.empty(e, k, n, dtype=FP8, device=dev)
    fprop_inv = torch.empty(e, n, dtype=torch.float32, device=dev)
    dgrad_inv = torch.empty(e, k, dtype=torch.float32, device=dev)
    row_amax = torch.empty(e, n, dtype=torch.float32, device=dev)
    col_amax = torch.zeros(e, k, dtype=torch.float32, device=dev)
    _experts_amax_kernel[(e, triton.cdiv(n, _AMAX_BN))](w, row_amax, col_amax, fprop_inv, n, k, w.stride(0),
                                                         w.stride(1), BN=_AMAX_BN, BK=_AMAX_BK, num_warps=_AMAX_WARPS,
                                                         **_KW)
    _experts_cast_kernel[(e, triton.cdiv(n, _BN), triton.cdiv(k, _BK))](
        w, row_amax, col_amax, fprop, dgrad, dgrad_inv, n, k, w.stride(0), w.stride(1),
        BN=_BN, BK=_BK, num_warps=_EXPERT_WARPS, **_KW)
    return fprop, fprop_inv, dgrad, dgrad_inv
