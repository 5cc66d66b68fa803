"""FP8AdamW over FSDP2 (DTensor) parameters: each rank steps its own shards, with per-tensor scales.

Under FSDP2 every parameter is a DTensor sharded on dim 0 (``Shard(0)`` over ``dp_shard``; HSDP adds a
``Replicate()`` dim over ``dp_replicate``). A group's flat layout (``optim/layout.py``) is built over the
local shards (``p.to_local()``; its gradient ``p.grad.to_local()``), so each rank holds and updates 1/N
of the states.

Scales are per tensor, **reduced over the shard group**, not per shard: each step the new amaxes of the
group's scaled states (``(3, T)``: ``m``, ``v``, ``master``; COAT's amin too) go through one all-reduce MAX
per sharded mesh dimension (one for FSDP2), batched for the whole group, and every rank computes the same
scales one process would. Why: (1) the FP8 payload of a tensor is then an ordinary sharded tensor with
one scale, so DCP can reshard it (dp_shard = 2 -> 1 or any other layout) without requantizing; per-shard
scales would have to be stored and merged per layout; (2) the numerics are the single process's, up to
the summation order of the gradient's reduce-scatter. Per-block scales would need no reduction, but
``granularity = "block"`` is refused under FSDP2: blocks of the unsharded layout straddle shard
boundaries unless every shard starts on a block boundary, which 1-D parameters (norms) do not.

Stochastic rounding uses each element's index in the *unsharded* group's layout (``noise_delta``: the
offset from the local flat index), so its random numbers, like the scales, do not depend on the sharding.

The working weights: FSDP2 owns the local shards (and may reallocate them: uneven shards are re-padded
at its lazy init), so they cannot become views into the optimizer's flat buffer. The step writes the new
weights into a temporary flat buffer and copies each segment into ``p.to_local()`` (one more read and
write of 2 bytes/param per step, no persistent memory). The master weights are the optimizer's own.

Not supported (refused with a one-line error): FP8 gradients (``grad = "e5m2"/"e4m3"``: FSDP2 already
holds the reduce-scattered gradient shard), per-block scales, tensor parallel / other placements
(``Shard(d)`` with d > 0).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fp8kit.optim.layout import FlatLayout


def is_dtensor(t: torch.Tensor) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (FSDP2 / TP parameter or gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class ShardInfo:
    """How a group's DTensor parameters are sharded: mesh, placements, reduction groups, noise offsets.

    Args:
        params: the group's DTensor parameters (one mesh, placements ``Shard(0)`` / ``Replicate()`` only).
        block: the layout's block size (to rebuild the unsharded layout's offsets).
        device: where ``noise_delta`` lives.

    Raises:
        ValueError: mixed meshes/placements in the group, or a placement other than Shard(0)/Replicate.
    """

    def __init__(self, params: list[torch.Tensor], block: int, device: torch.device):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        p0 = params[0]
        self.mesh, self.placements = p0.device_mesh, tuple(p0.placements)
        for i, p in enumerate(params):
            if not is_dtensor(p):
                raise ValueError(f"FP8AdamW: a parameter group mixes DTensor and plain parameters (parameter {i} "
                                 f"of shape {tuple(p.shape)}); put them into different groups")
            if p.device_mesh != self.mesh or tuple(p.placements) != self.placements:
                raise ValueError(
                    f"FP8AdamW: parameter {i} of shape {tuple(p.shape)} has mesh/placements {p.device_mesh}/"
                    f"{p.placements}, the group's first {self.mesh}/{self.placements}; one mesh and placement per group"
                )
        for pl in self.placements:
            if not (isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0)):
                raise ValueError(
                    f"FP8AdamW: DTensor placement {pl} is not supported (FSDP2's Shard(0) and HSDP's Replicate "
                    "only; tensor parallel shards on other dims): use optim.name = \"adamw\" with tensor parallel"
                )
        #: mesh dims the tensors are sharded over (the amax and gradient-norm reductions run over these)
        self.shard_dims = [i for i, pl in enumerate(self.placements) if isinstance(pl, Shard)]
        self.groups = [self.mesh.get_group(i) for i in self.shard_dims]
        numels = [p.numel() for p in params]  # global
        starts = []
        for p in params:
            local_shape, offset = compute_local_shape_and_global_offset(p.shape, self.mesh, p.placements)
            if tuple(local_shape) != tuple(p.to_local().shape):
                raise ValueError(f"FP8AdamW: parameter of shape {tuple(p.shape)} has a local shard of shape "
                                 f"{tuple(p.to_local().shape)}, expected {tuple(local_shape)} (uneven custom sharding)")
            row = p.numel() // p.shape[0] if p.dim() and p.shape[0] else 0
            starts.append(offset[0] * row if p.dim() else 0)
        unsharded = FlatLayout.build(numels, block, torch.device("cpu"))
        local = FlatLayout.build([p.to_local().numel() for p in params], block, torch.device("cpu"))
        #: int64 (T,): index in the unsharded group's layout = local flat index + noise_delta[t]
        self.noise_delta = torch.tensor(
            [g + s - lo for g, s, lo in zip(unsharded.offsets, starts, local.offsets, strict=True)],
            dtype=torch.int64, device=device,
        )

    def reduce_max_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce MAX ``t`` in place over the shard group (one collective per sharded mesh dim)."""
        for g in self.groups:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        return t

    def reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """All-reduce SUM ``t`` in place over the shard group (replicas hold equal values: not summed)."""
        for g in self.groups:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=g)
        return t

    def wrap(self, local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's shard, the local shape of ``like``) as a DTensor of ``like``'s global shape,
        mesh and placements (what DCP saves and reshards)."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())
