"""The run directory: where a run writes, checked before anything is written.

Contents: ``resolved_config.toml``, ``conversion_report.md`` / ``.json``, ``metrics.jsonl``,
``checkpoints/``, ``summary.md`` / ``summary.json`` (and ``run_info.json``: devices, versions).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fp8kit.base.errors import Fp8kitError
from fp8kit.train.checkpoint import latest_checkpoint

RUN_MARKER = "metrics.jsonl"
AUTO = "auto"


@dataclass(frozen=True)
class ResumePlan:
    """Where a run starts: ``checkpoint`` (None: from step 0) and whether it writes into an existing run.

    ``into_run``: the run directory the checkpoint belongs to (or, for ``auto``, ``--out``), which the
    run then continues: its ``metrics.jsonl`` is kept up to the resume step and appended to.
    """

    checkpoint: Path | None
    into_run: Path | None
    auto: bool = False


def plan_resume(resume: str | Path | None, out_dir: Path | None, *, where: str = "--resume") -> ResumePlan:
    """Decide where a run starts (the one place that does).

    Args:
        resume: None or ``""`` (start fresh), ``"auto"``, or a run / checkpoint directory.
        out_dir: ``--out`` (None: the default run directory, or the resumed run's directory).
        where: the flag or config key ``resume`` came from, for the error message.

    ``auto``: if ``out_dir`` holds a complete checkpoint (:func:`fp8kit.train.checkpoint.latest_checkpoint`:
    written and renamed into place; temporary directories of interrupted writes never count), continue
    from its latest one in ``out_dir``; otherwise start fresh in ``out_dir`` (an existing run there without
    a complete checkpoint, e.g. one killed before its first checkpoint, is started over). So one command
    line starts a run and continues it after any restart (torchrun ``--max-restarts``, SLURM requeue).
    Every rank decides on its own from the same shared directory.

    Raises:
        Fp8kitError: ``auto`` without ``out_dir``.
    """
    if resume is None or str(resume) == "":
        return ResumePlan(None, None)
    if str(resume) == AUTO:
        if out_dir is None:
            raise Fp8kitError(
                f"{where} auto needs --out DIR: the run directory to continue (or to start in when it holds "
                f"no checkpoint yet)"
            )
        return ResumePlan(latest_checkpoint(Path(out_dir)), Path(out_dir), auto=True)
    path = Path(resume)
    run = path if (path / "checkpoints").is_dir() else path.parent.parent
    return ResumePlan(path, run)


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
    try:  # permission bits are not the whole story (root, /proc, read-only mounts): try it, leave nothing
        os.rmdir(tempfile.mkdtemp(prefix=".fp8kit-write-test-", dir=probe))
    except OSError as e:
        raise Fp8kitError(
            f"--out {str(out_dir)!r} cannot be written: creating a directory in {str(probe)!r} fails "
            f"({e.strerror or type(e).__name__})"
        ) from None
    if out_dir.is_dir() and (out_dir / RUN_MARKER).exists() and not resuming_here:
        raise Fp8kitError(
            f"--out {str(out_dir)!r} already holds a run ({RUN_MARKER}); choose another --out, or continue "
            f"it with --resume {str(out_dir)!r} (or --resume auto)"
        )


def create_run_dir(out_dir: Path) -> Path:
    """Create ``out_dir`` and ``out_dir/checkpoints``.

    Raises:
        Fp8kitError: the file system refuses (one line).
    """
    out_dir = Path(out_dir)
    try:
        (out_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise Fp8kitError(f"--out {str(out_dir)!r} cannot be created: {e.strerror or e}") from None
    return out_dir
