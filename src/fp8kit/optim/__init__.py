"""Optimizers: FP8AdamW (FP8-LM precision decoupling) and training-state memory accounting."""

from fp8kit.optim.fp8_adamw import FP8AdamW, FP8AdamWPrecision
from fp8kit.optim.memory import training_state_bytes

__all__ = ["FP8AdamW", "FP8AdamWPrecision", "training_state_bytes"]
