"""Decide FP8 or BF16 for every site: static rules first, then the run's precision.

Deciding is pure: sites and config in, :class:`Decision` rows out. ``plan`` prints them, ``train``
applies them through ``fp8/convert.py``; nothing here touches a module.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8kit.fp8.rules import StaticRules
from fp8kit.fp8.sites import Site


@dataclass(frozen=True)
class Decision:
    """The precision chosen for one site and why.

    Attributes:
        site: the site decided.
        precision: ``"fp8"`` or ``"bf16"``.
        rule: short id of the rule that decided (``linear``, ``head``, ``dims%16``, ``exclude``,
            ``mixed_precision``, ...).
        reason: one sentence for the conversion report.
        recipe: the FP8 recipe (``None`` for BF16 sites).
    """

    site: Site
    precision: str
    rule: str
    reason: str
    recipe: str | None = None

    @property
    def fqn(self) -> str:
        return self.site.fqn

    @property
    def is_fp8(self) -> bool:
        return self.precision == "fp8"

    def to_dict(self) -> dict:
        return {
            "fqn": self.site.fqn,
            "shape": list(self.site.weight_shape),
            "module_type": self.site.module_type,
            "role": self.site.role,
            "module_kind": self.site.module_kind,
            "ub_name": self.site.ub_name,
            "num_gemms": self.site.num_gemms,
            "component": self.site.component,
            "precision": self.precision,
            "rule": self.rule,
            "reason": self.reason,
            "recipe": self.recipe,
        }


def decide(
    sites: list[Site],
    *,
    mixed_precision: str,
    recipe: str,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
) -> list[Decision]:
    """One :class:`Decision` per site.

    Args:
        sites: from :func:`fp8kit.fp8.sites.find_sites`.
        mixed_precision: ``"fp8"`` or ``"bf16"`` (``train.mixed_precision``); with ``bf16`` every
            site is BF16, FP8 candidates saying so.
        recipe: the FP8 recipe recorded on FP8 decisions.
        include / exclude: ``fp8.include`` / ``fp8.exclude`` patterns.

    Raises:
        ConfigError: an invalid pattern.
    """
    rules = StaticRules.from_lists(list(include or []), list(exclude or []))
    out: list[Decision] = []
    for site in sites:
        verdict = rules.check(site)
        if not verdict.candidate:
            out.append(Decision(site, "bf16", verdict.rule, verdict.reason))
        elif mixed_precision != "fp8":
            out.append(Decision(site, "bf16", "mixed_precision", f"train.mixed_precision = {mixed_precision!r}"))
        else:
            out.append(Decision(site, "fp8", verdict.rule, verdict.reason, recipe))
    return out


def summarize(decisions: list[Decision]) -> dict:
    """Counts for logs and summaries: sites, FP8 sites, and the share of linear weights in FP8."""
    linear = [d for d in decisions if d.site.in_features is not None]
    params = sum(_numel(d.site.weight_shape) for d in linear)
    fp8_params = sum(_numel(d.site.weight_shape) for d in linear if d.is_fp8)
    return {
        "sites": len(decisions),
        "fp8_sites": sum(d.is_fp8 for d in decisions),
        "linear_params": params,
        "fp8_linear_params": fp8_params,
        "fp8_param_fraction": fp8_params / params if params else 0.0,
    }


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

