"""Schedules: the learning rate (linear warmup + cosine decay) and the precision phases.

Precision phases (the usual pattern for tensorwise FP8, as KempnerForge's FP8 accuracy notes give it:
BF16 warmup, FP8 bulk, optional BF16 cooldown; KempnerForge makes users restart to switch, fp8kit
switches inside one run): for a run of ``steps`` steps (0-based step index ``s``)::

    s <  bf16_warmup_steps                         -> "bf16"
    s >= steps - bf16_cooldown_steps               -> "bf16"
    otherwise                                      -> "fp8"

With ``train.mixed_precision = "bf16"`` every step is BF16.
"""

from __future__ import annotations

import math


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR at 0-based ``step``: linear warmup, then cosine to ``min_lr_ratio``.

    Warmup: ``(step + 1) / warmup_steps``; decay (Loshchilov & Hutter 2017, SGDR, one cycle):
    ``min + (1 - min) * (1 + cos(pi * p)) / 2`` with ``p`` the fraction of the decay done.
    """
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    p = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def precision_at(step: int, *, mixed_precision: str, steps: int, bf16_warmup_steps: int, bf16_cooldown_steps: int) -> str:
    """The precision phase (``"fp8"`` or ``"bf16"``) of 0-based ``step``; see the module docstring."""
    if mixed_precision != "fp8":
        return "bf16"
    if step < bf16_warmup_steps or step >= steps - bf16_cooldown_steps:
        return "bf16"
    return "fp8"
