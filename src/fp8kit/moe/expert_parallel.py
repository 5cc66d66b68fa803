"""Expert parallelism: each of ``ep`` ranks holds ``E / ep`` experts; tokens travel by all-to-all.

Layout (torchtitan's: expert parallelism borrows its ranks from data parallelism, and from tensor
parallelism when ``tp > 1``): the ranks of the run, in the order of the main mesh ``dp_replicate x
dp_shard x tp`` (tp innermost), form groups of ``ep`` consecutive ranks; rank ``r`` of a group holds
experts ``[r L, (r + 1) L)`` with ``L = E / ep``. The expert weights become DTensors ``Shard(0)`` over the
``ep`` mesh dimension and ``Replicate`` over ``edp`` (``dp x tp / ep`` groups holding the same experts);
FSDP2 leaves them alone (``fully_shard(ignored_params=...)``), DCP saves and reshards them like any
DTensor, and the gradient norm sums their shards.

Forward of one MoE layer on one rank (``moe/experts.py`` calls :func:`ep_experts_forward`):

```
[tp > 1: this rank's 1/tp of the tokens, which every tp rank holds alike (see below)]
pairs sorted by global expert -> all_to_all (split sizes from an all_to_all of the per-expert counts;
                                 bf16, or FP8 with ep_fp8_dispatch: moe/fp8_dispatch.py, dispatch_format)
  -> received rows grouped by local expert -> the local experts: the fused rowwise FP8 MLP
     (moe/fused_experts.py, fed the E4M3 payload directly with FP8 dispatch) where the layer runs it, else
     the per-weight grouped GEMMs (FP8 or BF16)
  -> all_to_all back -> pairs in their original order -> weighted sum over the topk experts
[tp > 1: all_gather of the tp ranks' outputs: every tp rank has every token's output again]
```

Every gather and scatter of rows is a gather in both directions (``routing.gather_pairs``, ``pick_rows``,
``combine_pairs``): no autograd ``index_put`` with its sort in the backward.

Both all-to-alls are differentiable (``torch.distributed._functional_collectives.all_to_all_single_autograd``,
the one torchtitan uses); the split
sizes need one device-to-host copy per layer (as in torchtitan and Megatron without padding-free
capacity).

With tensor parallelism (attention TP, ``parallel/parallelize.apply_tp``; the MoE block, router included,
runs on whole tokens on every tp rank) the ``tp`` ranks of one data-parallel rank hold the same tokens and
the same router output. Each of them dispatches only its own ``1/tp`` of the token rows
(:class:`_TPRows`; zero rows pad the token count to a multiple of ``tp``) and the outputs are
all-gathered over ``tp`` (:class:`_TPGather`), so no expert computes a token twice. Gradients: the
output gradient is the same on every tp rank (the rest of the block is replicated or tensor-parallel),
so the gather's backward takes this rank's rows of it, and the slice's backward all-gathers the
gradients of the rows: the gradient of the hidden states and of the router weights is then whole and
the same on every tp rank, as the router's and the norms' replicated weights need.

Gradients of the experts (why the hook): the loss of each data-parallel rank is the mean over its own
tokens and FSDP2 averages the other weights' gradients over all ``dp`` ranks. An expert's local gradient
already sums the contributions of the token rows of every rank in its ep group (the backward all-to-all
brings them); :func:`_scale_expert_grad` adds those of the other groups (all-reduce over ``edp``) and
divides by ``dp``, so expert gradients equal what one process would compute on the global batch (every
token row of the global batch is dispatched by exactly one rank, whatever ``tp``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fp8kit.base.errors import ConfigError
from fp8kit.moe import routing
from fp8kit.moe.fp8_dispatch import fp8_all_to_all, rowwise_dispatch


@dataclass
class EPGroup:
    """The expert-parallel layout of a run.

    Attributes:
        mesh: 2-D DeviceMesh ``("edp", "ep")`` over all ranks of the run (``edp x ep = dp x tp``).
        ep: experts are split over this many ranks.
        dp: all data-parallel ranks (``dp_replicate x dp_shard``): expert gradients are divided by it.
        fp8_dispatch: the forward dispatch all-to-all sends E4M3 (``moe/fp8_dispatch.py``,
            ``distributed.ep_fp8_dispatch``; the payload per layer: :func:`dispatch_format`) instead of the
            activation dtype; the combine stays bf16.
        tp_mesh: the run's 1-D ``tp`` DeviceMesh when ``tp > 1`` (the token rows are split over it), else None.
    """

    mesh: object
    ep: int
    dp: int
    fp8_dispatch: bool = False
    tp_mesh: object = None

    # cached: slicing a DeviceMesh costs about 0.1 ms of host time per call, and the EP forward asks for the group
    # up to four times per layer after its split-size sync, where the GPU waits for the host (session 55's profile)
    @functools.cached_property
    def group(self):
        """The ``ep`` process group (looked up once)."""
        return self.mesh["ep"].get_group()

    @functools.cached_property
    def rank(self) -> int:
        """This rank's index in the ``ep`` group (looked up once)."""
        return self.mesh["ep"].get_local_rank()

    def __getstate__(self) -> dict:
        """The fields without the looked-up process group (not picklable): a copied or pickled layout (``deepcopy``
        of a model, ``torch.save``) looks it up again."""
        return {k: v for k, v in self.__dict__.items() if k not in ("group", "rank")}


def check_ep_layout(ep: int, dp: int, tp: int, key: str = "distributed.ep") -> None:
    """Check that expert parallelism over ``ep`` ranks fits the mesh (the one place this rule lives).

    ``ep`` must divide ``dp x tp`` (``dp = dp_replicate x dp_shard``): its ranks are borrowed from data
    parallelism and, with ``tp > 1``, tensor parallelism (module docstring). ``ep = 1`` always fits.

    Raises:
        ConfigError: naming ``key`` (the setting, e.g. ``distributed.ep``) and the sizes.
    """
    if ep > 1 and (dp * tp) % ep:
        raise ConfigError(f"{key} = {ep} does not divide the number of ranks dp_replicate x dp_shard x tp = "
                          f"{dp} x {tp} = {dp * tp} (expert parallelism borrows its ranks from data and tensor "
                          f"parallelism)")


def check_ep_divides_experts(ep: int, num_experts: int, where: str, key: str = "distributed.ep") -> None:
    """Check that ``ep`` divides the ``num_experts`` experts of ``where`` (a module name, for the message).

    Raises:
        ConfigError: ``{key} = {ep} does not divide the {num_experts} experts of {where}``.
    """
    if num_experts % ep:
        raise ConfigError(f"{key} = {ep} does not divide the {num_experts} experts of {where}")


def ep_mesh(device_type: str, dp: int, ep: int, tp: int):
    """The ``("edp", "ep")`` DeviceMesh over the same ranks as the run's main mesh (``dp x tp`` ranks in
    its order: groups of ``ep`` consecutive ranks).

    Raises:
        ConfigError: the sizes do not fit (:func:`check_ep_layout`).
    """
    from torch.distributed.device_mesh import init_device_mesh

    check_ep_layout(ep, dp, tp)
    return init_device_mesh(device_type, (dp * tp // ep, ep), mesh_dim_names=("edp", "ep"))


def _scale_expert_grad(group: EPGroup):
    edp = group.mesh["edp"]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if edp.size() > 1:  # summed in float32, as FSDP2 reduces the other gradients (reduce_dtype)
            total = local.float()
            dist.all_reduce(total, group=edp.get_group())
            local = (total / group.dp).to(local.dtype)
        else:
            local = local / group.dp
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
    module.reset_scale_hints()


def local_weight(w: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight (a DTensor under expert parallelism), differentiably."""
    from torch.distributed.tensor import DTensor

    return w.to_local() if isinstance(w, DTensor) else w


def _all_gather_rows(x: torch.Tensor, tp_mesh) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_gather_tensor

    return all_gather_tensor(x.contiguous(), 0, tp_mesh.get_group()).wait()


class _TPRows(torch.autograd.Function):
    """This tp rank's rows of a tensor that every tp rank holds alike (rows a multiple of tp); backward:
    the all-gather of the rows' gradients (module docstring)."""

    @staticmethod
    def forward(ctx, x, tp_mesh):
        ctx.tp_mesh = tp_mesh
        n = x.shape[0] // tp_mesh.size()
        r = tp_mesh.get_local_rank()
        return x[r * n:(r + 1) * n].clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad, ctx.tp_mesh), None


class _TPGather(torch.autograd.Function):
    """The tp ranks' rows, all-gathered in rank order; backward: this rank's rows of the gradient (the
    same on every tp rank, module docstring)."""

    @staticmethod
    def forward(ctx, x, tp_mesh):
        ctx.tp_mesh, ctx.rows = tp_mesh, x.shape[0]
        return _all_gather_rows(x, tp_mesh)

    @staticmethod
    def backward(ctx, grad):
        r, n = ctx.tp_mesh.get_local_rank(), ctx.rows
        return grad[r * n:(r + 1) * n].contiguous(), None


def tp_rows(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, tp_mesh):
    """This tp rank's share of the token rows (module docstring): ``(T, .)`` -> ``(ceil(T / tp), .)`` each,
    zero rows (expert 0, router weight 0) padding ``T`` to a multiple of ``tp``. Differentiable."""
    tp, t = tp_mesh.size(), hidden.shape[0]
    pad = -t % tp
    if pad:
        hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
        top_k_index = torch.cat([top_k_index, top_k_index.new_zeros(pad, top_k_index.shape[1])])
        top_k_weights = torch.cat([top_k_weights, top_k_weights.new_zeros(pad, top_k_weights.shape[1])])
    n = (t + pad) // tp
    r = tp_mesh.get_local_rank()
    return _TPRows.apply(hidden, tp_mesh), top_k_index[r * n:(r + 1) * n], _TPRows.apply(top_k_weights, tp_mesh)


@torch.compiler.disable
def ep_experts_forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """One MoE layer under expert parallelism (module docstring).

    Runs eagerly inside a compiled block (``torch.compiler.disable``): the split sizes are read on the host and
    change every step, so a traced version would re-compile on each new split until Dynamo's recompile limit;
    the row gathers, casts and GEMMs inside are compiled helpers and custom ops of their own.

    Args:
        module: a ``Float8GroupedExperts`` after :func:`shard_experts` (``num_experts`` = global E).
        hidden: (T, H) this rank's tokens; top_k_index / top_k_weights: (T, topk) router output. With
            ``tp > 1`` they are the same on every tp rank, and each rank dispatches ``1/tp`` of the rows.

    Returns:
        (T, H) in ``hidden``'s dtype.
    """
    group: EPGroup = module.ep_group
    if group.tp_mesh is None:
        return _ep_rows_forward(module, hidden, top_k_index, top_k_weights)
    rows = tp_rows(hidden, top_k_index, top_k_weights, group.tp_mesh)
    out = _TPGather.apply(_ep_rows_forward(module, *rows), group.tp_mesh)
    return out[:hidden.shape[0]]


def dispatch_format(module: nn.Module, device: torch.device) -> str:
    """How one expert-parallel MoE layer sends its tokens: ``"bf16"`` (no FP8 dispatch), ``"rowwise"`` (E4M3 with
    one scale per token, fed straight to the fused FP8 experts: ``fp8_dispatch.rowwise_dispatch``) or ``"1x128"``
    (E4M3 + 1x128 scales, dequantized on arrival for experts that take bf16 rows: ``fp8_dispatch.fp8_all_to_all``).

    Args:
        module: a ``Float8GroupedExperts`` after :func:`shard_experts`; device: where it runs (the grouped kernel
            is resolved per device).
    """
    if not module.ep_group.fp8_dispatch:
        return "bf16"
    return "rowwise" if module.runs_fused(device) else "1x128"


def _ep_rows_forward(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """:func:`ep_experts_forward` of the token rows this rank dispatches."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    group: EPGroup = module.ep_group
    ep, e = group.ep, module.num_experts
    local = e // ep
    t, topk = top_k_index.shape
    ids = top_k_index.reshape(-1).long()
    order = torch.argsort(ids, stable=True)  # pairs sorted by global expert, i.e. by destination rank
    token_rows = order // topk
    pair_rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(e, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group.group)  # [src, local expert] counts for me
    splits = torch.stack([counts.view(ep, local).sum(1), recv_counts.view(ep, local).sum(1)]).tolist()
    send_splits, recv_splits = splits
    # The local dispatch of the rows to come, made before the all-to-all is queued: it needs only the counts, and
    # with output_size its repeat_interleave does not wait for the GPU (without it, a host sync per layer that waited
    # for the all-to-all too where the payload path had already waited on it)
    local_ids = torch.repeat_interleave(torch.arange(local, device=ids.device).repeat(ep), recv_counts,
                                        output_size=sum(recv_splits))
    # The received row count changes every step. torchao's token-keyed autotuning is made once per process
    # (Float8GroupedExperts.grouped_kernel -> grouped_mm.tune_once_for_all_row_counts; without it every new
    # count re-tunes for seconds). The padded buffer is also bucketed (<= 1/8 extra rows) so that
    # torch.compile and the caching allocator see a few shapes (step times: docs/benchmarks.md).
    d = routing.dispatch(local_ids[:, None], local, rows=routing.bucketed_rows(local_ids.numel(), local, ids.numel()))
    fmt, received, weights = dispatch_format(module, hidden.device), None, None
    if fmt == "rowwise":  # E4M3 rows for the fused experts' fprop GEMM, the bf16 gradient back
        # the experts' weight casts queued once the all-to-all is, before it is waited for: they run while the tokens
        # travel, as on the bf16 path, whose all-to-all is waited for inside the experts after their casts
        copies = []
        recv, received = rowwise_dispatch(hidden, token_rows, pair_rows, recv_splits, send_splits, group.group,
                                          during=lambda: copies.append(module.fp8_weight_copies(hidden.device)))
        weights = copies[0]
    else:
        x_sorted = routing.gather_pairs(hidden, token_rows, pair_rows)
        if fmt == "1x128":  # E4M3 + 1x128 scales out, dequantized here; the bf16 gradient back
            recv = fp8_all_to_all(x_sorted, recv_splits, send_splits, group.group)
        else:
            recv = all_to_all_single_autograd(x_sorted, recv_splits, send_splits, group.group)
    y = module.local_experts(recv, d, received, weights=weights)  # (P, H) in local-expert order
    back = all_to_all_single_autograd(routing.pick_rows(y, d.pair_rows), send_splits, recv_splits, group.group)
    return routing.combine_pairs(back, pair_rows, top_k_weights, hidden.dtype)
