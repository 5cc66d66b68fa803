"""FP8 recipes: the one table of how each recipe computes, and its torchao config where torchao runs it.

Formats (OCP FP8; Micikevicius et al. 2022, arXiv:2209.05433): E4M3 (max 448, 3 mantissa bits) for the
forward operands, E5M2 (max 57344, 2 mantissa bits: more range) for gradients: the HYBRID format. Every
scale is ``scale = fp8_max / max(amax, eps)`` (``fp8.scaling.scale_from_amax``), computed from the tensor
being cast ("dynamic" / current scaling), at the recipe's granularity. The three GEMMs of a linear
``y = x @ w.T`` are fprop (``y``), dgrad (``dx = dy @ w``) and wgrad (``dw = dy.T @ x``).

=====================  ===========  ================================================  ==============
recipe                 runs on      granularity (fprop / dgrad / wgrad)               K, N multiple of
=====================  ===========  ================================================  ==============
tensorwise             torchao      one scale per tensor; E4M3 x, w; E5M2 dy          16
rowwise                torchao      per row of each operand (token / channel),        16
                                    power-of-two scales; E4M3 x, w; E5M2 dy
rowwise_with_gw_hp     torchao      rowwise fprop / dgrad, wgrad in bf16              16
blockwise              fp8kit       x, dy per 1x128 block along the reduction dim     128
                                    (per 128x1 block along tokens for wgrad), w per
                                    128x128 block (one copy serves fprop and dgrad);
                                    E4M3 for every operand (DeepSeek-V3,
                                    arXiv:2412.19437 section 3.3); ``fp8.linear``
delayed                fp8kit       one scale per tensor from an amax history of      16
                                    earlier steps (Transformer Engine DelayedScaling,
                                    HYBRID); E4M3 x, w; E5M2 dy; ``fp8.delayed``
=====================  ===========  ================================================  ==============

Accumulation (``Recipe.fast_accum``): on Hopper an FP8 GEMM either adds the tensor cores' partial products in
their own reduced-precision accumulator ("fast accumulation", ``torch._scaled_mm(use_fast_accum=True)``) or
promotes them to an FP32 accumulator every few K steps (Transformer Engine's "split accumulator"; DeepSeek-V3,
arXiv:2412.19437 section 3.3.2, on why the promotion matters for long reductions). The torchao recipes of
per-tensor or per-row scales (tensorwise, rowwise, rowwise_with_gw_hp, whose wgrad runs in bf16) use fast
accumulation in fprop only and the split accumulator in dgrad and wgrad: torchao's default
(``Float8LinearConfig.gemm_config_output``) and Transformer Engine's for delayed scaling (``_2X_ACC_FPROP = False``,
``_2X_ACC_DGRAD = _2X_ACC_WGRAD = True``). fp8kit's delayed recipe runs fprop and wgrad fast and keeps the split
accumulator in dgrad (:data:`DELAYED_FAST_ACCUM`, session 42): measured on an H200 (docs/benchmarks.md section 6),
Llama-3-8B layers x 8 train at 1.404-1.418x of BF16 with it against 1.374-1.396x with fprop only, and in short runs
ended within 0.3% of BF16's loss (400 steps, two runs: final train loss +0.29% / -0.22% of BF16's, BF16 itself
varying 0.4% run to run, 40-step windows up to +1.8%; llama-125m, 1200 steps: validation loss -0.02%, fprop only
+0.34%, train loss +0.65%), where fast dgrad trained 1.3-2.4% above BF16 (session 41). Two 800-step 8B runs
(sessions 43-44) ended at a validation loss +0.15% / +0.63% of BF16's (fprop only -0.01% / +0.23%) and a train loss
+0.53% / +0.65% (fprop only +0.12% / +1.04%): in the first the default ran above BF16's train loss in every 80-step window and
fprop only mostly below, in the second fprop only ran above in every window and further than the default, so the
two settings' train-loss difference reads as a trajectory's (fprop only ended closer in validation loss in both);
``fp8.fast_accum = ["fprop"]`` is Transformer Engine's setting. Why wgrad tolerates it and
dgrad does not is a reading, not a measurement: a dgrad error enters every earlier layer's gradients, a wgrad error
only its own weight's gradient, which the optimizer averages over steps. Fast accumulation makes an isolated fprop
GEMM 0-5% faster at the 8B linears (``benchmarks/experiments/fast_accum/bench.py``); its fprop error against the
float64 product of the same FP8 operands is 49.6-53.5 dB below the signal (55.6 dB split), far smaller than the FP8
quantization's own (~28 dB); wgrad's (K = the tokens, 8192 there) was not measured alone. Blockwise GEMMs apply
a scale per 128-wide K block, in FP32, and cuBLAS refuses fast accumulation for them. The table covers dense
linears: MoE experts accumulate as their kernels do (the rowwise grouped GEMMs fast in all three GEMMs,
``moe.grouped_mm``; blockwise experts through the blockwise GEMM). ``fp8.fast_accum`` overrides the table for the
dense linears of every recipe but blockwise (:func:`fast_accum_for`).

torchao's recipes: ``torchao.float8.Float8LinearConfig.from_recipe_name``; FSDP2 FP8 all-gather only for
tensorwise. fp8kit's blockwise: ``fp8kit.fp8.linear.Float8BlockwiseLinear`` (numerics in
``fp8kit.fp8.blockwise``; GEMMs through cuBLAS blockwise ``scaled_mm`` on Hopper, emulated in fp32 on CPU).

Importing this module imports neither torchao nor Triton; only :func:`float8_linear_config` imports torchao.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fp8kit.base.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from torchao.float8 import Float8LinearConfig


#: The three GEMMs of a linear ``y = x @ w.T``: fprop ``y``, dgrad ``dx = dy @ w``, wgrad ``dw = dy.T @ x``.
GEMMS: tuple[str, ...] = ("fprop", "dgrad", "wgrad")
#: Fast accumulation in fprop only: Transformer Engine's and torchao's default (module docstring).
FPROP_FAST_ACCUM: tuple[str, ...] = ("fprop",)
#: The delayed recipe's default: fprop and wgrad fast, dgrad split (module docstring; measured in session 42).
DELAYED_FAST_ACCUM: tuple[str, ...] = ("fprop", "wgrad")


@dataclass(frozen=True)
class Recipe:
    """One row of the recipe table (module docstring).

    Attributes:
        name: the ``fp8.recipe`` value.
        engine: ``"torchao"`` (torchao ``Float8Linear``) or ``"fp8kit"`` (fp8kit's own FP8 linear).
        dims_multiple: in_features and out_features must be multiples of this (else the site stays BF16).
        fsdp_fp8_all_gather: FSDP2 can all-gather FP8 weights with this recipe.
        tensor_parallel: the recipe runs under tensor parallel (DTensor styles exist for its module).
        fast_accum: the GEMMs of :data:`GEMMS` that run with tensor-core fast accumulation by default (module
            docstring).
        fast_accum_gemms: the GEMMs that can run with fast accumulation at all (FP8 GEMMs through
            ``torch._scaled_mm``: not blockwise's, not rowwise_with_gw_hp's bf16 wgrad), where ``fp8.fast_accum``
            applies.
    """

    name: str
    engine: str
    dims_multiple: int
    fsdp_fp8_all_gather: bool
    tensor_parallel: bool
    fast_accum: tuple[str, ...] = ()
    fast_accum_gemms: tuple[str, ...] = GEMMS


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("tensorwise", "torchao", 16, True, True, FPROP_FAST_ACCUM),
        Recipe("rowwise", "torchao", 16, False, True, FPROP_FAST_ACCUM),
        Recipe("rowwise_with_gw_hp", "torchao", 16, False, True, FPROP_FAST_ACCUM, ("fprop", "dgrad")),
        Recipe("blockwise", "fp8kit", 128, False, True, (), ()),
        Recipe("delayed", "fp8kit", 16, False, True, DELAYED_FAST_ACCUM),
    )
}
RECIPE_NAMES: tuple[str, ...] = tuple(RECIPES)


def recipe_info(recipe: str, where: str = "fp8.recipe") -> Recipe:
    """The table row of ``recipe``.

    Raises:
        ConfigError: the recipe is unknown (naming ``where`` and the valid names).
    """
    try:
        return RECIPES[recipe]
    except KeyError:
        raise ConfigError(f"{where}: unknown recipe {recipe!r}; choose one of {', '.join(RECIPE_NAMES)}") from None


def fast_accum_for(recipe: str, requested=None, where: str = "fp8.fast_accum") -> tuple[str, ...]:
    """The GEMMs of ``recipe`` that run with fast accumulation: ``requested`` (``fp8.fast_accum``: a list of
    :data:`GEMMS` names) or, when None, the recipe table's default (``Recipe.fast_accum``). Only the GEMMs that can
    (``Recipe.fast_accum_gemms``: none for blockwise, fprop and dgrad for rowwise_with_gw_hp) are kept; the run says
    which were dropped (:func:`fast_accum_note`).

    Returns:
        the names in :data:`GEMMS` order, each once.

    Raises:
        ConfigError: an unknown recipe, or a requested name that is not a GEMM (naming ``where``).
    """
    info = recipe_info(recipe)
    if requested is None:
        return info.fast_accum
    bad = [g for g in requested if g not in GEMMS]
    if bad:
        raise ConfigError(f"{where}: unknown GEMM(s) {', '.join(map(repr, bad))}; choose from {', '.join(GEMMS)}")
    return tuple(g for g in GEMMS if g in requested and g in info.fast_accum_gemms)


def fast_accum_note(recipe: str, requested) -> str | None:
    """A warning for a run whose ``fp8.fast_accum`` (``requested``; None: the default, never warned) names GEMMs
    ``recipe`` cannot run with fast accumulation (``Recipe.fast_accum_gemms``), runs dgrad with it (measured less
    accurate: Llama-3-8B layers, docs/benchmarks.md section 6, session 41), or runs wgrad with it in a recipe other
    than delayed (measured within 0.3% of BF16's loss in short runs with the delayed recipe only, session 42); or
    None."""
    notes = []
    dropped = [g for g in (requested or ()) if g not in recipe_info(recipe).fast_accum_gemms]
    if dropped:
        why = ("cuBLAS's blockwise GEMMs apply the block scales in FP32 and take no fast accumulation"
               if recipe == "blockwise" else "its wgrad GEMM runs in bf16")
        notes.append(f"fp8.fast_accum: {', '.join(dropped)} has no effect with fp8.recipe = {recipe!r}: {why}")
    fast = fast_accum_for(recipe, requested) if requested is not None else ()
    if "dgrad" in fast:
        notes.append(
            "fp8.fast_accum: dgrad with fast accumulation is faster but less accurate: on Llama-3-8B layers (delayed "
            "recipe, 400 steps, two runs) the settings with fast dgrad trained 1.3-2.4% above BF16's loss and those "
            "with the split accumulator in dgrad did not (docs/benchmarks.md section 6, sessions 41-42); check "
            "convergence before relying on it")
    if "wgrad" in fast and recipe != "delayed":
        notes.append(
            f"fp8.fast_accum: wgrad with fast accumulation ended within 0.3% of BF16's loss with the delayed recipe "
            f"in short runs (Llama-3-8B layers, 400 steps, two runs: train loss +0.29% / -0.22%; llama-125m, 1200 "
            f"steps: validation loss -0.02%; docs/benchmarks.md section 6, session 42), not measured with "
            f"{recipe!r}; check convergence before relying on it")
    return "; ".join(notes) or None


def float8_linear_config(
    recipe: str, *, emulate: bool = False, enable_fsdp_float8_all_gather: bool = False,
    fast_accum: tuple[str, ...] | None = None,
) -> Float8LinearConfig:
    """Build the torchao ``Float8LinearConfig`` of a torchao recipe.

    Args:
        recipe: a recipe of :data:`RECIPES` whose engine is torchao.
        emulate: run the FP8 matmul as an emulation in high precision (for GPUs without FP8
            tensor cores; numerically FP8, no speed-up).
        enable_fsdp_float8_all_gather: let FSDP2 all-gather FP8 weights plus scales (tensorwise only,
            as in torchao).
        fast_accum: the GEMMs with fast accumulation (``fp8.fast_accum``, :func:`fast_accum_for`); None: the
            recipe table's (fprop: torchao's own default).

    Raises:
        ConfigError: the recipe is unknown or not a torchao recipe, or FP8 all-gather is asked for a recipe
            that cannot all-gather FP8.
    """
    info = recipe_info(recipe)
    if info.engine != "torchao":
        raise ConfigError(f"fp8.recipe = {recipe!r} runs on fp8kit's own FP8 linear, not torchao's Float8Linear")
    if enable_fsdp_float8_all_gather and not info.fsdp_fp8_all_gather:
        raise ConfigError(
            f"fp8.enable_fsdp_float8_all_gather is only supported by torchao for the tensorwise recipe, not {recipe!r}"
        )
    from fp8kit.base.torchao_lib import torchao_float8

    float8 = torchao_float8()
    cfg = float8.Float8LinearConfig.from_recipe_name(recipe)
    # Float8LinearConfig is a frozen dataclass: replace() keeps the recipe's cast configs.
    import dataclasses

    fast = fast_accum_for(recipe, fast_accum)
    gemm = {g: float8.Float8GemmConfig(use_fast_accum=g in fast) for g in GEMMS}
    return dataclasses.replace(cfg, emulate=emulate, enable_fsdp_float8_all_gather=enable_fsdp_float8_all_gather,
                               gemm_config_output=gemm["fprop"], gemm_config_grad_input=gemm["dgrad"],
                               gemm_config_grad_weight=gemm["wgrad"])
