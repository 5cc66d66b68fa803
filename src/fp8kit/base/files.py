"""File permissions of the weights fp8kit writes.

The safetensors writer creates its files private (mode 0600), whatever the process umask, while every other file
of a checkpoint or an export (``config.json``, ``train_state.pt``, the tokenizer) gets the mode of an ordinary new
file. On a shared machine a teammate could then read a run's config but not its weights. fp8kit gives the
weights it writes the ordinary mode.
"""

from __future__ import annotations

import os
from pathlib import Path


def new_file_mode(directory: Path) -> int:
    """The permission bits (``0o777`` mask) a file created in ``directory`` with ``open()`` gets: ``0o666``
    less the umask (and what a default ACL of the directory imposes). Found by creating and removing a probe
    file, which reads the umask without changing it (``os.umask`` would, for every thread of the process).

    Raises:
        OSError: ``directory`` is not writable.
    """
    probe = Path(directory) / f".fp8kit-mode-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        mode = os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
    probe.unlink()  # raises where files can be made but not removed: the caller then leaves the modes alone
    return mode


def ordinary_mode(*paths: Path) -> None:
    """Give each of ``paths`` (files just written by fp8kit, e.g. by safetensors: 0600) the mode a new file
    gets in its directory (:func:`new_file_mode`). A file system that refuses ``chmod`` (some network mounts)
    leaves the files as they were: readable by their owner, which is all training needs."""
    modes: dict[Path, int] = {}
    for p in map(Path, paths):
        try:
            mode = modes.get(p.parent)
            if mode is None:
                mode = modes[p.parent] = new_file_mode(p.parent)
            os.chmod(p, mode)
        except OSError:
            continue
