"""The FP8 backend: torchao's ``float8`` package, imported once and quietly.

torchao logs a warning for each of its prebuilt CUDA extension libraries that cannot be loaded
(always the case on a CPU-only torch) and torch warns about an enum registration; neither concerns
the FP8 training path, which is pure PyTorch + Triton/Inductor. We silence those two loggers during
the import only, and restore their levels afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from types import ModuleType


class _DropBelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@contextlib.contextmanager
def quiet_torchao_imports():
    """Drop the two import-time warnings described above while the block runs.

    Used around the import of ``torchao.float8`` and around transformers' model construction (which
    imports torchao's quantization modules when torchao is installed). A filter, not a level: torch
    re-initialises its loggers' levels while torchao imports it.
    """
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    drop = _DropBelowError()
    for lg in loggers:
        lg.addFilter(drop)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(drop)


@functools.cache
def torchao_float8() -> ModuleType:
    """Import and return ``torchao.float8`` (cached), with ``Float8Linear`` attached as an attribute."""
    with quiet_torchao_imports():
        import torchao.float8 as float8
        from torchao.float8.float8_linear import Float8Linear
    float8.Float8Linear = Float8Linear
    return float8


def torchao_version() -> str:
    """The installed torchao version string."""
    torchao_float8()
    import torchao

    return str(getattr(torchao, "__version__", "unknown"))
