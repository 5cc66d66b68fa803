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


class OneConfig:
    """An autotuned Triton kernel (``triton.autotune``'s ``Autotuner``) launched with one of its configs, untuned: the
    config's meta-parameters and its compile options (``num_warps``, and ``maxnreg`` where set). Tests and benchmarks
    put it in place of a kernel module's attribute to check or time every config (``kernel[grid](...)`` as before).

    Args:
        tuner: the ``Autotuner`` (its ``fn`` is the JIT function, its ``configs`` the candidates).
        cfg: one of ``tuner.configs``.
        drop: launch keywords removed before the call (Triton's interpreter takes no ``enable_fp_fusion``).
    """

    def __init__(self, tuner, cfg, drop: tuple[str, ...] = ()):
        self.tuner, self.cfg, self.drop = tuner, cfg, drop

    def __getitem__(self, grid):
        opts = {"num_warps": self.cfg.num_warps, **({"maxnreg": self.cfg.maxnreg} if self.cfg.maxnreg else {})}

        def run(*args, **kw):
            kw = {k: v for k, v in kw.items() if k not in self.drop}
            return self.tuner.fn[grid](*args, **kw, **self.cfg.kwargs, **opts)

        return run
