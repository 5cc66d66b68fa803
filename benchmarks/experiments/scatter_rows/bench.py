"""Experiment: the dispatch's gather + rowwise cast (and the combine backward's weighted one) as a *scatter* over
tokens: each token row read once, cast, and stored at its top-k rows, instead of each of the P rows read through
the gather index (every token read top-k times). Padding rows are zeroed by the same launch's tail programs.

Prints device ms (CUDA graphs, ``graph_timing.timed``) of the current gather kernel and the scatter kernel at
Qwen3-30B-A3B / DeepSeek-V3 / Mixtral token shapes, and whether they give the same bits.

    python benchmarks/experiments/scatter_rows/bench.py [model prefixes, comma-separated]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graph_timing import same_bits, timed  # noqa: E402

from fp8kit.moe import rowwise_quant_triton as K  # noqa: E402
from fp8kit.moe.routing import combine_row_weights, dispatch, row_pairs  # noqa: E402


@triton.jit
def _scatter_rows_kernel(
    src_ptr, pair_rows_ptr, idx_ptr, q_ptr, inv_ptr, rows_ptr, w_ptr, T, P, K_, stride_src, stride_q, stride_inv,
    zero_inv, TOKEN_PROGRAMS,
    TOPK: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PAD_ROWS: tl.constexpr,
    HAS_W: tl.constexpr, STORE_ROWS: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    cmask = cols < K_
    if pid < TOKEN_PROGRAMS:
        offs_t = pid * ROWS + tl.arange(0, ROWS)
        tmask = offs_t < T
        mask = tmask[:, None] & cmask[None, :]
        x = tl.load(src_ptr + offs_t.to(tl.int64)[:, None] * stride_src + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        if not HAS_W:
            scale = K._pow2_scale(tl.max(tl.abs(x), axis=1), EPS, AMAX_MAX, FP8_MAX)
            q = K._cast(x, scale[:, None], FP8_MAX)
            inv = K._inv(scale)
        for j in tl.static_range(TOPK):
            p = tl.load(pair_rows_ptr + offs_t * TOPK + j, mask=tmask, other=0).to(tl.int64)
            if HAS_W:
                w = tl.load(w_ptr + offs_t * TOPK + j, mask=tmask, other=0.0).to(tl.float32)
                xw = K._weighted(x, w, src_ptr.dtype.element_ty)
                scale = K._pow2_scale(tl.max(tl.abs(xw), axis=1), EPS, AMAX_MAX, FP8_MAX)
                q = K._cast(xw, scale[:, None], FP8_MAX)
                inv = K._inv(scale)
                if STORE_ROWS:
                    tl.store(rows_ptr + p[:, None] * K_ + cols[None, :], xw.to(rows_ptr.dtype.element_ty), mask=mask)
            elif STORE_ROWS:
                tl.store(rows_ptr + p[:, None] * K_ + cols[None, :], x.to(rows_ptr.dtype.element_ty), mask=mask)
            tl.store(q_ptr + p[:, None] * stride_q + cols[None, :], q, mask=mask)
            tl.store(inv_ptr + p * stride_inv, inv, mask=tmask)
    else:  # padding rows (index T): zeros, and the inv_scale of an all-zero row
        offs_p = (pid - TOKEN_PROGRAMS) * PAD_ROWS + tl.arange(0, PAD_ROWS)
        pm = offs_p < P
        idx = tl.load(idx_ptr + offs_p, mask=pm, other=0)
        pad = pm & (idx >= T)
        prow = offs_p.to(tl.int64)
        for c in range(0, K_, BLOCK_K):
            cc = c + cols
            m = pad[:, None] & (cc < K_)[None, :]
            tl.store(q_ptr + prow[:, None] * stride_q + cc[None, :], tl.zeros((PAD_ROWS, BLOCK_K), tl.float32).to(tl.float8e4nv), mask=m)
            if STORE_ROWS:
                tl.store(rows_ptr + prow[:, None] * K_ + cc[None, :],
                         tl.zeros((PAD_ROWS, BLOCK_K), rows_ptr.dtype.element_ty), mask=m)
        tl.store(inv_ptr + prow * stride_inv, tl.zeros((PAD_ROWS,), tl.float32) + zero_inv, mask=pad)


def scatter_quantize_rows(src, pair_rows, gather_idx, topk, weight=None, keep_rows=False, rows_per=None, warps=None):
    t, k = src.shape
    p = gather_idx.shape[0]
    q = torch.empty(p, k, dtype=K.FP8, device=src.device)
    inv = torch.empty(p, dtype=torch.float32, device=src.device)
    rows_out = torch.empty(p, k, dtype=src.dtype, device=src.device) if keep_rows else None
    r, block_k, chunks, w = K._row_blocks(k)
    assert chunks == 1
    r = rows_per or r
    w = warps or w
    zero_inv = float(_zero_inv())
    tp = triton.cdiv(t, r)
    pad_rows = 64
    grid = (tp + triton.cdiv(p, pad_rows),)
    _scatter_rows_kernel[grid](
        src, pair_rows, gather_idx, q, inv, q if rows_out is None else rows_out, inv if weight is None else weight,
        t, p, k, src.stride(0), q.stride(0), inv.stride(0), zero_inv, tp,
        TOPK=topk, ROWS=r, BLOCK_K=block_k, PAD_ROWS=pad_rows, HAS_W=weight is not None, STORE_ROWS=keep_rows,
        num_warps=w, **K._KW)
    return (q, inv) if weight is None and not keep_rows else (q, inv, rows_out)


_ZI = None


def _zero_inv():
    global _ZI
    if _ZI is None:
        z = torch.zeros(1, 16, device="cuda", dtype=torch.bfloat16)
        _ZI = K.gather_quantize_rows(z, torch.zeros(1, dtype=torch.long, device="cuda"))[1].item()
    return _ZI


def main() -> int:
    torch.manual_seed(0)
    shapes = {"qwen3-30b-a3b": (16384, 2048, 128, 8), "deepseek-v3": (16384, 7168, 128, 8),
              "mixtral-8x7b": (16384, 4096, 8, 2), "qwen1.5-moe-a2.7b (top-4)": (16384, 2048, 60, 4)}
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    print("| model | op | gather ms | scatter ms | ratio | same bits |")
    print("|---|---|---|---|---|---|")
    for name, (t, h, e, topk) in shapes.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        src = torch.randn(t, h, device="cuda", dtype=torch.bfloat16) * torch.rand(t, 1, device="cuda") * 4
        logits = torch.randn(t, e, device="cuda")
        w, ids = logits.softmax(-1).topk(topk, dim=-1)
        d = dispatch(ids, e)
        pr = d.pair_rows.contiguous()
        for op in ("gather", "gather+rows", "weighted", "weighted+rows"):
            weighted, keep = op.startswith("weighted"), op.endswith("+rows")
            if weighted:
                token, w_row = combine_row_weights(row_pairs(d.pair_rows, d.rows), w)
                old = lambda: K.gather_quantize_rows(src, token, weight=w_row, keep_rows=keep)  # noqa: E731,B023
                wp = w.reshape(-1).contiguous()
                new = lambda: scatter_quantize_rows(src, pr, d.gather_idx, topk, weight=wp, keep_rows=keep)  # noqa
            else:
                old = lambda: K.gather_quantize_rows(src, d.gather_idx, keep_rows=keep)  # noqa: E731,B023
                new = lambda: scatter_quantize_rows(src, pr, d.gather_idx, topk, keep_rows=keep)  # noqa: E731,B023
            a, b = old(), new()
            ok = same_bits(tuple(x for x in a if x is not None), tuple(x for x in b if x is not None))
            to, tn = timed(old), timed(new)
            print(f"| {name} | {op} | {to:.3f} | {tn:.3f} | {to / tn:.2f}x | {ok} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
