"""The whole gated expert MLP in rowwise FP8 as one autograd Function, quantization fused into the token path
(the ``fused`` grouped kernel).

``out[rows of e] = (silu(x W_up_gate[e]^T) * (x W_up_up[e]^T)) W_down[e]^T`` for the expert-sorted rows ``x``
of the tokens (``routing.Dispatch``), with every GEMM a ``torch._scaled_grouped_mm`` on rowwise E4M3 operands
(the recipe of ``moe/quantize.py``, power-of-two scales), and every cast done by a fused Triton kernel of
``moe/rowwise_quant.py`` that reads its input once and never writes a bf16 intermediate it does not need:

============================  ===========================================================  ============
step                          kernel                                                       replaces
============================  ===========================================================  ============
dispatch + x cast             ``dispatch_quantize_rows(hidden, gather_idx, pair_rows)``:   gather, cast
                              FP8 x in expert order, the bf16 permuted copy never exists;
                              from top-2 each token is read once and stored at its rows
weights, fprop + dgrad        ``quantize_experts_dual(W)`` once per weight version (cached  two casts
                              across micro-batches); the dgrad copy serves the backward;
                              with the previous step's scales as hints, one read of ``W``
SwiGLU + down's input cast    ``swiglu_quantize_rows(h)``: ``a`` (kept for the backward)   act, cast
                              and its FP8 copy from one read of ``h``
SwiGLU backward + dh cast     ``swiglu_backward_quantize_rows(h, da)``: ``dh`` and its      act bwd, cast
                              rowwise copy from one read of ``h`` and ``da``
down wgrad operands           ``quantize_group_cols_dual(dy, a)``: per-(expert, column)    scatter amax
                              scales without a scatter, both operands in one launch
up wgrad operands             ``quantize_group_cols_dual(dh, hidden, index_x=gather_idx)``  gather, scatter
                              reads the tokens through the dispatch index again
token gradient                ``dx[pair_rows]`` summed over the top-k (a gather)           index_put
combine + its backward        with ``top_k_weights``: the combine in the forward, and the  gather-mul
                              output gradient's dgrad and wgrad casts read the ``(T, H)``  write + read
                              gradient through the pairs, each row times its router
                              weight (``dispatch_quantize_rows(weight=)``, the ``g`` of
                              ``quantize_group_cols_dual``): ``dy (P, H)`` never exists
============================  ===========================================================  ============

``dy`` is cast by ``gather_quantize_rows`` with the identity index when the combine is not fused (expert parallelism
combines after the return all-to-all, so its experts get ``dy`` rows; float32 tokens).

Under expert parallelism with FP8 dispatch (``received=``, ``moe/fp8_dispatch.rowwise_dispatch``) the tokens arrive
already cast by the same kernel on the sending rank: the dispatch + x cast step becomes a gather of their E4M3
bytes and scales (``rowwise_payload.payload_rows``, the same bits), and the gate_up wgrad reads the received tokens
dequantized (exact in bf16: power-of-two scales).

With ``wgrad="bf16"`` (torchao's ``rowwise_with_gw_hp`` recipe: fprop and dgrad in FP8, wgrad in high precision)
both weight gradients are ``torch._grouped_mm`` on the bf16 operands instead: no per-(expert, column) casts of
``dy, a, dh, x`` (the two ``quantize_group_cols_dual`` launches) for a bf16 wgrad GEMM. ``gate_up_proj``'s wgrad reads the tokens in
expert order: gathered once more in the backward (``dispatch_rows``: from top-2 each token read once), or (``keep_rows``, ``fp8.grouped_wgrad_input``) written by the
dispatch's read beside their FP8 copy (``dispatch_quantize_rows(keep_rows=True)``) and saved: ``(P, H)`` bf16 more per layer
(0.5 GiB at Qwen3-30B-A3B with 16K tokens) for 0.14 ms per layer on the H100. Under expert-parallel FP8 dispatch
the received rows are dequantized in the backward instead. Where the experts are small (Qwen3-30B-A3B: 768 wide) those casts
cost more than the FP8 wgrad GEMM saves (``benchmarks/moe_layer.py``, docs/benchmarks.md section 4).
The SwiGLU backward and the rowwise cast of its output are one kernel (``swiglu_backward_quantize_rows``).

Numerics equal the unfused rowwise path (``moe/grouped_mm.fp8_grouped_mm`` with the ``scaled_grouped_mm`` /
``emulated`` kernels) up to the order of the float32 top-k sum of the token gradient, since every cast is
the same function bit for bit (the GPU tests of ``rowwise_quant`` check it); on the CPU the casts run their
PyTorch references and the GEMMs the float32 emulation, which CI tests.

Applies to gated SiLU experts whose gate and up halves are concatenated (transformers' ``act_fn`` path:
Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3), with both weights in FP8; anything else runs the unfused path
(``moe/experts.py`` decides). Rows past the last group are never read downstream (as in the unfused path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp8kit.moe import rowwise_quant as rq
from fp8kit.moe.grouped_mm import resolve_wgrad
from fp8kit.moe.routing import (
    combine_row_weights,
    combine_rows,
    combine_weights_grad,
    row_pairs,
    sum_token_rows,
)
from fp8kit.moe.rowwise_payload import dequantize_payload, payload_rows

GemmFn = Callable[..., torch.Tensor]


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise E4M3 copy of a 2-D tensor (identity gather: one fused read on CUDA)."""
    return rq.gather_quantize_rows(t, torch.arange(t.shape[0], device=t.device))


class _FusedRowwiseMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, w_up, w_down, top_k_weights, gather_idx, pair_rows, offs, gemm, out_dtype, cached,
                wgrad_fp8, received, keep_rows):
        # a bf16 wgrad reads the tokens in expert order: written beside their FP8 copy by the same read and saved
        # (keep_rows), instead of gathered again in the backward
        keep_x = keep_rows and not wgrad_fp8 and received is None
        if received is None:
            xq, xs, kept = rq.dispatch_quantize_rows(hidden, gather_idx, pair_rows, keep_rows=keep_x)
            x_src = kept if keep_x else hidden
        else:  # expert-parallel FP8 dispatch: already cast on the sending rank (hidden is its carrier)
            xq, xs = payload_rows(received, gather_idx, hidden.shape[1])
            x_src = received
        if cached is None:
            up_f, up_fs, up_d, up_ds = rq.quantize_experts_dual(w_up)
            down_f, down_fs, down_d, down_ds = rq.quantize_experts_dual(w_down)
        else:
            (up_f, up_fs, up_d, up_ds), (down_f, down_fs, down_d, down_ds) = cached
        h = gemm(xq, up_f, xs, up_fs, offs, out_dtype)
        a, aq, as_ = rq.swiglu_quantize_rows(h)
        y = gemm(aq, down_f, as_, down_fs, offs, out_dtype)
        saved = [x_src, gather_idx, pair_rows, offs, h, a, up_d, up_ds, down_d, down_ds]
        # routing.combine, here so that the backward can read its gradient through the pairs. Its rows and weights
        # are held by ctx, not saved, so that the backward can free the (P, H) rows once the router weights'
        # gradient is taken (saved tensors would live through the whole backward: +0.5 GiB peak at Qwen3-30B-A3B).
        ctx.combine = None if top_k_weights is None else [y, top_k_weights]
        if top_k_weights is not None:
            y = combine_rows(y, pair_rows, top_k_weights, hidden.dtype)
        ctx.save_for_backward(*saved)
        ctx.gemm, ctx.out_dtype, ctx.wgrad_fp8 = gemm, out_dtype, wgrad_fp8
        ctx.dtypes = (hidden.dtype, w_up.dtype, w_down.dtype)
        ctx.tokens, ctx.received, ctx.x_in_expert_order = hidden.shape, received is not None, keep_x
        return y

    @staticmethod
    def backward(ctx, grad):
        x_src, gather_idx, pair_rows, offs, h, a, up_d, up_ds, down_d, down_ds = ctx.saved_tensors
        gemm, out_dtype, wgrad_fp8 = ctx.gemm, ctx.out_dtype, ctx.wgrad_fp8
        x_dtype, up_dtype, down_dtype = ctx.dtypes
        (tokens, hdim), received = ctx.tokens, ctx.received
        # down_proj's output gradient dy: its dgrad copy, and what its wgrad cast reads
        d_router = None
        if ctx.combine is not None:
            y, weights = ctx.combine
            ctx.combine = None
            d_router = combine_weights_grad(y, pair_rows, grad, weights.shape[1], weights.dtype) \
                if ctx.needs_input_grad[3] else None
            rows = y.shape[0]
            del y
            # dy = grad[token] * weight (routing.combine_rows_grad), never written unless the wgrad is bf16
            grad = grad.contiguous()
            dyq, dys, dy = rq.dispatch_quantize_rows(grad, gather_idx, pair_rows, weight=weights.reshape(-1),
                                                     keep_rows=not wgrad_fp8)
            dy_src = None
            if wgrad_fp8:  # the wgrad cast reads the gradient through the pairs too
                token, w_row = combine_row_weights(row_pairs(pair_rows, rows), weights)
                dy_src = dict(g=grad, index_g=token, weight_g=w_row)
        else:
            dy = grad.to(a.dtype).contiguous()
            dyq, dys = _rows(dy)
            dy_src = dict(g=dy)
        # down_proj: dgrad and wgrad
        da = gemm(dyq, down_d, dys, down_ds, offs, out_dtype)
        if wgrad_fp8:
            gt, gts, ac, acs = rq.quantize_group_cols_dual(x=a, offs=offs, **dy_src)
            dw_down = gemm(gt, ac, gts, acs, offs, out_dtype)
        else:
            dw_down = wgrad_high_precision(dy, a, offs)
        # SwiGLU backward and gate_up_proj's output-gradient cast in one pass; then its dgrad and wgrad (x read again
        # through the dispatch index)
        dh, dhq, dhs = rq.swiglu_backward_quantize_rows(h, da)
        dx_rows = gemm(dhq, up_d, dhs, up_ds, offs, out_dtype)
        if wgrad_fp8:
            x = dequantize_payload(x_src, hdim, x_dtype) if received else x_src
            ht, hts, xc, xcs = rq.quantize_group_cols_dual(dh, x, offs, index_x=gather_idx)
            dw_up = gemm(ht, xc, hts, xcs, offs, out_dtype)
        else:
            x = x_src if ctx.x_in_expert_order else _expert_rows(x_src, gather_idx, pair_rows, hdim, dh.dtype,
                                                                 received)
            dw_up = wgrad_high_precision(dh, x, offs)
        # tokens: the sum of each token's top-k rows (rows past the last group are never picked)
        dhidden = sum_token_rows(dx_rows, pair_rows, tokens, x_dtype)
        return (dhidden, dw_up.to(up_dtype), dw_down.to(down_dtype), d_router,
                None, None, None, None, None, None, None, None, None)


def _expert_rows(x_src: torch.Tensor, gather_idx: torch.Tensor, pair_rows: torch.Tensor, hdim: int,
                 dtype: torch.dtype, received: bool) -> torch.Tensor:
    """The ``gate_up_proj`` input in expert order, ``(P, H)`` of ``dtype``, for the high-precision wgrad: the tokens
    ``x_src (T, H)`` in the dispatch's layout (``rowwise_quant.dispatch_rows``: from top-2 each token read once), or
    (expert-parallel FP8 dispatch) the received payload rows ``x_src`` dequantized through the dispatch index."""
    if received:
        return dequantize_payload(x_src, hdim, dtype, index=gather_idx)
    return rq.dispatch_rows(x_src.to(dtype), gather_idx, pair_rows)


def wgrad_high_precision(g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Per-expert weight gradient ``dW[e] = g[rows of e]^T x[rows of e]`` in the operands' dtype (no FP8).

    Args:
        g: ``(P, N)`` output gradients in expert order; x: ``(P, K)`` the GEMM's inputs in the same order
            (padding rows zero in at least one of them); offs: ``(E,)`` int32 cumulative group ends.

    Returns:
        ``(E, N, K)`` in ``g``'s dtype (``torch._grouped_mm`` with the groups along the reduction dimension;
        empty experts get zeros). Rows past ``offs[-1]`` are not read.
    """
    return torch._grouped_mm(g.contiguous().t(), x.to(g.dtype), offs=offs)


def fused_rowwise_experts(
    hidden: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, gather_idx: torch.Tensor,
    pair_rows: torch.Tensor, offs: torch.Tensor, gemm: GemmFn, out_dtype: torch.dtype, cache_weights: bool = True,
    wgrad: str = "auto", received: torch.Tensor | None = None, top_k_weights: torch.Tensor | None = None,
    scale_hints: tuple[torch.Tensor, ...] | None = None, keep_rows: bool = False,
    weights: tuple[tuple[torch.Tensor, ...], ...] | None = None,
) -> torch.Tensor:
    """The expert MLP of the dispatched tokens in rowwise FP8 with fused quantization (module docstring), and with
    ``top_k_weights`` the combine too.

    Args:
        hidden: (T, H) tokens (bf16 on CUDA).
        w_up: (E, 2I, H) ``gate_up_proj`` (gate rows first, then up); w_down: (E, H, I) ``down_proj``.
        gather_idx, pair_rows, offs: the ``routing.Dispatch`` of the tokens (groups aligned to 16 rows).
        gemm: ``torch._scaled_grouped_mm`` semantics (``grouped_mm._cuda_scaled_grouped_mm`` on Hopper,
            ``grouped_mm.emulated_scaled_grouped_mm`` elsewhere, or ``rowwise_loop.loop_scaled_grouped_mm`` with the
            group bounds bound, ``fp8.grouped_gemm = "loop"``); kept for the backward.
        out_dtype: the GEMMs' output dtype (bf16 on CUDA).
        cache_weights: quantize each expert weight once per weight version and optimizer step, shared by the
            micro-batches of a gradient-accumulation step (:mod:`fp8kit.fp8.weight_cache`; the same bits).
        wgrad: ``"fp8"`` (every GEMM in FP8), ``"bf16"`` (the weight gradients' GEMMs in the activations'
            dtype, without their casts; module docstring) or ``"auto"`` (``grouped_mm.resolve_wgrad``: bf16 for
            narrow experts).
        received: the rowwise FP8 payload of expert-parallel dispatch (``fp8_dispatch.rowwise_dispatch``), whose
            rows are the tokens: ``hidden`` is then its ``(R, H)`` carrier (values never read; its gradient is
            the received rows' gradient) and ``gather_idx`` indexes the payload rows.
        top_k_weights: (T, topk) router weights of the pairs (``pair_rows`` in ``top_k_index.reshape(-1)`` order):
            return ``routing.combine`` of the expert outputs, whose backward the casts of the output gradient then
            read through the pairs (``dy (P, H)`` is never written). Only with ``hidden`` in ``out_dtype`` (the
            gradient is then read in the rows' dtype, as ``routing.combine_rows_grad`` rounds it; float32 tokens
            under autocast combine outside: inside this Function, traced by torch.compile, their whole expert
            branch lost its gradients on the H100, torch 2.11, as ``routing._Combine`` did in session 13), and not
            with ``received`` (expert parallelism combines after its return all-to-all).
        scale_hints: without ``cache_weights``, four int32 tensors ``(up_rows (E, 2I), up_cols (E, H), down_rows
            (E, H), down_cols (E, I))`` holding the float32 bits of the weights' previous ``inv_scale`` s
            (``Float8GroupedExperts.scale_hints``): the weights are cast with them as hints (one read where no scale
            moved; the same bits for any values) and they are overwritten with this call's scales.
        keep_rows: with a bf16 wgrad (and not ``received``), write the tokens' bf16 rows in expert order beside
            their FP8 copy in the forward and save them for ``gate_up_proj``'s wgrad (``(P, H)`` more saved), instead
            of gathering them again in the backward (``GroupedGemmConfig.wgrad_input``). The same bits either way.
        weights: both weights' FP8 copies, already made by :func:`expert_weight_copies` with these
            ``cache_weights`` / ``scale_hints`` (expert parallelism casts them while its FP8 dispatch all-to-all is
            in flight, so that the casts run while the tokens travel); None: made here.

    Returns:
        (P, H) expert outputs in expert order, in ``out_dtype`` (rows past ``offs[-1]`` undefined on CUDA); with
        ``top_k_weights`` the combined ``(T, H)`` in ``hidden``'s dtype (``routing.combine``'s formula, float32 sum
        in ``k`` order). Gradients flow to ``hidden``, ``w_up``, ``w_down`` and ``top_k_weights`` (in their dtypes),
        bit for bit what the uncombined call followed by ``routing.combine`` gives.

    Raises:
        ValueError: shapes that do not fit (from the quantization ops, naming the tensor), an unknown ``wgrad``, or
            ``top_k_weights`` with ``received``, with ``hidden`` not in ``out_dtype``, or not ``(T, topk)`` for the
            ``pair_rows`` given.
    """
    if top_k_weights is not None and (received is not None or hidden.dtype != out_dtype or top_k_weights.dim() != 2
                                      or top_k_weights.shape[0] != hidden.shape[0]
                                      or top_k_weights.numel() != pair_rows.numel()):
        raise ValueError(f"fused_rowwise_experts: top_k_weights {tuple(top_k_weights.shape)} must be (T, topk) for "
                         f"{hidden.shape[0]} tokens and {pair_rows.numel()} pairs, with hidden in the GEMMs' output "
                         f"dtype (hidden {hidden.dtype}, out_dtype {out_dtype}), and cannot be combined with an "
                         f"expert-parallel payload (received={'given' if received is not None else 'None'})")
    wgrad = resolve_wgrad(wgrad, w_down.shape[-1])
    e, two_i, hdim = w_up.shape
    if w_down.shape != (e, hdim, two_i // 2) or hidden.shape[1] != hdim:
        raise ValueError(f"fused_rowwise_experts: hidden {tuple(hidden.shape)}, gate_up_proj {tuple(w_up.shape)} and "
                         f"down_proj {tuple(w_down.shape)} are not (T, H), (E, 2I, H), (E, H, I)")
    cached = weights if weights is not None else expert_weight_copies(w_up, w_down, cache_weights, scale_hints)
    return _FusedRowwiseMLP.apply(hidden, w_up, w_down, top_k_weights, gather_idx, pair_rows, offs, gemm, out_dtype,
                                  cached, wgrad == "fp8", received, keep_rows)


def expert_weight_copies(w_up: torch.Tensor, w_down: torch.Tensor, cache_weights: bool,
                         scale_hints: tuple[torch.Tensor, ...] | None) -> tuple[tuple[torch.Tensor, ...], ...] | None:
    """The FP8 copies of both expert weights that :func:`fused_rowwise_experts` uses (``((q, inv_scale) of fprop,
    (q, inv_scale) of dgrad)`` per weight, ``rowwise_quant.quantize_experts_dual``): from the weight cache with
    ``cache_weights``, else cast with ``scale_hints`` (and the hints advanced); None without either (the
    forward casts them itself)."""
    if cache_weights:
        return _cached_weights(w_up, w_down)
    if scale_hints is not None:
        return _hinted_weights(w_up, w_down, scale_hints)
    return None


def _hinted_weights(w_up: torch.Tensor, w_down: torch.Tensor, hints: tuple[torch.Tensor, ...]
                    ) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Both weights' FP8 copies cast with the scale hints, and the hints advanced to this cast's scales (an in-place
    copy that torch.compile traces; the op itself is functional)."""
    up_rows, up_cols, down_rows, down_cols = hints
    with torch.no_grad():
        up = rq.quantize_experts_dual(w_up, hints=(up_rows.view(torch.float32), up_cols.view(torch.float32)))
        down = rq.quantize_experts_dual(w_down, hints=(down_rows.view(torch.float32), down_cols.view(torch.float32)))
        for hint, inv in ((up_rows, up[1]), (up_cols, up[3]), (down_rows, down[1]), (down_cols, down[3])):
            hint.copy_(inv.view(torch.int32))
    return up, down


@torch.compiler.disable
def _cached_weights(w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], ...]:
    """Both weights' FP8 copies from the weight cache, looked up OUTSIDE any compiled graph: the cached tensors then
    enter the compiled code as graph inputs, which Inductor never reuses as scratch memory. (Returned from inside a
    compiled graph, as outputs of an op, the inference graph of an eval step reused their memory for later buffers
    and corrupted the cache: validation losses of 6.5 instead of 3.9 on H100, 2026-11-23.)"""
    with torch.no_grad():
        return rq.quantize_experts_dual(w_up, cache=True), rq.quantize_experts_dual(w_down, cache=True)
