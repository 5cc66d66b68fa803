"""fp8kit: FP8 training for PyTorch that is never slower than BF16.

A library first: :func:`convert_to_fp8` converts the layers of any PyTorch model (HF transformers
models included) that pass the FP8 rules (and, optionally, a measured selective-FP8 policy), and returns
the per-module decisions. A
trainer on top: ``fp8kit train`` (see ``fp8kit.train.trainer.train``).
"""

from __future__ import annotations

from fp8kit.base.runtime import VERSION as __version__

__all__ = ["__version__", "convert_to_fp8"]


def convert_to_fp8(model, config=None, *, selective=None, num_tokens: int | None = None,
                   mixed_precision: str = "fp8"):
    """Convert ``model``'s eligible layers to FP8 in place and return the per-site decisions.

    The same path as ``fp8kit train``: sites -> static rules (``[fp8]`` include / exclude, embeddings,
    heads, routers, dims % 16) -> the measured policy (``[selective]``, if given) -> the one module swapper
    (``fp8kit.parallel.convert.apply_fp8``: torchao ``Float8Linear`` for linears, fp8kit's grouped experts
    for MoE experts).

    Args:
        model: any ``torch.nn.Module`` (HF transformers models included).
        config: an :class:`fp8kit.config.FP8Config` (recipe, include / exclude patterns, ``emulate``);
            default tensorwise with no patterns.
        selective: an :class:`fp8kit.config.SelectiveConfig` (policy path(s) and token counts) for the
            measured per-module choice, or None.
        num_tokens: tokens per micro-batch (``seq_length x micro_batch_size``) for policy lookups, unless
            ``selective.fp8_dynamic_num_tokens`` is set.
        mixed_precision: ``"fp8"`` converts; ``"bf16"`` only decides (every site BF16).

    Returns:
        The list of :class:`fp8kit.selective.decide.Decision`, one per site (print it with
        :func:`fp8kit.selective.report.print_report`).

    Warns:
        UserWarning: each warning of the decision options (a policy measured with another recipe or on
            another device; ``selective_fp8 = "auto"``, which only ``fp8kit train`` measures).

    Raises:
        ConfigError: an invalid config, or a selective config without a token count.
        PolicyError: a policy file is missing or invalid.
    """
    from fp8kit.config import FP8Config
    from fp8kit.config.options import conversion_options_for, decide_for_library
    from fp8kit.parallel.convert import apply_fp8

    config = config or FP8Config()
    decisions = decide_for_library(model, config, selective, mixed_precision=mixed_precision, num_tokens=num_tokens)
    if mixed_precision == "fp8":
        conversion = conversion_options_for(config)
        apply_fp8(model, decisions, conversion)
    return decisions
