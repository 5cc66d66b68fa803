"""Run config -> :class:`~fp8kit.parallel.prepare.PrepareOptions` (what ``prepare_model`` applies).

The config is the only reader of the whole :class:`~fp8kit.config.RunConfig`; the parallel layer gets this
small options object.
"""

from __future__ import annotations

import torch

from fp8kit.config.options import delayed_scaling_for, grouped_gemm_config, requested_fast_accum
from fp8kit.config.schema import RunConfig
from fp8kit.parallel.prepare import PrepareOptions, weight_cache_applies


def weight_cache_requested(cfg: RunConfig) -> bool:
    """Whether the run asks for the FP8 weight cache (``PrepareOptions.cache_weights``): ``fp8.weight_cache`` and
    micro-batches that share an optimizer step (``train.grad_accum > 1``); ``prepare_model`` still turns it off under
    FSDP2."""
    return cfg.fp8.weight_cache and cfg.train.grad_accum > 1


def weight_cast_accumulation(cfg: RunConfig, mesh=None, *, experts: bool = False) -> int:
    """Micro-batches per optimizer step that reuse their cast FP8 weights in this run: ``train.grad_accum`` where the
    weight cache applies on ``mesh`` (:func:`~fp8kit.parallel.prepare.weight_cache_applies`), else 1; ``experts``: for
    the MoE experts, whose weights FSDP2 leaves alone under expert parallelism (``distributed.ep > 1``). ``mesh`` None
    (``fp8kit plan``, or one process): the config's ``distributed.dp_shard`` / ``dp_replicate`` say whether the run
    will use FSDP2, so ``plan`` looks up the timings ``fp8kit train`` cached under torchrun. What ``selective_fp8 =
    "auto"`` times the FP8 experts (``experts=True``) and, through :func:`dense_weight_cast_accumulation`, the dense
    linears with."""
    d = cfg.distributed
    sizes = (d.dp_shard, d.dp_replicate) if mesh is None else None
    applies = weight_cache_applies(weight_cache_requested(cfg), mesh, sizes, not_fsdp=experts and d.ep > 1)
    return cfg.train.grad_accum if applies else 1


def dense_weight_cast_accumulation(cfg: RunConfig, accumulate: int) -> int:
    """Micro-batches per optimizer step that share the cast weights of this run's dense FP8 linears, given
    ``accumulate`` (:func:`weight_cast_accumulation`): the blockwise and delayed linears cache them
    (``prepare_model``), the delayed ones not with ``train.cuda_graphs``; torchao's recipes cast every micro-batch
    (1). What ``selective_fp8 = "auto"`` times the dense sites with (``BenchLayersArgs.accumulate``)."""
    recipe = cfg.fp8.recipe
    cached = recipe == "blockwise" or (recipe == "delayed" and not cfg.train.cuda_graphs)
    return accumulate if cached else 1


def weight_cast_accumulations(cfg: RunConfig, mesh=None) -> tuple[int, int]:
    """``(dense, experts)``: micro-batches per optimizer step that share one cast of the dense FP8 linears' weights
    (:func:`dense_weight_cast_accumulation`) and of the MoE experts' (:func:`weight_cast_accumulation` with
    ``experts``) in this run on ``mesh``. The one place both are derived, for ``auto``'s timings
    (``bench.auto.FP8SiteOptions.for_run``) and the run's start line (``train.setup.weight_cast_reuse``)."""
    return (dense_weight_cast_accumulation(cfg, weight_cast_accumulation(cfg, mesh)),
            weight_cast_accumulation(cfg, mesh, experts=True))


def prepare_options(cfg: RunConfig, *, fp8_now: bool, emulate: bool) -> PrepareOptions:
    """The model-preparation options of a run.

    Args:
        cfg: the run config.
        fp8_now: convert the FP8 decisions at preparation (the run is FP8 and its first step is in an FP8
            phase of the precision schedule).
        emulate: emulate FP8 matmuls (``fp8.emulate`` on a device without FP8 tensor cores).
    """
    t, d = cfg.train, cfg.distributed
    return PrepareOptions(
        fp8=fp8_now,
        recipe=cfg.fp8.recipe,
        emulate=emulate,
        fp8_all_gather=cfg.fp8.enable_fsdp_float8_all_gather,
        grouped=grouped_gemm_config(cfg),
        delayed=delayed_scaling_for(cfg.fp8),
        activation_checkpointing=t.activation_checkpointing,
        compile=t.compile,
        cuda_graphs=t.cuda_graphs,
        sequence_parallel=d.sequence_parallel,
        ep=d.ep,
        ep_fp8_dispatch=d.ep_fp8_dispatch,
        fp8_reduce_scatter=d.fp8_reduce_scatter,
        param_dtype=torch.float32 if t.param_dtype == "fp32" else torch.bfloat16,
        cache_weights=weight_cache_requested(cfg),
        blockwise_recompute=cfg.fp8.blockwise_recompute,
        blockwise_wgrad_x=cfg.fp8.blockwise_wgrad_x,
        blockwise_fused_mlp=cfg.fp8.blockwise_fused_mlp,
        delayed_fused_mlp=cfg.fp8.delayed_fused_mlp,
        fast_accum=requested_fast_accum(cfg.fp8),
    )
