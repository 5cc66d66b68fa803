"""``parallelize``: the one place where a model becomes a distributed FP8 training model.

Order (seed 001 and torchtitan), each step's reason next to it in :func:`parallelize`::

    tensor parallel (DTensor styles; FP8 linears through torchao's Float8 styles)
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

``distributed.sequence_parallel`` also splits the norms and the residual stream over tokens
(``[B, T/tp, H]``) between the linears; the embeddings stay whole-sequence because HF's decoder computes
the rotary positions and the causal mask from the embedding output's length (see :func:`apply_tp`).
Sequence-parallel communication is BF16: the all-gather of the attention / MLP inputs in forward and of
the row-parallel outputs' gradients in backward (``tp_styles.Float8RowwiseParallelSP``: the gradient is
cast to E5M2 after that all-gather, on the whole sequence, as without SP).

A linear decided FP8 that is tensor-parallel becomes a ``Float8Linear`` just before its TP style is
applied, because torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` only accept
``Float8Linear`` modules; its FP8 casts then see TP-sharded DTensor weights, so the tensorwise amax of a
weight, an input or a gradient is reduced over the ``tp`` mesh by DTensor (the right process group),
and FSDP2's FP8 all-gather reduces the weight amax over the ``dp_shard`` mesh of its DTensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fp8kit.errors import ConfigError
from fp8kit.fp8.convert import apply_fp8, fp8_fqns
from fp8kit.fp8.decide import Decision

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


@dataclass
class Parallelized:
    """What :func:`parallelize` did (recorded in the run's summary).

    Attributes:
        steps: the applied steps, in order, e.g. ``["tp", "fp8", "fsdp2"]``.
        fp8_all_gather: FSDP2 all-gathers FP8 weights (call :func:`after_optimizer_step` each step).
        notes: loud fallbacks and other facts a user must see.
    """

    steps: list[str] = field(default_factory=list)
    fp8_all_gather: bool = False
    notes: list[str] = field(default_factory=list)


def fp8_all_gather_choice(fp8_all_gather: bool | None, recipe: str, fsdp: bool) -> bool:
    """Whether FSDP2 all-gathers FP8 weights plus scales instead of BF16 weights.

    Args:
        fp8_all_gather: ``fp8.enable_fsdp_float8_all_gather`` (None: on for tensorwise; config validation
            refuses true with a rowwise recipe).
        recipe: ``fp8.recipe``.
        fsdp: parameters are sharded with FSDP2 / HSDP (nothing is all-gathered otherwise).

    Combined with tensor parallel this works with torchao 0.18 (tp 2 x dp_shard 2: torch 2.13 on 4 gloo
    ranks, tests/test_distributed.py; torch 2.11 on 4 x H200 with NCCL, docs/benchmarks.md section 5): the
    ``aten.is_pinned`` failure on DTensor reported by seed 001 does not occur.
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
    if getattr(hf_cfg, "model_type", None) not in ("llama", "qwen2", "qwen3", "mistral"):
        raise ConfigError(
            f"distributed.tp = {tp}: the tensor-parallel plan covers Llama/Qwen-style dense blocks, not model_type "
            f"{getattr(hf_cfg, 'model_type', None)!r}"
        )


def apply_tp(model: nn.Module, tp_mesh, decisions: list[Decision], float8_config, *, sequence_parallel: bool) -> int:
    """Shard the linears of every block over ``tp_mesh`` (see the module docstring); returns FP8 linears sharded.

    With ``sequence_parallel`` the residual stream between the attention and MLP halves is split over
    tokens (``[B, T/tp, H]``): the norms run on their token shard (``SequenceParallel``), the attention and
    MLP inputs are all-gathered (``PrepareModuleInput``, bf16), and the row-parallel outputs are
    reduce-scattered instead of all-reduced (FP8 linears: ``Float8RowwiseParallelSP``, whose backward
    all-gathers the bf16 gradient before its E5M2 cast). The first block's input is split (a local slice) and the final
    norm's output is all-gathered before ``lm_head``; embeddings, rotary positions and the causal mask are
    computed on the whole sequence as without TP.

    Raises:
        ConfigError: a block lacks one of the planned linears (not a Llama/Qwen-style block).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    fp8_names = fp8_fqns(decisions) if float8_config is not None else set()
    blocks = _blocks(model)
    prefix = next(n for n, m in model.named_modules() if m is blocks)
    # The FP8 TP styles require Float8Linear modules: convert those linears first (decisions are data).
    tp_fp8 = [d for d in decisions if d.fqn in fp8_names and d.fqn.rsplit(".", 2)[-2] in ("self_attn", "mlp")]
    if tp_fp8:
        apply_fp8(model, tp_fp8, float8_config)
    n_fp8 = 0
    for i, block in enumerate(blocks):
        plan = {}
        for name in COLWISE + ROWWISE:
            fqn = f"{prefix}.{i}.{name}"
            try:
                block.get_submodule(name)
            except AttributeError:
                raise ConfigError(f"distributed.tp: block {prefix}.{i} has no {name} (not a Llama/Qwen-style block)") from None
            fp8 = fqn in fp8_names
            n_fp8 += fp8
            if fp8:
                from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

                from fp8kit.distributed.tp_styles import Float8RowwiseParallelSP

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
        head = model.get_output_embeddings()
        parallelize_module(head, tp_mesh, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
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


def apply_ep(model: nn.Module, mesh, cfg, decisions: list[Decision]) -> set:
    """Expert parallelism over ``distributed.ep`` ranks (``fp8kit.moe.expert_parallel``); returns the expert
    parameters (for FSDP2 to ignore).

    Every experts module with 3-D weights becomes a ``Float8GroupedExperts`` (BF16 until the FP8
    conversion decides otherwise) holding this rank's ``E / ep`` experts.

    Raises:
        ConfigError: no MoE experts in the model, an experts layout fp8kit cannot run, or ``ep`` that
            does not divide the experts / data-parallel size, or ``tp > 1``.
    """
    from fp8kit.fp8.options import grouped_gemm_config
    from fp8kit.moe.expert_parallel import EPGroup, ep_mesh, shard_experts
    from fp8kit.moe.experts import layout_problem, swap_in

    ep = cfg.distributed.ep
    fqns = list(dict.fromkeys(d.site.module_fqn for d in decisions if d.site.is_grouped_weight))
    if not fqns:
        raise ConfigError(f"distributed.ep = {ep}: the model has no MoE experts to split")
    dp = mesh["dp_replicate"].size() * mesh["dp_shard"].size()
    group = EPGroup(ep_mesh(mesh.device_type, dp, ep, mesh["tp"].size()), ep, dp)
    params: set = set()
    for fqn in fqns:
        problem = layout_problem(model.get_submodule(fqn))
        if problem:
            raise ConfigError(f"distributed.ep = {ep}: {fqn}: {problem}")
        module = swap_in(model, fqn, frozenset(), grouped_gemm_config(cfg))
        shard_experts(module, group)
        params.update((module.gate_up_proj, module.down_proj))
    return params


def parallelize(model: nn.Module, mesh, cfg, decisions: list[Decision], *, float8_config, hf_cfg=None) -> Parallelized:
    """Make ``model`` a distributed training model in place (the order of the module docstring).

    Args:
        model: an HF causal LM, fully materialised on this rank's device (the same weights on every rank).
        mesh: the 3-D ``("dp_replicate", "dp_shard", "tp")`` DeviceMesh (:func:`fp8kit.distributed.mesh.init_distributed`).
        cfg: the run config (``train.activation_checkpointing``, ``train.compile``, ``train.param_dtype``).
        decisions: the FP8/BF16 decision of every site (decided on the unsharded model).
        float8_config: torchao ``Float8LinearConfig`` (None for bf16 runs); its
            ``enable_fsdp_float8_all_gather`` decides FP8 all-gather (see :func:`fp8_all_gather_choice`).
        hf_cfg: the model's HF config (for the TP divisibility check).

    Returns:
        :class:`Parallelized`.

    Raises:
        ConfigError: a model the TP or EP plan does not fit.
    """
    from fp8kit.distributed.mesh import dp_mesh

    done = Parallelized()
    tp = mesh["tp"].size()
    dp_shard, dp_replicate = mesh["dp_shard"].size(), mesh["dp_replicate"].size()

    # 1. Tensor parallel first: it changes the shapes the later steps see (per-rank weight shards), and
    #    the FP8 TP styles must own the linear's input/output hooks before FSDP2 wraps the block.
    if tp > 1:
        if hf_cfg is not None:
            check_tp(hf_cfg, tp)
        sp = cfg.distributed.sequence_parallel
        apply_tp(model, mesh["tp"], decisions, float8_config, sequence_parallel=sp)
        done.steps.append("tp+sp" if sp else "tp")

    # 2. Expert parallel before FP8: the experts modules become fp8kit's grouped experts holding only this
    #    rank's E / ep experts (DTensor Shard(0) over "ep"), so the FP8 conversion below and the grouped
    #    FP8 GEMMs see the local experts; FSDP2 later leaves these weights alone (ignored_params).
    expert_params: set[nn.Parameter] = set()
    if cfg.distributed.ep > 1:
        expert_params = apply_ep(model, mesh, cfg, decisions)
        done.steps.append(f"ep{cfg.distributed.ep}")

    # 3. FP8 conversion of the remaining linears, after TP (it sees the TP-sharded modules) and before AC
    #    (AC must recompute through Float8Linear) and FSDP2 (FP8 all-gather needs torchao's weight
    #    wrapper in place when fully_shard takes the parameters).
    if float8_config is not None:
        from fp8kit.fp8.options import grouped_gemm_config

        apply_fp8(model, decisions, float8_config, grouped_gemm_config(cfg))
        done.steps.append("fp8")
        done.fp8_all_gather = bool(getattr(float8_config, "enable_fsdp_float8_all_gather", False)) and (
            dp_shard > 1 or dp_replicate > 1
        )
        if cfg.fp8.enable_fsdp_float8_all_gather and not (dp_shard > 1 or dp_replicate > 1):
            done.notes.append("fp8.enable_fsdp_float8_all_gather = true has no effect: no FSDP2 (dp_shard = 1)")

    # 4. Activation checkpointing per block, inside FSDP2's unit, so that the recomputation in backward
    #    runs on the already all-gathered parameters of that block.
    if cfg.train.activation_checkpointing:
        apply_ac(model)
        done.steps.append("ac")

    # 5. FSDP2 last among the module transformations: it takes the final parameters (TP DTensors, FP8
    #    weight wrappers) and shards them over the data-parallel ranks.
    if dp_shard > 1 or dp_replicate > 1:
        param_dtype = torch.float32 if cfg.train.param_dtype == "fp32" else torch.bfloat16
        apply_fsdp(model, dp_mesh(mesh), param_dtype=param_dtype, ignored_params=expert_params)
        done.steps.append("fsdp2" if dp_replicate == 1 else "hsdp")

    # 6. Compile each block last: it traces the final modules (FSDP2's hooks are skipped by dynamo and
    #    run eagerly around the compiled block).
    if cfg.train.compile:
        for block in _blocks(model):
            block.compile()
        done.steps.append("compile")
    return done


def after_optimizer_step(model: nn.Module, done: Parallelized) -> None:
    """Once per step after ``optimizer.step()``: with FP8 all-gather, precompute every FP8 weight's scale
    in one all-reduce (torchao ``precompute_float8_dynamic_scale_for_fsdp``) instead of one per layer."""
    if done.fp8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def grad_norm_and_clip(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 gradient norm over DTensor (FSDP2/TP) and plain gradients, then clip in place.

    Gradients are grouped by their device mesh and placements; each group's norm is taken with
    ``torch.nn.utils.get_total_norm`` (a DTensor for sharded groups, made whole with ``full_tensor``:
    DTensor does the reduction over the right ranks), and the group norms combine as
    ``sqrt(sum(norm_g ** 2))``. Clipping uses ``clip_grads_with_norm_`` per group.

    Returns:
        The total norm before clipping (0-dim float32 tensor, the same on every rank).
    """
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(p)
    norms = []
    for ps in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in ps], norm_type=2.0, foreach=True)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        norms.append(n.float())
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if max_norm and max_norm != float("inf"):
        for ps in groups.values():
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total, foreach=True)
    return total
