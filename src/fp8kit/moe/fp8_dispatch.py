"""FP8 token dispatch for expert parallelism: the forward all-to-all sends E4M3, not bf16.

``distributed.ep_fp8_dispatch = true`` (with ``ep > 1``) replaces the forward dispatch all-to-all of
``moe/expert_parallel.ep_experts_forward`` by one of two payloads, chosen per MoE layer by what its local experts
consume (``expert_parallel.dispatch_format``):

``rowwise`` (the local experts run the fused rowwise FP8 MLP, ``moe/fused_experts.py``): :func:`rowwise_dispatch`

```
forward   hidden (T, H) bf16 --gather_quantize_payload(token of each sorted pair)--> payload (S, H + 16) uint8:
          per row the H E4M3 bytes and the float32 inv_scale of the rowwise recipe (moe/quantize.py: one
          power-of-two scale per token row), written by the fused cast kernel the experts' own fprop cast uses
          (from the tokens' side: each token read once, stored at its top-k rows; moe/rowwise_payload.py,
          moe/rowwise_quant.py), so the bf16 sorted copy is never written
          -> all_to_all (uint8) -> received (R, H + 16)
          -> payload_rows(received, local dispatch index): the fprop GEMM's E4M3 operand and its row scales,
             gathered into expert order (1 byte per element each way; no unpack, no second cast)
backward  d(received rows) (R, H) bf16 -> all_to_all back (bf16) -> summed over each token's top-k rows -> dhidden
          the gate_up wgrad reads the received rows dequantized (dequantize_payload: exact in bf16)
```

The experts' forward is the same bits as with a bf16 dispatch (the rowwise cast of a token does not depend on
where it runs; ``tests/test_moe_ep_fp8.py`` checks it), and the token travels in ``H + 16`` bytes instead of
``2 H`` (0.504x at H = 2048).

``1x128`` (the local experts are BF16 or run another FP8 path): :func:`fp8_all_to_all`

```
forward   x (S, H) bf16 -> quantize_1x128 -> q (S, H) E4M3, s (S, H/128) fp32 decoding scales
          -> one uint8 payload (S, H + 4 H/128): each row's H bytes of q followed by the bytes of its scales
          -> all_to_all -> unpack -> q * s (fp8/blockwise.dequantize_rows) -> the activation dtype
backward  dy (R, H) bf16 -> all_to_all back (bf16) -> dx (S, H)
```

Bytes per row: ``H + H / 32`` instead of ``2 H`` (0.52x of bf16 for any ``H``); the tokens are dequantized on
arrival, so the saving is the link's alone (worth it where the link is slow, e.g. EP across nodes).

Both payloads travel as ``uint8`` (gloo refuses float8 dtypes; NCCL moves the same bytes) with the scales
inside the same rows, so one collective carries both (one latency instead of two, and no second set of split
sizes). 1x128 quantization (``fp8/blockwise.quantize_1x128``): one float32 scale ``448 / amax`` per 128
consecutive elements of a token, the E4M3 rounding to nearest even; ``H`` must be a multiple of 128
(:func:`check_dispatch_hidden` refuses others at set-up).

Gradient: a straight-through estimator. The quantize-dequantize step ``Q(x)`` is treated as the identity,
so the gradient of the dispatch is the gradient of the identity's all-to-all: the bf16 output gradient
goes back through the reverse all-to-all unchanged (``dQ/dx := 1``; the true derivative of rounding is 0
almost everywhere). DeepSeek-V3 (arXiv 2412.19437, 3.3.2 "Low-Precision Communication") does the same:
it quantizes the activations to FP8 before the MoE dispatch and keeps the combine in BF16; the backward
communication of the dispatch is the bf16 gradient. The combine (expert outputs back to their tokens)
stays bf16 here too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp8kit.base.errors import ConfigError
from fp8kit.base.triton_lib import triton_module
from fp8kit.fp8.blockwise import BLOCK, FP8, dequantize_rows, quantize_1x128
from fp8kit.moe.routing import sum_token_rows
from fp8kit.moe.rowwise_payload import gather_quantize_payload

#: bytes of one float32 decoding scale
SCALE_BYTES = 4


def check_dispatch_hidden(hidden: int, where: str, key: str = "distributed.ep_fp8_dispatch") -> None:
    """Refuse FP8 dispatch of tokens whose hidden size is not a multiple of 128: the E4M3 + 1x128 payload (what
    experts outside the fused FP8 path receive, e.g. during a BF16 warm-up phase) needs whole 128-element blocks;
    checked at set-up for every layer, whatever payload it starts with.

    Raises:
        ConfigError: naming ``key``, ``where`` (the experts module) and the hidden size.
    """
    if hidden % BLOCK:
        raise ConfigError(
            f"{key} = true: {where} has hidden size {hidden}, not a multiple of {BLOCK} (FP8 dispatch to experts "
            f"outside the fused FP8 path sends one float32 scale per {BLOCK} elements of a token); set {key} = false"
        )


def payload_row_bytes(hidden: int) -> int:
    """Bytes one token takes in the FP8 payload: ``hidden`` E4M3 bytes + ``hidden / 128`` float32 scales."""
    return hidden + SCALE_BYTES * (hidden // BLOCK)


def pack_reference(x: torch.Tensor) -> torch.Tensor:
    """Quantize tokens to the FP8 dispatch payload (plain PyTorch: the CPU path and the Triton kernel's reference).

    Args:
        x: ``(S, H)`` float tensor, ``H`` a multiple of 128.

    Returns:
        ``(S, payload_row_bytes(H))`` uint8: row ``i`` holds ``q[i]`` (E4M3 bits) then the bytes of its
        ``H / 128`` float32 decoding scales (``fp8/blockwise.quantize_1x128``).
    """
    q, scale_inv = quantize_1x128(x)
    return torch.cat([q.view(torch.uint8), scale_inv.contiguous().view(torch.uint8)], dim=1)


def unpack_reference(payload: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The tokens of a :func:`pack` payload, dequantized (``q * scale_inv`` in float32, then ``dtype``); plain
    PyTorch (the CPU path and the Triton kernel's reference).

    Args:
        payload: ``(R, payload_row_bytes(hidden))`` uint8.

    Returns:
        ``(R, hidden)`` tensor of ``dtype``.
    """
    q = payload[:, :hidden].contiguous().view(FP8)
    scale_inv = payload[:, hidden:].contiguous().view(torch.float32)
    return dequantize_rows(q, scale_inv).to(dtype)


def _kernels():
    """:mod:`fp8kit.moe.fp8_dispatch_triton`, or None (``base.triton_lib.triton_module``)."""
    return triton_module("fp8kit.moe.fp8_dispatch_triton", "FP8 expert-parallel dispatch")


@torch.library.custom_op("fp8kit::ep_dispatch_pack", mutates_args=())
def _pack_op(x: torch.Tensor) -> torch.Tensor:
    k = _kernels() if x.is_cuda else None
    return k.pack(x if x.stride(-1) == 1 else x.contiguous()) if k is not None else pack_reference(x)


@_pack_op.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], payload_row_bytes(x.shape[1]), dtype=torch.uint8)


@torch.library.custom_op("fp8kit::ep_dispatch_unpack", mutates_args=())
def _unpack_op(payload: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    k = _kernels() if payload.is_cuda else None
    return k.unpack(payload.contiguous(), hidden, dtype) if k is not None else unpack_reference(payload, hidden, dtype)


@_unpack_op.register_fake
def _(payload: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return payload.new_empty(payload.shape[0], hidden, dtype=dtype)


def pack(x: torch.Tensor) -> torch.Tensor:
    """:func:`pack_reference`'s payload; on CUDA one fused Triton pass (:mod:`fp8kit.moe.fp8_dispatch_triton`,
    equal bit for bit). ``x``: ``(S, H)`` float, ``H`` a multiple of 128 -> ``(S, payload_row_bytes(H))`` uint8.
    A ``torch.library`` custom op (``torch.ops.fp8kit.ep_dispatch_pack``)."""
    return _pack_op(x)


def unpack(payload: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`unpack_reference`; on CUDA one fused Triton pass (equal bit for bit). ``payload``: ``(R,
    payload_row_bytes(hidden))`` uint8 -> ``(R, hidden)`` of ``dtype``. Custom op ``fp8kit::ep_dispatch_unpack``."""
    return _unpack_op(payload, hidden, dtype)


def _exchange(t: torch.Tensor, out_splits: list[int], in_splits: list[int], group,
              during: Callable[[], None] | None = None) -> torch.Tensor:
    """All-to-all of rows: ``in_splits[j]`` rows of ``t`` go to rank ``j``, ``out_splits[j]`` come from it.
    ``during``: called once the all-to-all is queued and before this stream waits for it, so that the GPU work it
    queues (which must not need the rows) runs while they travel; work queued before the collective would run
    before it starts (the collective's stream waits for everything queued ahead of it)."""
    from torch.distributed._functional_collectives import all_to_all_single

    pending = all_to_all_single(t.contiguous(), out_splits, in_splits, group)
    if during is not None:
        during()
    return pending.wait()


class _FP8Dispatch(torch.autograd.Function):
    """Forward: pack -> all-to-all (uint8) -> unpack. Backward: the reverse all-to-all of the bf16
    gradient (straight-through estimator, module docstring)."""

    @staticmethod
    def forward(ctx, x, recv_splits, send_splits, group):
        ctx.splits, ctx.group = (recv_splits, send_splits), group
        received = _exchange(pack(x), recv_splits, send_splits, group)
        return unpack(received, x.shape[1], x.dtype)

    @staticmethod
    def backward(ctx, grad):
        recv_splits, send_splits = ctx.splits
        return _exchange(grad, send_splits, recv_splits, ctx.group), None, None, None


def fp8_all_to_all(x: torch.Tensor, recv_splits: list[int], send_splits: list[int], group) -> torch.Tensor:
    """The dispatch all-to-all of expert parallelism with an FP8 payload (module docstring).

    Args:
        x: ``(sum(send_splits), H)`` tokens sorted by destination rank, ``H`` a multiple of 128.
        recv_splits / send_splits: rows received from / sent to each rank of ``group``.
        group: the expert-parallel process group.

    Returns:
        ``(sum(recv_splits), H)`` received tokens, dequantized to ``x``'s dtype. Differentiable: the gradient
        goes back through the reverse all-to-all in the gradient's dtype (straight-through).
    """
    return _FP8Dispatch.apply(x, list(recv_splits), list(send_splits), group)


# --------------------------------------------------------------------------- rowwise payload (fused FP8 experts)


class _RowwiseDispatch(torch.autograd.Function):
    """Forward: fused rowwise cast into the payload (from the tokens' side: each token read once, stored at its
    top-k send rows) -> all-to-all. Outputs ``(carrier, received)``:
    ``received`` the uint8 payload rows (not differentiable), ``carrier`` a ``(R, H)`` stand-in of the received
    tokens that holds no memory (an expanded zero) and only carries their gradient back: the consumer
    (``fused_experts`` with ``received=``) reads the payload, never the carrier's values, and returns the
    gradient of the received rows as the carrier's. Backward: that gradient back through the reverse all-to-all
    (bf16, straight-through) and summed over each token's top-k rows."""

    @staticmethod
    def forward(ctx, hidden, token_rows, pair_rows, recv_splits, send_splits, group, during):
        ctx.splits, ctx.group, ctx.tokens = (recv_splits, send_splits), group, hidden.shape[0]
        ctx.save_for_backward(pair_rows)
        received = _exchange(gather_quantize_payload(hidden, token_rows, pair_rows), recv_splits, send_splits, group,
                             during)
        ctx.mark_non_differentiable(received)
        # no zero gradient materialized for the (R, H + 16) payload (a fill per layer and step): backward gets None
        ctx.set_materialize_grads(False)
        ctx.carrier_shape, ctx.carrier_dtype = (received.shape[0], hidden.shape[1]), hidden.dtype
        return hidden.new_zeros(()).expand(received.shape[0], hidden.shape[1]), received

    @staticmethod
    def backward(ctx, d_carrier, _d_received):
        (pair_rows,) = ctx.saved_tensors
        if d_carrier is None:  # no loss reached the carrier: zeros still cross, every rank joins the collective
            d_carrier = torch.zeros(ctx.carrier_shape, dtype=ctx.carrier_dtype, device=pair_rows.device)
        recv_splits, send_splits = ctx.splits
        d_sorted = _exchange(d_carrier, send_splits, recv_splits, ctx.group)
        dhidden = sum_token_rows(d_sorted, pair_rows, ctx.tokens, d_carrier.dtype)
        return dhidden, None, None, None, None, None, None


def rowwise_dispatch(hidden: torch.Tensor, token_rows: torch.Tensor, pair_rows: torch.Tensor,
                     recv_splits: list[int], send_splits: list[int], group,
                     during: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The dispatch all-to-all with the rowwise E4M3 payload (module docstring, ``rowwise``).

    Args:
        hidden: ``(T, H)`` this rank's tokens (bf16 on CUDA), ``H`` a multiple of 16.
        token_rows: ``(S,)`` int64 token of each sorted (token, expert) pair, pairs sorted by destination rank.
        pair_rows: ``(S,)`` int64 sorted row of each pair in ``top_k_index.reshape(-1)`` order (the inverse of the
            sort): the gradient of token ``t`` sums rows ``pair_rows[t * topk : (t + 1) * topk]``.
        recv_splits / send_splits: rows received from / sent to each rank of ``group`` (the EP process group).
        during: optional work to queue while the payload travels (called once, between queuing the all-to-all and
            waiting for it; expert parallelism casts the experts' weights there), e.g. a closure that keeps its
            result.

    Returns:
        ``(carrier (R, H) of hidden's dtype, received (R, H + 16) uint8)``, ``R = sum(recv_splits)``: pass both to
        ``fused_rowwise_experts(carrier, ..., received=received)``. The gradient of ``carrier`` reaches ``hidden``
        (straight-through, bf16 reverse all-to-all).
    """
    return _RowwiseDispatch.apply(hidden, token_rows, pair_rows, list(recv_splits), list(send_splits), group, during)
