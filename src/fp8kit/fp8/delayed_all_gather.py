"""FSDP2 all-gather of the delayed recipe's weights in E4M3 (``fp8.enable_fsdp_float8_all_gather`` with
``fp8.recipe = "delayed"``): half the bytes of a BF16 all-gather, and no weight cast in the forward.

Why it fits delayed scaling: the weight's scale comes from its amax history, so it is known before the
all-gather, and every rank holds the same one (the roll reduces the records over the data-parallel group). Each
rank casts its own shard with it (``saturate(w * scale) -> E4M3``, the very math of
:func:`fp8kit.fp8.delayed._cast_impl`, elementwise), and the gathered bytes are those of the whole weight cast
on one rank, bit for bit. Before the first recorded step (dynamic scales) the scale comes from the whole
weight's amax: the shards' amaxes MAX-reduced over the FSDP mesh, as the dynamic cast reduces them over the
group. The weight's amax for the history is recorded here, from the shard (the roll reduces the records over
the group, so every rank records the whole weight's), at every gather (FSDP2 gathers under ``no_grad``; the
weights, so their amax, change only at the optimizer step).

The mechanism is FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) on a
wrapper subclass of the sharded parameter, as torchao's ``WeightWithDynamicFloat8CastTensor`` does for its
tensorwise recipe; the gathered weight is torchao's ``Float8TrainingTensor`` (E4M3 data, its scale, reporting
the parameter's dtype to autograd), which the delayed linear and the fused delayed MLP take instead of casting
(:func:`fp8kit.fp8.delayed.gathered_fp8`). A projection swapped to BF16 (``DelayedEntry.active`` false: the
precision schedule's BF16 phases, the divergence guard) all-gathers its BF16 weight.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8kit.fp8.delayed import _amax, _cast_impl, _cast_on_device, float8_tensor_types
from fp8kit.fp8.delayed_state import E4M3, DelayedEntry, DelayedScalingState, record_, reduce_max
from fp8kit.fp8.fsdp_weight import FP8AllGatherWeight
from fp8kit.fp8.scaling import scale_from_amax


class DelayedFloat8Weight(FP8AllGatherWeight):
    """A delayed linear's weight (or its FSDP2 shard) whose all-gather is E4M3 (module docstring).

    Every op but FSDP2's all-gather hooks sees the wrapped tensor ``_tensor`` (:class:`FP8AllGatherWeight`).
    ``entry`` is the module's :class:`~fp8kit.fp8.delayed_state.DelayedEntry` (its bound weight scale, its record),
    ``state`` the :class:`~fp8kit.fp8.delayed_state.DelayedScalingState` holding it (its ``group`` reduces a
    dynamic scale).
    """

    _entry: DelayedEntry
    _state: DelayedScalingState

    def fsdp_pre_all_gather(self, mesh) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The shard to all-gather: E4M3 with the entry's weight scale (dynamic before the first recorded step),
        or the BF16 shard itself for a projection running in BF16 now."""
        e, w = self._entry, self._tensor
        if not e.active:
            return (w,), None
        if e.started:  # one read of the shard on CUDA: the cast and its amax (fp8.delayed._cast_on_device)
            scale = e.scale[1]
            q, amax = _cast_on_device(w, scale, E4M3)
        else:
            # the whole weight's amax: over the state's group (every data-parallel rank), as the dynamic cast
            # reduces it (fp8.delayed._cast)
            amax = _amax(w)
            scale = scale_from_amax(reduce_max(amax, self._state.group), E4M3)
            q = _cast_impl(w, scale, E4M3)[0]
        # FSDP2 all-gathers under no_grad, so the record is written at every gather: the weight's amax depends on
        # the weights only, which change at the optimizer step, so an evaluation forward's or the backward's
        # re-gather writes the value the training forward writes (the roll takes it with the step's records)
        record_(e.forward_amax, 1, amax)
        return (q,), scale

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None):
        """The unsharded weight: torchao's ``Float8TrainingTensor`` of the gathered E4M3 bytes and the scale they
        were cast with (or the gathered BF16 weight)."""
        (data,) = all_gather_outputs
        if out is not None:  # FSDP2 reuses the unsharded tensor: only an E4M3 one has a scale to refresh
            if metadata is not None:
                out._scale = metadata
            return None
        if metadata is None:
            return data, (data,)
        tt = float8_tensor_types()
        return tt.Float8TrainingTensor(data, metadata, param_dtype, tt.LinearMMConfig(),
                                       gemm_input_role=tt.GemmInputRole.WEIGHT), (data,)


def wrap_weight(module: torch.nn.Module) -> None:
    """Make ``module.weight`` (a delayed linear's) a :class:`DelayedFloat8Weight` Parameter, before ``fully_shard``
    and before the optimizer is built. Idempotent."""
    w = module.weight
    if isinstance(w.data, DelayedFloat8Weight):
        return
    module.weight = torch.nn.Parameter(DelayedFloat8Weight(w.data, entry=module._entry, state=module.state),
                                       requires_grad=w.requires_grad)
