"""Distributed FP8 pieces: the FP8 gradient all-reduce with FP8-LM's automatic scaling.

``fp8_all_reduce(tensor, group, state, key)`` averages a tensor over ranks through FP8;
``fp8_allreduce_hook`` is the same as a DDP communication hook; ``AutoScaleState`` keeps the factor mu.
"""

from fp8kit.comm.autoscale import AutoScaleState, fp8_allreduce_bytes, ring_allreduce_bytes
from fp8kit.comm.fp8_allreduce import fp8_all_reduce, fp8_allreduce_hook

__all__ = [
    "AutoScaleState",
    "fp8_all_reduce",
    "fp8_allreduce_bytes",
    "fp8_allreduce_hook",
    "ring_allreduce_bytes",
]
