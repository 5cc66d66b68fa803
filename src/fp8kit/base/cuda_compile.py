"""Eager helpers compiled on CUDA: one place for "``torch.compile`` this small function when it runs eagerly on a GPU".

Small elementwise / gather / reduction functions that run outside a compiled region (the eager MoE layer, the
backward of a custom autograd Function) each cost several kernels and float32 temporaries eagerly; compiled, they
are one or two Triton kernels. On the CPU, and inside an outer ``torch.compile`` (which traces them into its own
graph anyway), the plain function runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def compiled_on_cuda(fn: F, *, dynamic: bool | None = None) -> F:
    """``fn`` run through ``torch.compile`` (compiled lazily, on first CUDA use) when its first tensor argument
    (positional, else keyword) is on a CUDA device and no outer compile is tracing; the plain ``fn`` otherwise
    (``wrapper.eager``). Results may differ from eager in the last bit: Inductor sums in another order and its
    ``exp`` / ``sigmoid`` may round differently; gathers and plain products are exact (``tests/test_moe_fused_gpu.py``).
    Each wrapper is one Dynamo function: new shapes or dtypes recompile it, up to Dynamo's recompile limit
    (``dynamic`` is ``torch.compile``'s: None = static first, dynamic on the first recompile; True = dynamic at
    once). Use as ``@compiled_on_cuda`` or ``compiled_on_cuda(fn, dynamic=True)``."""
    compiled: dict[str, Callable] = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or not first.is_cuda or torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if "fn" not in compiled:
            compiled["fn"] = torch.compile(fn, dynamic=dynamic)
        return compiled["fn"](*args, **kwargs)

    wrapper.eager = fn  # the plain function (tests, references)
    return wrapper  # type: ignore[return-value]
