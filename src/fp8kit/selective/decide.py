"""Decide FP8 or BF16 for every site: static rules, then the run's precision, then the selective-FP8 policy.

Deciding is pure: sites and options in, :class:`Decision` rows out. ``plan`` prints them, ``train``
applies them through ``parallel/convert.py``; nothing here touches a module, and nothing is decided per
step (as in LoongForge adaptive FP8, no runtime overhead: the decision happens once, at model build).

Order for one site:

1. the static filter (``selective/rules.py``): embeddings, heads, routers, experts, non-2-D, dims % 16,
   ``fp8.include`` / ``fp8.exclude``;
2. ``train.mixed_precision = "bf16"``: everything BF16;
3. with ``selective.selective_fp8 = "auto"`` and a measured table (``DecideOptions.auto.timings``): FP8 only
   where the site's unit measured ``bf16_ms / fp8_ms >= auto.min_speedup`` (``selective/auto.py``; a shape
   missing from the table keeps its static rule, with that said in the reason);
4. with ``selective.selective_fp8 = true`` (a policy): the policy of the site's component
   (``selective/policy.py``) at the component's token count, with the run's ``tp`` (dense) or ``etp`` and
   local experts (grouped);
5. otherwise FP8.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp8kit.fp8.recipes import recipe_info
from fp8kit.moe.expert_parallel import check_ep_divides_experts
from fp8kit.selective.auto import AutoOptions, AutoShape, Timing, auto_units, auto_verdict
from fp8kit.selective.policy import Policy
from fp8kit.selective.rules import StaticRules
from fp8kit.selective.sites import Site

#: The recipe of FP8 grouped expert weights (``fp8kit.moe``) under every run recipe but ``blockwise``: rowwise
#: E4M3 in all three GEMMs (the only scaling ``torch._scaled_grouped_mm`` takes on Hopper).
GROUPED_RECIPE = "rowwise"


#: Most local experts a blockwise grouped site may have and still run FP8: blockwise experts are a per-expert loop
#: of dense GEMMs (``moe/grouped_loop.py``), host-bound with many small experts (H100, ``benchmarks/moe_layer.py``:
#: Mixtral's 8 experts 1.14x BF16, Qwen3-30B-A3B's 128 experts 0.04-0.10x).
BLOCKWISE_LOOP_MAX_EXPERTS = 16


def grouped_recipe(run_recipe: str) -> str:
    """The recipe FP8 expert weights run under the run's ``fp8.recipe``: ``blockwise`` experts
    (``moe/grouped_loop.py``) for ``blockwise``, :data:`GROUPED_RECIPE` for every other recipe."""
    return "blockwise" if run_recipe == "blockwise" else GROUPED_RECIPE


@dataclass(frozen=True)
class Decision:
    """The precision chosen for one site and why.

    Attributes:
        site: the site decided.
        precision: ``"fp8"`` or ``"bf16"``.
        rule: short id of the rule that decided (``linear``, ``head``, ``dims%16``, ``exclude``,
            ``mixed_precision``, ``policy``, ...).
        reason: one sentence for the conversion report.
        recipe: the FP8 recipe (``None`` for BF16 sites); grouped expert weights run
            :func:`grouped_recipe` of the run's recipe (blockwise or rowwise).
        tp / etp: the parallel sizes the decision used.
        num_gemms: local experts per rank for grouped sites (``num_experts / ep``), else None.
        num_tokens: the component's token count (``seq_length x micro_batch_size`` or explicit).
        measured: the ``selective_fp8 = "auto"`` timing of the site's unit that decided, else None.
    """

    site: Site
    precision: str
    rule: str
    reason: str
    recipe: str | None = None
    tp: int = 1
    etp: int = 1
    num_gemms: int | None = None
    num_tokens: int | None = None
    measured: Timing | None = None

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
            "component": self.site.component,
            "tp": self.tp,
            "etp": self.etp,
            "num_gemms": self.num_gemms,
            "num_tokens": self.num_tokens,
            "precision": self.precision,
            "rule": self.rule,
            "reason": self.reason,
            "recipe": self.recipe,
            "measured": self.measured.to_dict() if self.measured is not None else None,
        }


@dataclass(frozen=True)
class Selective:
    """Selective-FP8 inputs: one policy and token count per component (``"*"``: every other component)."""

    policies: dict[str, Policy]
    num_tokens: dict[str, int]
    topk: int = 1

    def for_component(self, component: str) -> tuple[Policy | None, int | None]:
        return (self.policies.get(component, self.policies.get("*")),
                self.num_tokens.get(component, self.num_tokens.get("*")))


@dataclass(frozen=True)
class DecideOptions:
    """Everything :func:`decide` needs besides the sites (``auto``: the ``selective_fp8 = "auto"`` inputs, with
    the measured table once ``fp8kit.bench.auto`` has timed it)."""

    mixed_precision: str = "fp8"
    recipe: str = "tensorwise"
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    output_head: bool = False
    tp: int = 1
    ep: int = 1
    etp: int = 1
    num_tokens: int | None = None
    selective: Selective | None = None
    auto: AutoOptions | None = None
    warnings: tuple[str, ...] = field(default=())
    #: ``fp8.fast_accum`` as given (None: the recipe table's default); only for :func:`decision_notes`
    fast_accum: tuple[str, ...] | None = None


def decide(sites: list[Site], options: DecideOptions) -> list[Decision]:
    """One :class:`Decision` per site, in the order of the module docstring.

    Raises:
        ConfigError: an invalid pattern, or ``ep`` that does not divide a site's experts.
    """
    rules = StaticRules.from_lists(list(options.include), list(options.exclude),
                                   recipe_info(options.recipe).dims_multiple, options.output_head)
    shape_of = _auto_shapes(sites, rules, options)
    out: list[Decision] = []
    for site in sites:
        recipe = grouped_recipe(options.recipe) if site.is_grouped_weight else options.recipe
        num_gemms = None
        if site.num_gemms is not None:
            check_ep_divides_experts(options.ep, site.num_gemms, site.fqn)
            num_gemms = site.num_gemms // options.ep
        tokens = options.num_tokens
        if options.selective is not None:
            tokens = options.selective.for_component(site.component)[1] or tokens
        ctx = {"tp": options.tp, "etp": options.etp, "num_gemms": num_gemms, "num_tokens": tokens}
        verdict = rules.check(site)
        if not verdict.candidate:
            out.append(Decision(site, "bf16", verdict.rule, verdict.reason, **ctx))
            continue
        if recipe == "blockwise" and site.is_grouped_weight and (num_gemms or 0) > BLOCKWISE_LOOP_MAX_EXPERTS:
            out.append(Decision(site, "bf16", "blockwise-loop", (
                f"blockwise experts run a per-expert loop of dense GEMMs (torch has no blockwise grouped GEMM): "
                f"with {num_gemms} local experts it is host-bound (128 experts measured 0.04-0.10x BF16); kept "
                f"BF16 -- fp8.recipe = tensorwise / rowwise / delayed runs experts on the fused rowwise grouped "
                f"GEMM, or expert parallelism brings the local experts to <= {BLOCKWISE_LOOP_MAX_EXPERTS}"), **ctx))
            continue
        if options.mixed_precision != "fp8":
            out.append(Decision(site, "bf16", "mixed_precision",
                                f"train.mixed_precision = {options.mixed_precision!r}", **ctx))
            continue
        if site.fqn in shape_of:
            auto, shape = options.auto, shape_of[site.fqn]
            timing = auto.timings.get(shape)
            use_fp8, why = auto_verdict(timing, auto.min_speedup, shape.num_tokens,
                                        "pairs" if shape.is_grouped else "tokens")
            if use_fp8 is None:
                out.append(Decision(site, "fp8", verdict.rule, f"{verdict.reason}; {why}", recipe, **ctx))
            else:
                out.append(Decision(site, "fp8" if use_fp8 else "bf16", "auto", why, recipe if use_fp8 else None,
                                    measured=timing, **ctx))
            continue
        if options.selective is not None:
            policy, _ = options.selective.for_component(site.component)
            if policy is None:
                out.append(Decision(site, "bf16", "policy", f"no policy for component {site.component!r} -> bf16", **ctx))
                continue
            pv = policy.decide(site.module_kind, site.ub_name, num_tokens=tokens, tp=options.tp, etp=options.etp,
                               num_gemms=num_gemms, topk=options.selective.topk)
            out.append(Decision(site, "fp8" if pv.use_fp8 else "bf16", "policy", pv.reason,
                                recipe if pv.use_fp8 else None, **ctx))
            continue
        out.append(Decision(site, "fp8", verdict.rule, verdict.reason, recipe, **ctx))
    return out


def fp8_head(decisions: list[Decision]) -> bool:
    """Whether an output head was decided FP8 (``fp8.output_head``, and no rule, ``auto`` measurement or policy kept
    it BF16); ``fp8kit train`` saves it in the checkpoint's train state."""
    return any(d.site.role == "head" and d.is_fp8 for d in decisions)


def decision_notes(decisions: list[Decision], options: DecideOptions) -> list[str]:
    """Warnings for what the user asked for and some decided sites do not take, with the reason; empty when the run
    is not FP8. ``fp8kit train``, ``fp8kit plan`` and the library entry points show the same list.

    - ``fp8.output_head = true`` where an output head still stays BF16 (tied to the embedding, dims,
      ``fp8.exclude``, measured slower by ``auto``, no rule in a policy);
    - ``fp8.fast_accum`` set while MoE experts run in FP8: it reaches dense linears only; the experts' GEMMs
      accumulate as their kernels do (``fp8.recipes`` module docstring).
    """
    if options.mixed_precision != "fp8":
        return []
    notes = []
    if options.output_head:
        notes += [f"fp8.output_head = true, but {d.fqn} stays BF16: {d.reason}"
                  for d in decisions if d.site.role == "head" and not d.is_fp8]
    if options.fast_accum is not None and any(d.is_fp8 and d.site.is_grouped for d in decisions):
        notes.append(f"fp8.fast_accum = {list(options.fast_accum)} applies to dense linears only: the FP8 MoE "
                     "experts' GEMMs accumulate as their kernels do (rowwise grouped GEMMs fast in all three, "
                     "blockwise with FP32 promotion)")
    return notes


def _auto_shapes(sites: list[Site], rules: StaticRules, options: DecideOptions) -> dict[str, AutoShape]:
    """FQN -> the :class:`AutoShape` its unit is timed at, for every FP8 candidate when a measured ``auto``
    table is given (else empty)."""
    auto = options.auto
    if auto is None or auto.timings is None or options.mixed_precision != "fp8":
        return {}
    candidates = [s for s in sites if rules.check(s).candidate]
    units = auto_units(candidates, tp=options.tp, ep=options.ep, num_tokens=auto.num_tokens, topk=auto.topk,
                       fused_experts=auto.fused_experts)
    return {fqn: u.shape for u in units for fqn in u.fqns}


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
