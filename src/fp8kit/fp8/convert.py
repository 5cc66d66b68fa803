"""Apply FP8 decisions to a model, and undo them (for the precision schedule).

:func:`apply_fp8` swaps the ``nn.Linear`` modules decided ``fp8`` for torchao ``Float8Linear``
(through torchao's own ``convert_to_float8_training`` with a filter that admits exactly those FQNs).
:func:`restore_bf16` swaps them back to plain ``nn.Linear``. Both keep the very same ``Parameter``
objects, so optimizer state (keyed by parameter) survives every switch, and ``state_dict`` keys do
not change (``Float8Linear`` holds ``weight``/``bias`` like ``nn.Linear``).
"""

from __future__ import annotations

from torch import nn

from fp8kit.errors import Fp8kitError
from fp8kit.fp8.backend import torchao_float8
from fp8kit.fp8.decide import Decision


def fp8_fqns(decisions: list[Decision]) -> set[str]:
    """FQNs of the sites decided FP8 (linear layers only)."""
    return {d.fqn for d in decisions if d.is_fp8 and not d.site.is_grouped}


def apply_fp8(model: nn.Module, decisions: list[Decision], float8_config) -> int:
    """Swap every ``nn.Linear`` decided FP8 for a ``Float8Linear``; returns how many were swapped.

    Modules already in FP8 are left as they are, so this is idempotent.

    Raises:
        Fp8kitError: a decided FQN is not an ``nn.Linear`` of this model.
    """
    wanted = fp8_fqns(decisions)
    float8 = torchao_float8()
    modules = dict(model.named_modules())
    missing = [f for f in wanted if not isinstance(modules.get(f), nn.Linear)]
    if missing:
        raise Fp8kitError(f"FP8 decision for {missing[0]!r}, which is not an nn.Linear of this model")
    todo = {f for f in wanted if not isinstance(modules[f], float8.Float8Linear)}
    if not todo:
        return 0
    float8.convert_to_float8_training(
        model, config=float8_config, module_filter_fn=lambda _mod, fqn: fqn in todo
    )
    return len(todo)


def restore_bf16(model: nn.Module) -> int:
    """Swap every ``Float8Linear`` back to ``nn.Linear`` sharing the same parameters; returns the count."""
    float8 = torchao_float8()
    count = 0
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
    """Number of ``Float8Linear`` modules in ``model``."""
    float8 = torchao_float8()
    return sum(isinstance(m, float8.Float8Linear) for m in model.modules())
