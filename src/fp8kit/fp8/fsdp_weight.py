"""The sharded weight whose FSDP2 all-gather is FP8: the wrapper both fp8kit recipes' FP8 all-gathers build on.

FSDP2 calls ``fsdp_pre_all_gather`` on a sharded parameter's local tensor when that tensor defines it (and
``fsdp_post_all_gather`` on the gathered bytes): the extension torchao's ``WeightWithDynamicFloat8CastTensor``
uses for its tensorwise recipe. :class:`FP8AllGatherWeight` is that wrapper without the hooks: every other op sees
the wrapped tensor ``_tensor`` (same shape, dtype and values), so the optimizer, ``state_dict`` and checkpoints see
a plain weight (DCP saves ``_tensor``: ``fp8kit.train.checkpoint.plain_tensor``). Its subclasses add the hooks:

- :class:`fp8kit.fp8.delayed_all_gather.DelayedFloat8Weight` (E4M3 at the weight's delayed scale);
- :class:`fp8kit.fp8.blockwise_all_gather.BlockwiseFloat8Weight` (E4M3 with one scale per 128x128 block).

A subclass passes its extra state as keyword arguments (``meta``): they are set as ``_<name>`` attributes, kept by
every op that keeps the wrapper, and are the ``__tensor_flatten__`` context ``torch.compile`` carries.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

# FSDP2 pads and copies the local shard with these ops: their outputs stay wrapped (torchao's list)
PRESERVE = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
}


class FP8AllGatherWeight(torch.Tensor):
    """A weight (or its FSDP2 shard) wrapping ``tensor``, with ``meta`` kept as ``_<name>`` attributes (module
    docstring). Not used directly: a subclass defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, **meta: Any):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(), dtype=tensor.dtype,
            layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, **meta: Any):
        self._tensor = tensor
        self._meta = meta
        for name, value in meta.items():
            setattr(self, f"_{name}", value)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        owner = None

        def unwrap(t):
            nonlocal owner
            owner = t
            return t._tensor

        if func == torch.ops.aten.detach.default:
            return type(args[0])(args[0]._tensor.detach(), **args[0]._meta)
        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: type(owner)(t, **owner._meta), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._meta

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, meta, outer_size, outer_stride):
        return cls(inner_tensors["_tensor"], **meta)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._tensor})"
