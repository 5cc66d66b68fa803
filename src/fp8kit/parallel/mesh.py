"""The run's process layout: ``[distributed]`` sizes -> a checked :class:`ParallelDims` -> a DeviceMesh.

The mesh is ``dp_replicate x dp_shard x tp`` (outer to inner; tp innermost so that the tensor-parallel
ranks are neighbours, on one host under torchrun's usual numbering). Data-parallel ranks (``dp =
dp_replicate x dp_shard``) see different micro-batches; the ``tp`` ranks of one data-parallel rank see
the same micro-batch. Nothing here reads the environment at import; :func:`init_distributed` reads
torchrun's ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` when it is called.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fp8kit.base.errors import ConfigError
from fp8kit.moe.expert_parallel import check_ep_layout


@dataclass(frozen=True)
class ParallelDims:
    """Resolved parallel sizes; ``dp_replicate * dp_shard * tp == world_size`` always holds.

    Attributes:
        dp_replicate: replicated data-parallel size (HSDP's outer dimension).
        dp_shard: FSDP2 sharding size (``-1`` resolved).
        tp: tensor-parallel size.
        world_size: the number of processes.
        ep: expert-parallel size (ranks borrowed from data and tensor parallelism; ``fp8kit.moe.expert_parallel``).
    """

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different micro-batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """Parameters are sharded with FSDP2 (``dp_shard > 1``) or replicated with HSDP."""
        return self.dp_shard > 1 or self.dp_replicate > 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        return (f"world {self.world_size} = dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} "
                f"x tp {self.tp}" + (f", ep {self.ep}" if self.ep > 1 else ""))


def resolve_dims(dp_shard: int, dp_replicate: int, tp: int, ep: int, world_size: int) -> ParallelDims:
    """Check ``[distributed]`` against the world size; ``dp_shard = -1`` takes what is left.

    Raises:
        ConfigError: the product of the sizes differs from the world size (naming the keys and the
            world size), or ``ep`` does not fit (``moe.expert_parallel.check_ep_layout``: ``ep`` must
            divide ``dp_replicate x dp_shard x tp``).
    """
    if dp_shard == -1:
        rest = dp_replicate * tp
        if world_size % rest:
            raise ConfigError(
                f"[distributed] dp_replicate = {dp_replicate} x tp = {tp} = {rest} does not divide the world size "
                f"{world_size} (dp_shard = -1 fills the mesh with world size / (dp_replicate x tp))"
            )
        dp_shard = world_size // rest
    product = dp_replicate * dp_shard * tp
    if product != world_size:
        raise ConfigError(
            f"[distributed] dp_replicate = {dp_replicate} x dp_shard = {dp_shard} x tp = {tp} = {product} ranks, "
            f"but the world size is {world_size} (torchrun --nproc_per_node x --nnodes); set dp_shard = -1 to fill "
            f"the mesh"
        )
    check_ep_layout(ep, dp_replicate * dp_shard, tp, key="[distributed] ep")
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, world_size=world_size, ep=ep)


def init_distributed(dims: ParallelDims, device: torch.device):
    """Start the process group (NCCL on CUDA, gloo on CPU) and build the DeviceMesh.

    Args:
        dims: the resolved sizes (``dims.world_size`` must equal torchrun's ``WORLD_SIZE``).
        device: ``cuda`` or ``cpu``; on CUDA each process takes the GPU ``LOCAL_RANK``.

    Returns:
        ``(mesh, device)``: a 3-D DeviceMesh with dims ``("dp_replicate", "dp_shard", "tp")`` (sizes may
        be 1) and this process's device.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(
        device.type, (dims.dp_replicate, dims.dp_shard, dims.tp), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
    )
    return mesh, device


def end_distributed(*, completed: bool) -> None:
    """End the default process group a torchrun launch started (no-op when none is initialized).

    Args:
        completed: every rank reached this call the normal way (the run returned on all of them). Then the
            ranks first meet at a barrier, so no rank tears down its gloo / NCCL connections while a peer is
            still finishing the last collective with it: a gloo rank that did so aborted with "terminate
            called without an active exception" (SIGABRT) under load, failing a finished run. ``False`` on
            an error path: no barrier, since a failed peer would never join it.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if completed:
        dist.barrier()
    dist.destroy_process_group()


def dp_mesh(mesh):
    """The data-parallel sub-mesh: ``("dp_replicate", "dp_shard")`` (2-D, for HSDP) or ``"dp_shard"``."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def dp_group(mesh):
    """The process group over all data-parallel ranks (metrics are averaged over it)."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
    return mesh["dp_shard"].get_group()


def dp_rank(mesh) -> int:
    """This process's index among the data-parallel ranks (which slice of the global batch it takes)."""
    return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()
