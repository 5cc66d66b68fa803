"""fp8kit's Triton kernel modules, imported lazily (CPU installs have no triton): the one place that does it."""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType


@functools.cache
def triton_module(module: str, what: str) -> ModuleType | None:
    """Import the Triton kernel module ``module`` (dotted name) once, or return None with one warning.

    Args:
        module: e.g. ``"fp8kit.fp8.kernels.blockwise_triton"``.
        what: the kernels' job, for the warning (e.g. ``"blockwise quantization"``).

    Returns:
        The module, or None when triton cannot be imported: the CUDA ops then run their PyTorch references
        (same results, slower), and the warning says so.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:  # pragma: no cover - CUDA torch ships triton
        warnings.warn(f"fp8kit {what}: triton unavailable ({e}); using the slow PyTorch reference", stacklevel=3)
        return None
