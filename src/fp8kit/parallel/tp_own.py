"""Tensor-parallel styles for fp8kit's own FP8 linears (``fp8.recipe = "blockwise"`` / ``"delayed"``).

torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` take torchao ``Float8Linear`` modules only,
and torch's ``ColwiseParallel`` / ``RowwiseParallel`` take ``nn.Linear``. :class:`OwnColwiseParallel` and
:class:`OwnRowwiseParallel` are torch's styles (the same ``input_layouts`` / ``output_layouts`` /
``use_local_output`` machinery, sequence parallel included) that also accept
``Float8BlockwiseLinear`` and ``Float8DelayedLinear``:

- column-parallel: weight ``Shard(0)`` ``[N/tp, K]``, input ``Replicate`` ``[.., K]`` (under sequence
  parallel the ``Shard(1)`` input is all-gathered in bf16 first), output ``Shard(-1)`` ``[.., N/tp]``;
- row-parallel: weight ``Shard(1)`` ``[N, K/tp]``, input ``Shard(-1)`` ``[.., K/tp]``, output ``Partial``
  -> all-reduce to ``Replicate`` (or reduce-scatter to ``Shard(1)`` under sequence parallel), in bf16.

The module itself bridges the DTensors (``fp8kit.fp8.linear.sharded_linear``): its FP8 casts and GEMMs run
on this rank's local shards, so the custom ops never see a DTensor, and the gradients of the output reach
the FP8 casts after the styles' bf16 collectives (the row-parallel output gradient is whole, all-gathered
first under sequence parallel).

Scales across tp ranks, as Transformer Engine's:

- blockwise: a shard is whole 128-blocks (:func:`check_shard`: ``N/tp`` column-parallel, ``K/tp``
  row-parallel multiples of 128), so every 1x128 activation block and 128x128 weight block of a rank is a
  block of the unsharded tensor with the same scale; the tokens (the wgrad blocks' 128 rows) are whole on
  every rank. No scale needs communication.
- delayed: one scale per whole tensor. The step's amaxes (input, weight, output gradient) are MAX-reduced over
  ``DelayedScalingState.group`` before they join the history; with ``tp > 1`` that group spans the data- and
  tensor-parallel ranks (:func:`amax_group`, Megatron's amax reduction group), so a column-parallel weight
  shard, a row-parallel input shard and a column-parallel output-gradient shard scale with the amax of the
  whole tensor, and every rank's history advances identically. The first step's dynamic scales are
  reduced the same way.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.tensor import distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from fp8kit.base.errors import ConfigError
from fp8kit.fp8.delayed import Float8DelayedLinear
from fp8kit.fp8.linear import Float8BlockwiseLinear
from fp8kit.fp8.recipes import recipe_info

#: fp8kit's own FP8 linear modules and their recipes.
OWN_LINEARS = {Float8BlockwiseLinear: "blockwise", Float8DelayedLinear: "delayed"}


def check_shard(name: str, shape: tuple[int, int], recipe: str, kind: str, tp: int, *,
                remedy: str | None = None) -> None:
    """Refuse a ``kind`` (``"column"`` / ``"row"``)-parallel FP8 linear whose per-rank shard the recipe cannot run.

    Blockwise needs whole 128-blocks on every rank (``out_features / tp`` column-parallel, ``in_features / tp``
    row-parallel multiples of 128); the other recipes (delayed, and torchao's: its ``Float8Linear`` runs the
    shard's GEMM with the same ``torch._scaled_mm``) need the FP8 GEMM's multiple of 16 on the shard
    (``torch._scaled_mm`` on CUDA; on the CPU it takes any shape, so a run would fail only on the GPU).

    Args:
        name: the module's FQN, for the message.
        shape: the unsharded weight ``(out_features, in_features)``.
        recipe: the decision's FP8 recipe.
        kind: ``"column"`` (weight ``Shard(0)``) or ``"row"`` (weight ``Shard(1)``).
        tp: the tensor-parallel size.
        remedy: the way out the message suggests (default: the ``fp8.exclude`` pattern to add for this layer in
            every block, or another tp).

    Raises:
        ConfigError: naming the layer, the recipe, the weight and shard shapes, and the way out.
    """
    problem = shard_problem(name, shape, recipe, kind, tp)
    if problem is not None:
        remedy = remedy or f"keep it BF16 (add \"{exclude_pattern(name)}\" to fp8.exclude) or use a tp for which it is"
        raise ConfigError(f"fp8.recipe = {recipe!r} with distributed.tp = {tp}: {problem}; {remedy}")


def exclude_pattern(name: str) -> str:
    """The ``fp8.exclude`` pattern of the layer ``name`` in every block (``*.self_attn.k_proj``)."""
    return "*." + ".".join(name.split(".")[-2:])


def shard_problem(name: str, shape: tuple[int, int], recipe: str, kind: str, tp: int) -> str | None:
    """Why :func:`check_shard` refuses the linear ``name`` (the layer, its weight and shard shapes and the multiple
    it needs), or None when its shard runs. Arguments as :func:`check_shard`."""
    info = recipe_info(recipe)
    if tp == 1:
        return None
    n, k = shape
    dim, size = (0, n) if kind == "column" else (1, k)
    m = info.dims_multiple
    if size % tp == 0 and (size // tp) % m == 0:
        return None
    local = [-(-n // tp), k] if dim == 0 else [n, -(-k // tp)]
    what = "whole 128x128 / 1x128 blocks" if recipe == "blockwise" else "an FP8 GEMM shape (torch._scaled_mm)"
    feat = "out_features" if dim == 0 else "in_features"
    return (f"{name} is {kind}-parallel and its weight {list(shape)} splits into {local} per rank, not {what}: "
            f"{feat} / tp must be a multiple of {m}")


def amax_group(mesh):
    """The process group whose ranks share one delayed scale per tensor: all data- and tensor-parallel ranks
    of ``mesh`` (``("dp_replicate", "dp_shard", "tp")``), or None for a one-rank mesh.

    Data parallel only: ``fp8kit.parallel.mesh.dp_group``. With ``tp > 1`` the tp ranks hold shards of one
    tensor (weights, row-parallel inputs, column-parallel output gradients) and the dp ranks hold other
    tokens: Megatron-LM reduces Transformer Engine's amaxes over this same tensor-and-data-parallel group.
    """
    from fp8kit.parallel.mesh import dp_group

    dims = tuple(d for d in ("dp_replicate", "dp_shard", "tp") if mesh[d].size() > 1)
    if not dims:
        return None
    if "tp" not in dims:
        return dp_group(mesh)
    if len(dims) == 1:
        return mesh["tp"].get_group()
    return mesh[dims]._flatten("_".join(("amax",) + dims)).get_group()


def _check_module(style: str, module: nn.Module, device_mesh, kind: str) -> None:
    """Set-up checks of an own FP8 linear under a TP style: shard shapes, and the delayed amax group."""
    recipe = OWN_LINEARS[type(module)]
    tp = device_mesh.size()
    name = getattr(module, "name", None)  # Float8DelayedLinear knows its FQN; Float8BlockwiseLinear does not
    check_shard(name or type(module).__name__, (module.out_features, module.in_features), recipe, kind, tp,
                remedy=None if name else "keep this layer BF16 (nn.Linear) or use a tp for which it is")
    if isinstance(module, Float8DelayedLinear):
        import torch.distributed as dist

        group = module.state.group
        mine = set(device_mesh.mesh.flatten().tolist())
        if group is None or not mine <= set(dist.get_process_group_ranks(group)):
            raise ConfigError(
                f"{style} of Float8DelayedLinear {module.name}: DelayedScalingState.group must hold the tp ranks "
                f"{sorted(mine)} (one scale per whole tensor); set it to fp8kit.parallel.tp_own.amax_group(mesh)"
            )


class OwnColwiseParallel(ColwiseParallel):
    """torch's ``ColwiseParallel`` that also shards fp8kit's own FP8 linears (module docstring).

    Keyword args as ``ColwiseParallel`` (``input_layouts``, ``output_layouts``, ``use_local_output``).
    ``nn.Linear`` modules get torch's own behaviour.

    Raises (when applied):
        ConfigError: a shard the recipe cannot run (:func:`check_shard`), or a delayed module whose
            ``DelayedScalingState.group`` does not span the tp ranks.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if type(module) not in OWN_LINEARS:
            return super()._apply(module, device_mesh)
        _check_module("OwnColwiseParallel", module, device_mesh, "column")
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class OwnRowwiseParallel(RowwiseParallel):
    """torch's ``RowwiseParallel`` that also shards fp8kit's own FP8 linears (module docstring). The bias, if
    any, stays replicated and is added once to the reduced output.

    Keyword args as ``RowwiseParallel``; ``output_layouts=Shard(1)`` for sequence parallel (reduce-scatter).

    Raises (when applied):
        ConfigError: as :class:`OwnColwiseParallel`.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if type(module) not in OWN_LINEARS:
            return super()._apply(module, device_mesh)
        from torch.distributed.tensor import Shard

        _check_module("OwnRowwiseParallel", module, device_mesh, "row")
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition_linear_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )
