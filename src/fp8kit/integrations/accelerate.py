"""fp8kit's decisions in Accelerate's torchao FP8 route (the one LLaMA-Factory's ``fp8: true`` takes).

Accelerate converts ``nn.Linear`` layers to torchao ``Float8Linear`` in ``Accelerator.prepare`` when
``mixed_precision="fp8"`` and an ``AORecipeKwargs(config=Float8LinearConfig, module_filter_func=fn)``
handler is given; ``fn(module, fqn) -> bool`` chooses the layers. Here ``fn`` is fp8kit's per-site
decision (static rules plus, optionally, a measured selective-FP8 policy), so Accelerate converts exactly
the layers ``fp8kit plan`` / ``fp8kit train`` would::

    from accelerate import Accelerator
    from fp8kit.integrations.accelerate import ao_recipe_kwargs
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[ao_recipe_kwargs(model)])
    model, optimizer = accelerator.prepare(model, optimizer)

Only torchao recipes (tensorwise, rowwise, rowwise_with_gw_hp) and linear layers go this way: MoE experts
decided FP8 by fp8kit stay BF16 here (Accelerate converts ``nn.Linear`` only), and fp8kit's own recipes
(blockwise, delayed) need :func:`fp8kit.integrations.transformers.prepare_for_trainer`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from fp8kit.base.errors import ConfigError
from fp8kit.config.options import decide_for_library, requested_fast_accum
from fp8kit.config.schema import FP8Config, SelectiveConfig
from fp8kit.fp8.recipes import float8_linear_config, recipe_info
from fp8kit.parallel.convert import fp8_fqns, plain_fqn
from fp8kit.selective.decide import Decision


def fp8kit_module_filter(decisions: list[Decision]) -> Callable[[nn.Module, str], bool]:
    """Accelerate's / torchao's ``module_filter_func``: True for the linears fp8kit decided FP8.

    The FQN torchao passes is relative to the model given to ``Accelerator.prepare``; wrapper parts
    (``_orig_mod``, activation-checkpoint wrappers) are ignored and a prefix (``module.``,
    ``base_model.model.``) is allowed, so decisions made on the bare model match a wrapped one.
    """
    wanted = fp8_fqns(decisions)

    def module_filter(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        name = plain_fqn(fqn)
        return name in wanted or any(name.endswith("." + w) for w in wanted)

    return module_filter


def ao_recipe_kwargs(model: nn.Module, config: FP8Config | None = None, *, selective: SelectiveConfig | None = None,
                     num_tokens: int | None = None, enable_fsdp_float8_all_gather: bool | None = None):
    """``accelerate.utils.AORecipeKwargs`` with fp8kit's recipe and decisions for ``model``.

    Args:
        model: the model before ``Accelerator.prepare`` (decisions are made on its sites).
        config: fp8kit's ``[fp8]`` section (recipe: a torchao recipe; include / exclude; emulate).
        selective, num_tokens: as in :func:`fp8kit.convert_to_fp8` (measured policy, tokens per micro-batch).
        enable_fsdp_float8_all_gather: FP8 all-gather under FSDP2 (tensorwise only); default: the
            ``config`` value, else on for tensorwise (LLaMA-Factory's ``fp8_enable_fsdp_float8_all_gather``).

    Raises:
        ConfigError: the recipe is not a torchao recipe, or FP8 all-gather with a recipe that cannot.
        ImportError: accelerate is not installed.
    """
    from accelerate.utils import AORecipeKwargs

    config = config or FP8Config()
    if recipe_info(config.recipe).engine != "torchao":
        raise ConfigError(
            f"fp8.recipe = {config.recipe!r} is fp8kit's own FP8 linear, which Accelerate's torchao route cannot "
            f"build; use fp8kit.integrations.transformers.prepare_for_trainer, or a torchao recipe"
        )
    all_gather = enable_fsdp_float8_all_gather
    if all_gather is None:
        all_gather = config.enable_fsdp_float8_all_gather
    if all_gather is None:
        all_gather = recipe_info(config.recipe).fsdp_fp8_all_gather
    decisions = decide_for_library(model, config, selective, num_tokens=num_tokens)
    ao_config = float8_linear_config(config.recipe, emulate=config.emulate, enable_fsdp_float8_all_gather=all_gather,
                                     fast_accum=requested_fast_accum(config))
    return AORecipeKwargs(config=ao_config, module_filter_func=fp8kit_module_filter(decisions))
