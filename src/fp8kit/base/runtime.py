"""Facts about the process and the device: which device, which rank, which library versions.

Each question has one answer here, used by ``train``, ``bench-layers`` and the CLI alike:
:func:`resolve_device` (``auto`` / ``cpu`` / ``cuda[:N]``), :func:`rank` / :func:`is_main` (rank 0 writes
and prints), :func:`launched_world_size` (torchrun's ``WORLD_SIZE``, read when called, never at import),
:func:`versions` and :func:`device_name` (recorded with every run and benchmark).
"""

from __future__ import annotations

import os
import platform

import torch

from fp8kit.base.errors import CapabilityError

#: fp8kit's version (the package metadata's ``version``).
VERSION = "0.1.0"


def resolve_device(name: str, where: str = "train.device") -> torch.device:
    """``auto`` -> ``cuda`` when available else ``cpu``; checks that a requested CUDA device exists.

    Args:
        name: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        where: the config key or flag the name came from (for the error message).

    Raises:
        CapabilityError: CUDA asked for but unavailable, or the index is out of range.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise CapabilityError(
                f"{where} = {name!r}, but CUDA is not available (torch {torch.__version__}); use {where} = \"cpu\""
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise CapabilityError(f"{where} = {name!r}, but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


def device_name(device: torch.device) -> str:
    """The GPU's marketing name, or ``CPU (<processor>, <threads> threads)``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def versions() -> dict[str, str]:
    """Library versions recorded with every run and benchmark."""
    import tokenizers
    import transformers

    from fp8kit.base.torchao_lib import torchao_version

    return {
        "fp8kit": VERSION,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchao": torchao_version(),
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "cuda": str(torch.version.cuda),
    }


def launched_world_size() -> int:
    """``WORLD_SIZE`` of a torchrun launch (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """``RANK`` of a torchrun launch (0 when not launched by torchrun); usable before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def launched_local_rank() -> int:
    """``LOCAL_RANK`` of a torchrun launch (the rank within its node; 0 when not launched by torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def distributed_ready() -> bool:
    """A default process group exists (torchrun launch after ``init_process_group``)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if distributed_ready() else 0


def is_main() -> bool:
    """True on the process that writes the run directory and prints (global rank 0)."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    import torch.distributed as dist

    if distributed_ready():
        dist.barrier()
