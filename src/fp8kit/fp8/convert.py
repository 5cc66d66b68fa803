"""Apply FP8 decisions to a model, and undo them (for the precision schedule).

:func:`apply_fp8` swaps the ``nn.Linear`` modules decided ``fp8`` for torchao ``Float8Linear``
(through torchao's own ``convert_to_float8_training`` with a filter that admits exactly those FQNs),
and the MoE experts modules with a 3-D weight decided ``fp8`` for ``fp8kit.moe``'s
``Float8GroupedExperts``. :func:`restore_bf16` swaps both back. All swaps keep the very same
``Parameter`` objects, so optimizer state (keyed by parameter) survives every switch, and
``state_dict`` keys do not change.
"""

from __future__ import annotations

from torch import nn

from fp8kit.errors import Fp8kitError
from fp8kit.fp8.backend import torchao_float8
from fp8kit.fp8.decide import Decision
from fp8kit.moe import experts as moe_experts
from fp8kit.moe.grouped_mm import GroupedGemmConfig


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


def apply_fp8(model: nn.Module, decisions: list[Decision], float8_config,
              grouped: GroupedGemmConfig | None = None) -> int:
    """Swap every module decided FP8 for its FP8 form; returns how many modules were swapped.

    ``nn.Linear`` -> torchao ``Float8Linear`` (``float8_config``); an experts module with a 3-D weight
    decided FP8 -> ``Float8GroupedExperts`` (``grouped``, see ``fp8/options.grouped_gemm_config``; default:
    automatic backend, emulation allowed where ``float8_config.emulate`` is set; the backend is resolved
    on the first forward on each device). Modules already converted are left as they are, so this
    is idempotent.

    Raises:
        Fp8kitError: a decided FQN is not an ``nn.Linear`` / supported experts module of this model.
    """
    count = _apply_grouped(model, decisions, float8_config, grouped)
    wanted = fp8_fqns(decisions)
    float8 = torchao_float8()
    modules = dict(model.named_modules())
    missing = [f for f in wanted if not isinstance(modules.get(f), nn.Linear)]
    if missing:
        raise Fp8kitError(f"FP8 decision for {missing[0]!r}, which is not an nn.Linear of this model")
    todo = {f for f in wanted if not isinstance(modules[f], float8.Float8Linear)}
    if not todo:
        return count
    float8.convert_to_float8_training(
        model, config=float8_config, module_filter_fn=lambda _mod, fqn: fqn in todo
    )
    return count + len(todo)


def _apply_grouped(model: nn.Module, decisions: list[Decision], float8_config, grouped: GroupedGemmConfig | None) -> int:
    wanted = fp8_expert_weights(decisions)
    if not wanted:
        return 0
    if grouped is None:
        grouped = GroupedGemmConfig(emulate=bool(getattr(float8_config, "emulate", False)))
    count = 0
    for fqn, weights in wanted.items():
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            raise Fp8kitError(f"FP8 decision for experts {fqn!r}, which is not a module of this model") from None
        if isinstance(module, moe_experts.Float8GroupedExperts) and module.fp8_weights == weights:
            continue
        moe_experts.swap_in(model, fqn, weights, grouped)
        count += 1
    return count


def restore_bf16(model: nn.Module) -> int:
    """Swap every FP8 module back to its BF16 form sharing the same parameters; returns the count."""
    float8 = torchao_float8()
    count = moe_experts.swap_out(model)
    for fqn, module in list(model.named_modules()):
        if not isinstance(module, float8.Float8Linear):
            continue
        parent_name, _, child = fqn.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        plain = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
        plain.weight = module.weight
        plain.bias = module.bias
        setattr(parent, child, plain)
        count += 1
    return count


def count_fp8_modules(model: nn.Module) -> int:
    """Number of ``Float8Linear`` and FP8 grouped-experts modules in ``model``."""
    float8 = torchao_float8()
    return sum(isinstance(m, float8.Float8Linear)
               or (isinstance(m, moe_experts.Float8GroupedExperts) and bool(m.fp8_weights)) for m in model.modules())
