"""The steps of model preparation: tensor parallel, expert parallel, activation checkpointing, FSDP2.

``fp8kit.parallel.prepare.prepare_model`` applies them in this order (torchtitan's ``parallelize``), each
step's reason next to it there::

    tensor parallel (DTensor styles; FP8 linears through torchao's Float8 styles or tp_own's styles)
      -> expert parallel (MoE: E / ep experts per rank, all-to-all token dispatch; fp8kit.moe.expert_parallel)
      -> FP8 conversion of the remaining FP8 linears
      -> activation checkpointing (torch's checkpoint_wrapper per block)
      -> FSDP2 (fully_shard per block, then the root), FP8 or BF16 all-gather
      -> torch.compile per block

TP plan for HF Llama / Qwen2 blocks (Megatron style)::

    self_attn.q_proj, k_proj, v_proj, mlp.gate_proj, up_proj   column-parallel: weight [out/tp, in],
        input replicated [B, T, H], output sharded over features [B, T, out/tp] (local heads)
    self_attn.o_proj, mlp.down_proj                              row-parallel: weight [out, in/tp],
        input [B, T, in/tp], output all-reduced to replicated [B, T, out]
    embed_tokens, norms, lm_head                                 replicated (the same on every tp rank)

MoE blocks (Qwen3-MoE, Qwen2-MoE, Mixtral: the block's ``mlp`` holds ``experts``): only the attention is
tensor parallel. The router and the experts are whole on every tp rank and see the whole (replicated)
tokens; under expert parallelism each tp rank dispatches its own 1/tp of the token rows and the outputs
are all-gathered over tp (``fp8kit.moe.expert_parallel``: no token is computed twice), the ``ep`` ranks
borrowed from data and tensor parallelism. Without expert parallelism every tp rank computes the experts
on all tokens (the same work tp times). With sequence parallelism the MoE block's input is all-gathered
(bf16) and its output sliced back to this rank's token shard.

``distributed.sequence_parallel`` also splits the norms and the residual stream over tokens
(``[B, T/tp, H]``) between the linears; the embeddings stay whole-sequence because HF's decoder computes
the rotary positions and the causal mask from the embedding output's length (see :func:`apply_tp`).
Sequence-parallel communication is BF16: the all-gather of the attention / MLP inputs in forward and of
the row-parallel outputs' gradients in backward (``tp_styles.Float8RowwiseParallelSP``: the gradient is
cast to E5M2 after that all-gather, on the whole sequence, as without SP).

A linear decided FP8 that is tensor-parallel becomes its FP8 module just before its TP style is
applied. torchao recipes: a ``Float8Linear``, because torchao's ``Float8ColwiseParallel`` /
``Float8RowwiseParallel`` only accept ``Float8Linear`` modules; its FP8 casts then see TP-sharded DTensor
weights, so the tensorwise amax of a weight, an input or a gradient is reduced over the ``tp`` mesh by
DTensor (the right process group), and FSDP2's FP8 all-gather reduces the weight amax over the ``dp_shard``
mesh of its DTensor. fp8kit's own recipes (blockwise, delayed): a ``Float8BlockwiseLinear`` /
``Float8DelayedLinear`` under ``parallel/tp_own.py``'s styles, computing on its local shards; blockwise
shards are whole 128-blocks (the same scales as one process), delayed amaxes are MAX-reduced over the
data- and tensor-parallel ranks (``tp_own.amax_group``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fp8kit.base.errors import ConfigError
from fp8kit.fp8.recipes import recipe_info
from fp8kit.moe.grouped_mm import GroupedGemmConfig
from fp8kit.parallel.convert import ConversionOptions, apply_fp8, fp8_fqns
from fp8kit.parallel.tp_own import (
    OwnColwiseParallel,
    OwnRowwiseParallel,
    check_shard,
    exclude_pattern,
    shard_problem,
)
from fp8kit.selective.decide import Decision

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
#: model types whose blocks the TP plan covers: Llama-style attention, and a dense MLP or a MoE block
DENSE_TYPES = ("llama", "qwen2", "qwen3", "mistral")
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")


@dataclass
class Parallelized:
    """What ``prepare_model`` did (recorded in the run's summary).

    Attributes:
        steps: the applied steps, in order, e.g. ``["tp", "fp8", "fsdp2"]``.
        fp8_all_gather: FSDP2 all-gathers FP8 weights (call :func:`after_optimizer_step` each step).
        notes: loud fallbacks and settings without effect: printed as the run's warnings.
        facts: what the run does that is neither (e.g. how many MLPs run fused): printed as notes.
        grad_comm: the ``fp8kit.comm.AutoScaleState`` of FSDP2's FP8 gradient reduce-scatter
            (``distributed.fp8_reduce_scatter``), saved in checkpoints; None when it is off.
    """

    steps: list[str] = field(default_factory=list)
    fp8_all_gather: bool = False
    notes: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)
    grad_comm: object = None


def fp8_all_gather_choice(fp8_all_gather: bool | None, recipe: str, fsdp: bool) -> bool:
    """Whether FSDP2 all-gathers FP8 weights plus scales instead of BF16 weights.

    Args:
        fp8_all_gather: ``fp8.enable_fsdp_float8_all_gather`` (None: on for tensorwise; config validation
            refuses true with a rowwise recipe).
        recipe: ``fp8.recipe``.
        fsdp: parameters are sharded with FSDP2 / HSDP (nothing is all-gathered otherwise).

    Combined with tensor parallel this works with torchao 0.18 (tp 2 x dp_shard 2: torch 2.13 on 4 gloo
    ranks, tests/test_distributed.py; torch 2.11 on 4 x H200 with NCCL, docs/benchmarks.md section 5): the
    ``aten.is_pinned`` failure on DTensor reported for TP + FP8 all-gather in torchtitan-style trainers does not
    occur.
    """
    want = (recipe == "tensorwise") if fp8_all_gather is None else fp8_all_gather
    return bool(want and fsdp)


def _blocks(model: nn.Module) -> nn.ModuleList:
    from fp8kit.models.build import transformer_blocks

    return transformer_blocks(model)


def check_tp(hf_cfg, tp: int) -> None:
    """Refuse a model whose heads or MLP width do not split over ``tp`` ranks.

    Raises:
        ConfigError: naming the HF config field and the tp size.
    """
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        v = getattr(hf_cfg, key, None)
        if isinstance(v, int) and v % tp:
            raise ConfigError(f"distributed.tp = {tp} does not divide the model's {key} = {v}")
    if getattr(hf_cfg, "model_type", None) not in DENSE_TYPES + MOE_TYPES:
        raise ConfigError(
            f"distributed.tp = {tp}: the tensor-parallel plan covers Llama/Qwen-style blocks (model_type "
            f"{', '.join(DENSE_TYPES + MOE_TYPES)}), not model_type {getattr(hf_cfg, 'model_type', None)!r}"
        )


def _tp_plan(model: nn.Module) -> tuple[str, list[tuple[str, ...]], list[bool]]:
    """``(blocks' FQN prefix, the planned linear names of each block, which blocks are MoE)``: a MoE block (its
    mlp holds ``experts``) keeps its router and experts whole on every tp rank, only its attention is tensor
    parallel."""
    blocks = _blocks(model)
    prefix = next(n for n, m in model.named_modules() if m is blocks)
    moe = [hasattr(getattr(block, "mlp", None), "experts") for block in blocks]
    return prefix, [tuple(n for n in COLWISE + ROWWISE if not (m and n.startswith("mlp."))) for m in moe], moe


def check_tp_shards(model: nn.Module, decisions: list[Decision], tp: int, device_type: str = "cuda") -> None:
    """Refuse an FP8 linear the tensor-parallel plan would shard into a piece its recipe cannot run
    (``tp_own.check_shard``: blockwise needs whole 128-blocks per rank; every other recipe an FP8 GEMM shape,
    multiples of 16, as ``torch._scaled_mm`` on CUDA requires). Called by :func:`apply_tp` before any module
    or collective, and by ``fp8kit plan`` (for a GPU run), so a plan shows what training would refuse.

    On ``device_type = "cpu"`` torchao's recipes are not checked: the CPU's ``torch._scaled_mm`` takes any
    shape (how the test suite trains the tiny preset with tp = 2), while fp8kit's own recipes are (their
    kernels and block layouts need the shapes on every device).

    Raises:
        ConfigError: naming every kind of layer refused (the first refused layer of each kind: the layer, the
            recipe, the weight and shard shapes) and the ``fp8.exclude`` patterns that keep them all BF16.
    """
    if tp == 1:
        return
    prefix, names, _ = _tp_plan(model)
    kinds = {f"{prefix}.{i}.{n}": "column" if n in COLWISE else "row" for i, ns in enumerate(names) for n in ns}
    refused: dict[str, tuple[Decision, str]] = {}  # exclude pattern -> (its first layer, the problem)
    for d in decisions:
        if d.fqn not in kinds or not d.is_fp8 or d.site.is_grouped:
            continue
        if device_type != "cpu" or recipe_info(d.recipe).engine == "fp8kit":
            problem = shard_problem(d.fqn, tuple(d.site.weight_shape), d.recipe, kinds[d.fqn], tp)
            if problem is not None:
                refused.setdefault(exclude_pattern(d.fqn), (d, problem))
    if len(refused) == 1:  # check_shard's own message
        ((d, _),) = refused.values()
        check_shard(d.fqn, tuple(d.site.weight_shape), d.recipe, kinds[d.fqn], tp)
    if refused:
        recipes = sorted({d.recipe for d, _ in refused.values()})
        one = len(recipes) == 1
        lines = "; ".join(problem + ("" if one else f" (recipe {d.recipe!r})") for d, problem in refused.values())
        patterns = ", ".join(f'"{p}"' for p in refused)
        head = f"fp8.recipe = {recipes[0]!r}" if one else f"FP8 recipes {', '.join(map(repr, recipes))}"
        raise ConfigError(f"{head} with distributed.tp = {tp}: {len(refused)} kinds of FP8 linear split into shards "
                          f"the recipe cannot run (the first refused layer of each kind named): {lines}. Keep them "
                          f"BF16 (add {patterns} to fp8.exclude) or use a tp for which they are")


def apply_tp(model: nn.Module, tp_mesh, decisions: list[Decision], conversion: ConversionOptions | None, *,
             sequence_parallel: bool) -> int:
    """Shard the linears of every block over ``tp_mesh`` (see the module docstring); returns FP8 linears sharded.

    With ``sequence_parallel`` the residual stream between the attention and MLP halves is split over
    tokens (``[B, T/tp, H]``): the norms run on their token shard (``SequenceParallel``), the attention and
    MLP inputs are all-gathered (``PrepareModuleInput``, bf16), and the row-parallel outputs are
    reduce-scattered instead of all-reduced (FP8 linears: ``Float8RowwiseParallelSP``, whose backward
    all-gathers the bf16 gradient before its E5M2 cast). The first block's input is split (a local slice) and the final
    norm's output is all-gathered before ``lm_head``; embeddings, rotary positions and the causal mask are
    computed on the whole sequence as without TP.

    FP8 linears of fp8kit's own recipes (blockwise, delayed) get ``tp_own.OwnColwiseParallel`` /
    ``OwnRowwiseParallel`` (their FP8 ops on local shards, bf16 collectives; ``parallel/tp_own.py``),
    those of torchao's recipes torchao's Float8 styles.

    Raises:
        ConfigError: a block lacks one of the planned linears (not a Llama/Qwen-style block), or an FP8
            linear whose per-rank shard its recipe cannot run (:func:`check_tp_shards`: blockwise needs whole
            128-blocks, the other recipes multiples of 16), naming the layer and the shapes.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    fp8_names = fp8_fqns(decisions) if conversion is not None else set()
    blocks = _blocks(model)
    prefix, names, moe = _tp_plan(model)  # module docstring, "MoE blocks"
    planned = {f"{prefix}.{i}.{n}" for i, ns in enumerate(names) for n in ns}
    # The FP8 TP styles require the FP8 modules: convert those linears first (decisions are data), after
    # checking that every rank's shard is one its recipe can run (before any module or collective).
    tp_fp8 = [d for d in decisions if d.fqn in fp8_names and d.fqn in planned]
    check_tp_shards(model, tp_fp8, tp_mesh.size(), tp_mesh.device_type)
    own = {d.fqn for d in tp_fp8 if recipe_info(d.recipe).engine == "fp8kit"}
    if tp_fp8:
        apply_fp8(model, tp_fp8, conversion)
    n_fp8 = 0
    for i, block in enumerate(blocks):
        plan = {}
        for name in names[i]:
            fqn = f"{prefix}.{i}.{name}"
            try:
                block.get_submodule(name)
            except AttributeError:
                raise ConfigError(f"distributed.tp: block {prefix}.{i} has no {name} (not a Llama/Qwen-style block)") from None
            fp8 = fqn in fp8_names
            n_fp8 += fp8
            if fqn in own:  # fp8kit's Float8BlockwiseLinear / Float8DelayedLinear (parallel/tp_own.py)
                col, row = OwnColwiseParallel, OwnRowwiseParallel
            elif fp8:
                from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

                from fp8kit.parallel.tp_styles import Float8RowwiseParallelSP

                # under SP the row-parallel output's gradient is all-gathered before its E5M2 cast (tp_styles.py)
                col, row = Float8ColwiseParallel, (Float8RowwiseParallelSP if sequence_parallel else Float8RowwiseParallel)
            else:
                col, row = ColwiseParallel, RowwiseParallel
            if name in COLWISE:
                plan[name] = col()
            else:
                plan[name] = row(output_layouts=Shard(1)) if sequence_parallel else row()
        if sequence_parallel:
            plan["input_layernorm"] = SequenceParallel(use_local_output=True)
            plan["post_attention_layernorm"] = SequenceParallel(use_local_output=True)
            # The attention and MLP inputs: token shards -> whole sequence (one bf16 all-gather each).
            plan["self_attn"] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=True,
            )
            if moe[i]:  # whole sequence in (all-gather), this rank's token shard of the output out (a slice)
                plan["mlp"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                    output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True,
                )
            else:
                plan["mlp"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                )
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        # Whole-sequence embeddings -> token shard at the first block (a local slice, no communication).
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
        base = model.get_submodule(prefix.rpartition(".")[0]) if "." in prefix else model
        parallelize_module(base, tp_mesh, {"norm": SequenceParallel(use_local_output=True)})
        # The whole sequence for the head: all-gathered as the final norm's output (its hook runs after
        # SequenceParallel's), not as the head's input: the head is a module FP8 conversion and the precision
        # schedule replace (fp8.output_head), and a replaced module loses its hooks.
        if not isinstance(getattr(base, "norm", None), nn.Module):
            raise ConfigError(f"distributed.sequence_parallel: model {type(model).__name__} has no final norm "
                              f"{(prefix.rpartition('.')[0] + '.norm').lstrip('.')!r} to all-gather the sequence "
                              f"after; set distributed.sequence_parallel = false")
        parallelize_module(base.norm, tp_mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))
    return n_fp8


def apply_ac(model: nn.Module) -> None:
    """Wrap every block in torch's non-reentrant ``checkpoint_wrapper`` (state_dict keys unchanged)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = _blocks(model)
    for i in range(len(blocks)):
        blocks[i] = checkpoint_wrapper(blocks[i], preserve_rng_state=False)


def apply_fsdp(model: nn.Module, dp_mesh, *, param_dtype: torch.dtype, ignored_params: set | None = None) -> None:
    """``fully_shard`` every block, then the root (embeddings, final norm, lm_head).

    Mixed precision: compute in bf16 (a no-op cast for bf16 parameters), gradients reduce-scattered in
    fp32 (torchtitan's default: the average over ranks does not round in bf16). ``ignored_params``
    (expert-parallel experts, already sharded over ``ep``) are left to their own gradient handling.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = {"ignored_params": set(ignored_params)} if ignored_params else {}
    blocks = _blocks(model)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at the start of backward: keep them gathered.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1, **kw)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, **kw)


def apply_ep(model: nn.Module, mesh, ep: int, decisions: list[Decision], grouped: GroupedGemmConfig, *,
             fp8_dispatch: bool = False) -> set:
    """Expert parallelism over ``distributed.ep`` ranks (``fp8kit.moe.expert_parallel``); returns the expert
    parameters (for FSDP2 to ignore).

    Every experts module with 3-D weights becomes a ``Float8GroupedExperts`` (BF16 until the FP8
    conversion decides otherwise) holding this rank's ``E / ep`` experts. ``fp8_dispatch``
    (``distributed.ep_fp8_dispatch``): the dispatch all-to-all sends E4M3 (``fp8kit.moe.fp8_dispatch``; the payload
    per layer: ``moe.expert_parallel.dispatch_format``).

    Raises:
        ConfigError: no MoE experts in the model, an experts layout fp8kit cannot run, ``ep`` that
            does not divide the experts or ``dp x tp``, or ``fp8_dispatch`` with a hidden size that is not a
            multiple of 128.
    """
    from fp8kit.moe.expert_parallel import EPGroup, ep_mesh, shard_experts
    from fp8kit.moe.experts import layout_problem, swap_in
    from fp8kit.moe.fp8_dispatch import check_dispatch_hidden

    fqns = list(dict.fromkeys(d.site.module_fqn for d in decisions if d.site.is_grouped_weight))
    if not fqns:
        raise ConfigError(f"distributed.ep = {ep}: the model has no MoE experts to split")
    for fqn in fqns:  # before any collective: every rank refuses alike
        problem = layout_problem(model.get_submodule(fqn))
        if problem:
            raise ConfigError(f"distributed.ep = {ep}: {fqn}: {problem}")
        if fp8_dispatch:
            check_dispatch_hidden(model.get_submodule(fqn).gate_up_proj.shape[2], fqn)
    dp, tp = mesh["dp_replicate"].size() * mesh["dp_shard"].size(), mesh["tp"].size()
    group = EPGroup(ep_mesh(mesh.device_type, dp, ep, tp), ep, dp, fp8_dispatch=fp8_dispatch,
                    tp_mesh=mesh["tp"] if tp > 1 else None)
    params: set = set()
    for fqn in fqns:
        module = swap_in(model, fqn, frozenset(), grouped)
        shard_experts(module, group)
        params.update((module.gate_up_proj, module.down_proj))
    return params


def after_optimizer_step(model: nn.Module, done: Parallelized) -> None:
    """Once per step after ``optimizer.step()``: with FP8 all-gather, precompute every FP8 weight's scale
    in one all-reduce (torchao ``precompute_float8_dynamic_scale_for_fsdp``) instead of one per layer."""
    if done.fp8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
