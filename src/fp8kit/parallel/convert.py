"""Apply FP8 decisions to a model, and undo them: the one module swapper.

:func:`apply_fp8` swaps the ``nn.Linear`` modules decided ``fp8`` for torchao ``Float8Linear`` (through
torchao's own ``convert_to_float8_training`` with a filter that admits exactly those FQNs; the
``Float8LinearConfig`` is built from each decision's own ``recipe``, so the decision is the one source of
truth for how a layer computes), and the MoE experts modules with a 3-D weight decided ``fp8`` for
``fp8kit.moe``'s ``Float8GroupedExperts``; recipes that fp8kit runs itself (``blockwise``) swap the
linear for ``fp8kit.fp8.linear.Float8BlockwiseLinear``. :func:`restore_bf16` swaps all of them back. All swaps keep the very
same ``Parameter`` objects, so optimizer state (keyed by parameter) survives every switch, and
``state_dict`` keys do not change.

``prepare_model`` (the first conversion of a run), the precision schedule (BF16 <-> FP8 phases) and the
library entry point ``fp8kit.convert_to_fp8`` all go through these two functions. Decisions name modules
by their plain FQN (``model.layers.0.mlp.up_proj``); wrappers added later (``checkpoint_wrapper``'s
``_checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod``) are looked through.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from fp8kit.base.errors import Fp8kitError
from fp8kit.base.torchao_lib import torchao_float8
from fp8kit.fp8.blockwise_all_gather import wrap_weight as wrap_blockwise_weight
from fp8kit.fp8.delayed import DelayedScalingState, Float8DelayedLinear
from fp8kit.fp8.delayed_all_gather import wrap_weight
from fp8kit.fp8.delayed_siblings import link_input_siblings
from fp8kit.fp8.linear import Float8BlockwiseLinear
from fp8kit.fp8.recipes import float8_linear_config, recipe_info
from fp8kit.fp8.swiglu_mlp import fused_mlp_report, install_fused_mlps
from fp8kit.moe import experts as moe_experts
from fp8kit.moe.grouped_mm import GroupedGemmConfig
from fp8kit.selective.decide import Decision

#: Name parts inserted by module wrappers; decisions use FQNs without them.
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


@dataclass(frozen=True)
class ConversionOptions:
    """How the FP8 modules compute (the recipe itself comes from each :class:`Decision`).

    Attributes:
        emulate: run FP8 matmuls as a high-precision emulation (GPUs without FP8 tensor cores; same
            numerics, no speed-up).
        fsdp_float8_all_gather: FSDP2 all-gathers FP8 weights plus scales (tensorwise: torchao's; delayed:
            ``fp8kit.fp8.delayed_all_gather``, cast with each weight's delayed scale; blockwise:
            ``fp8kit.fp8.blockwise_all_gather``, each shard's 128x128 blocks).
        fsdp_shards: the FSDP2 shards of each weight (``dp_shard``): a blockwise weight is all-gathered in FP8 only
            when its shards hold whole 128-row blocks.
        grouped: how FP8 MoE experts compute (grouped-GEMM kernel choice, emulation).
        delayed: the amax histories of the ``delayed`` recipe's modules (kept across precision switches and
            saved with checkpoints); None: created on first use with the default settings.
        cache_weights: blockwise linears keep their FP8 weight across micro-batches
            (``Float8BlockwiseLinear(cache_weight=...)``, ``fp8kit.fp8.weight_cache``); experts follow ``grouped``.
        keep_weight_copies: blockwise linears keep the forward's FP8 ``w^T`` copy for the backward
            (``Float8BlockwiseLinear(keep_weight_copy=...)``); ``prepare_model`` turns it off under FSDP2, where it
            would hold every layer's unsharded FP8 weight from its forward to its backward.
        keep_input_copies: blockwise linears keep the forward's FP8 ``x^T`` copy for the backward
            (``Float8BlockwiseLinear(keep_input_copy=...)``); off with ``fp8.blockwise_recompute``.
        wgrad_x: blockwise linears' wgrad copy of their input, ``"128x1"`` or ``"128x128"``
            (``Float8BlockwiseLinear(wgrad_x=...)``; ``fp8.blockwise_wgrad_x``).
        fused_mlp: SwiGLU MLPs whose three projections are blockwise FP8 run as one function with the SwiGLU's
            casts fused (``fp8kit.fp8.swiglu_mlp.install_fused_mlps``; ``fp8.blockwise_fused_mlp``).
        delayed_fused_mlp: the same for SwiGLU MLPs whose three projections are delayed-scaling FP8
            (``fp8kit.fp8.delayed_mlp``; ``fp8.delayed_fused_mlp``).
        fast_accum: torchao linears' GEMMs with fast accumulation (``fp8.fast_accum``; None: the recipe table's;
            the delayed recipe's are in ``delayed.config.fast_accum``).
    """

    emulate: bool = False
    cache_weights: bool = False
    keep_weight_copies: bool = True
    keep_input_copies: bool = True
    wgrad_x: str = "128x1"
    fused_mlp: bool = False
    delayed_fused_mlp: bool = True
    fsdp_float8_all_gather: bool = False
    fsdp_shards: int = 1
    grouped: GroupedGemmConfig = field(default_factory=GroupedGemmConfig)
    delayed: DelayedScalingState = field(default_factory=DelayedScalingState)
    fast_accum: tuple[str, ...] | None = None

    def fuses_mlps(self, recipe: str) -> bool:
        """Whether SwiGLU MLPs of ``recipe``'s projections run fused (``fused_mlp`` / ``delayed_fused_mlp``)."""
        return {"blockwise": self.fused_mlp, "delayed": self.delayed_fused_mlp}.get(recipe, False)


#: fp8kit's own FP8 linear modules (recipes whose engine is fp8kit).
FP8_LINEARS = (Float8BlockwiseLinear, Float8DelayedLinear)


def plain_fqn(fqn: str) -> str:
    """``fqn`` without wrapper parts (:data:`WRAPPER_PARTS`): the name decisions use."""
    return ".".join(p for p in fqn.split(".") if p not in WRAPPER_PARTS)


def plain_named_modules(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """``{plain fqn: (real fqn, module)}`` for every module (the innermost module under each plain name)."""
    out: dict[str, tuple[str, nn.Module]] = {}
    for real, module in model.named_modules():
        out[plain_fqn(real)] = (real, module)
    return out


def fp8_fqns(decisions: list[Decision]) -> set[str]:
    """FQNs of the sites decided FP8 (linear layers only)."""
    return {d.fqn for d in decisions if d.is_fp8 and not d.site.is_grouped}


def fp8_expert_weights(decisions: list[Decision]) -> dict[str, frozenset[str]]:
    """Experts module FQN -> names of its 3-D weights decided FP8 (modules with none are left out)."""
    out: dict[str, set[str]] = {}
    for d in decisions:
        if d.is_fp8 and d.site.is_grouped_weight:
            out.setdefault(d.site.module_fqn, set()).add(d.fqn.rpartition(".")[2])
    return {k: frozenset(v) for k, v in out.items()}


def apply_fp8(model: nn.Module, decisions: list[Decision], options: ConversionOptions | None = None) -> int:
    """Swap every module decided FP8 for its FP8 form; returns how many modules were swapped.

    ``nn.Linear`` -> torchao ``Float8Linear`` with the ``Float8LinearConfig`` of the decision's recipe;
    an experts module with a 3-D weight decided FP8 -> ``Float8GroupedExperts`` (``options.grouped``).
    Modules already converted are left as they are, so this is idempotent.

    Raises:
        Fp8kitError: a decided FQN is not an ``nn.Linear`` / supported experts module of this model, or a
            decision has no recipe.
        ConfigError: a decision's recipe is unknown to torchao's float8 (``fp8.recipes``).
    """
    options = options or ConversionOptions()
    modules = plain_named_modules(model)
    count = _apply_grouped(model, decisions, options, modules)
    float8 = torchao_float8()
    by_recipe: dict[str, set[str]] = {}
    for d in decisions:
        if not (d.is_fp8 and not d.site.is_grouped):
            continue
        real = modules.get(d.fqn)
        if real is not None and is_fp8_linear(real[1]):
            continue  # converted already (an earlier call, or tensor parallel's own-recipe styles)
        if real is None or not isinstance(real[1], nn.Linear):
            raise Fp8kitError(f"FP8 decision for {d.fqn!r}, which is not an nn.Linear of this model")
        if not d.recipe:
            raise Fp8kitError(f"FP8 decision for {d.fqn!r} carries no recipe")
        by_recipe.setdefault(d.recipe, set()).add(real[0])
    for recipe, todo in by_recipe.items():
        if recipe_info(recipe).engine == "fp8kit":
            count += _swap_own(model, todo, recipe, options)
            if options.fuses_mlps(recipe):
                install_fused_mlps(model, recipe)
            continue
        config = float8_linear_config(
            recipe, emulate=options.emulate, enable_fsdp_float8_all_gather=options.fsdp_float8_all_gather,
            fast_accum=options.fast_accum,
        )
        float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn, t=todo: fqn in t)
        count += len(todo)
    link_input_siblings(model)  # delayed q/k/v and gate/up: one cast of their shared input
    return count


def fused_mlp_notes(model: nn.Module, recipe: str = "blockwise") -> tuple[list[str], list[str]]:
    """What ``fp8.<recipe>_fused_mlp`` does in ``model`` now: ``(facts, fallbacks)``.

    ``facts`` says how many SwiGLU MLPs run fused (a note of the run); ``fallbacks`` names each reason some run
    unfused, with an example (warnings: the setting, asked for or on by default, does not apply to them, so those
    MLPs run slower than the setting promises). Both empty when the model has no MLP of
    ``swiglu_mlp.FUSABLE_MLPS``."""
    fused, blocked = fused_mlp_report(model)
    if not fused and not blocked:
        return [], []
    key = f"fp8.{recipe}_fused_mlp"
    facts = [f"{key}: {len(fused)} of {len(fused) + len(blocked)} SwiGLU MLPs run with the SwiGLU's FP8 casts "
             f"fused (fp8kit.fp8.{'swiglu_mlp' if recipe == 'blockwise' else 'delayed_mlp'})"]
    by_reason: dict[str, list[str]] = {}
    for name, reason in blocked.items():
        by_reason.setdefault(reason, []).append(name)
    fallbacks = [f"{key}: {len(names)} MLP(s) run unfused ({reason}), e.g. {names[0]}"
                 for reason, names in sorted(by_reason.items())]
    return facts, fallbacks


def _swap_own(model: nn.Module, todo: set[str], recipe: str, options: ConversionOptions) -> int:
    """``nn.Linear`` -> fp8kit's FP8 linear of ``recipe`` (same Parameters) at the real FQNs ``todo``."""
    for real in sorted(todo):
        parent_name, _, child = real.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        try:
            if recipe == "delayed":
                new = Float8DelayedLinear.from_linear(linear, options.delayed, plain_fqn(real))
                if options.fsdp_float8_all_gather:  # FSDP2 all-gathers its E4M3 cast (fp8.delayed_all_gather)
                    wrap_weight(new)
            else:
                new = Float8BlockwiseLinear.from_linear(linear, emulate=options.emulate, name=plain_fqn(real),
                                                        cache_weight=options.cache_weights,
                                                        keep_weight_copy=options.keep_weight_copies,
                                                        keep_input_copy=options.keep_input_copies,
                                                        wgrad_x=options.wgrad_x)
                if options.fsdp_float8_all_gather:  # its 128x128 blocks, when the shards hold whole ones
                    wrap_blockwise_weight(new, options.fsdp_shards)
        except ValueError as e:
            raise Fp8kitError(str(e)) from None
        setattr(parent, child, new)
    return len(todo)


def _apply_grouped(model: nn.Module, decisions: list[Decision], options: ConversionOptions,
                   modules: dict[str, tuple[str, nn.Module]]) -> int:
    wanted = fp8_expert_weights(decisions)
    count = 0
    for fqn, weights in wanted.items():
        if fqn not in modules:
            raise Fp8kitError(f"FP8 decision for experts {fqn!r}, which is not a module of this model")
        real, module = modules[fqn]
        if isinstance(module, moe_experts.Float8GroupedExperts) and module.fp8_weights == weights:
            continue
        moe_experts.swap_in(model, real, weights, options.grouped)
        count += 1
    return count


def restore_bf16(model: nn.Module, fqns: set[str] | None = None) -> int:
    """Swap every FP8 module back to its BF16 form sharing the same parameters; returns the count.

    With ``fqns`` (plain FQNs): only the FP8 linear modules named there (MoE experts stay as they are);
    the divergence guard (``fp8kit.train.guard``) moves single layers to BF16 this way.
    """
    float8 = torchao_float8()
    count = moe_experts.swap_out(model) if fqns is None else 0
    for fqn, module in list(model.named_modules()):
        if fqns is not None and plain_fqn(fqn) not in fqns:
            continue
        if isinstance(module, FP8_LINEARS):
            plain = module.to_linear()
        elif isinstance(module, float8.Float8Linear):
            plain = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
            plain.weight = module.weight
            plain.bias = module.bias
        else:
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, plain)
        count += 1
    link_input_siblings(model)  # the delayed linears left in FP8 share their inputs' scales without those swapped out
    return count


def is_fp8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an FP8 linear now: torchao's ``Float8Linear`` or one of fp8kit's own recipes'
    (:data:`FP8_LINEARS`), also under FSDP2, whose ``fully_shard`` makes the module's class a subclass of its own."""
    return isinstance(module, (*FP8_LINEARS, torchao_float8().Float8Linear))


def count_fp8_modules(model: nn.Module) -> int:
    """Number of FP8 linear (:func:`is_fp8_linear`) and FP8 grouped-experts modules in ``model``."""
    return sum(is_fp8_linear(m) or (isinstance(m, moe_experts.Float8GroupedExperts) and bool(m.fp8_weights))
               for m in model.modules())
