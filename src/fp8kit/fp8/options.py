"""Run config -> :class:`~fp8kit.fp8.decide.DecideOptions` (policies loaded and checked here).

``num_tokens`` defaults to ``data.seq_length x train.micro_batch_size`` (the seed's definition);
``fp8.fp8_dynamic_num_tokens`` and ``fp8.component_num_tokens`` override it. ``moe_router_topk``
comes from the HF config (``num_experts_per_tok``).
"""

from __future__ import annotations

from fp8kit.config import RunConfig
from fp8kit.fp8.decide import DecideOptions, Selective
from fp8kit.fp8.policy import load_policy


def grouped_gemm_config(cfg: RunConfig):
    """How the run's FP8 MoE experts compute (``fp8kit.moe.grouped_mm.GroupedGemmConfig``): automatic
    backend; the emulation on GPUs without an FP8 grouped GEMM only with ``fp8.emulate = true``."""
    from fp8kit.moe.grouped_mm import GroupedGemmConfig

    return GroupedGemmConfig(emulate=cfg.fp8.emulate)


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
    f8 = cfg.fp8
    num_tokens = f8.fp8_dynamic_num_tokens or cfg.data.seq_length * cfg.train.micro_batch_size
    selective = None
    warnings: list[str] = []
    if f8.selective_fp8:
        paths = dict(f8.component_policy_paths)
        if f8.fp8_dynamic_policy_path:
            paths["*"] = f8.fp8_dynamic_policy_path
        policies = {comp: load_policy(p) for comp, p in paths.items()}
        tokens = {"*": num_tokens, **f8.component_num_tokens}
        selective = Selective(policies, tokens, moe_topk(hf_cfg) if hf_cfg is not None else 1)
        for pol in policies.values():
            meta = pol.metadata
            if meta.get("recipe") and meta["recipe"] != f8.recipe:
                warnings.append(
                    f"policy {pol.source} was measured with recipe {meta['recipe']!r}, this run uses {f8.recipe!r}"
                )
            if device_name and meta.get("device") and meta["device"] != device_name:
                warnings.append(
                    f"policy {pol.source} was measured on {meta['device']!r}, this run trains on {device_name!r}: "
                    f"its thresholds may not hold here"
                )
    return DecideOptions(
        mixed_precision=cfg.train.mixed_precision,
        recipe=f8.recipe,
        include=tuple(f8.include),
        exclude=tuple(f8.exclude),
        tp=cfg.distributed.tp,
        ep=cfg.distributed.ep,
        etp=cfg.distributed.etp,
        num_tokens=num_tokens,
        selective=selective,
        warnings=tuple(warnings),
    )
