"""FP8 recipes: a recipe name -> torchao ``Float8LinearConfig``.

Numerics (torchao ``float8/config.py``, Micikevicius et al. 2022, arXiv:2209.05433):

- Inputs and weights are cast to E4M3 (max 448: more mantissa for the forward values), the output
  gradient to E5M2 (max 57344: more range for gradients). This is the HYBRID format.
- Scaling is dynamic ("current"): ``scale = fp8_max / max(amax, eps)`` computed from the tensor being
  cast, at the granularity the recipe names:

  ``tensorwise``          one scale per tensor for all three GEMMs (output / fprop, grad_input /
                          dgrad, grad_weight / wgrad). Fastest; torchao's default.
  ``rowwise``             one scale per row of each operand (per token for activations, per output
                          channel for weights), scales rounded to powers of two. More accurate with
                          outliers, slower (extra transposed casts).
  ``rowwise_with_gw_hp``  rowwise for output and grad_input, but grad_weight stays in high precision
                          (bf16): the most accurate of the three.

Importing this module does not import torchao; only :func:`float8_linear_config` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8kit.base.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from torchao.float8 import Float8LinearConfig

RECIPE_NAMES: tuple[str, ...] = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def float8_linear_config(
    recipe: str, *, emulate: bool = False, enable_fsdp_float8_all_gather: bool = False
) -> Float8LinearConfig:
    """Build the torchao ``Float8LinearConfig`` for a recipe name.

    Args:
        recipe: one of :data:`RECIPE_NAMES`.
        emulate: run the FP8 matmul as an emulation in high precision (for GPUs without FP8
            tensor cores; numerically FP8, no speed-up).
        enable_fsdp_float8_all_gather: let FSDP2 all-gather FP8 weights plus scales (tensorwise only,
            as in torchao).

    Raises:
        ConfigError: the recipe is unknown, or FP8 all-gather is asked for a rowwise recipe.
    """
    if recipe not in RECIPE_NAMES:
        raise ConfigError(f"fp8.recipe: unknown recipe {recipe!r}; choose one of {', '.join(RECIPE_NAMES)}")
    if enable_fsdp_float8_all_gather and recipe != "tensorwise":
        raise ConfigError(
            f"fp8.enable_fsdp_float8_all_gather is only supported by torchao for the tensorwise recipe, not {recipe!r}"
        )
    from fp8kit.base.torchao_lib import torchao_float8

    float8 = torchao_float8()
    cfg = float8.Float8LinearConfig.from_recipe_name(recipe)
    # Float8LinearConfig is a frozen dataclass: replace() keeps the recipe's cast configs.
    import dataclasses

    return dataclasses.replace(cfg, emulate=emulate, enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather)
