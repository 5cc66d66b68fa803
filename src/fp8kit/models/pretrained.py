"""A local Hugging Face model directory as the starting point of a run (``model.pretrained = "DIR"``).

The directory is the layout ``save_pretrained`` writes (and ``fp8kit export`` writes)::

    config.json                       the architecture (``model_type`` + the config class's kwargs)
    model.safetensors                 the weights, or
    model.safetensors.index.json      sharded: {"weight_map": {key: "model-00001-of-00004.safetensors"}}
    model-0000N-of-0000M.safetensors
    tokenizer.json, tokenizer_config.json, ...   (read by the data layer, ``fp8kit.data.tokenizer``)
    generation_config.json            (optional; copied by ``fp8kit export``)

Weights are only ever read from safetensors files (no pickle: a directory with only ``pytorch_model.bin``
is refused). Two ways in:

- one process: :func:`load_pretrained`, transformers' own ``from_pretrained(dir, config=...,
  use_safetensors=True, local_files_only=True)`` (its key renames and MoE expert fusing included), after
  :func:`check_weights` has compared every safetensors header with the configured model;
- FSDP2 / TP (torchrun): the model is built on ``meta``, sharded, materialised empty on the device
  (:func:`materialize`), then :func:`load_sharded` reads each rank's own slices with
  ``torch.distributed.checkpoint`` and its ``HuggingFaceStorageReader`` (safetensors ``get_slice``: a rank
  reads the bytes of its shards only, so the whole checkpoint never sits in one process).

Every problem is one line naming the directory and the file (:class:`~fp8kit.base.errors.ConfigError`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from fp8kit.base.errors import ConfigError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.00.pth")


@dataclass
class PretrainedDir:
    """What a pretrained directory holds (see the module docstring).

    Attributes:
        path: the directory.
        config: the parsed ``config.json``.
        weight_files: the safetensors files, in index order.
        has_generation_config: ``generation_config.json`` is present.
    """

    path: Path
    config: dict
    weight_files: list[Path] = field(default_factory=list)
    has_generation_config: bool = False

    @property
    def where(self) -> str:
        return f"model.pretrained {str(self.path)!r}"


def read_config_json(path: Path, where: str) -> dict:
    """Parse a Hugging Face ``config.json``: a JSON object with a ``model_type`` key.

    Raises:
        ConfigError: naming ``where`` and the file, when it is unreadable, not JSON, or has no ``model_type``.
    """
    try:
        config = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: {str(path)!r} is not a readable JSON file: {' '.join(str(e).split())}") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(f"{where}: {str(path)!r} has no 'model_type' key (is it an HF config.json?)")
    return config


def inspect_pretrained(path: str | Path) -> PretrainedDir:
    """Read ``config.json`` and locate the weight files of a pretrained directory (headers are not read).

    Raises:
        ConfigError: the directory, its ``config.json`` (valid JSON with ``model_type`` and ``vocab_size``)
            or its safetensors weights are missing, a shard named by the index is missing, or the model is
            quantized (``quantization_config``: fine-tuning needs the BF16 weights).
    """
    p = Path(path).expanduser()
    where = f"model.pretrained {str(p)!r}"
    if not p.is_dir():
        raise ConfigError(f"{where} is not a directory (a local Hugging Face model directory is expected)")
    cfg_path = p / CONFIG_FILE
    if not cfg_path.is_file():
        raise ConfigError(f"{where}: no {CONFIG_FILE} in it (not a Hugging Face model directory)")
    config = read_config_json(cfg_path, where)
    if not isinstance(config.get("vocab_size"), int):
        raise ConfigError(f"{where}: {cfg_path} has no integer 'vocab_size' (a causal LM's config is expected)")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?") if isinstance(
            config["quantization_config"], dict) else "?"
        raise ConfigError(
            f"{where}: {cfg_path} describes a quantized model (quantization_config, {method}); fine-tuning needs the "
            f"BF16 / FP32 weights: dequantize it first"
        )
    return PretrainedDir(p, config, _weight_files(p, where), (p / GENERATION_CONFIG_FILE).is_file())


def _weight_files(p: Path, where: str) -> list[Path]:
    index = p / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{where}: {index} is not a safetensors index (no 'weight_map'): {e}") from None
        files = [p / n for n in names]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"{where}: {index} names the shard {f.name!r}, which is not in the directory")
        if not files:
            raise ConfigError(f"{where}: {index} lists no weights")
        return files
    if (p / SINGLE_FILE).is_file():
        return [p / SINGLE_FILE]
    pickled = [n for n in _PICKLE_FILES if (p / n).is_file()]
    if pickled:
        raise ConfigError(
            f"{where}: only {pickled[0]} (a pickle file) holds the weights; fp8kit loads safetensors only "
            f"(convert it with transformers: from_pretrained(...).save_pretrained(DIR, safe_serialization=True))"
        )
    raise ConfigError(f"{where}: no weights in it (expected {SINGLE_FILE} or {INDEX_FILE} with its shards)")


def checkpoint_shapes(pd: PretrainedDir) -> dict[str, tuple[list[int], Path]]:
    """``{key: (shape, file)}`` from the safetensors headers (no tensor data is read).

    Raises:
        ConfigError: a file is not a valid safetensors file.
    """
    from safetensors import safe_open

    out: dict[str, tuple[list[int], Path]] = {}
    for f in pd.weight_files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():
                    out[key] = (list(h.get_slice(key).get_shape()), f)
        except Exception as e:  # safetensors raises SafetensorError and OSError subclasses
            first = " ".join(str(e).split())[:200] or type(e).__name__
            raise ConfigError(f"{pd.where}: {f} is not a readable safetensors file: {first}") from None
    return out


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: kept}`` for state-dict entries that are the same parameter (tied embeddings / lm_head)."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    return aliases


def check_weights(pd: PretrainedDir, model: nn.Module, *, require_all: bool) -> None:
    """Compare the checkpoint's headers with the configured model (shapes only; works on ``meta``).

    Args:
        pd: the pretrained directory.
        model: the model built from its ``config.json`` (any device).
        require_all: every model parameter must be in the checkpoint under its own name (the sharded
            route, which reads by name); otherwise only the names present in both are compared and
            transformers' own load reports the rest (it renames / fuses some layouts).

    Raises:
        ConfigError: ``FILE: KEY has shape [..] in the checkpoint but [..] from config.json``, or a missing key.
    """
    ckpt = checkpoint_shapes(pd)
    aliases = tied_aliases(model)
    for name, t in model.state_dict().items():
        if name in ckpt:
            shape, f = ckpt[name]
            if shape != list(t.shape):
                raise ConfigError(
                    f"{pd.where}: {f.name} holds {name} of shape {shape}, but {CONFIG_FILE} gives {list(t.shape)} "
                    f"(the weights do not belong to this config)"
                )
        elif require_all and name not in _buffers(model) and not (name in aliases and aliases[name] in ckpt):
            raise ConfigError(
                f"{pd.where}: no weight {name!r} in {pd.weight_files[0].name if len(pd.weight_files) == 1 else INDEX_FILE} "
                f"(the checkpoint does not match {CONFIG_FILE}, or stores another key layout)"
            )


def _buffers(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_buffers()}


def load_pretrained(pd: PretrainedDir, hf_cfg, *, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """One process: transformers' ``from_pretrained`` of the directory with the run's ``hf_cfg``.

    The weights are read from safetensors only (``use_safetensors=True``), nothing is downloaded
    (``local_files_only=True``), and no remote code runs. ``hf_cfg`` is the run's config (the directory's
    ``config.json`` with the run's attention kernel and depth, see ``fp8kit.models.build``), so the model
    equals :func:`~fp8kit.models.build.build_model`'s but with the checkpoint's weights.

    Raises:
        ConfigError: shapes that differ from ``config.json`` (checked on the headers first), model
            parameters the checkpoint lacks, or another load failure (first line).
    """
    from fp8kit.base.torchao_lib import quiet_torchao_imports

    with quiet_torchao_imports():
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

    with torch.device("meta"), quiet_torchao_imports():
        skeleton = AutoModelForCausalLM.from_config(hf_cfg)
    check_weights(pd, skeleton, require_all=False)
    del skeleton
    was = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report is replaced by the one-line errors below
    hf_logging.disable_progress_bar()
    try:
        with quiet_torchao_imports():
            model, info = AutoModelForCausalLM.from_pretrained(
                str(pd.path), config=hf_cfg, dtype=dtype, use_safetensors=True, local_files_only=True,
                trust_remote_code=False, output_loading_info=True,
            )
    except Exception as e:  # transformers raises several types; keep the first line
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise ConfigError(f"{pd.where}: transformers cannot load it: {first}") from None
    finally:
        hf_logging.set_verbosity(was)
        hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ConfigError(
            f"{pd.where}: the checkpoint lacks {missing[0]!r}{more} that {CONFIG_FILE} asks for "
            f"(its weights do not match its config)"
        )
    model.config.use_cache = False
    return model.to(device)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give a model built on ``meta`` (and possibly sharded) real, uninitialised storage on ``device``.

    Parameters get empty storage (``nn.Module.to_empty``: under FSDP2 each rank allocates its own
    shards only); the non-persistent buffers that are not in any checkpoint (rotary ``inv_freq``, scaled
    embeddings' scales) are recomputed by the model's own ``_init_weights`` for the modules that hold them
    (transformers' initialisation of those buffers; it may also initialise that module's parameters, which
    the load then overwrites). Load the weights afterwards (:func:`load_sharded`, or a checkpoint).
    """
    model.to_empty(device=device)
    init = getattr(model, "_init_weights", None)
    for m in model.modules():
        if getattr(m, "_non_persistent_buffers_set", None):
            if init is None:
                raise ConfigError(f"{type(model).__name__}: cannot recompute the buffers of {type(m).__name__}")
            with torch.no_grad():
                init(m)


def load_sharded(pd: PretrainedDir, model: nn.Module) -> None:
    """Read the checkpoint into a prepared (FSDP2 / TP sharded) model: each rank its own slices.

    ``torch.distributed.checkpoint.load`` with ``HuggingFaceStorageReader`` fills the model's state dict
    (``get_model_state_dict``: FQNs without the activation-checkpoint / compile wrappers, DTensor shards
    as the rank holds them); the reader opens each safetensors file once and copies only the requested
    slices (``safe_open(...).get_slice``, memory-mapped), converting dtype on the copy. Keys must match
    the model's parameter names (:func:`check_weights` with ``require_all=True`` is run first).

    Raises:
        ConfigError: missing keys or shapes that differ, or a read failure (first line).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    sd = get_model_state_dict(model)
    ckpt = checkpoint_shapes(pd)
    for name in list(sd):  # tied weights are stored once; the kept one fills both
        if name not in ckpt:
            sd.pop(name)
    try:
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(str(pd.path)))
        set_model_state_dict(model, sd, options=_partial_options())
    except Exception as e:
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise ConfigError(f"{pd.where}: cannot read its weights into the sharded model: {first}") from None


def _partial_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False)
