"""Checkpoints: model weights as safetensors (one process) or torch.distributed.checkpoint (torchrun).

Layout of ``checkpoints/step_000100/`` (the number of completed optimizer steps) of a single-process run::

    model.safetensors   model weights in the HF layout (state_dict keys of the transformers model)
    train_state.pt      optimizer, LR scheduler, data position, RNG states, step, precision phase,
                        and the model's parameter shapes (to refuse a checkpoint of another model)

and of a distributed run (FSDP2 / TP; ``train_state.pt`` has ``"format": "dcp"`` and no optimizer)::

    dcp/                torch.distributed.checkpoint files of ``{"model": ..., "optim": ...}``, keyed by
                        parameter FQN (``torch.distributed.checkpoint.state_dict``), so any layout can
                        load them: 2 ranks -> 1 process, FSDP2 -> TP, ...
    train_state.pt      LR scheduler, data position, rank 0's RNG states, step, phase, parameter shapes,
                        and the layout it was saved from (``"layout"``)

A checkpoint is written into a temporary directory (``checkpoints/.step_000100.tmp``) and renamed into
place once every file is written (:func:`replace_dir`): the rename is the completeness marker, so a crash
(``kill -9``, a lost node) during a write leaves the previous checkpoints the latest complete ones
(:func:`latest_checkpoint`). Asynchronous checkpoints (``train.async_checkpoint``,
:mod:`fp8kit.train.async_checkpoint`) use the DCP layout in one process too, and are renamed after the
background write. ``train_state.pt`` is loaded with ``torch.load(weights_only=True)``: it holds
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

from fp8kit.base.errors import CheckpointError
from fp8kit.base.files import ordinary_mode
from fp8kit.base.runtime import barrier, is_main
from fp8kit.optim.state_io import float8_as_bytes

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
DCP_DIR = "dcp"


def is_dcp(ckpt: Path) -> bool:
    """True for a checkpoint written by a distributed run (torch.distributed.checkpoint files)."""
    return (Path(ckpt) / DCP_DIR / ".metadata").is_file()


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def is_complete(ckpt: Path) -> bool:
    """True for a checkpoint directory holding ``train_state.pt`` and its weights (safetensors or DCP)."""
    ckpt = Path(ckpt)
    return (ckpt / STATE_FILE).is_file() and ((ckpt / MODEL_FILE).is_file() or is_dcp(ckpt))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete checkpoint of ``run_dir`` with the most steps (``checkpoints/step_N``), or None.

    Temporary directories of writes that did not finish (``checkpoints/.step_N.tmp``) never count.
    """
    ckdir = Path(run_dir) / "checkpoints"
    if not ckdir.is_dir():
        return None
    steps = [p for p in ckdir.glob("step_*") if p.name[5:].isdigit() and is_complete(p)]
    return max(steps, key=lambda p: int(p.name[5:]), default=None)


def replace_dir(tmp: Path, directory: Path) -> None:
    """Put the fully written ``tmp`` in place of ``directory`` with renames only (atomic on POSIX).

    An existing ``directory`` (the same step saved again after a resume) is first renamed aside and
    removed after, so a crash at any point leaves either the old or the new checkpoint complete.
    """
    old = directory.with_name(f".{directory.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if directory.exists():
        os.replace(directory, old)
    os.replace(tmp, directory)
    shutil.rmtree(old, ignore_errors=True)


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
    replace_dir(tmp, directory)
    return directory


def find_checkpoint(path: Path, *, what: str = "--resume") -> Path:
    """A checkpoint directory from a run directory (its latest complete checkpoint) or a checkpoint directory.

    Args:
        path: a run directory or a checkpoint directory.
        what: the flag or command the path came from, for the error message (``--resume``, ``export``).

    Raises:
        CheckpointError: ``path`` is no directory, or holds no complete checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        what_is = "is a file" if path.exists() else "does not exist"
        raise CheckpointError(f"{what} {str(path)!r}: {what_is} (give a run directory or a checkpoint directory)")
    if is_complete(path):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(
            f"{what} {str(path)!r}: no checkpoint found (expected {path / 'checkpoints'}/step_*/{STATE_FILE})"
        )
    return latest


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
    if is_dcp(ckpt):
        return
    with safe_open(str(Path(ckpt) / MODEL_FILE), framework="pt") as f:
        f.keys()  # opens and validates the header


OPTIMIZER_NAMES = {"adamw": "AdamW (torch.optim.AdamW)", "fp8_adamw": "FP8AdamW"}


def saved_optimizer(ckpt: Path, state: dict) -> str | None:
    """``"adamw"`` or ``"fp8_adamw"``: the optimizer whose states the checkpoint holds (None: no states).

    FP8AdamW's per-parameter states are ``m``/``v``(/``master``) and scales, ``torch.optim.AdamW``'s
    ``exp_avg``/``exp_avg_sq`` (DCP: read from the metadata; one process: from ``train_state.pt``).
    """
    if is_dcp(ckpt):
        import torch.distributed.checkpoint as dcp

        names = {k.rsplit(".", 1)[-1] for k in dcp.FileSystemReader(str(Path(ckpt) / DCP_DIR)).read_metadata()
                 .state_dict_metadata if k.startswith("optim.state.")}
    else:
        osd = state.get("optimizer") or {}
        if "flat" in osd or "fp8adamw" in osd:
            return "fp8_adamw"
        names = {n for st in (osd.get("state") or {}).values() for n in st}
    if "exp_avg" in names:
        return "adamw"
    if "v" in names:
        return "fp8_adamw"
    return None


def saved_fp8adamw_precision(ckpt: Path, state: dict) -> dict | None:
    """The ``FP8AdamWPrecision.as_dict()`` of the FP8AdamW states the checkpoint holds (None: unknown or none).

    Read from the train state's ``fp8adamw_precision`` (written since ``optim.granularity`` became ``auto``), else
    from the optimizer state (one process). An older DCP checkpoint says only how its scales are laid out: its
    ``m`` / ``v`` scales are 0-dim per tensor and 1-D per block (``{"granularity": ...}`` alone).
    """
    saved = state.get("fp8adamw_precision")
    if saved is None:
        saved = ((state.get("optimizer") or {}).get("fp8adamw") or {}).get("precision")
    if saved is None and is_dcp(ckpt):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = dcp.FileSystemReader(str(Path(ckpt) / DCP_DIR)).read_metadata().state_dict_metadata
        for key, value in meta.items():
            if key.startswith("optim.state.") and key.endswith("_scale") and isinstance(value, TensorStorageMetadata):
                return {"granularity": "tensor" if len(value.size) == 0 else "block"}
    return saved


def check_optimizer(ckpt: Path, state: dict, optim_name: str) -> None:
    """Refuse to resume optimizer states of another optimizer (FP8AdamW <-> AdamW): no silent re-init.

    Raises:
        CheckpointError: one line naming both optimizers and how to switch explicitly.
    """
    saved = saved_optimizer(ckpt, state)
    if saved is None or saved == optim_name or optim_name not in OPTIMIZER_NAMES:
        return
    raise CheckpointError(
        f"--resume {str(ckpt)!r}: the checkpoint holds {OPTIMIZER_NAMES[saved]} optimizer states, this run's "
        f"optimizer is {OPTIMIZER_NAMES[optim_name]} (optim.name = \"{optim_name}\"); resume with optim.name = "
        f"\"{saved}\", or switch optimizers explicitly: `fp8kit export` the checkpoint and start a new run with "
        f"model.pretrained = the export directory (fresh optimizer states)"
    )


def check_dcp_optimizer_state(ckpt: Path, osd: dict) -> None:
    """Refuse a DCP checkpoint whose optimizer states differ from ``osd``'s (the flattened state dict this
    run would load into) in presence, dtype or global shape, before ``dcp.load`` (which would fail with a
    long traceback or, for dtypes, convert silently).

    Raises:
        CheckpointError: naming the first differing state.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(Path(ckpt) / DCP_DIR)).read_metadata().state_dict_metadata
    for key, value in osd.items():
        if not (key.startswith("state.") and isinstance(value, torch.Tensor)):
            continue
        saved = meta.get(f"optim.{key}")
        if saved is None:
            raise CheckpointError(
                f"--resume {str(ckpt)!r}: the checkpoint has no optimizer state {key[6:]!r} (saved with another "
                f"optimizer or optim precision)"
            )
        if isinstance(saved, TensorStorageMetadata):
            if saved.properties.dtype != value.dtype or tuple(saved.size) != tuple(value.shape):
                raise CheckpointError(
                    f"--resume {str(ckpt)!r}: optimizer state {key[6:]!r} is {saved.properties.dtype} "
                    f"{list(saved.size)} in the checkpoint but {value.dtype} {list(value.shape)} here (another "
                    f"optim precision or model shape)"
                )


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
    ordinary_mode(path)  # safetensors writes 0600; the rest of the checkpoint has the umask's mode


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


# ----------------------------------------------------------------------------------------------
# Distributed checkpoints (torch.distributed.checkpoint)


def dcp_options():
    """DCP state-dict options: the optimizer state flattened to per-parameter keys, so that a checkpoint
    loads into an optimizer with other parameter groups (a run's groups depend on its layout: plain
    tensors, FSDP2 DTensors and expert-parallel DTensors go to separate fused-AdamW groups)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def plain_tensor(t):
    """``t`` without a tensor subclass that only wraps one tensor of its shape and dtype (torchao's
    ``WeightWithDynamicFloat8CastTensor`` and fp8kit's ``DelayedFloat8Weight``, the FSDP2 FP8 all-gather weights),
    inside a DTensor or not: what DCP saves.

    The async stager copies a tensor's own storage; a wrapper subclass's storage is not its data (measured:
    NaN/garbage weights in the staged copy, torch 2.13 + torchao 0.18, FSDP2 with FP8 all-gather on 2 gloo
    ranks), and the synchronous save pickles the subclass's metadata (``DelayedFloat8Weight`` holds its delayed
    state, whose process group does not pickle), so the wrapped tensor is saved instead. It is the same data: DCP
    loads it back into the wrapper.
    """
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not isinstance(t, torch.Tensor):
        return t
    if isinstance(t, DTensor):
        local = t.to_local()
        inner = plain_tensor(local)
        if inner is local:
            return t
        return DTensor.from_local(inner, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        if len(names) == 1:
            inner = getattr(t, names[0])
            if inner.shape == t.shape and inner.dtype == t.dtype and not is_traceable_wrapper_subclass(inner):
                return inner
    return t


def save_distributed_checkpoint(directory: Path, model: nn.Module, optimizer, state: dict) -> Path:
    """Write a DCP checkpoint from every rank (collective), atomically; returns ``directory``.

    Model and optimizer states come from ``torch.distributed.checkpoint.state_dict.get_state_dict``
    (FQN-keyed, sharded as the run holds them); rank 0 writes ``train_state.pt`` (``state`` must hold
    no optimizer) and renames the temporary directory into place.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp")
    if is_main():
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier()
    msd, osd = get_state_dict(model, optimizer, options=dcp_options())
    msd = {k: plain_tensor(v) for k, v in msd.items()}
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / DCP_DIR))
    shapes = {k: list(v.shape) for k, v in msd.items()}
    if is_main():
        torch.save({**state, "format": "dcp", "param_shapes": shapes}, tmp / STATE_FILE)
        replace_dir(tmp, directory)
    barrier()
    return directory


def load_into(ckpt: Path, model: nn.Module, optimizer, state: dict, *, param_order: list[str] | None = None) -> None:
    """Load a checkpoint of any format into a model and optimizer of any layout.

    DCP checkpoint: resharded by ``torch.distributed.checkpoint`` onto the model's current layout (one
    process or many). Single-process checkpoint into a distributed model: the full safetensors weights and
    the optimizer state (mapped from parameter index to FQN through ``param_order``, the FQNs in the
    optimizer's parameter order) go through ``set_state_dict(full_state_dict=True)``. With
    ``optimizer=None`` only the weights are loaded.

    Raises:
        CheckpointError: the files do not fit the model (first line of the underlying error).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    ckpt = Path(ckpt)
    try:
        if is_dcp(ckpt):
            import torch.distributed.checkpoint as dcp

            if optimizer is None:
                from torch.distributed.checkpoint.state_dict import get_model_state_dict

                msd = get_model_state_dict(model)
                dcp.load({"model": msd}, checkpoint_id=str(ckpt / DCP_DIR))
                set_model_state_dict(model, msd)
                return
            msd, osd = get_state_dict(model, optimizer, options=dcp_options())
            saved = saved_fp8adamw_precision(ckpt, state)
            if (saved or {}).get("granularity") == "block" and hasattr(optimizer, "adapt_full_state") \
                    and optimizer.precision.granularity == "tensor":
                _load_dcp_recast(ckpt, model, optimizer, msd, saved)
                return
            check_dcp_optimizer_state(ckpt, osd)
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(ckpt / DCP_DIR))
            set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=dcp_options())
            return
        full = load_file(str(ckpt / MODEL_FILE))
        aliases = json.loads((safe_open(str(ckpt / MODEL_FILE), framework="pt").metadata() or {}).get("fp8kit_tied", "{}"))
        for alias, kept in aliases.items():
            full.setdefault(alias, full[kept])
        opts = StateDictOptions(full_state_dict=True)
        if optimizer is None:
            set_model_state_dict(model, full, options=opts)
            return
        # set_state_dict scatters each full state to its shards: gloo has no float8, so FP8AdamW's E4M3
        # states go as their bytes (the optimizer reads them back as E4M3)
        osd = _optimizer_state_by_fqn(state["optimizer"], param_order or [])
        adapt = getattr(optimizer, "adapt_full_state", None)  # FP8AdamW: same precision, or block -> tensor scales
        if adapt is not None and "fp8adamw" in state["optimizer"]:
            osd = adapt(state["optimizer"]["fp8adamw"]["precision"], osd)
        osd = float8_as_bytes(osd)
        set_state_dict(model, optimizer, model_state_dict=full, optim_state_dict=osd, options=opts)
    except CheckpointError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(ckpt)!r}: cannot load it into this run's model: {first}") from None


def _load_dcp_recast(ckpt: Path, model: nn.Module, optimizer, msd: dict, saved: dict) -> None:
    """A DCP checkpoint whose FP8AdamW states have per-block scales (a one-process run with
    ``train.async_checkpoint``) into an optimizer with per-tensor ones (FSDP2): the model resharded as usual, the
    optimizer states read whole on every rank, recast (``FP8AdamW.adapt_full_state``) and scattered to the shards
    (``set_optimizer_state_dict(full_state_dict=True)``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    dcp.load({"model": msd}, checkpoint_id=str(ckpt / DCP_DIR))
    set_model_state_dict(model, msd, options=dcp_options())
    meta = dcp.FileSystemReader(str(ckpt / DCP_DIR)).read_metadata().state_dict_metadata
    flat = _load_state_dict_from_keys({k for k in meta if k.startswith("optim.")},
                                      checkpoint_id=str(ckpt / DCP_DIR))["optim"]
    per_param: dict[str, dict] = {}
    for key, value in flat.items():  # "state.<fqn>.<name>" (dcp_options flattens the optimizer state)
        if key.startswith("state."):
            fqn, name = key[len("state."):].rsplit(".", 1)
            per_param.setdefault(fqn, {})[name] = value
    block = {"block_size": optimizer.precision.block_size, **saved, "granularity": "block"}
    adapted = optimizer.adapt_full_state({**optimizer.precision.as_dict(), **block}, {"state": per_param})
    # the torch layout keyed by FQN (as the one-process path loads): this run's groups, the saved hyperparameters
    groups = get_optimizer_state_dict(model, optimizer, options=StateDictOptions())["param_groups"]
    for g in groups:
        saved_hp = {hp: flat.get(f"param_groups.{g['params'][0]}.{hp}") for hp in g if hp != "params"}
        g.update({hp: v for hp, v in saved_hp.items() if v is not None})
    osd = float8_as_bytes({"state": adapted["state"], "param_groups": groups})
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))


def _optimizer_state_by_fqn(osd: dict, param_order: list[str]) -> dict:
    """A torch optimizer state dict keyed by parameter index -> keyed by FQN (the DCP state_dict form)."""
    ids = [i for g in osd["param_groups"] for i in g["params"]]
    if len(ids) != len(param_order):
        raise CheckpointError(
            f"the checkpoint's optimizer holds {len(ids)} parameters, this run's optimizer {len(param_order)}"
        )
    name = dict(zip(ids, param_order, strict=True))
    return {
        "state": {name[i]: v for i, v in osd["state"].items()},
        "param_groups": [{**g, "params": [name[i] for i in g["params"]]} for g in osd["param_groups"]],
    }
