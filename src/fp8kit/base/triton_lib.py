"""fp8kit's Triton kernel modules, imported lazily (CPU installs have no triton): the one place that does it."""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType

import torch


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


def two_rows_if_one(x: torch.Tensor) -> torch.Tensor:
    """``x[M, K]`` itself, or for ``M == 1`` the row with a zero row below it: ``[2, K]``, a new tensor.

    Triton 3.6 turns an integer kernel argument equal to 1 into the constant 1, and with the row count ``M`` such
    a constant it compiled fp8kit's activation casts wrong (the Gluon 128x1 cast in session 47; the Triton cast in
    session 48: rows 16-127 of the padded ``q`` held wrong bytes; ``M`` = 2, 17, 127, 129, 1000 and an unspecialized
    ``M = 1`` were exact, docs/benchmarks.md). The casts read rows past ``M`` as zeros, so a zero second row gives
    the same outputs, bit for bit (the GPU tests check ``M = 1`` against the reference), and no launch sees
    ``M = 1``. The launchers call this; the cost (one ``[2, K]`` copy) falls only on one-row inputs.
    """
    if x.shape[0] != 1:
        return x
    return torch.cat([x, x.new_zeros(1, x.shape[1])])


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
