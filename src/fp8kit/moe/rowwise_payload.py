"""The rowwise FP8 token payload of expert-parallel dispatch: the fused experts' fprop operand, made on the sending rank.

The fused rowwise FP8 experts (``moe/fused_experts.py``) start with ``rowwise_quant.gather_quantize_rows``: the
tokens of the expert-sorted rows, cast to E4M3 with one power-of-two scale per row (``moe/quantize.py``). A row's
cast depends only on its token, so under expert parallelism the sending rank can make it and send the result
(``distributed.ep_fp8_dispatch``, ``moe/fp8_dispatch.rowwise_dispatch``). This module holds that payload:

- layout: one uint8 row per routed pair, ``K`` E4M3 bytes, the 4 bytes of the float32 ``inv_scale``, then 12
  bytes of padding (unspecified contents) so that every row starts on a 16-byte boundary when ``K % 16 == 0``
  (16-byte stores and loads; the FP8 GEMM needs ``K % 16 == 0`` anyway): :data:`PAYLOAD_TAIL`,
  :func:`rowwise_payload_bytes`, :func:`payload_views`;
- sender: :func:`gather_quantize_payload`, the Triton kernel of ``dispatch_quantize_rows`` (each token read once
  and stored at its top-k rows) or of ``gather_quantize_rows`` writing straight into the payload rows (custom op
  ``fp8kit::moe_rw_gather_quant_payload``; the PyTorch reference elsewhere);
- receiver: :func:`payload_rows` (the E4M3 rows and scales gathered into local-expert order: the fprop operand,
  bit for bit what ``gather_quantize_rows`` of the same tokens gives, padding rows included; custom op
  ``fp8kit::moe_payload_rows``, a Triton kernel on CUDA, :mod:`fp8kit.moe.payload_triton`) and
  :func:`dequantize_payload` (``q * inv_scale``, exact in bf16: what gate_up's weight gradient reads).

Bytes per token: ``K + 16`` instead of bf16's ``2 K`` (0.504x at K = 2048).
"""

from __future__ import annotations

import functools

import torch

from fp8kit.base.cuda_compile import compiled_on_cuda
from fp8kit.base.triton_lib import triton_module
from fp8kit.moe import rowwise_quant as rq
from fp8kit.moe.quantize import quantize_rows

FP8 = torch.float8_e4m3fn

#: Bytes after a token's ``K`` E4M3 bytes: its float32 ``inv_scale`` and 12 bytes of padding (module docstring).
PAYLOAD_TAIL = 16


def rowwise_payload_bytes(k: int) -> int:
    """Bytes of one token in a rowwise payload: ``K`` E4M3 bytes + :data:`PAYLOAD_TAIL`."""
    return k + PAYLOAD_TAIL


def payload_views(payload: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q (P, K) E4M3, inv_scale (P,) float32)``: views into a ``(P, rowwise_payload_bytes(K))`` uint8 payload
    (row-strided, no copy).

    Raises:
        ValueError: ``payload`` not a contiguous 2-D uint8 tensor of ``K + 16`` columns, or ``K % 16 != 0``.
    """
    if k % 16 or payload.dtype != torch.uint8 or payload.dim() != 2 or payload.shape[1] != rowwise_payload_bytes(k) \
            or not payload.is_contiguous():
        raise ValueError(f"rowwise payload: expected a contiguous (P, {rowwise_payload_bytes(k)}) uint8 tensor for "
                         f"K = {k} (a multiple of 16), got {payload.dtype} {tuple(payload.shape)}")
    return payload[:, :k].view(FP8), payload.view(torch.float32)[:, k // 4]


def _check_k(src: torch.Tensor) -> None:
    if src.dim() == 2 and src.shape[1] % 16:
        raise ValueError(f"fp8kit::moe_rw_gather_quant_payload: src must have a multiple of 16 columns, got "
                         f"{tuple(src.shape)}")


def gather_quantize_payload_ref(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of :func:`gather_quantize_payload`: ``gather_quantize_rows_ref``'s ``q`` and ``inv_scale``
    written into a zero-initialized payload."""
    _check_k(src)
    q, inv = rq.gather_quantize_rows_ref(src, index)
    payload = torch.zeros(index.shape[0], rowwise_payload_bytes(src.shape[1]), dtype=torch.uint8, device=src.device)
    pq, pinv = payload_views(payload, src.shape[1])
    pq.copy_(q)
    pinv.copy_(inv)
    return payload


@torch.library.custom_op("fp8kit::moe_rw_gather_quant_payload", mutates_args=())
def _payload_op(src: torch.Tensor, index: torch.Tensor, pair_rows: torch.Tensor | None) -> torch.Tensor:
    _check_pairs(src, index, pair_rows)
    return gather_quantize_payload_ref(src, index)


@_payload_op.register_kernel("cuda")
def _(src, index, pair_rows):
    rq._check_gather(src, index)
    _check_k(src)
    topk = _check_pairs(src, index, pair_rows)
    kernels = rq._triton_kernels()
    if kernels is None or index.numel() == 0 or src.shape[1] == 0:
        return gather_quantize_payload_ref(src, index)
    payload = torch.empty(index.shape[0], rowwise_payload_bytes(src.shape[1]), dtype=torch.uint8, device=src.device)
    out = payload_views(payload, src.shape[1])
    src, index = rq._rows_last(src), index.contiguous()
    with torch.cuda.device(src.device):
        if topk >= rq.SCATTER_MIN_TOPK and kernels.scatter_quantize_rows(src, index, pair_rows.contiguous(),
                                                                         out=out) is not None:
            return payload
        kernels.gather_quantize_rows(src, index, out=out)
    return payload


@_payload_op.register_fake
def _(src, index, pair_rows):
    rq._check_gather(src, index)
    _check_k(src)
    _check_pairs(src, index, pair_rows)
    return src.new_empty(index.shape[0], rowwise_payload_bytes(src.shape[1]), dtype=torch.uint8)


def _check_pairs(src: torch.Tensor, index: torch.Tensor, pair_rows: torch.Tensor | None) -> int:
    """``topk`` of the layout ``pair_rows`` gives (0 without it), after checking it as
    ``fp8kit::moe_rw_dispatch_quant`` does."""
    return 0 if pair_rows is None else rq._check_dispatch(src, index, pair_rows, None,
                                                          "fp8kit::moe_rw_gather_quant_payload")


def gather_quantize_payload(src: torch.Tensor, index: torch.Tensor,
                            pair_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``rowwise_quant.gather_quantize_rows(src, index)`` written into payload rows (module docstring).

    The ``q`` and ``inv_scale`` bits equal ``gather_quantize_rows``'s; on CUDA a Triton kernel writes them in place
    (one pass, no separate pack): with ``pair_rows`` (the layout known from the tokens' side too) and top-k >=
    ``rowwise_quant.SCATTER_MIN_TOPK``, the scatter kernel of ``rowwise_quant.dispatch_quantize_rows`` (each token row
    read and cast once, stored at its top-k payload rows); otherwise the gather kernel (each row read through
    ``index``). :func:`payload_views` reads them back without a copy.

    Args:
        src: ``(T, K)`` bf16 / fp16 / fp32 tokens, ``K`` a multiple of 16.
        index: ``(P,)`` int64 / int32 source row of each output row (``T``: a zero row), as ``gather_quantize_rows``.
        pair_rows: optional ``(T * topk,)`` int64 / int32 output row of each (token, slot) pair in token-major order
            (``index[pair_rows[i]] == i // topk``, ``index == T`` on the other rows; the CUDA kernel does not check
            it): expert parallelism's send order (``moe/expert_parallel.py``).

    Returns:
        ``(P, K + 16)`` uint8, contiguous.

    Raises:
        ValueError: as ``gather_quantize_rows``, or ``K`` not a multiple of 16, or ``pair_rows`` not a 1-D integer
            tensor on ``src``'s device holding a whole number of rows per token of ``src`` and no more than
            ``index``'s rows (``rowwise_quant.dispatch_quantize_rows``' checks).
    """
    return torch.ops.fp8kit.moe_rw_gather_quant_payload(src, index, pair_rows)


@functools.cache
def _zero_row_inv_bits() -> int:
    """The int32 bits of the ``inv_scale`` the rowwise recipe gives an all-zero row (``gather_quantize_rows``'s
    padding rows), so that :func:`payload_rows` pads with the same bits."""
    return int(quantize_rows(torch.zeros(1, 16))[1].view(torch.int32).item())


@compiled_on_cuda
def _gather_words(words: torch.Tensor, index: torch.Tensor, hidden_words: int, zero_inv: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    # an appended zero row (its scale slot the zero row's bits) for index R, as routing.gather_rows pads
    pad = torch.zeros(1, words.shape[1], dtype=words.dtype, device=words.device)
    pad[0, hidden_words] = zero_inv
    rows = torch.cat([words, pad])[index]
    return rows[:, :hidden_words], rows[:, hidden_words]


def payload_rows_reference(received: torch.Tensor, index: torch.Tensor, hidden: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`payload_rows` in PyTorch: one gather of 32-bit words (compiled on CUDA); the CPU's path and the GPU
    tests' reference."""
    payload_views(received, hidden)  # checks the layout
    q, inv = _gather_words(received.view(torch.int32), index, hidden // 4, _zero_row_inv_bits())
    # Compiled, the two outputs are written as their own buffers; eagerly (the CPU, or Dynamo's recompile limit
    # reached) they are strided views of the gathered rows, which torch._scaled_grouped_mm refuses
    # ("scale must be contiguous"): a copy then, a no-op otherwise.
    return q.contiguous().view(FP8), inv.contiguous().view(torch.float32)


def _check_index(received: torch.Tensor, index: torch.Tensor) -> None:
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32) or index.device != received.device:
        raise ValueError(f"fp8kit::moe_payload_rows: index must be a 1-D int64 / int32 tensor on {received.device}, "
                         f"got {index.dtype} {tuple(index.shape)} on {index.device}")


def _own_storage(q: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`payload_rows_reference`'s outputs as a custom op may return them: with one row both can be views of the
    one gathered row (outputs may not alias), then copies; otherwise as they are."""
    if q.untyped_storage().data_ptr() == inv.untyped_storage().data_ptr():
        return q.clone(), inv.clone()
    return q, inv


@torch.library.custom_op("fp8kit::moe_payload_rows", mutates_args=())
def _payload_rows_op(received: torch.Tensor, index: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_index(received, index)
    return _own_storage(*payload_rows_reference(received, index, hidden))


@_payload_rows_op.register_kernel("cuda")
def _(received, index, hidden):
    payload_views(received, hidden)
    _check_index(received, index)
    kernels = triton_module("fp8kit.moe.payload_triton", "EP payload rows")
    if kernels is None:
        return _own_storage(*payload_rows_reference(received, index, hidden))
    with torch.cuda.device(received.device):
        q, inv = kernels.payload_rows(received, index.contiguous(), hidden, _zero_row_inv_bits())
    return q.view(FP8), inv.view(torch.float32)


@_payload_rows_op.register_fake
def _(received, index, hidden):
    payload_views(received, hidden)
    _check_index(received, index)
    return received.new_empty(index.shape[0], hidden, dtype=FP8), received.new_empty(index.shape[0],
                                                                                     dtype=torch.float32)


def payload_rows(received: torch.Tensor, index: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fprop operand of the fused experts from a rowwise payload: rows gathered into expert order.

    Args:
        received: ``(R, H + 16)`` uint8 rowwise payload (``R`` may be 0).
        index: ``(P,)`` int64 / int32 payload row of each output row, ``R`` meaning a zero row
            (``routing.Dispatch.gather_idx`` of the local dispatch).
        hidden: ``H``.

    Returns:
        ``(q (P, H) E4M3 row-major, inv_scale (P,) float32)``, contiguous: equal bit for bit to
        ``gather_quantize_rows(tokens, index)`` of the tokens the payload was made from (zero rows included). On
        CUDA a Triton kernel moving 16-byte pieces (:mod:`fp8kit.moe.payload_triton`), elsewhere
        :func:`payload_rows_reference`; a custom op (``fp8kit::moe_payload_rows``), so ``torch.compile`` traces it.

    Raises:
        ValueError: ``received`` not a ``(R, H + 16)`` contiguous uint8 tensor with ``H % 16 == 0``, or ``index`` not a
            1-D int64 / int32 tensor on its device.
    """
    return torch.ops.fp8kit.moe_payload_rows(received, index, hidden)


@compiled_on_cuda
def _dequantize(q: torch.Tensor, inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * inv[:, None]).to(dtype)


def dequantize_payload(received: torch.Tensor, hidden: int, dtype: torch.dtype,
                       index: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens of a rowwise payload as ``q * inv_scale`` (float32, exact: power-of-two scales) in ``dtype``.

    Args:
        received: ``(R, H + 16)`` uint8 rowwise payload; hidden: ``H``.
        index: optional ``(P,)`` rows to gather first (``R`` = a zero row), as :func:`payload_rows`.

    Returns:
        ``(R, H)``, or ``(P, H)`` with ``index``, of ``dtype``.
    """
    if index is None:
        q, inv = payload_views(received, hidden)
    else:
        q, inv = payload_rows(received, index, hidden)
    return _dequantize(q, inv, dtype)
