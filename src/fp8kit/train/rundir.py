"""The run directory: where a run writes, checked before anything is written.

Contents: ``resolved_config.toml``, ``conversion_report.md`` / ``.json``, ``metrics.jsonl``,
``checkpoints/``, ``summary.md`` / ``summary.json`` (and ``run_info.json``: devices, versions).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from fp8kit.base.errors import Fp8kitError

RUN_MARKER = "metrics.jsonl"


def default_run_dir(preset: str, precision: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{preset}-{precision}"


def check_writable(out_dir: Path, *, resuming_here: bool = False) -> None:
    """Make sure a run can be written to ``out_dir`` without creating anything yet.

    Raises:
        Fp8kitError: the path is a file, a directory without write permission (or whose nearest
            existing parent has none), or already holds another run (unless resuming into it).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise Fp8kitError(f"--out {str(out_dir)!r} is a file, not a directory")
    probe = out_dir
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise Fp8kitError(f"--out {str(out_dir)!r} cannot be written: no write permission on {str(probe)!r}")
    if out_dir.is_dir() and (out_dir / RUN_MARKER).exists() and not resuming_here:
        raise Fp8kitError(
            f"--out {str(out_dir)!r} already holds a run ({RUN_MARKER}); choose another --out, or continue it "
            f"with --resume {str(out_dir)!r}"
        )


def create_run_dir(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    (out_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    return out_dir
