"""``prepare_model``: the one path by which a built model becomes a training model, for 1..N ranks.

It runs once per run, after the per-site decisions and before the optimizer is built and a checkpoint
is restored (FSDP2 replaces the parameters by sharded DTensors, which the optimizer must hold). The order
is torchtitan's ``parallelize`` and the PyTorch FP8 trainer recipe (TP -> EP -> FP8 -> AC -> FSDP2 ->
compile); a single process is the same path with every parallel size 1 (``mesh=None``)::

    1. tensor parallel    (mesh tp > 1)   DTensor styles per block; FP8 linears get torchao's Float8 styles
                                          (torchao recipes) or parallel.tp_own's (blockwise, delayed)
    2. expert parallel    (ep > 1)        E / ep experts per rank, all-to-all token dispatch
    3. FP8 conversion     (options.fp8)   parallel.convert.apply_fp8 of the decisions not yet converted
    4. activation ckpt    (options.ac)    torch checkpoint_wrapper per transformer block
    5. FSDP2 / HSDP       (mesh dp > 1)   fully_shard per block, then the root; FP8 or BF16 all-gather
    6. torch.compile      (options.compile) per block, last: it traces the final modules

The model may be on ``meta`` (``distributed.meta_init``): the steps then shard shapes only, and the caller
gives each rank storage for its own shards afterwards (``fp8kit.models.init``). The precision schedule
(BF16 warm-up / cool-down phases) later swaps modules with the same
``apply_fp8`` / ``restore_bf16`` and the :class:`~fp8kit.parallel.convert.ConversionOptions` recorded in
the returned :class:`Prepared`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from fp8kit.base.errors import ConfigError
from fp8kit.comm import AutoScaleState, apply_fp8_reduce_scatter
from fp8kit.comm.fsdp_reduce_scatter import fsdp_custom_reduce_scatter_support
from fp8kit.fp8.blockwise_all_gather import gather_notes
from fp8kit.fp8.delayed import DelayedScaling, DelayedScalingState
from fp8kit.moe.grouped_mm import GroupedGemmConfig, resolve_wgrad_input
from fp8kit.parallel.convert import (
    ConversionOptions,
    apply_fp8,
    fused_mlp_notes,
    is_fp8_linear,
    plain_named_modules,
)
from fp8kit.parallel.parallelize import (
    Parallelized,
    apply_ac,
    apply_ep,
    apply_fsdp,
    apply_tp,
    check_tp,
    fp8_all_gather_choice,
)
from fp8kit.parallel.tp_own import amax_group
from fp8kit.selective.decide import Decision


@dataclass(frozen=True)
class PrepareOptions:
    """What :func:`prepare_model` applies (built from the run config by ``fp8kit.config.options``).

    Attributes:
        fp8: convert the sites decided FP8 now (False for a BF16 run, or a run that starts in a BF16 phase
            of the precision schedule: the modules are converted later by the schedule).
        recipe: the run's FP8 recipe (the FP8 all-gather default depends on it).
        emulate: emulate FP8 matmuls (GPUs without FP8 tensor cores).
        fp8_all_gather: ``fp8.enable_fsdp_float8_all_gather`` (None: on for tensorwise under FSDP2).
        grouped: how FP8 MoE experts compute.
        delayed: the ``delayed`` recipe's amax-history settings.
        activation_checkpointing: recompute each block in backward.
        compile: ``torch.compile`` each block.
        cuda_graphs: with ``compile``, compile each block with ``mode="reduce-overhead"`` (CUDA graph trees); what it
            needs (compile, one process, CUDA) is checked by the config and
            ``fp8kit.train.setup.build_setup``.
        sequence_parallel: with tp > 1, split norms and the residual stream over tokens.
        ep: expert-parallel size.
        ep_fp8_dispatch: with ``ep > 1``, the dispatch all-to-all sends E4M3 (``fp8kit.moe.fp8_dispatch``: the
            fused FP8 experts' own rowwise cast, or E4M3 + 1x128 scales for other experts); with ``ep = 1`` a note
            that it has no effect.
        param_dtype: the parameters' dtype (FSDP2's mixed precision computes in bf16 either way).
        fp8_reduce_scatter: ``"off"``, or the FP8 format of FSDP2's gradient reduce-scatter
            (``fp8kit.comm.apply_fp8_reduce_scatter``; ``distributed.fp8_reduce_scatter``).
        cache_weights: keep the FP8 copies of blockwise linears', fused experts' and delayed linears' weights across
            the micro-batches of an optimizer step (``fp8kit.fp8.weight_cache``; the delayed recipe's also holds the
            weight scale for the step, ``fp8kit.fp8.delayed_weight_cache``; ``fp8kit train``: with
            ``train.grad_accum > 1``). Ignored under FSDP2, where the cache would hold unsharded copies of every
            layer's weights until the next step; the delayed recipe's also with ``cuda_graphs``.
        blockwise_recompute: blockwise linears keep no FP8 copy of their input or weight from forward to
            backward and quantize both again there, blockwise experts their weights (``fp8.blockwise_recompute``;
            with ``cache_weights`` the cached weight is still reused).
        blockwise_wgrad_x: the blocks of blockwise linears' wgrad copy of their input, ``"128x1"`` or ``"128x128"``
            (``fp8.blockwise_wgrad_x``; ``Float8BlockwiseLinear(wgrad_x=...)``).
        blockwise_fused_mlp: SwiGLU MLPs whose projections are all blockwise FP8 run with the SwiGLU's casts fused
            (``fp8.blockwise_fused_mlp``; ``fp8kit.fp8.swiglu_mlp``).
        delayed_fused_mlp: the same for delayed-scaling projections (``fp8.delayed_fused_mlp``;
            ``fp8kit.fp8.delayed_mlp``).
        fast_accum: ``fp8.fast_accum`` as given (None: the recipe table's): torchao linears' GEMMs with fast
            accumulation (the delayed recipe's come resolved in ``delayed``); what it does not reach (FP8 MoE
            experts, the recipe's own limits) is warned about by ``selective.decide.decision_notes`` and
            ``decide_options``.
    """

    fp8: bool = True
    recipe: str = "tensorwise"
    emulate: bool = False
    fp8_all_gather: bool | None = None
    grouped: GroupedGemmConfig = field(default_factory=GroupedGemmConfig)
    delayed: DelayedScaling = field(default_factory=DelayedScaling)
    activation_checkpointing: bool = False
    compile: bool = False
    cuda_graphs: bool = False
    sequence_parallel: bool = False
    ep: int = 1
    ep_fp8_dispatch: bool = False
    param_dtype: torch.dtype = torch.bfloat16
    fp8_reduce_scatter: str = "off"
    cache_weights: bool = False
    blockwise_recompute: bool = False
    blockwise_wgrad_x: str = "128x1"
    blockwise_fused_mlp: bool = False
    delayed_fused_mlp: bool = True
    fast_accum: tuple[str, ...] | None = None


@dataclass
class Prepared(Parallelized):
    """What :func:`prepare_model` did, plus the conversion options the precision schedule reuses."""

    conversion: ConversionOptions = field(default_factory=ConversionOptions)


def uses_fsdp(mesh, sizes: tuple[int, int] | None = None) -> bool:
    """Whether a run on ``mesh`` shards or replicates its parameters with FSDP2 / HSDP.

    ``mesh`` None: a run not launched yet, seen from one process (``fp8kit plan``), described by ``sizes``, the
    config's ``(distributed.dp_shard, distributed.dp_replicate)``: FSDP2 when either is above 1 (``dp_shard = -1``
    fills a mesh this process cannot see: counted as 1). ``sizes`` None too: one process, no FSDP2."""
    if mesh is None:
        return sizes is not None and (sizes[0] > 1 or sizes[1] > 1)
    return mesh["dp_shard"].size() > 1 or mesh["dp_replicate"].size() > 1


def weight_cache_applies(requested: bool, mesh, sizes: tuple[int, int] | None = None, *,
                         not_fsdp: bool = False) -> bool:
    """Whether the FP8 weight cache (``PrepareOptions.cache_weights``) is used on ``mesh`` (or, without one, on the
    data-parallel ``sizes`` a config names: :func:`uses_fsdp`): as ``requested``, except under FSDP2, where it would
    hold unsharded FP8 copies of every layer's weights; ``not_fsdp``: for weights FSDP2 leaves alone (the experts
    under expert parallelism, its ``ignored_params``: each rank holds its own experts whole), which cache as in one
    process. The one place this is decided (``prepare_model``, and ``config.prepare_options.weight_cast_accumulation``
    for the ``auto`` timers)."""
    return requested and (not_fsdp or not uses_fsdp(mesh, sizes))


def prepare_model(model: nn.Module, decisions: list[Decision], options: PrepareOptions, mesh=None,
                  *, hf_cfg=None) -> Prepared:
    """Make ``model`` a training model in place (the order of the module docstring).

    Args:
        model: an HF causal LM, fully materialised on this rank's device (the same weights on every rank),
            or on ``meta`` (meta-device initialisation: every step here works on shapes; the caller then
            materialises this rank's shards, ``fp8kit.models.init.initialize_shards``).
        decisions: the FP8/BF16 decision of every site (decided on the unsharded model).
        options: :class:`PrepareOptions`.
        mesh: the 3-D ``("dp_replicate", "dp_shard", "tp")`` DeviceMesh of a torchrun launch
            (``fp8kit.parallel.mesh.init_distributed``), or None for one process.
        hf_cfg: the model's HF config (for the TP divisibility check).

    Returns:
        :class:`Prepared`: the applied steps (e.g. ``["tp", "fp8", "ac", "fsdp2", "compile"]``), whether
        FSDP2 all-gathers FP8 weights, loud notes, and the conversion options.

    Raises:
        ConfigError: a model the TP or EP plan does not fit.
        Fp8kitError: a decision names a module this model lacks.
    """
    tp = mesh["tp"].size() if mesh is not None else 1
    dp_shard = mesh["dp_shard"].size() if mesh is not None else 1
    dp_replicate = mesh["dp_replicate"].size() if mesh is not None else 1
    fsdp = uses_fsdp(mesh)
    cache = weight_cache_applies(options.cache_weights, mesh)
    # FSDP2 re-gathers weights for the backward: blockwise linears and experts quantize them again there; expert
    # parallel experts are not FSDP2's (ignored_params, step 2 below) and keep their cache
    grouped = replace(options.grouped, cache_weights=weight_cache_applies(options.cache_weights, mesh,
                                                                          not_fsdp=options.ep > 1),
                      keep_weight_copies=not (fsdp or options.blockwise_recompute),
                      blockwise_wgrad_x=options.blockwise_wgrad_x,
                      wgrad_input=resolve_wgrad_input(options.grouped.wgrad_input, options.activation_checkpointing))
    conversion = ConversionOptions(
        emulate=options.emulate,
        fsdp_float8_all_gather=fp8_all_gather_choice(options.fp8_all_gather, options.recipe, fsdp),
        fsdp_shards=dp_shard if fsdp else 1,
        grouped=grouped,
        cache_weights=cache,
        keep_weight_copies=not (fsdp or options.blockwise_recompute),
        keep_input_copies=not options.blockwise_recompute,
        wgrad_x=options.blockwise_wgrad_x,
        fused_mlp=options.blockwise_fused_mlp,
        delayed_fused_mlp=options.delayed_fused_mlp,
        # the delayed recipe's weight cache: not with CUDA graphs (their replay would skip its lookup)
        delayed=DelayedScalingState(replace(options.delayed, cache_weights=cache and not options.cuda_graphs)),
        fast_accum=options.fast_accum,
    )
    done = Prepared(conversion=conversion)
    if tp > 1 or fsdp:  # one delayed scale per tensor across the data- and tensor-parallel ranks
        conversion.delayed.group = amax_group(mesh)

    # 1. Tensor parallel first: it changes the shapes the later steps see (per-rank weight shards), and
    #    the FP8 TP styles must own the linear's input/output hooks before FSDP2 wraps the block.
    if tp > 1:
        if hf_cfg is not None:
            check_tp(hf_cfg, tp)
        apply_tp(model, mesh["tp"], decisions, conversion if options.fp8 else None,
                 sequence_parallel=options.sequence_parallel)
        done.steps.append("tp+sp" if options.sequence_parallel else "tp")

    # 2. Expert parallel before FP8: the experts modules become fp8kit's grouped experts holding only this
    #    rank's E / ep experts (DTensor Shard(0) over "ep"), so the FP8 conversion below and the grouped
    #    FP8 GEMMs see the local experts; FSDP2 later leaves these weights alone (ignored_params).
    expert_params: set[nn.Parameter] = set()
    if options.ep > 1:
        expert_params = apply_ep(model, mesh, options.ep, decisions, grouped,
                                 fp8_dispatch=options.ep_fp8_dispatch)
        done.steps.append(f"ep{options.ep}")
    elif options.ep_fp8_dispatch:
        done.notes.append("distributed.ep_fp8_dispatch = true has no effect: no expert parallelism (ep = 1)")
    if options.blockwise_wgrad_x != "128x1" and options.fp8 and options.recipe != "blockwise":
        done.notes.append(f"fp8.blockwise_wgrad_x = {options.blockwise_wgrad_x!r} has no effect: fp8.recipe is "
                          f"{options.recipe!r}")
    if options.blockwise_recompute and options.fp8 and options.recipe != "blockwise":
        done.notes.append(f"fp8.blockwise_recompute = true has no effect: fp8.recipe is {options.recipe!r}")
    elif options.blockwise_recompute and options.fp8 and not options.compile:
        done.notes.append("fp8.blockwise_recompute = true without train.compile: each blockwise linear saves its "
                          "BF16 input for the backward (only torch.compile recomputes it from what the step "
                          "saves anyway), which can take more memory than the FP8 copy it replaces")

    # 3. FP8 conversion of the remaining linears and experts, after TP (it sees the TP-sharded modules)
    #    and before AC (AC must recompute through the FP8 modules) and FSDP2 (FP8 all-gather needs
    #    torchao's weight wrapper in place when fully_shard takes the parameters).
    if options.fp8:
        apply_fp8(model, decisions, conversion)  # skips what tensor parallel converted already
        done.steps.append("fp8")
        if conversion.fuses_mlps(options.recipe):
            if options.recipe == "delayed" and options.param_dtype == torch.float32:
                done.notes.append("fp8.delayed_fused_mlp: the SwiGLU MLPs run as their three linears in this run: "
                                  "FP32 weights (train.param_dtype = fp32) give float32 activations, which the fused "
                                  "MLP's kernel does not take (fp8kit.fp8.delayed_mlp)")
            else:
                facts, fallbacks = fused_mlp_notes(model, options.recipe)
                done.facts.extend(facts)
                done.notes.extend(fallbacks)
        done.fp8_all_gather = conversion.fsdp_float8_all_gather
        if conversion.fsdp_float8_all_gather and options.recipe == "blockwise":
            facts, notes = gather_notes(model, dp_shard)
            done.facts.extend(facts)
            done.notes.extend(notes)
        if options.fp8_all_gather and not fsdp:
            done.notes.append("fp8.enable_fsdp_float8_all_gather = true has no effect: no FSDP2 (dp_shard = 1)")

    # 4. Activation checkpointing per block, inside FSDP2's unit, so that the recomputation in backward
    #    runs on the already all-gathered parameters of that block.
    if options.activation_checkpointing:
        apply_ac(model)
        done.steps.append("ac")

    # 5. FSDP2 last among the module transformations: it takes the final parameters (TP DTensors, FP8
    #    weight wrappers) and shards them over the data-parallel ranks.
    if fsdp:
        apply_fsdp(model, _dp_mesh(mesh), param_dtype=options.param_dtype, ignored_params=expert_params)
        done.steps.append("fsdp2" if dp_replicate == 1 else "hsdp")
    _fp8_reduce_scatter(model, options.fp8_reduce_scatter, done, dp_shard, dp_replicate)

    # 6. Compile each block last: it traces the final modules (FSDP2's hooks are skipped by dynamo and
    #    run eagerly around the compiled block).
    if options.compile:
        from fp8kit.models.build import transformer_blocks

        mode = "reduce-overhead" if options.cuda_graphs else None
        for block in transformer_blocks(model):
            block.compile(mode=mode)
        if options.fp8:
            compile_fp8_heads(model, decisions, cuda_graphs=options.cuda_graphs)
        done.steps.append("compile")
    return done


def compile_fp8_heads(model: nn.Module, decisions: list[Decision], *, cuda_graphs: bool) -> list[str]:
    """``torch.compile`` in place each output head that runs in FP8 now (``fp8.output_head``), as step 6
    compiles the blocks: the head sits outside them, and run eagerly its casts would be separate passes over
    the logits' gradient (``[tokens, vocab]``). Called by :func:`prepare_model` and again after every swap
    (``train.loop.modules_swapped``: the precision schedule, the divergence guard; a swapped-in module is a new,
    uncompiled one).

    Returns:
        the FQNs compiled now (heads already compiled, or BF16 now, are left as they are).
    """
    mode = "reduce-overhead" if cuda_graphs else None
    modules = plain_named_modules(model)
    done = []
    for d in decisions:
        if d.site.role != "head" or not d.is_fp8 or d.fqn not in modules:
            continue
        real, module = modules[d.fqn]
        if not is_fp8_linear(module) or getattr(module, "_compiled_call_impl", None) is not None:
            continue  # BF16 now (a BF16 phase of the precision schedule; also under FSDP2), or compiled already
        module.compile(mode=mode)
        done.append(real)
    return done


def _fp8_reduce_scatter(model: nn.Module, fmt: str, done: Prepared, dp_shard: int, dp_replicate: int) -> None:
    """``distributed.fp8_reduce_scatter``: FSDP2's gradient reduce-scatter through FP8 (after ``fully_shard``)."""
    if fmt == "off":
        return
    if dp_replicate > 1:
        raise ConfigError(f"distributed.fp8_reduce_scatter = {fmt!r} with dp_replicate = {dp_replicate} (HSDP): not "
                          "supported (only the reduce-scatter of plain FSDP2 is replaced); set it to 'off' or use "
                          "dp_replicate = 1")
    if dp_shard == 1:
        done.notes.append(f"distributed.fp8_reduce_scatter = {fmt!r} has no effect: no FSDP2 (dp_shard = 1)")
        return
    ok, why = fsdp_custom_reduce_scatter_support()
    if not ok:
        raise ConfigError(f"distributed.fp8_reduce_scatter = {fmt!r}: {why}; upgrade torch or set it to 'off'")
    done.grad_comm = AutoScaleState(fp8_dtype=fmt)
    apply_fp8_reduce_scatter(model, done.grad_comm)
    done.steps.append(f"fp8-reduce-scatter-{fmt}")


def _dp_mesh(mesh):
    from fp8kit.parallel.mesh import dp_mesh

    return dp_mesh(mesh)
