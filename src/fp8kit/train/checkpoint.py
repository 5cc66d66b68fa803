"""Checkpoints of a single-process run: model weights as safetensors, the rest as a torch file.

Layout of ``checkpoints/step_000100/`` (the number of completed optimizer steps)::

    model.safetensors   model weights in the HF layout (state_dict keys of the transformers model)
    train_state.pt      optimizer, LR scheduler, data position, RNG states, step, precision phase,
                        and the model's parameter shapes (to refuse a checkpoint of another model)

A checkpoint is written into a temporary directory and renamed into place, so a crash never leaves a
half-written checkpoint. ``train_state.pt`` is loaded with ``torch.load(weights_only=True)``: it holds
only tensors, numbers, strings and containers, and no pickled objects are ever constructed.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from fp8kit.errors import CheckpointError

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def param_shapes(model: nn.Module) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def save_checkpoint(directory: Path, model: nn.Module, state: dict) -> Path:
    """Write ``model`` and ``state`` to ``directory`` atomically; returns ``directory``."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_model_weights(model, tmp / MODEL_FILE)
    torch.save({**state, "param_shapes": param_shapes(model)}, tmp / STATE_FILE)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(tmp, directory)
    return directory


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory from a run directory (its latest checkpoint) or a checkpoint directory.

    Raises:
        CheckpointError: no checkpoint there.
    """
    path = Path(path)
    if (path / STATE_FILE).is_file() and (path / MODEL_FILE).is_file():
        return path
    ckdir = path / "checkpoints"
    candidates = sorted(p for p in ckdir.glob("step_*") if (p / STATE_FILE).is_file()) if ckdir.is_dir() else []
    if not candidates:
        raise CheckpointError(f"--resume {str(path)!r}: no checkpoint found (expected {ckdir}/step_*/{STATE_FILE})")
    return candidates[-1]


def load_train_state(ckpt: Path) -> dict:
    """Read ``train_state.pt`` safely (``weights_only=True``).

    Raises:
        CheckpointError: the file is unreadable or not a train state.
    """
    try:
        state = torch.load(Path(ckpt) / STATE_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"checkpoint {str(ckpt)!r}: {STATE_FILE} was refused by torch.load(weights_only=True): it holds "
            f"objects other than tensors and plain containers, so it is not loaded"
        ) from None
    except Exception as e:  # torch raises several types for corrupt files
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: cannot read {STATE_FILE}: {first}") from None
    if not isinstance(state, dict) or "step" not in state or "param_shapes" not in state:
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: {STATE_FILE} is not an fp8kit train state")
    return state


def check_compatible(ckpt: Path, model: nn.Module, state: dict) -> None:
    """Refuse a checkpoint saved from a model of another shape.

    Raises:
        CheckpointError: naming the first parameter whose presence or shape differs.
    """
    saved = {k: list(v) for k, v in state["param_shapes"].items()}
    now = param_shapes(model)
    for key in sorted(set(saved) | set(now)):
        if key not in now:
            raise CheckpointError(
                f"--resume {str(ckpt)!r}: the checkpoint has parameter {key!r}, which the configured model "
                f"lacks (different architecture or depth)"
            )
        if key not in saved:
            raise CheckpointError(
                f"--resume {str(ckpt)!r}: the configured model has parameter {key!r}, which the checkpoint "
                f"lacks (different architecture or depth)"
            )
        if saved[key] != now[key]:
            raise CheckpointError(
                f"--resume {str(ckpt)!r}: {key} has shape {saved[key]} in the checkpoint but {now[key]} in the "
                f"configured model (different model shape)"
            )
    with safe_open(str(Path(ckpt) / MODEL_FILE), framework="pt") as f:
        f.keys()  # opens and validates the header


def _tied_names(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: kept_name}`` for entries that are the same tensor (tied weights such as embed/lm_head)."""
    first: dict[tuple, str] = {}
    aliases = {}
    for name, t in sd.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def save_model_weights(model: nn.Module, path: Path) -> None:
    """Write the model's state dict to a safetensors file, tied weights once (listed in the metadata).

    Unlike ``safetensors.torch.save_model`` this accepts parameters that are views of a larger buffer
    (FP8AdamW's flat layout), since each entry is written from its own bytes.
    """
    sd = model.state_dict()
    aliases = _tied_names(sd)
    tensors = {k: v.detach().contiguous() for k, v in sd.items() if k not in aliases}
    save_file(tensors, str(path), metadata={"fp8kit_tied": json.dumps(aliases)})


def load_model_weights(ckpt: Path, model: nn.Module) -> None:
    """Load ``model.safetensors`` into ``model`` (strict; copies into the existing parameters)."""
    path = Path(ckpt) / MODEL_FILE
    try:
        sd = load_file(str(path), device=str(next(model.parameters()).device))
        for alias, kept in _tied_names(model.state_dict()).items():  # tied weights are stored once
            if alias not in sd and kept in sd:
                sd[alias] = sd[kept]
            elif kept not in sd and alias in sd:
                sd[kept] = sd[alias]
        model.load_state_dict(sd, strict=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: cannot load {MODEL_FILE}: {first}") from None
