"""Import a script of ``benchmarks/`` (not a package) as a module, for the tests of its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(script: str | Path) -> ModuleType:
    """The module of ``script``: a path, or a file name in ``benchmarks/`` (``"step_profile.py"``), executed once per
    call under its stem's name."""
    path = Path(script) if Path(script).is_absolute() else BENCHMARKS / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
