"""Token dispatch for grouped-GEMM experts: sort (token, expert) pairs by expert into 16-row-aligned groups.

The FP8 grouped GEMM needs every expert's group to start on a multiple of 16 rows (its wgrad GEMM
groups along K). Instead of a separate pad step, the padding is folded into the gather that sorts the
tokens by expert anyway, so the pad costs nothing extra (torchao's option
``pad_token_groups_for_grouped_mm`` pads in a step of its own). Padding rows read an appended zero row,
so they add nothing to any gradient.

Shapes are static (no device-to-host sync, so it compiles and captures): with ``S = tokens x topk``
pairs and ``E`` experts, the padded buffer has ``P = round_up(S + E * 15, 16)`` rows, enough for any
routing; rows past the last group (``offs[-1]``) are never computed or read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8kit.base.cuda_compile import compiled_on_cuda
from fp8kit.moe.grouped_mm import ALIGN


@dataclass(frozen=True)
class Dispatch:
    """Where each (token, expert) pair goes in the padded, expert-sorted buffer.

    Attributes:
        gather_idx: (P,) int64 source row of each padded row (``num_tokens`` = the zero row).
        pair_rows: (S,) int64 padded row of each pair, pairs in ``top_k_index.reshape(-1)`` order.
        offs: (E,) int32 cumulative end row of each expert's group (the grouped GEMM's ``offs``).
        tokens_per_expert: (E,) int64 pairs routed to each expert (before padding).
    """

    gather_idx: torch.Tensor
    pair_rows: torch.Tensor
    offs: torch.Tensor
    tokens_per_expert: torch.Tensor

    @property
    def rows(self) -> int:
        return self.gather_idx.shape[0]


def padded_rows(num_pairs: int, num_experts: int, align: int = ALIGN) -> int:
    """``P``: rows of the padded buffer for ``num_pairs`` pairs over ``num_experts`` experts."""
    return -(-(num_pairs + num_experts * (align - 1)) // align) * align


def bucketed_rows(num_pairs: int, num_experts: int, scale: int, align: int = ALIGN) -> int:
    """``P`` for a pair count that changes from step to step (expert parallelism: the rows a rank receives),
    rounded up to a multiple of ``max(256, next_pow2(scale) / 8)`` so that only a few distinct shapes occur.

    Fewer distinct shapes for torch.compile and the caching allocator (torchao's token-keyed autotuning
    is handled by ``grouped_mm.tune_once_for_all_row_counts``); ``scale`` is the typical pair count (e.g.
    this rank's own ``tokens x topk``).
    """
    step = max(256, (1 << max(scale - 1, 1).bit_length()) // 8)
    return -(-padded_rows(num_pairs, num_experts, align) // step) * step


def dispatch(top_k_index: torch.Tensor, num_experts: int, align: int = ALIGN, rows: int | None = None) -> Dispatch:
    """Plan the expert-sorted, padded layout for a router's choices.

    Args:
        top_k_index: (T, topk) integer expert ids in ``[0, num_experts)``.
        num_experts: E.
        align: group alignment in rows (16 for FP8).
        rows: ``P`` to use instead of :func:`padded_rows` (at least that; see :func:`bucketed_rows`).

    Returns:
        A :class:`Dispatch`. Pairs of one expert keep their token order (stable sort).
    """
    num_tokens = top_k_index.shape[0]
    topk = top_k_index.shape[1] if top_k_index.dim() == 2 else 1
    ids = top_k_index.reshape(-1).long()
    s = ids.numel()
    dev = ids.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + align - 1) // align * align
    ends = padded.cumsum(0)
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    rank = torch.arange(s, device=dev) - (counts.cumsum(0) - counts)[sorted_ids]
    dest = (ends - padded)[sorted_ids] + rank
    pair_rows = torch.empty_like(dest).scatter_(0, order, dest)
    p = padded_rows(s, num_experts, align)
    if rows is not None:
        if rows < p:
            raise ValueError(f"dispatch: rows = {rows} is below the {p} rows {s} pairs over {num_experts} experts may need")
        p = rows
    gather_idx = torch.full((p,), num_tokens, dtype=torch.long, device=dev).scatter_(0, dest, order // topk)
    return Dispatch(gather_idx, pair_rows, ends.to(torch.int32), counts)


class _GatherRows(torch.autograd.Function):
    """``hidden[gather_idx]`` with a zero row for padding; backward as a gather, not a scatter.

    The gradient of token ``t`` is the sum of the gradients of its ``topk`` padded rows,
    ``dx[pair_rows].view(T, topk, H).sum(1)``: a gather and a reduction over topk (deterministic, no
    atomics). Autograd's own backward of ``x[idx]`` is an accumulating ``index_put`` that sorts the indices
    first (``indexing_backward_kernel``: 7 ms of a 85 ms DeepSeek-V3 expert layer on the H100,
    ``benchmarks/moe_layer.py``).
    """

    @staticmethod
    def forward(ctx, hidden, gather_idx, pair_rows):
        ctx.save_for_backward(pair_rows)
        ctx.tokens = hidden.shape[0]
        return gather_rows(hidden, gather_idx)

    @staticmethod
    def backward(ctx, grad_rows):
        (pair_rows,) = ctx.saved_tensors
        return sum_token_rows(grad_rows, pair_rows, ctx.tokens, grad_rows.dtype), None, None


@compiled_on_cuda
def gather_rows(hidden: torch.Tensor, gather_idx: torch.Tensor) -> torch.Tensor:
    """``(T, H) -> (P, H)``: the tokens in expert order; index ``T`` (padding) reads a zero row. Not differentiable
    by itself (:func:`gather` is). One kernel on CUDA (``base.cuda_compile``)."""
    return torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])[gather_idx]


def sum_token_rows(rows: torch.Tensor, pair_rows: torch.Tensor, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """(P, H) per-row values -> (T, H): each token's ``topk`` rows (``pair_rows``, pairs in token-major order)
    summed in at least float32, cast to ``dtype``. The gradient of the dispatch gather, as a gather (one kernel on
    CUDA). ``topk`` is computed here, on the host, and reaches the compiled kernel as a constant: when the token
    count changes between calls (expert parallelism, variable batches) only the row count becomes dynamic, and the
    reduction over ``topk`` stays unrolled (derived inside, it was symbolic too: 1.5x slower,
    ``benchmarks/routing_dynamic.py``)."""
    return _sum_topk_rows(rows, pair_rows, max(1, pair_rows.numel() // max(tokens, 1)), dtype)


@compiled_on_cuda
def _sum_topk_rows(rows: torch.Tensor, pair_rows: torch.Tensor, topk: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`sum_token_rows` with ``topk`` given: the rows of each token's pairs added one ``k`` after the other
    (:func:`_topk_loop`)."""
    acc = torch.promote_types(rows.dtype, torch.float32)
    pairs = pair_rows.view(-1, topk)
    return _topk_loop(lambda k: rows[pairs[:, k]].to(acc), topk).to(dtype)


def _topk_loop(term: Callable[[int], torch.Tensor], topk: int) -> torch.Tensor:
    """``term(0) + term(1) + ... + term(topk - 1)``, added in that order (``topk`` a host constant).

    The routing's sums over a token's ``topk`` rows are written as this loop rather than as a reduction over a
    ``(T, topk, H)`` view: Inductor compiles the loop into one pointwise kernel whose every load is a gathered row,
    contiguous along ``H``, while the reduction became a kernel with ``topk`` as the fastest axis of its tile,
    reading 2-byte pieces of ``topk`` rows at once. On the H100, 16384 tokens, top-8: 0.71 instead of 2.34 ms at
    DeepSeek-V3's hidden size 7168 (3.0 vs 0.9 TB/s), 0.21 instead of 0.64 ms at Qwen3-30B-A3B's 2048; equal at
    Mixtral's top-2 (``benchmarks/experiments/routing_loops/``). The float32 sum is in ``k`` order on every device."""
    out = term(0)
    for k in range(1, topk):
        out = out + term(k)
    return out


@compiled_on_cuda
def combine_rows(rows: torch.Tensor, pair_rows: torch.Tensor, top_k_weights: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Forward of :func:`combine`: ``rows`` (P, H), ``pair_rows`` (S,), ``top_k_weights`` (T, topk) -> (T, H)
    ``out[t] = sum_k rows[pair_rows[t, k]] * w[t, k]`` in float32 (at least), cast to ``out_dtype``; one
    gather-multiply-reduce kernel on CUDA, no (T, topk, H) float32 temporary."""
    t, topk = top_k_weights.shape
    return weighted_sum(rows[pair_rows].view(t * topk, rows.shape[1]), top_k_weights, out_dtype)


def row_pairs(pair_rows: torch.Tensor, rows: int) -> torch.Tensor:
    """The inverse of ``pair_rows`` (S,): ``(rows,)`` int64, the pair of each padded row, ``S`` for rows no pair
    uses (padding, rows past the last group)."""
    s = pair_rows.numel()
    out = torch.full((rows,), s, dtype=torch.long, device=pair_rows.device)
    return out.scatter_(0, pair_rows, torch.arange(s, device=pair_rows.device))


@compiled_on_cuda
def combine_rows_grad(grad: torch.Tensor, top_k_weights: torch.Tensor, row_pair: torch.Tensor,
                      dtype: torch.dtype) -> torch.Tensor:
    """Gradient of :func:`combine` for its ``(P, H)`` rows: ``drows[r] = grad[t] * w[t, k]`` (float32 product, cast
    to ``dtype``) for the row ``r`` of pair ``(t, k)``, zero for padding rows. ``grad`` (T, H), ``top_k_weights``
    (T, topk), ``row_pair`` (P,) from :func:`row_pairs` (``S`` marks padding). A gather, not autograd's zero-fill
    plus ``index_copy`` of a (S, H) float32 product."""
    t, topk = top_k_weights.shape
    g = torch.cat([grad, grad.new_zeros(1, grad.shape[1])])
    w = torch.cat([top_k_weights.reshape(-1), top_k_weights.new_zeros(1)])
    return (g[torch.div(row_pair, topk, rounding_mode="floor")].float() * w[row_pair].float()[:, None]).to(dtype)


@compiled_on_cuda
def combine_row_weights(row_pair: torch.Tensor, top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`combine_rows_grad` reads for each of the ``(P,)`` rows, without reading it: ``(token (P,) int64,
    weight (P,) in top_k_weights' dtype)``, ``token = row_pair // topk`` (``T`` for padding rows: the zero row of a
    gather) and ``weight = w[t, k]`` of the row's pair (0 for padding). ``row_pair`` from :func:`row_pairs`,
    ``top_k_weights`` (T, topk). ``drows[r] = (grad[token[r]].float() * weight[r].float()).to(dtype)`` is then
    :func:`combine_rows_grad` (``rowwise_quant.dispatch_quantize_rows`` with the router weights computes it inside its cast)."""
    topk = top_k_weights.shape[1]
    w = torch.cat([top_k_weights.reshape(-1), top_k_weights.new_zeros(1)])
    return torch.div(row_pair, topk, rounding_mode="floor"), w[row_pair]


@compiled_on_cuda
def combine_weights_grad(rows: torch.Tensor, pair_rows: torch.Tensor, grad: torch.Tensor, topk: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """Gradient of :func:`combine` for the router weights: ``dw[t, k] = sum_h rows[pair_rows[t, k], h] *
    grad[t, h]`` in float32, cast to ``dtype``; ``(T, topk)``. ``topk`` is passed as a constant, so a changing token
    count makes only the row dimension dynamic (:func:`sum_token_rows`)."""
    picked = rows[pair_rows].view(-1, topk, rows.shape[1])
    return (picked.float() * grad.float()[:, None, :]).sum(dim=-1).to(dtype)


class _PairRows(torch.autograd.Function):
    """``rows[pair_rows]`` (each padded row is used by at most one pair); backward writes each pair's gradient
    into its own row (``index_copy_``, no accumulation needed) instead of autograd's sorting ``index_put``."""

    @staticmethod
    def forward(ctx, rows, pair_rows):
        ctx.save_for_backward(pair_rows)
        ctx.rows = rows.shape[0]
        return rows[pair_rows]

    @staticmethod
    def backward(ctx, grad_pairs):
        (pair_rows,) = ctx.saved_tensors
        out = grad_pairs.new_zeros(ctx.rows, grad_pairs.shape[1])
        return out.index_copy_(0, pair_rows, grad_pairs), None


class _Combine(torch.autograd.Function):
    """:func:`combine` run eagerly: gather-only kernels in both directions (``combine_rows*``, compiled on CUDA)."""

    @staticmethod
    def forward(ctx, rows, pair_rows, top_k_weights, out_dtype):
        ctx.save_for_backward(rows, pair_rows, top_k_weights)
        return combine_rows(rows, pair_rows, top_k_weights, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        rows, pair_rows, w = ctx.saved_tensors
        drows = dw = None
        if ctx.needs_input_grad[0]:
            drows = combine_rows_grad(grad, w, row_pairs(pair_rows, rows.shape[0]), rows.dtype)
        if ctx.needs_input_grad[2]:
            dw = combine_weights_grad(rows, pair_rows, grad, w.shape[1], w.dtype)
        return drows, None, dw, None


def gather(hidden: torch.Tensor, d: Dispatch) -> torch.Tensor:
    """(T, H) tokens -> (P, H) padded expert-sorted rows (padding rows are zeros). Differentiable; the gradient
    of a token is the float32 sum of its rows' gradients (``_GatherRows``)."""
    return gather_pairs(hidden, d.gather_idx, d.pair_rows)


def gather_pairs(hidden: torch.Tensor, gather_idx: torch.Tensor, pair_rows: torch.Tensor) -> torch.Tensor:
    """:func:`gather` with the index pair given directly: ``hidden[gather_idx]`` (``T`` = a zero row), differentiable,
    the gradient of token ``t`` the float32 sum of rows ``pair_rows[t * topk : (t + 1) * topk]``. Expert parallelism
    sorts its pairs by rank this way (``moe/expert_parallel.py``)."""
    return _GatherRows.apply(hidden, gather_idx, pair_rows)


def pick_rows(rows: torch.Tensor, pair_rows: torch.Tensor) -> torch.Tensor:
    """``rows[pair_rows]`` (each row picked at most once), differentiable with a gradient written row by row
    (``index_copy_``) instead of autograd's sorting, accumulating ``index_put``."""
    return _PairRows.apply(rows, pair_rows)


def combine(rows: torch.Tensor, d: Dispatch, top_k_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(P, H) expert outputs -> (T, H): each token's outputs weighted by its router weights and summed in float32
    (:func:`weighted_sum`'s formula). Differentiable in ``rows`` and ``top_k_weights``; each padded row is used by
    at most one pair, so its gradient is one product (rows no pair uses get zeros).

    Eagerly: ``_Combine`` (one compiled kernel per direction on CUDA). Traced by an outer ``torch.compile``: plain
    differentiable ops (``_PairRows`` + :func:`weighted_sum`), which Inductor fuses itself. (``_Combine`` traced
    by Dynamo on CUDA lost the gradient of the whole expert branch for float32 inputs (FP32 master weights under
    bf16 autocast): zero gradients for the experts, router and norm of a Qwen3-MoE block, H100, torch 2.11,
    2026-11-25; root cause not found; ``tests/test_moe_fused_gpu.py::test_compiled_block_gradients_equal_eager``.)
    """
    return combine_pairs(rows, d.pair_rows, top_k_weights, out_dtype)


def combine_pairs(rows: torch.Tensor, pair_rows: torch.Tensor, top_k_weights: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`combine` with the pairs' rows given directly: ``(P, H)`` rows, ``pair_rows`` (S,) the row of each
    pair in ``top_k_index.reshape(-1)`` order (each row used at most once) -> (T, H)."""
    if torch.compiler.is_compiling():
        return weighted_sum(_PairRows.apply(rows, pair_rows), top_k_weights, out_dtype)
    return _Combine.apply(rows, pair_rows, top_k_weights, out_dtype)


def weighted_sum(pair_rows: torch.Tensor, top_k_weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(S, H) outputs of the pairs in ``top_k_index.reshape(-1)`` order -> (T, H): weighted by the router
    weights (T, topk) and summed over the topk experts in float32 (as transformers' grouped_mm experts do), in ``k``
    order (:func:`_topk_loop`)."""
    t, topk = top_k_weights.shape
    picked = pair_rows.view(t, topk, pair_rows.shape[1])
    w = top_k_weights.float()
    return _topk_loop(lambda k: picked[:, k].float() * w[:, k, None], topk).to(out_dtype)
