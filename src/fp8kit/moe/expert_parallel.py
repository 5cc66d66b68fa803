"""Expert parallelism: each of ``ep`` ranks holds ``E / ep`` experts; tokens travel by all-to-all.

Layout (torchtitan's: expert parallelism borrows ranks from ``dp_shard``): the data-parallel ranks form
groups of ``ep`` consecutive ranks; rank ``r`` of a group holds experts ``[r L, (r + 1) L)`` with
``L = E / ep``. The expert weights become DTensors ``Shard(0)`` over the ``ep`` mesh dimension and
``Replicate`` over the other data-parallel dimensions (``edp``: the same experts on another group); FSDP2
leaves them alone (``fully_shard(ignored_params=...)``), DCP saves and reshards them like any DTensor, and
the gradient norm sums their shards.

Forward of one MoE layer on one rank (``moe/experts.py`` calls :func:`ep_experts_forward`):

```
pairs sorted by global expert -> all_to_all (split sizes from an all_to_all of the per-expert counts)
  -> received rows grouped by local expert -> grouped GEMMs (FP8 or BF16) on the local experts
  -> all_to_all back -> pairs in their original order -> weighted sum over the topk experts
```

Both all-to-alls are differentiable (``torch.distributed._functional_collectives.all_to_all_single_autograd``,
the one torchtitan uses); the split
sizes need one device-to-host copy per layer (as in torchtitan and Megatron without padding-free
capacity).

Gradients (why the hook): the loss of each data-parallel rank is the mean over its own tokens and FSDP2
averages the other weights' gradients over all ``dp`` ranks. An expert's local gradient already sums
the contributions of the tokens of every rank in its ep group (the backward all-to-all brings them);
:func:`_scale_expert_grad` adds those of the other groups (all-reduce over ``edp``) and divides by ``dp``,
so expert gradients equal what one process would compute on the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fp8kit.base.errors import ConfigError
from fp8kit.moe import routing


@dataclass
class EPGroup:
    """The expert-parallel layout of a run.

    Attributes:
        mesh: 2-D DeviceMesh ``("edp", "ep")`` over the data-parallel ranks.
        ep: experts are split over this many ranks.
        dp: all data-parallel ranks (``edp x ep``): expert gradients are divided by it.
    """

    mesh: object
    ep: int
    dp: int

    @property
    def group(self):
        return self.mesh["ep"].get_group()

    @property
    def rank(self) -> int:
        return self.mesh["ep"].get_local_rank()


def check_ep_layout(ep: int, dp: int, tp: int, key: str = "distributed.ep") -> None:
    """Check that expert parallelism over ``ep`` ranks fits the mesh (the one place this rule lives).

    ``ep`` must divide the data-parallel size ``dp = dp_replicate x dp_shard`` (its ranks are borrowed
    from data parallelism, as in torchtitan), and ``ep > 1`` needs ``tp = 1``. ``ep = 1`` always fits.

    Raises:
        ConfigError: naming ``key`` (the setting, e.g. ``distributed.ep``) and the sizes.
    """
    if ep > 1 and dp % ep:
        raise ConfigError(f"{key} = {ep} does not divide the data-parallel size dp_replicate x dp_shard = {dp} "
                          f"(expert parallelism borrows its ranks from data parallelism)")
    if ep > 1 and tp > 1:
        raise ConfigError(f"{key} = {ep} with tp = {tp}: expert parallelism with tensor parallelism is not "
                          f"supported; use tp = 1")


def check_ep_divides_experts(ep: int, num_experts: int, where: str, key: str = "distributed.ep") -> None:
    """Check that ``ep`` divides the ``num_experts`` experts of ``where`` (a module name, for the message).

    Raises:
        ConfigError: ``{key} = {ep} does not divide the {num_experts} experts of {where}``.
    """
    if num_experts % ep:
        raise ConfigError(f"{key} = {ep} does not divide the {num_experts} experts of {where}")


def ep_mesh(device_type: str, dp: int, ep: int, tp: int):
    """The ``("edp", "ep", "tp")`` DeviceMesh over the same ranks as the run's main mesh, and its 2-D
    ``("edp", "ep")`` part.

    Raises:
        ConfigError: the sizes do not fit (:func:`check_ep_layout`).
    """
    from torch.distributed.device_mesh import init_device_mesh

    check_ep_layout(ep, dp, tp)
    mesh = init_device_mesh(device_type, (dp // ep, ep, tp), mesh_dim_names=("edp", "ep", "tp"))
    return mesh["edp", "ep"]


def _scale_expert_grad(group: EPGroup):
    edp = group.mesh["edp"]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local = local / group.dp
        if edp.size() > 1:
            dist.all_reduce(local, group=edp.get_group())
        if isinstance(grad, DTensor):
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return local

    return hook


def shard_experts(module: nn.Module, group: EPGroup) -> None:
    """Keep this rank's ``E / ep`` experts of a ``Float8GroupedExperts`` as ``Shard(0)`` DTensors.

    Raises:
        ConfigError: ``ep`` does not divide the module's experts (:func:`check_ep_divides_experts`).
    """
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    check_ep_divides_experts(group.ep, module.num_experts, type(module).__name__)
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(module, name)
        dt = distribute_tensor(p.detach(), group.mesh, [Replicate(), Shard(0)])
        new = nn.Parameter(dt, requires_grad=p.requires_grad)
        new.register_hook(_scale_expert_grad(group))
        setattr(module, name, new)
    module.ep_group = group


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (a DTensor under expert parallelism), differentiably."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


def ep_experts_forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """One MoE layer under expert parallelism (module docstring).

    Args:
        module: a ``Float8GroupedExperts`` after :func:`shard_experts` (``num_experts`` = global E).
        hidden: (T, H) this rank's tokens; top_k_index / top_k_weights: (T, topk) router output.

    Returns:
        (T, H) in ``hidden``'s dtype.
    """
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    group: EPGroup = module.ep_group
    ep, e = group.ep, module.num_experts
    local = e // ep
    t, topk = top_k_index.shape
    ids = top_k_index.reshape(-1).long()
    order = torch.argsort(ids, stable=True)
    x_sorted = hidden[order // topk]
    counts = torch.zeros(e, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group.group)  # [src, local expert] counts for me
    splits = torch.stack([counts.view(ep, local).sum(1), recv_counts.view(ep, local).sum(1)]).tolist()
    send_splits, recv_splits = splits
    recv = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group.group)
    local_ids = torch.repeat_interleave(torch.arange(local, device=ids.device).repeat(ep), recv_counts)
    # The received row count changes every step. torchao's token-keyed autotuning is made once per process
    # (Float8GroupedExperts.grouped_kernel -> grouped_mm.tune_once_for_all_row_counts; without it every new
    # count re-tunes for seconds). The padded buffer is also bucketed (<= 1/8 extra rows) so that
    # torch.compile and the caching allocator see a few shapes (step times: docs/benchmarks.md).
    d = routing.dispatch(local_ids[:, None], local, rows=routing.bucketed_rows(local_ids.numel(), local, ids.numel()))
    x = routing.gather(recv, d)
    h = module._gate(module._linear("gate_up_proj", x, d.offs))
    y = module._linear("down_proj", h, d.offs)[d.pair_rows]
    back = all_to_all_single_autograd(y, send_splits, recv_splits, group.group)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return routing.weighted_sum(back[inverse], top_k_weights, hidden.dtype)
