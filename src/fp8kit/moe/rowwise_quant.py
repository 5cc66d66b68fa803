"""Fused rowwise E4M3 quantization for the FP8 grouped GEMM of MoE experts: the casts of
:mod:`fp8kit.moe.quantize`, fused with what comes before them, equal to them bit for bit.

The rowwise recipe of :mod:`fp8kit.moe.quantize` (power-of-two scales ``round_scale_pow2(scale_from_amax(
amax, e4m3, AMAX_EPS))``, ``fp8/scaling.py``; cast ``saturate(x * scale)`` to E4M3; ``inv_scale = 1 / scale``)
without the intermediate copies and separate amax passes:

- :func:`gather_quantize_rows`: the dispatch gather (``routing.Dispatch.gather_idx``) + ``quantize_rows``;
  the gathered BF16 copy is never written. ``moe/rowwise_payload.py`` has its kernel write the same bits into
  one uint8 row per token: the FP8 token dispatch of expert parallelism.
- :func:`dispatch_quantize_rows`: the same from ``routing.dispatch``'s layout seen from both sides (``gather_idx``
  and ``pair_rows``), optionally keeping the bf16 rows (a bf16 wgrad's operand) and, with the router weights, as
  the combine's backward (``routing.combine_rows_grad``: each expert row's gradient is its token's gradient times
  the router weight; the ``(P, H)`` product never written unless kept). On CUDA with top-k >= ``SCATTER_MIN_TOPK``
  each token row is read once and stored at its top-k rows, instead of every row read through the gather index.
- :func:`dispatch_rows`: the same layout's plain gather without a cast (a bf16 weight gradient's input).
- :func:`swiglu_quantize_rows`: ``a = silu(gate) * up`` (:func:`fp8kit.moe.token_quant.swiglu_ref`, bit for
  bit) + ``quantize_rows(a)``, from one read of ``h``.
- :func:`swiglu_backward_quantize_rows`: the SwiGLU backward ``dh`` (:func:`swiglu_backward_ref`; on CUDA within a
  bf16 ulp: the hardware's sigmoid) + ``quantize_rows(dh)`` of the ``dh`` written, from one read of ``h`` and ``da``.
- :func:`quantize_group_cols_fused` / :func:`quantize_group_cols_dual`: the wgrad operands (one scale per
  (group, column)) without the scatter: groups are contiguous row ranges; ``x`` optionally read through
  the dispatch index, ``g`` through the combine's (token index and router weight per row).
- :func:`quantize_experts_dual`: both right operands of the expert weights (fprop: over K; dgrad: over N); with
  the previous step's scales as hints from one read of the weights (:mod:`fp8kit.moe.rowwise_weights_triton`).

Each is a ``torch.library`` op (``torch.ops.fp8kit.moe_rw_*``): CUDA runs the Triton kernels of
:mod:`fp8kit.moe.rowwise_quant_triton`, every other device (and empty inputs) the PyTorch reference below,
which calls the functions of :mod:`fp8kit.moe.quantize` on the materialized input. The GPU test
(tests/test_moe_rowwise_quant_gpu.py) asserts equal bits. The ops are opaque to Inductor and have no
autograd formula (their callers are ``autograd.Function`` s). NaN inputs are out of contract (the kernels'
max does not propagate NaN as ``torch.amax`` does).

Bytes moved per element (bf16 input ``b = 2``; the reference's in parentheses, counting its intermediates):
gather ``b + 1`` (``3b + 1 + 2*4``: gather write/read, abs/amax, float32 product); SwiGLU ``2b`` read, ``b + 1``
written; group columns ``2b`` read (the second pass mostly from L2) ``+ 1`` written (the reference: a
float32 abs copy, a scatter, a gathered scale per element, the cast and a transposing copy); expert weights
``2b`` read ``+ 2`` written, with hints ``b`` read ``+ 2`` written plus ``b + 1`` per element of a row or column
whose scale moved (two ``quantize_experts`` calls: ``~4b + 4`` plus float32 temporaries).
"""

from __future__ import annotations

import torch

from fp8kit.base.triton_lib import triton_module
from fp8kit.fp8.weight_cache import WeightCache
from fp8kit.moe.quantize import group_ids, quantize_experts, quantize_group_cols, quantize_rows
from fp8kit.moe.routing import combine_row_weights, gather_rows, row_pairs
from fp8kit.moe.token_quant import swiglu_ref

FP8 = torch.float8_e4m3fn
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_INTS = (torch.int64, torch.int32)


# --------------------------------------------------------------------------- checks

def _check_float(t: torch.Tensor, dims: int, name: str, where: str) -> None:
    if t.dim() != dims or t.dtype not in _FLOATS:
        raise ValueError(f"{where}: {name} must be a {dims}-D bf16 / fp16 / fp32 tensor, got {t.dtype} {tuple(t.shape)}")


def _check_index(index: torch.Tensor, device: torch.device, name: str, where: str) -> None:
    if index.dim() != 1 or index.dtype not in _INTS or index.device != device:
        raise ValueError(f"{where}: {name} must be a 1-D int64 / int32 tensor on {device}, got "
                         f"{index.dtype} {tuple(index.shape)} on {index.device}")


def _check_offs(offs: torch.Tensor, device: torch.device, where: str) -> None:
    if offs.dim() != 1 or offs.numel() == 0 or offs.dtype not in _INTS or offs.device != device:
        raise ValueError(f"{where}: offs must be a non-empty 1-D int32 / int64 tensor of cumulative group ends on "
                         f"{device}, got {offs.dtype} {tuple(offs.shape)} on {offs.device}")


def _check_gather(src: torch.Tensor, index: torch.Tensor) -> None:
    where = "fp8kit::moe_rw_gather_quant"
    _check_float(src, 2, "src", where)
    _check_index(index, src.device, "index", where)


def _check_dispatch(src: torch.Tensor, index: torch.Tensor, pair_rows: torch.Tensor,
                    weight: torch.Tensor | None, where: str = "fp8kit::moe_rw_dispatch_quant") -> int:
    """``topk`` of the dispatch layout, after checking the arguments of ``where`` (an op taking the layout from both
    sides)."""
    _check_float(src, 2, "src", where)
    _check_index(index, src.device, "index", where)
    _check_index(pair_rows, src.device, "pair_rows", where)
    t, s = src.shape[0], pair_rows.shape[0]
    if (t == 0 and s) or (t and s % t) or s > index.shape[0]:
        raise ValueError(f"{where}: pair_rows must hold topk rows per token of src ({t} tokens) and no more than "
                         f"index's {index.shape[0]} rows, got {s}")
    if weight is not None:
        _check_weight(weight, pair_rows, "weight", where)
    return s // t if t else 0


def _check_h(h: torch.Tensor) -> int:
    """The intermediate size ``I`` of ``h (P, 2I)``, after checking ``h``."""
    where = "fp8kit::moe_rw_swiglu_quant"
    _check_float(h, 2, "h", where)
    if h.shape[1] % 2:
        raise ValueError(f"{where}: h must be (P, 2I) with an even last dim, got shape {tuple(h.shape)}")
    return h.shape[1] // 2


def _check_dh(h: torch.Tensor, da: torch.Tensor) -> None:
    where = "fp8kit::moe_rw_swiglu_bwd_quant"
    i = _check_h(h)
    _check_float(da, 2, "da", where)
    if da.shape != (h.shape[0], i) or da.device != h.device:
        raise ValueError(f"{where}: da must be ({h.shape[0]}, {i}) on {h.device} for h {tuple(h.shape)}, got "
                         f"{tuple(da.shape)} on {da.device}")


def _check_group(x: torch.Tensor, offs: torch.Tensor, index: torch.Tensor | None, name: str, where: str) -> int:
    """The row count ``P`` of the (possibly gathered) ``x``, after checking the arguments."""
    _check_float(x, 2, name, where)
    _check_offs(offs, x.device, where)
    if index is None:
        return x.shape[0]
    _check_index(index, x.device, "index", where)
    return index.shape[0]


def _check_weight(weight: torch.Tensor, index: torch.Tensor, name: str, where: str) -> None:
    if weight.dim() != 1 or weight.dtype not in _FLOATS or weight.device != index.device or \
            weight.shape[0] != index.shape[0]:
        raise ValueError(f"{where}: {name} must be a 1-D float tensor with one weight per index entry "
                         f"({index.shape[0]}) on {index.device}, got {weight.dtype} {tuple(weight.shape)} on "
                         f"{weight.device}")


def _check_dual(g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, index_x: torch.Tensor | None,
                index_g: torch.Tensor | None = None, weight_g: torch.Tensor | None = None) -> None:
    where = "fp8kit::moe_rw_group_cols_dual_quant"
    if (index_g is None) != (weight_g is None):
        raise ValueError(f"{where}: index_g and weight_g come together (the combine's backward), got "
                         f"index_g {'None' if index_g is None else tuple(index_g.shape)} and weight_g "
                         f"{'None' if weight_g is None else tuple(weight_g.shape)}")
    p = _check_group(g, offs, index_g, "g", where)
    if weight_g is not None:
        _check_weight(weight_g, index_g, "weight_g", where)
    px = _check_group(x, offs, index_x, "x", where)
    if px != p:
        rows = "index_x" if index_x is not None else "x"
        raise ValueError(f"{where}: g has {p} rows but {rows} gives {px} (g {tuple(g.shape)}, x {tuple(x.shape)})")


def _check_w(w: torch.Tensor) -> None:
    _check_float(w, 3, "w", "fp8kit::moe_rw_experts_dual_quant")


def _check_hints(w: torch.Tensor, row_hint: torch.Tensor, col_hint: torch.Tensor) -> None:
    where = "fp8kit::moe_rw_experts_dual_quant_hinted"
    _check_float(w, 3, "w", where)
    e, n, k = w.shape
    for name, hint, want in (("row_hint", row_hint, (e, n)), ("col_hint", col_hint, (e, k))):
        if tuple(hint.shape) != want or hint.dtype != torch.float32 or hint.device != w.device:
            raise ValueError(f"{where}: {name} must be float32 {want} on {w.device} for w {tuple(w.shape)} (the "
                             f"previous {'fprop' if name == 'row_hint' else 'dgrad'} inv_scale), got "
                             f"{hint.dtype} {tuple(hint.shape)} on {hint.device}")


# --------------------------------------------------------------------------- reference

def _gathered(src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``cat([src, zeros(1, K)])[index]``: the dispatch gather (``routing.gather``), index ``T`` a zero row; with
    ``weight`` (P,) each row times its weight in float32, rounded to ``src``'s dtype (``routing.combine_rows_grad``)."""
    rows = torch.cat([src, src.new_zeros(1, src.shape[1])])[index]
    return rows if weight is None else (rows.float() * weight.float()[:, None]).to(src.dtype)


def gather_quantize_rows_ref(src: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`gather_quantize_rows`: ``quantize_rows(cat([src, zeros(1, K)])[index])``."""
    _check_gather(src, index)
    return quantize_rows(_gathered(src, index))


def _row_weights(weight: torch.Tensor, pair_rows: torch.Tensor, rows: int) -> torch.Tensor:
    """``(rows,)``: each padded row's pair weight (0 for padding), from ``weight`` in pair order
    (``routing.combine_row_weights``; its token index is not needed here, so the weights go in as one column)."""
    return combine_row_weights(row_pairs(pair_rows.long(), rows), weight.reshape(-1, 1))[1]


def dispatch_quantize_rows_ref(src: torch.Tensor, index: torch.Tensor, pair_rows: torch.Tensor,
                               weight: torch.Tensor | None, keep_rows: bool
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`dispatch_quantize_rows`: ``rows = cat([src, zeros(1, K)])[index]`` (with ``weight``
    each row times its pair's weight in float32, 0 for padding, rounded to ``src``'s dtype:
    ``routing.combine_rows_grad``), then ``quantize_rows(rows)``; ``(q, inv, rows if keep_rows else (0, K))``."""
    _check_dispatch(src, index, pair_rows, weight)
    rows = _gathered(src, index, None if weight is None else _row_weights(weight, pair_rows, index.shape[0]))
    return (*quantize_rows(rows), rows if keep_rows else rows[:0])


def swiglu_quantize_rows_ref(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`swiglu_quantize_rows`: ``a = swiglu_ref(h)``, then ``quantize_rows(a)``."""
    _check_h(h)
    a = swiglu_ref(h, interleaved)
    return (a, *quantize_rows(a))


def swiglu_backward_ref(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """Gradient ``dh (P, 2I)`` of ``a = silu(gate) * up`` (``gate, up = h.chunk(2, -1)``) given ``da (P, I)``:
    ``dgate = da * up * s * (1 + g (1 - s))``, ``dup = da * g * s``, ``s = sigmoid(g)`` (``torch.sigmoid``), in
    float32, rounded to ``h.dtype`` (the formula of ``token_quant.swiglu_backward``, without its 128-multiple
    requirement)."""
    gate, up = h.chunk(2, dim=-1)
    g, u, d = gate.float(), up.float(), da.float()
    s = torch.sigmoid(g)
    return torch.cat([d * u * s * (1.0 + g * (1.0 - s)), d * g * s], dim=1).to(h.dtype)


def swiglu_backward_quantize_rows_ref(h: torch.Tensor, da: torch.Tensor
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`swiglu_backward_quantize_rows`: ``dh = swiglu_backward_ref(h, da)``, then
    ``quantize_rows(dh)``."""
    _check_dh(h, da)
    dh = swiglu_backward_ref(h, da)
    return (dh, *quantize_rows(dh))


def quantize_group_cols_ref(
    x: torch.Tensor, offs: torch.Tensor, index: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of the op behind :func:`quantize_group_cols_fused`: ``(data (C, P) row-major, inv)`` of
    ``quantize_group_cols(rows, group_ids(offs, P), E, transposed=True)``, ``rows`` = ``x`` or ``x`` gathered."""
    p = _check_group(x, offs, index, "x", "fp8kit::moe_rw_group_cols_quant")
    rows = x if index is None else _gathered(x, index)
    return quantize_group_cols(rows, group_ids(offs, p), offs.shape[0], transposed=True)


def quantize_group_cols_dual_ref(
    g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, index_x: torch.Tensor | None,
    index_g: torch.Tensor | None = None, weight_g: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of the op behind :func:`quantize_group_cols_dual`: both ``(C, P)`` row-major buffers."""
    _check_dual(g, x, offs, index_x, index_g, weight_g)
    g_rows = g if index_g is None else _gathered(g, index_g, weight_g)
    return (*quantize_group_cols_ref(g_rows, offs, None), *quantize_group_cols_ref(x, offs, index_x))


def quantize_experts_dual_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of the op behind :func:`quantize_experts_dual`: ``quantize_experts(w, -1)`` and
    ``quantize_experts(w, -2)``, data as their row-major buffers ``(E, N, K)`` and ``(E, K, N)``."""
    _check_w(w)
    fprop, fprop_inv = quantize_experts(w, -1)
    dgrad, dgrad_inv = quantize_experts(w, -2)
    return fprop.transpose(-2, -1), fprop_inv, dgrad.transpose(-2, -1), dgrad_inv


# --------------------------------------------------------------------------- ops

def _triton_kernels():
    """:mod:`fp8kit.moe.rowwise_quant_triton`, or None (``base.triton_lib.triton_module``)."""
    return triton_module("fp8kit.moe.rowwise_quant_triton", "MoE rowwise quantization")


def _rows_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` with unit stride along its last dim (the kernels' only layout requirement)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _f32(like: torch.Tensor, *shape: int) -> torch.Tensor:
    return like.new_empty(*shape, dtype=torch.float32)


@torch.library.custom_op("fp8kit::moe_rw_gather_quant", mutates_args=())
def _gather_op(src: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return gather_quantize_rows_ref(src, index)


@_gather_op.register_kernel("cuda")
def _(src, index):
    _check_gather(src, index)
    kernels = _triton_kernels()
    if kernels is None or index.numel() == 0 or src.shape[1] == 0:
        return gather_quantize_rows_ref(src, index)
    with torch.cuda.device(src.device):
        return kernels.gather_quantize_rows(_rows_last(src), index.contiguous())


@_gather_op.register_fake
def _(src, index):
    _check_gather(src, index)
    return src.new_empty(index.shape[0], src.shape[1], dtype=FP8), _f32(src, index.shape[0])


#: Top-k from which the dispatch casts run from the tokens' side (each token read once, stored at its top-k rows)
#: instead of gathering each row. Alone on the H100: 1.35-2.3x faster at top-8 (Qwen3-30B-A3B, DeepSeek-V3),
#: 1.1-1.7x at top-4 (session 24); at top-2 (Mixtral) 0.8-0.96x with session 24's tile, and with session 27's tile
#: 1.57x for the dispatch cast and 1.17x for the combine backward's weighted cast (session 30, the same bits).
#: Inside the expert layer the gain is smaller (the gather's re-reads hit L2): 9-19% of these casts at top-8, and at
#: Mixtral's top-2 0.27-0.28 -> 0.25 ms per layer (``benchmarks/experiments/scatter_rows/``; docs/benchmarks.md
#: section 4, sessions 24 and 30). Top-1 (expert parallelism's received rows) keeps the gather: nothing to share.
SCATTER_MIN_TOPK = 2


@torch.library.custom_op("fp8kit::moe_rw_dispatch_quant", mutates_args=())
def _dispatch_op(src: torch.Tensor, index: torch.Tensor, pair_rows: torch.Tensor, weight: torch.Tensor | None,
                 keep_rows: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return dispatch_quantize_rows_ref(src, index, pair_rows, weight, keep_rows)


@_dispatch_op.register_kernel("cuda")
def _(src, index, pair_rows, weight, keep_rows):
    topk = _check_dispatch(src, index, pair_rows, weight)
    kernels = _triton_kernels()
    if kernels is None or index.numel() == 0 or src.shape[1] == 0 or src.shape[0] == 0:
        return dispatch_quantize_rows_ref(src, index, pair_rows, weight, keep_rows)
    empty = src.new_empty(0, src.shape[1])
    src = _rows_last(src)
    with torch.cuda.device(src.device):
        if topk >= SCATTER_MIN_TOPK:
            out = kernels.scatter_quantize_rows(src, index.contiguous(), pair_rows.contiguous(),
                                                None if weight is None else weight.contiguous(), keep_rows)
            if out is not None:
                q, inv, rows = out
                return q, inv, empty if rows is None else rows
        w_row = None if weight is None else _row_weights(weight, pair_rows, index.shape[0])  # the gather kernel's
        q, inv, *rows = kernels.gather_quantize_rows(src, index.contiguous(), weight=w_row, keep_rows=keep_rows)
    return q, inv, rows[0] if rows and rows[0] is not None else empty


@_dispatch_op.register_fake
def _(src, index, pair_rows, weight, keep_rows):
    _check_dispatch(src, index, pair_rows, weight)
    p, k = index.shape[0], src.shape[1]
    return src.new_empty(p, k, dtype=FP8), _f32(src, p), src.new_empty(p if keep_rows else 0, k)


@torch.library.custom_op("fp8kit::moe_dispatch_rows", mutates_args=())
def _rows_op(src: torch.Tensor, index: torch.Tensor, pair_rows: torch.Tensor) -> torch.Tensor:
    _check_dispatch(src, index, pair_rows, None)
    return _gathered(src, index)


@_rows_op.register_kernel("cuda")
def _(src, index, pair_rows):
    topk = _check_dispatch(src, index, pair_rows, None)
    kernels = _triton_kernels()
    if kernels is not None and topk >= SCATTER_MIN_TOPK and index.numel() and src.shape[1]:
        with torch.cuda.device(src.device):
            out = kernels.scatter_quantize_rows(_rows_last(src), index.contiguous(), pair_rows.contiguous(), cast=False)
        if out is not None:
            return out[2]
    return gather_rows(src, index)  # one compiled kernel on CUDA, as before this op


@_rows_op.register_fake
def _(src, index, pair_rows):
    _check_dispatch(src, index, pair_rows, None)
    return src.new_empty(index.shape[0], src.shape[1])


@torch.library.custom_op("fp8kit::moe_rw_swiglu_quant", mutates_args=())
def _swiglu_op(h: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_quantize_rows_ref(h, interleaved)


@_swiglu_op.register_kernel("cuda")
def _(h, interleaved):
    i = _check_h(h)
    kernels = _triton_kernels()
    if kernels is None or h.shape[0] == 0 or i == 0:
        return swiglu_quantize_rows_ref(h, interleaved)
    with torch.cuda.device(h.device):
        return kernels.swiglu_quantize_rows(_rows_last(h), interleaved)


@_swiglu_op.register_fake
def _(h, interleaved):
    i = _check_h(h)
    p = h.shape[0]
    return h.new_empty(p, i), h.new_empty(p, i, dtype=FP8), _f32(h, p)


@torch.library.custom_op("fp8kit::moe_rw_swiglu_bwd_quant", mutates_args=())
def _swiglu_bwd_op(h: torch.Tensor, da: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return swiglu_backward_quantize_rows_ref(h, da)


@_swiglu_bwd_op.register_kernel("cuda")
def _(h, da):
    _check_dh(h, da)
    kernels = _triton_kernels()
    if kernels is None or h.shape[0] == 0 or h.shape[1] == 0:
        return swiglu_backward_quantize_rows_ref(h, da)
    with torch.cuda.device(h.device):
        return kernels.swiglu_backward_quantize_rows(_rows_last(h), _rows_last(da))


@_swiglu_bwd_op.register_fake
def _(h, da):
    _check_dh(h, da)
    p, k = h.shape
    return h.new_empty(p, k), h.new_empty(p, k, dtype=FP8), _f32(h, p)


@torch.library.custom_op("fp8kit::moe_rw_group_cols_quant", mutates_args=())
def _group_op(x: torch.Tensor, offs: torch.Tensor, index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_group_cols_ref(x, offs, index)


@_group_op.register_kernel("cuda")
def _(x, offs, index):
    p = _check_group(x, offs, index, "x", "fp8kit::moe_rw_group_cols_quant")
    kernels = _triton_kernels()
    if kernels is None or p == 0 or x.shape[1] == 0:
        return quantize_group_cols_ref(x, offs, index)
    with torch.cuda.device(x.device):
        return kernels.quantize_group_cols(_rows_last(x), offs.contiguous(), None if index is None else index.contiguous())


@_group_op.register_fake
def _(x, offs, index):
    p = _check_group(x, offs, index, "x", "fp8kit::moe_rw_group_cols_quant")
    c = x.shape[1]
    return x.new_empty(c, p, dtype=FP8), _f32(x, offs.shape[0] * c)


@torch.library.custom_op("fp8kit::moe_rw_group_cols_dual_quant", mutates_args=())
def _dual_op(g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, index_x: torch.Tensor | None,
             index_g: torch.Tensor | None, weight_g: torch.Tensor | None) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_group_cols_dual_ref(g, x, offs, index_x, index_g, weight_g)


def _contig(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


@_dual_op.register_kernel("cuda")
def _(g, x, offs, index_x, index_g, weight_g):
    _check_dual(g, x, offs, index_x, index_g, weight_g)
    kernels = _triton_kernels()
    p = g.shape[0] if index_g is None else index_g.shape[0]
    if kernels is None or p == 0 or g.shape[1] == 0 or x.shape[1] == 0:
        return quantize_group_cols_dual_ref(g, x, offs, index_x, index_g, weight_g)
    with torch.cuda.device(g.device):
        return kernels.quantize_group_cols_dual(_rows_last(g), _rows_last(x), offs.contiguous(), _contig(index_x),
                                                _contig(index_g), _contig(weight_g))


@_dual_op.register_fake
def _(g, x, offs, index_x, index_g, weight_g):
    _check_dual(g, x, offs, index_x, index_g, weight_g)
    p = g.shape[0] if index_g is None else index_g.shape[0]
    n, k, e = g.shape[1], x.shape[1], offs.shape[0]
    return g.new_empty(n, p, dtype=FP8), _f32(g, e * n), g.new_empty(k, p, dtype=FP8), _f32(g, e * k)


@torch.library.custom_op("fp8kit::moe_rw_experts_dual_quant", mutates_args=())
def _experts_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return quantize_experts_dual_ref(w)


@_experts_op.register_kernel("cuda")
def _(w):
    _check_w(w)
    kernels = _triton_kernels()
    if kernels is None or w.numel() == 0:
        return quantize_experts_dual_ref(w)
    with torch.cuda.device(w.device):
        return kernels.quantize_experts_dual(_rows_last(w))


def _experts_fake(w):
    _check_w(w)
    e, n, k = w.shape
    return w.new_empty(e, n, k, dtype=FP8), _f32(w, e, n), w.new_empty(e, k, n, dtype=FP8), _f32(w, e, k)


_experts_op.register_fake(_experts_fake)


@torch.library.custom_op("fp8kit::moe_rw_experts_dual_quant_hinted", mutates_args=())
def _experts_hinted_op(w: torch.Tensor, row_hint: torch.Tensor, col_hint: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_hints(w, row_hint, col_hint)
    return quantize_experts_dual_ref(w)


@_experts_hinted_op.register_kernel("cuda")
def _(w, row_hint, col_hint):
    _check_hints(w, row_hint, col_hint)
    kernels = triton_module("fp8kit.moe.rowwise_weights_triton", "MoE expert-weight quantization")
    if kernels is None or w.numel() == 0:
        return quantize_experts_dual_ref(w)
    with torch.cuda.device(w.device):
        return kernels.quantize_experts_dual_hinted(_rows_last(w), row_hint.contiguous(), col_hint.contiguous())[:4]


@_experts_hinted_op.register_fake
def _(w, row_hint, col_hint):
    _check_hints(w, row_hint, col_hint)
    return _experts_fake(w)


_EXPERTS_CACHE = WeightCache(lambda w: torch.ops.fp8kit.moe_rw_experts_dual_quant(w), "moe rowwise experts",
                             requantize=lambda w, old: torch.ops.fp8kit.moe_rw_experts_dual_quant_hinted(
                                 w, old[1], old[3]))
_CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)


@torch.library.custom_op("fp8kit::moe_rw_experts_dual_quant_cached", mutates_args=(),
                         tags=(_CUDAGRAPH_UNSAFE,) if _CUDAGRAPH_UNSAFE is not None else ())
def _experts_cached_op(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # the lookup runs inside the op, so torch.compile treats it as opaque (as the dense blockwise cache)
    return _EXPERTS_CACHE.get(w)


_experts_cached_op.register_fake(_experts_fake)


def experts_cache_stats() -> dict[str, int]:
    """``{"hits", "misses", "entries"}`` of the expert-weight cache (:mod:`fp8kit.fp8.weight_cache`)."""
    return _EXPERTS_CACHE.stats()


# --------------------------------------------------------------------------- public entry points

def gather_quantize_rows(src: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise E4M3 copy of the rows of ``src`` gathered by ``index`` (a zero row where ``index == T``).

    Equal bit for bit to ``quantize_rows(torch.cat([src, zeros(1, K)])[index])`` (:mod:`fp8kit.moe.quantize`);
    on CUDA one Triton kernel reads each source row through ``index``.

    Args:
        src: ``(T, K)`` bf16 / fp16 / fp32 tokens.
        index: ``(P,)`` int64 (or int32) source row of each output row, on ``src``'s device, values in
            ``[0, T]``, ``T`` meaning a zero row (``routing.Dispatch.gather_idx``). Values outside that range
            are the caller's contract: the CPU path raises IndexError (and wraps negative values), the CUDA
            kernel does not check them.

    Returns:
        ``(q (P, K) E4M3 row-major, inv_scale (P,) float32)``; zero rows get ``inv_scale = 2^-48`` (amax
        floored at ``AMAX_EPS``).

    Raises:
        ValueError: ``src`` not a 2-D float tensor; ``index`` not a 1-D integer tensor on ``src``'s device.
    """
    return torch.ops.fp8kit.moe_rw_gather_quant(src, index)


def dispatch_quantize_rows(src: torch.Tensor, index: torch.Tensor, pair_rows: torch.Tensor,
                           weight: torch.Tensor | None = None, keep_rows: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The rowwise E4M3 copy of the tokens in expert order (the dispatch), knowing the layout from both sides.

    Equal bit for bit to :func:`gather_quantize_rows` ``(src, index)`` (``rows = cat([src, zeros(1, K)])[index]``,
    then ``quantize_rows(rows)``; with ``keep_rows`` also those rows). With ``weight`` each row is first multiplied
    by its pair's weight in float32 (0 for padding) and rounded to ``src``'s dtype: exactly
    ``routing.combine_rows_grad``'s rows when ``src`` is the combined output's gradient (the combine's backward),
    whose ``(P, K)`` product is never written unless ``keep_rows``. On CUDA, from ``SCATTER_MIN_TOPK`` experts per token, one Triton kernel reads each token
    row once and stores it at its top-k rows (reads ``topk`` times fewer bytes than the gather); below it, or
    for rows longer than 8192, the gather kernel.

    Args:
        src: ``(T, K)`` bf16 / fp16 / fp32 tokens (or the combined output's gradient).
        index: ``(P,)`` int64 / int32 source token of each row, ``T`` for padding (``routing.Dispatch.gather_idx``).
        pair_rows: ``(T * topk,)`` int64 / int32 row of each (token, slot) pair, pairs in token-major order
            (``routing.Dispatch.pair_rows``). The two must describe the same layout (``index[pair_rows[i]] ==
            i // topk``, ``index == T`` on the other rows): the CUDA kernels do not check it.
        weight: optional ``(T * topk,)`` float weight per pair, same order (``top_k_weights.reshape(-1)``).
        keep_rows: also return the ``(P, K)`` rows in ``src``'s dtype (weighted and rounded with ``weight``).

    Returns:
        ``(q (P, K) E4M3 row-major, inv_scale (P,) float32, rows (P, K) or None)``.

    Raises:
        ValueError: ``src`` not a 2-D float tensor; ``index`` / ``pair_rows`` not 1-D integer tensors on its
            device; ``pair_rows`` not a whole number of rows per token; ``weight`` not one float per pair.
    """
    q, inv, rows = torch.ops.fp8kit.moe_rw_dispatch_quant(src, index, pair_rows, weight, keep_rows)
    return q, inv, rows if keep_rows else None


def dispatch_rows(src: torch.Tensor, index: torch.Tensor, pair_rows: torch.Tensor) -> torch.Tensor:
    """The tokens in expert order, ``cat([src, zeros(1, K)])[index]`` (``routing.gather_rows``), knowing the layout
    from both sides: on CUDA from ``SCATTER_MIN_TOPK`` experts per token the scatter kernel of
    :func:`dispatch_quantize_rows` without its cast (each token row read once); below it a gather.

    Args:
        src, index, pair_rows: as :func:`dispatch_quantize_rows`.

    Returns:
        ``(P, K)`` in ``src``'s dtype; padding rows zero.

    Raises:
        ValueError: as :func:`dispatch_quantize_rows`.
    """
    return torch.ops.fp8kit.moe_dispatch_rows(src, index, pair_rows)


def swiglu_quantize_rows(h: torch.Tensor, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SwiGLU of the gate_up output and its rowwise E4M3 copy, from one read of ``h``.

    Args:
        h: ``(P, 2I)`` bf16 / fp16 / fp32; gate and up split as by :func:`fp8kit.moe.token_quant.split_gate_up`
            (halves, or even / odd columns when ``interleaved``).
        interleaved: the gate_up layout (transformers' ``is_concatenated = False``).

    Returns:
        ``(a (P, I) h.dtype, q (P, I) E4M3 row-major, inv_scale (P,) float32)``: ``a = silu(gate) * up`` bit for
        bit as :func:`fp8kit.moe.token_quant.swiglu_ref` (Cephes ``expf`` sigmoid, float32, one rounding), then
        ``quantize_rows(a)`` of those rounded values.

    Raises:
        ValueError: ``h`` not a 2-D float tensor or its last dim odd.
    """
    return torch.ops.fp8kit.moe_rw_swiglu_quant(h, interleaved)


def swiglu_backward_quantize_rows(h: torch.Tensor, da: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The SwiGLU backward of the fused experts and the rowwise E4M3 cast of its output, from one read of ``h`` and
    ``da``: the gate_up GEMM's output gradient for its dgrad (``q``) and, in ``h``'s dtype, for its wgrad cast.

    Args:
        h: ``(P, 2I)`` bf16 / fp16 / fp32 gate_up output (gate half, up half).
        da: ``(P, I)`` float gradient of ``a = silu(gate) * up``.

    Returns:
        ``(dh (P, 2I) h.dtype, q (P, 2I) E4M3 row-major, inv_scale (P,) float32)``: ``dh`` is
        :func:`swiglu_backward_ref` (on CUDA within a bf16 ulp of it: the kernel's sigmoid is the hardware's, as
        Inductor's, which computed ``dh`` here before), ``(q, inv_scale)`` exactly ``quantize_rows(dh)``.

    Raises:
        ValueError: ``h`` not a 2-D float tensor with an even last dim, or ``da`` not ``(P, I)`` on its device.
    """
    return torch.ops.fp8kit.moe_rw_swiglu_bwd_quant(h, da)


def quantize_group_cols_fused(
    x: torch.Tensor, offs: torch.Tensor, *, transposed: bool, index: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One E4M3 scale per (group, column) of ``x`` (P, C) or of ``x`` gathered by ``index``: a wgrad operand.

    Equal bit for bit to ``quantize_group_cols(rows, group_ids(offs, P), E, transposed=transposed)``
    (:mod:`fp8kit.moe.quantize`), ``rows = x`` or ``cat([x, zeros(1, C)])[index]``, on the whole tensor: rows
    past ``offs[-1]`` are cast with their own dummy group's scale, as the reference does. On CUDA one program
    per (group, column block) reduces the group's rows and casts them; no scatter, no gathered copy.

    Args:
        x: ``(P, C)`` bf16 / fp16 / fp32, rows grouped contiguously; with ``index``: ``(T, C)`` source rows.
        offs: ``(E,)`` int32 / int64 cumulative group ends (sorted; the grouped GEMM's ``offs``).
        transposed: ``True`` for the left operand ``g^T``: data ``(C, P)`` row-major; ``False`` for the right
            operand ``x``: data ``(P, C)`` column-major (a ``(C, P)`` row-major buffer viewed transposed).
        index: optional ``(P,)`` int64 / int32 row of ``x`` per row, ``T`` = a zero row (as in
            :func:`gather_quantize_rows`).

    Returns:
        ``(data, inv_scale (E*C,) float32, group-major)``.

    Raises:
        ValueError: ``x`` not a 2-D float tensor; ``offs`` or ``index`` not 1-D integer tensors on ``x``'s
            device; ``offs`` empty.
    """
    data, inv = torch.ops.fp8kit.moe_rw_group_cols_quant(x, offs, index)
    return (data if transposed else data.t()), inv


def quantize_group_cols_dual(
    g: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, index_x: torch.Tensor | None = None,
    index_g: torch.Tensor | None = None, weight_g: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both wgrad operands in one launch: ``g`` as :func:`quantize_group_cols_fused` with ``transposed=True``
    and ``x`` (read through ``index_x`` if given) with ``transposed=False``.

    Args:
        g: ``(P, N)`` output gradients, or ``(T, N)`` read through ``index_g (P,)`` with each row times
            ``weight_g (P,)`` (as :func:`dispatch_quantize_rows` with ``weight``: the combine's backward, fused);
        x: ``(P, K)`` activations, or ``(T, K)`` with ``index_x (P,)``;
        offs: ``(E,)`` cumulative group ends.

    Returns:
        ``(g_data (N, P) row-major, g_inv (E*N,), x_data (P, K) column-major, x_inv (E*K,))``, all float32
        scales group-major.

    Raises:
        ValueError: as :func:`quantize_group_cols_fused`, ``g`` and ``x`` with different row counts, or only one of
            ``index_g`` / ``weight_g``.
    """
    g_data, g_inv, x_data, x_inv = torch.ops.fp8kit.moe_rw_group_cols_dual_quant(g, x, offs, index_x, index_g,
                                                                                 weight_g)
    return g_data, g_inv, x_data.t(), x_inv


def quantize_experts_dual(w: torch.Tensor, cache: bool = False,
                          hints: tuple[torch.Tensor, torch.Tensor] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both right operands of the expert weights ``w`` (E, N, K): ``quantize_experts(w, -1)`` and
    ``quantize_experts(w, -2)`` (:mod:`fp8kit.moe.quantize`), bit for bit.

    With ``cache`` the result is computed once per weight version and optimizer step and reused across
    gradient-accumulation micro-batches (:class:`fp8kit.fp8.weight_cache.WeightCache`; the same bits); a new
    version is cast with the previous version's scales as hints.

    On CUDA without hints, two kernels (one read of ``w`` could not know a column's scale before the whole column
    is seen): the first reads ``w`` once for the row amax (fprop) and the column amax (dgrad, atomic max), the
    second reads it again and writes both casts of each tile. With ``hints`` (float32 ``(E, N)`` and ``(E, K)``: the
    ``fprop_inv`` and ``dgrad_inv`` expected, normally those of the previous optimizer step) one kernel reads ``w``
    once, casts with the hinted scales and gathers the amaxes, and a second recasts only the rows and columns whose
    scale is not the hinted one (:mod:`fp8kit.moe.rowwise_weights_triton`): the same bits for any hints. On the CPU
    hints are checked and otherwise unused.

    Returns:
        ``(fprop_data (E, K, N), fprop_inv (E, N), dgrad_data (E, N, K), dgrad_inv (E, K))``: ``fprop_data`` the
        transposed view of an ``(E, N, K)`` row-major buffer, ``dgrad_data`` column-major (an ``(E, K, N)``
        row-major buffer viewed transposed), exactly the layouts ``quantize_experts`` returns.

    Raises:
        ValueError: ``w`` not a 3-D float tensor; hints not float32 ``(E, N)`` and ``(E, K)`` on ``w``'s device; hints
            with ``cache`` (the cache keeps its own).
    """
    if hints is not None and cache:
        raise ValueError("quantize_experts_dual: hints and cache=True cannot be combined (the weight cache casts a new "
                         "weight version with the previous version's scales itself)")
    if hints is not None:
        fprop, fprop_inv, dgrad, dgrad_inv = torch.ops.fp8kit.moe_rw_experts_dual_quant_hinted(w, *hints)
    else:
        op = torch.ops.fp8kit.moe_rw_experts_dual_quant_cached if cache else torch.ops.fp8kit.moe_rw_experts_dual_quant
        fprop, fprop_inv, dgrad, dgrad_inv = op(w)
    return fprop.transpose(-2, -1), fprop_inv, dgrad.transpose(-2, -1), dgrad_inv
