"""fp8kit: FP8 training for PyTorch that is never slower than BF16.

A library first: :func:`convert_to_fp8` converts the linear layers of any PyTorch model (HF
transformers models included) that pass the FP8 rules, and returns the per-module decisions. A
trainer on top: ``fp8kit train`` (see ``fp8kit.train.trainer.train``).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "convert_to_fp8"]


def convert_to_fp8(model, config=None, *, mixed_precision: str = "fp8", emulate: bool = False):
    """Convert ``model``'s eligible ``nn.Linear`` layers to torchao ``Float8Linear`` in place.

    Args:
        model: any ``torch.nn.Module``.
        config: an :class:`fp8kit.config.FP8Config` (recipe, include / exclude patterns); default
            tensorwise with no patterns.
        mixed_precision: ``"fp8"`` converts; ``"bf16"`` only decides (every site BF16).
        emulate: emulate FP8 matmuls (for GPUs without FP8 tensor cores).

    Returns:
        The list of :class:`fp8kit.fp8.decide.Decision`, one per site (print it with
        :func:`fp8kit.fp8.report.print_report`).

    Raises:
        ConfigError: an unknown recipe or an invalid pattern.
    """
    from fp8kit.config import FP8Config
    from fp8kit.fp8.convert import apply_fp8
    from fp8kit.fp8.decide import DecideOptions, decide
    from fp8kit.fp8.recipes import float8_linear_config
    from fp8kit.fp8.sites import find_sites

    config = config or FP8Config()
    options = DecideOptions(mixed_precision=mixed_precision, recipe=config.recipe,
                            include=tuple(config.include), exclude=tuple(config.exclude))
    decisions = decide(find_sites(model), options)
    if mixed_precision == "fp8":
        apply_fp8(model, decisions, float8_linear_config(config.recipe, emulate=emulate))
    return decisions
