"""Experiment: every transposed FP8 copy of the delayed recipe made by an opaque Triton transpose of the row-major
FP8 copy, instead of inside the Inductor kernel that makes the operand (which writes it column by column from a
row-reduction kernel). Imported by ``sitecustomize.py`` when ``EXP_FP8_T=1``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import fp8kit.fp8.delayed as delayed


@triton.autotune(configs=[triton.Config({"BM": bm, "BN": bn}, num_warps=w)
                          for bm, bn, w in ((64, 64, 4), (128, 128, 8), (128, 64, 4), (64, 128, 4), (128, 128, 4))],
                 key=["M", "N"])
@triton.jit
def _t_kernel(x_ptr, y_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    rows = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    cols = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask)
    tl.store(y_ptr + cols[:, None] * M + rows[None, :], tl.trans(x), mask=tl.trans(mask))


@torch.library.custom_op("fp8exp::transpose", mutates_args=())
def fp8_t(q: torch.Tensor) -> torch.Tensor:
    q = q.contiguous()
    m, n = q.shape
    out = torch.empty(n, m, dtype=q.dtype, device=q.device)
    if q.numel():
        grid = lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]))  # noqa: E731
        _t_kernel[grid](q.view(torch.uint8), out.view(torch.uint8), m, n)
    return out


@fp8_t.register_fake
def _(q):
    return q.new_empty(q.shape[1], q.shape[0])


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return fp8_t(t).t()


def _recast_col_major(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # the cast from x.T (no CSE with the forward's), laid out row-major, then the opaque transpose
    return fp8_t(delayed._cast_impl(x.t(), scale, delayed.E4M3)[0].t().contiguous()).t()


delayed._col_major = _col_major
delayed._recast_col_major = _recast_col_major
print("fp8_transpose_op experiment: delayed recipe's transposed FP8 copies through fp8exp::transpose", flush=True)
