"""Distributed FP8 pieces: the FP8 gradient all-reduce with FP8-LM's automatic scaling, and its FSDP2 reduce-scatter.

``fp8_all_reduce(tensor, group, state, key, algorithm=...)`` averages a tensor over ranks through FP8 (fused
Triton passes on CUDA; "scatter": all-to-all + all-gather, "gather": one all-gather, "auto": gather at 2 ranks);
``fp8_allreduce_hook`` is the same as a DDP communication hook; ``AutoScaleState`` keeps the factor mu;
``Fp8ReduceScatter`` / ``apply_fp8_reduce_scatter(model, state)`` apply the same FP8 reduction to FSDP2's
gradient reduce-scatter (torch >= 2.9).
"""

from fp8kit.comm.autoscale import AutoScaleState, fp8_allreduce_bytes, ring_allreduce_bytes
from fp8kit.comm.fp8_allreduce import fp8_all_reduce, fp8_allreduce_hook
from fp8kit.comm.fsdp_reduce_scatter import Fp8ReduceScatter, apply_fp8_reduce_scatter

__all__ = [
    "AutoScaleState",
    "Fp8ReduceScatter",
    "apply_fp8_reduce_scatter",
    "fp8_all_reduce",
    "fp8_allreduce_bytes",
    "fp8_allreduce_hook",
    "ring_allreduce_bytes",
]
