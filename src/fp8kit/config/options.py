"""Run config -> :class:`~fp8kit.selective.decide.DecideOptions` (policies loaded and checked here).

The selective (measured) choice follows LoongForge adaptive FP8: ``num_tokens`` defaults to
``data.seq_length x train.micro_batch_size`` as there; ``selective.fp8_dynamic_num_tokens`` and
``selective.component_num_tokens`` override it. ``moe_router_topk`` comes from the HF config
(``num_experts_per_tok``). ``selective_fp8 = "auto"`` gives ``DecideOptions.auto`` without timings: the
static rules decide until ``fp8kit.bench.auto`` adds the measured table (``fp8kit train`` on CUDA).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from fp8kit.base.errors import ConfigError, PolicyError
from fp8kit.config.schema import FP8Config, RunConfig, SelectiveConfig
from fp8kit.fp8.recipes import fast_accum_for, fast_accum_note
from fp8kit.selective.auto import AutoOptions
from fp8kit.selective.decide import DecideOptions, Decision, Selective, decide, decision_notes
from fp8kit.selective.policy import MIXED_FAST_ACCUM, load_policy, report_fast_accum
from fp8kit.selective.sites import find_sites


def grouped_gemm_config(cfg: RunConfig):
    """How the run's FP8 MoE experts compute (``fp8kit.moe.grouped_mm.GroupedGemmConfig``): the recipe
    follows ``fp8.recipe`` (blockwise experts for ``blockwise``, rowwise grouped GEMMs otherwise), automatic
    backend; the emulation on GPUs without an FP8 grouped GEMM only with ``fp8.emulate = true``."""
    return grouped_for_fp8(cfg.fp8)


def grouped_for_fp8(fp8: FP8Config):
    """:func:`grouped_gemm_config` from the ``fp8`` section alone (library entry points)."""
    from fp8kit.moe.grouped_mm import GroupedGemmConfig

    return GroupedGemmConfig.for_fp8_recipe(fp8.recipe, emulate=fp8.emulate, kernel=fp8.grouped_kernel,
                                            wgrad=fp8.grouped_wgrad, gemm=fp8.grouped_gemm,
                                            wgrad_x=fp8.blockwise_wgrad_x, wgrad_input=fp8.grouped_wgrad_input)


def conversion_options_for(fp8: FP8Config):
    """The ``parallel.convert.ConversionOptions`` of an ``fp8`` section for the library entry points
    (``convert_to_fp8``, ``prepare_for_trainer``): emulation, the experts' recipe and kernel, the blockwise wgrad
    layout, ``fp8.blockwise_recompute``, ``fp8.blockwise_fused_mlp`` and ``fp8.delayed_fused_mlp``, and the delayed recipe's history settings. (``fp8kit train`` builds its own in ``parallel/prepare.py``, adding FSDP2.)"""
    from fp8kit.fp8.delayed_state import DelayedScalingState
    from fp8kit.parallel.convert import ConversionOptions

    keep = not fp8.blockwise_recompute  # fp8.blockwise_recompute: no FP8 copies kept from forward to backward
    return ConversionOptions(emulate=fp8.emulate, grouped=replace(grouped_for_fp8(fp8), keep_weight_copies=keep),
                             wgrad_x=fp8.blockwise_wgrad_x, keep_input_copies=keep, keep_weight_copies=keep,
                             fused_mlp=fp8.blockwise_fused_mlp, delayed_fused_mlp=fp8.delayed_fused_mlp,
                             delayed=DelayedScalingState(delayed_scaling_for(fp8)),
                             fast_accum=requested_fast_accum(fp8))


def requested_fast_accum(fp8: FP8Config) -> tuple[str, ...] | None:
    """``fp8.fast_accum`` as the FP8 modules, timers and cache keys take it: a tuple, or None (the recipe table's;
    ``fp8.recipes.fast_accum_for`` resolves either)."""
    return None if fp8.fast_accum is None else tuple(fp8.fast_accum)


def delayed_scaling_for(fp8: FP8Config):
    """The ``fp8.delayed_state.DelayedScaling`` settings of an ``fp8`` section (the delayed recipe)."""
    from fp8kit.fp8.delayed_state import DelayedScaling

    return DelayedScaling(fp8.amax_history_len, fp8.amax_compute_algo, fp8.margin, fp8.delayed_fused_cast,
                          fast_accum_for("delayed", requested_fast_accum(fp8)))


def moe_topk(hf_cfg) -> int:
    """Experts per token of an HF MoE config (1 for dense models)."""
    for key in ("num_experts_per_tok", "moe_router_topk", "num_experts_per_token", "top_k"):
        v = getattr(hf_cfg, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1


def options_from_config(cfg: RunConfig, hf_cfg=None, device_name: str | None = None) -> DecideOptions:
    """Build the decision options of a run.

    Args:
        cfg: the run config.
        hf_cfg: the model's HF config (for ``moe_router_topk``), or None.
        device_name: the device the run trains on; a policy measured on another device gives a
            warning naming both.

    Raises:
        PolicyError: a policy file is missing or invalid.
    """
    d = cfg.distributed
    return decide_options(
        cfg.fp8, cfg.selective, mixed_precision=cfg.train.mixed_precision,
        num_tokens=cfg.data.seq_length * cfg.train.micro_batch_size, tp=d.tp, ep=d.ep,
        topk=moe_topk(hf_cfg) if hf_cfg is not None else 1, device_name=device_name, measures_auto=True,
    )


def decide_options(fp8: FP8Config, selective: SelectiveConfig | None, *, mixed_precision: str = "fp8",
                   num_tokens: int | None = None, tp: int = 1, ep: int = 1, topk: int = 1,
                   device_name: str | None = None, measures_auto: bool = False) -> DecideOptions:
    """The decision options from the ``[fp8]`` and ``[selective]`` sections and the run's sizes.

    Args:
        fp8: the FP8 numerics section (recipe, include / exclude).
        selective: the measured-choice section, or None (no policy, no ``auto``).
        mixed_precision: ``fp8`` or ``bf16`` (everything BF16).
        num_tokens: the default token count for policy lookups (``seq_length x micro_batch_size``);
            ``selective.fp8_dynamic_num_tokens`` overrides it.
        tp, ep: the parallel sizes the policy is looked up at (experts are whole per rank: grouped rules of
            etp = 1).
        topk: experts per token (grouped sites look up ``num_tokens x topk``).
        device_name: the training device (a policy measured elsewhere gives a warning).
        measures_auto: the caller times the sites for ``selective_fp8 = "auto"`` (``fp8kit train``); if not
            (the library entry points), ``auto`` decides by the static rules and a warning says so.

    Raises:
        PolicyError: a policy file is missing or invalid.
        ConfigError: ``selective_fp8`` without any token count.
    """
    sel = selective
    tokens_now = (sel.fp8_dynamic_num_tokens if sel is not None else None) or num_tokens
    decide_selective = None
    auto = None
    warnings: list[str] = []
    if sel is not None and sel.selective_fp8 == "auto" and tokens_now is not None:
        auto = AutoOptions({"*": tokens_now, **sel.component_num_tokens}, topk, sel.auto_min_speedup)
    if sel is not None and sel.selective_fp8 == "auto" and not measures_auto and mixed_precision == "fp8":
        warnings.append(
            "selective.selective_fp8 = 'auto' is measured by `fp8kit train` only; here the static rules decide "
            "(every eligible layer in FP8). For a measured choice pass a policy (fp8kit bench-layers + "
            "merge-policy, selective_fp8 = 'policy')"
        )
    accum_note = fast_accum_note(fp8.recipe, fp8.fast_accum) if mixed_precision == "fp8" else None
    if accum_note:
        warnings.append(accum_note)
    if sel is not None and sel.selective_fp8 == "policy":
        if tokens_now is None:
            raise ConfigError("selective.selective_fp8: no token count; set selective.fp8_dynamic_num_tokens")
        policies = load_policies(sel)
        tokens = {"*": tokens_now, **sel.component_num_tokens}
        decide_selective = Selective(policies, tokens, topk)
        for pol in policies.values():
            meta = pol.metadata
            if meta.get("recipe") and meta["recipe"] != fp8.recipe:
                warnings.append(
                    f"policy {pol.source} was measured with recipe {meta['recipe']!r}, this run uses {fp8.recipe!r}"
                )
            elif meta.get("recipe") and pol.dense and mixed_precision == "fp8":  # dense rules: fast accumulation
                accum_warning = _policy_fast_accum_warning(pol.source, meta, fp8)
                if accum_warning:
                    warnings.append(accum_warning)
            if meta.get("note"):  # what the policy's own file says about it (a CPU policy, a stale one)
                warnings.append(f"policy {pol.source}: {meta['note']}")
            if device_name and meta.get("device") and meta["device"] != device_name:
                warnings.append(
                    f"policy {pol.source} was measured on {meta['device']!r}, this run trains on {device_name!r}: "
                    f"its thresholds may not hold here"
                )
    return DecideOptions(
        mixed_precision=mixed_precision,
        recipe=fp8.recipe,
        include=tuple(fp8.include),
        exclude=tuple(fp8.exclude),
        output_head=fp8.output_head,
        fast_accum=requested_fast_accum(fp8),
        tp=tp,
        ep=ep,
        num_tokens=tokens_now,
        selective=decide_selective,
        auto=auto,
        warnings=tuple(warnings),
    )


def _policy_fast_accum_warning(source: str, meta: dict, fp8: FP8Config) -> str | None:
    """The warning for a policy (``source``, its ``metadata`` ``meta``) timed with other fast accumulation than this
    run's (``fp8.fast_accum`` resolved against ``fp8.recipe``), or merged (``merge-policy --force``) from reports of
    different settings (``policy.MIXED_FAST_ACCUM``, each report's in ``meta["reports"]``); None when it matches."""
    measured, now = report_fast_accum(meta, f"policy {source}: metadata"), list(fast_accum_for(fp8.recipe, fp8.fast_accum))
    if measured == MIXED_FAST_ACCUM:
        each = "; ".join(f"{r.get('name')}: {r.get('fast_accum')}" for r in meta.get("reports") or [])
        return (f"policy {source} was merged (merge-policy --force) from reports measured with different fast "
                f"accumulation{f' ({each})' if each else ''}: its thresholds mix settings; this run uses it in "
                f"{now} (fp8.fast_accum)")
    if measured != now:
        return f"policy {source} was measured with fast accumulation in {measured}, this run uses it in {now} " \
               "(fp8.fast_accum)"
    return None


def decide_for_library(model, fp8: FP8Config, selective: SelectiveConfig | None, *, mixed_precision: str = "fp8",
                       num_tokens: int | None = None) -> list[Decision]:
    """The decisions of the library entry points (``convert_to_fp8``, ``prepare_for_trainer``, the Accelerate
    filter): :func:`decide_options` (no ``auto`` measurement) -> ``decide`` over ``model``'s sites, with each
    warning of the options (a policy measured with another recipe or on another device; ``auto`` unmeasured
    here) raised as a ``UserWarning`` at the caller's caller.

    Raises:
        PolicyError / ConfigError: as :func:`decide_options` and ``decide``.
    """
    options = decide_options(fp8, selective, mixed_precision=mixed_precision, num_tokens=num_tokens)
    for message in options.warnings:
        warnings.warn(message, stacklevel=3)
    decisions = decide(find_sites(model), options)
    for message in decision_notes(decisions, options):
        warnings.warn(message, stacklevel=3)
    return decisions


def load_policies(sel: SelectiveConfig) -> dict:
    """Component (``"*"``: every component without its own) -> the loaded :class:`~fp8kit.selective.policy.Policy`
    of ``selective.fp8_dynamic_policy_path`` and ``selective.component_policy_paths``. ``fp8kit train`` calls it
    before the data is prepared, so a missing or bad policy is the run's first error.

    Raises:
        PolicyError: a policy that cannot be loaded, prefixed with the config key that names it.
    """
    keys = {comp: f"selective.component_policy_paths.{comp}" for comp in sel.component_policy_paths}
    paths = dict(sel.component_policy_paths)
    if sel.fp8_dynamic_policy_path:
        paths["*"], keys["*"] = sel.fp8_dynamic_policy_path, "selective.fp8_dynamic_policy_path"
    out = {}
    for comp, p in paths.items():
        try:
            out[comp] = load_policy(p)
        except PolicyError as e:
            raise PolicyError(f"{keys[comp]}: {e}") from None
    return out
