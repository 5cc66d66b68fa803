"""The unsharded weight of the blockwise FP8 all-gather: E4M3 data and 128x128 block scales, as FSDP2 gathered them.

:class:`GatheredBlockwiseWeight` is what ``fsdp_post_all_gather`` (:mod:`fp8kit.fp8.blockwise_all_gather`) makes of
the gathered bytes and the module then finds as its ``weight``: a ``[N, K]`` tensor reporting the parameter's dtype
to autograd (its gradient is a plain ``[N, K]`` tensor, which FSDP2 reduce-scatters), holding

- ``_data``: E4M3 ``[N, K]``, the fprop layout of :func:`fp8kit.fp8.blockwise.quantize_weight` (``wq``);
- ``_scale``: float32 ``[N/128, L4(K/128)]``, its decoding scales (``ws``, padding 1.0).

A 128x128 block's scale does not depend on any other block, so the shards' quantizations, gathered, are the whole
weight's bit for bit (when every shard holds whole 128-row blocks, which :mod:`fp8kit.fp8.blockwise_all_gather`
checks). :func:`layouts` gives the linear the four tensors its quantization would have: the dgrad copy ``wq^T``
and its scales are a transpose of these (a 128x128 block transposed is the same block), so the forward casts no
weight and reads one byte per element instead of two. ``fp8kit.fp8.kernels.ops.quantize_weight`` and
``quantize_weight_dgrad`` take this path for such a weight.

Kept apart from the all-gather module so that the ops module can recognise the type without importing the
quantization it calls (a module global: recognising it imports nothing, so ``torch.compile`` traces it without a
graph break).
"""

from __future__ import annotations

import torch

from fp8kit.base.errors import Fp8kitError
from fp8kit.fp8.blockwise import BLOCK, round_up4

# FSDP2 and autograd apply these to the unsharded parameter: the same tensor, the wrapper kept
_SAME = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}


class GatheredBlockwiseWeight(torch.Tensor):
    """``[N, K]`` weight of dtype ``dtype`` held as E4M3 ``data`` ``[N, K]`` and float32 128x128 block decoding
    scales ``scale`` ``[N/128, L4(K/128)]`` (module docstring). Only the ops FSDP2 and autograd apply to a
    parameter keep it wrapped (``detach``, ``alias``, a ``view`` / ``as_strided`` of the whole tensor); any other op raises
    ``Fp8kitError`` naming it (not a ``TypeError``: Python's operators would turn that into their own message): the
    blockwise linear reads :func:`layouts`, never the tensor's values."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), dtype=dtype, device=data.device,
                                                   requires_grad=False)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self._data = data
        self._scale = scale

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        t = args[0]
        # a view of the whole tensor as itself (FSDP2 takes the unsharded parameter as an ``as_strided`` view)
        same_view = func in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                             torch.ops.aten.as_strided.default) and list(args[1]) == list(t.shape) and (
            func != torch.ops.aten.as_strided.default or (list(args[2]) == list(t.stride())
                                                         and (args[3] if len(args) > 3 else 0) in (0, None)))
        if isinstance(t, cls) and (func in _SAME or same_view):
            return cls(func(t._data, *args[1:], **kwargs) if func in _SAME else t._data, t._scale, t.dtype)
        raise Fp8kitError(
            f"{func} on a blockwise FP8 weight all-gathered by FSDP2 (fp8.enable_fsdp_float8_all_gather with "
            f"fp8.recipe = 'blockwise'): only fp8kit's blockwise linear reads it; set "
            f"fp8.enable_fsdp_float8_all_gather = false for code that uses the weight's values directly")

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner_tensors, dtype, outer_size, outer_stride):
        return GatheredBlockwiseWeight(inner_tensors["_data"], inner_tensors["_scale"], dtype)

    def __repr__(self) -> str:
        return f"GatheredBlockwiseWeight(shape={tuple(self.shape)}, dtype={self.dtype}, data={self._data.dtype})"


def gathered_blockwise(w: torch.Tensor) -> bool:
    """Whether ``w`` is a :class:`GatheredBlockwiseWeight` (traced by ``torch.compile`` as a plain type test)."""
    return isinstance(w, GatheredBlockwiseWeight)


def layouts(w: GatheredBlockwiseWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(wq, ws, wtq, wts)`` of :func:`fp8kit.fp8.blockwise.quantize_weight` from a gathered weight: ``wq`` and
    ``ws`` as gathered, ``wtq = wq^T`` contiguous ``[K, N]`` and ``wts`` ``[K/128, L4(N/128)]`` (padding 1.0), the
    same bits as quantizing the whole BF16 weight."""
    wq, ws = w._data, w._scale
    return (wq, ws, *dgrad_layout(w))


def dgrad_layout(w: GatheredBlockwiseWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """``(wtq, wts)``, the last two of :func:`layouts` (the backward's dgrad operand)."""
    wq, ws = w._data, w._scale
    n, k = wq.shape
    nb, kb = n // BLOCK, k // BLOCK
    wts = torch.nn.functional.pad(ws[:, :kb].t(), (0, round_up4(nb) - nb), value=1.0)
    return wq.t().contiguous(), wts.contiguous()
