"""``fp8kit export``: a run's checkpoint -> a directory that transformers loads as it loads any model.

``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer.from_pretrained(OUT)`` load what this
writes::

    config.json                     the run's architecture (``use_cache`` on, dtype bfloat16)
    model.safetensors               BF16 weights, or above ``max_shard_size`` (default 5GB)
    model-0000N-of-0000M.safetensors  shards + model.safetensors.index.json (transformers' save_pretrained)
    generation_config.json          the pretrained source's, when it had one; else transformers' default
                                    with the tokenizer's EOS
    tokenizer.json, tokenizer_config.json, ...  the run's tokenizer (see below)

The run's tokenizer is saved in the run directory at the start of a run (``<run>/tokenizer/``, by
:func:`save_run_tokenizer`): the pretrained directory's tokenizer files copied as they are (chat template
included), or fp8kit's trained byte-level BPE wrapped as a ``PreTrainedTokenizerFast`` (EOS
``<|endoftext|>``) and saved with ``save_pretrained``. The run's exact HF config is saved beside it
(``<run>/model_config.json``), so an export does not need the pretrained directory any more.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from fp8kit.base.errors import CheckpointError
from fp8kit.train.checkpoint import (
    check_compatible,
    find_checkpoint,
    is_dcp,
    load_into,
    load_model_weights,
    load_train_state,
)

TOKENIZER_DIR = "tokenizer"
MODEL_CONFIG_FILE = "model_config.json"
#: The files of a Hugging Face tokenizer (fast or slow); those present are copied.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "spiece.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
    "chat_template.json",
)
DEFAULT_MAX_SHARD_SIZE = "5GB"


def eos_token_of(tokenizer) -> str | None:
    """The EOS token of a ``tokenizers.Tokenizer`` (the first of the data layer's EOS names it knows)."""
    from fp8kit.data.tokenizer import _EOS_CANDIDATES  # the one list of EOS names (data layer)

    return next((t for t in _EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)


def save_run_tokenizer(tokenizer, source: str | None, out: Path) -> Path | None:
    """Save the run's tokenizer in the Hugging Face layout into ``out`` (replaced atomically).

    Args:
        tokenizer: the run's ``tokenizers.Tokenizer`` (None for pre-tokenized data: nothing is written).
        source: ``data.tokenizer``: a Hugging Face directory (its tokenizer files are copied), a
            ``tokenizer.json`` file, or None (fp8kit's trained BPE); the latter two are wrapped as a
            ``PreTrainedTokenizerFast`` with their EOS token.
        out: the directory to write.

    Returns:
        ``out``, or None when there is no tokenizer.
    """
    if tokenizer is None:
        return None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        src = Path(source).expanduser() if source else None
        copied = []
        if src is not None and src.is_dir():
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, tmp / name)
                    copied.append(name)
        if not copied:
            from transformers import PreTrainedTokenizerFast

            eos = eos_token_of(tokenizer)
            PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos).save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def save_run_files(setup, out_dir: Path) -> None:
    """At the start of a run (rank 0): ``<run>/tokenizer/`` and ``<run>/model_config.json`` (the HF config)."""
    save_run_tokenizer(setup.data.tokenizer_obj, setup.cfg.data.tokenizer, Path(out_dir) / TOKENIZER_DIR)
    setup.hf_cfg.to_json_file(str(Path(out_dir) / MODEL_CONFIG_FILE))


def export_checkpoint(path: Path, out_dir: Path, *, config: str | Path | None = None,
                      max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write a checkpoint of any format as a Hugging Face model directory (see the module docstring).

    The model is rebuilt from the run's ``model_config.json`` (or from the run config: ``config``, default
    the run's ``resolved_config.toml``), the weights are loaded (safetensors, or DCP files of any layout,
    read in this one process), cast to bfloat16 and written with transformers' ``save_pretrained``
    (safetensors, HF key layout, tied weights once, sharded above ``max_shard_size``).

    Args:
        path: a run directory (its latest checkpoint) or a checkpoint directory.
        out_dir: the output directory (created; must be empty if it exists).
        config: the run config; default: the ``resolved_config.toml`` of the checkpoint's run.
        max_shard_size: largest safetensors file (``"5GB"``, ``"500MB"`` or bytes); larger models are sharded
            with a ``model.safetensors.index.json``.

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: no checkpoint, no config, weights that do not fit, or a non-empty ``out_dir``
            (nothing is written in any of these cases).
    """
    from fp8kit.config import ModelConfig, build_config, read_config_file
    from fp8kit.models.build import build_model
    from fp8kit.models.pretrained import GENERATION_CONFIG_FILE

    ck = find_checkpoint(Path(path), what="export")
    run_dir = ck.parent.parent
    cfg_path = Path(config) if config is not None else run_dir / "resolved_config.toml"
    if not cfg_path.is_file():
        raise CheckpointError(
            f"export {str(path)!r}: no run config at {str(cfg_path)!r}; pass the run's config with --config"
        )
    out_dir = Path(out_dir)
    if out_dir.is_file() or (out_dir.is_dir() and any(out_dir.iterdir())):
        raise CheckpointError(f"export: the output directory {str(out_dir)!r} exists and is not empty")
    # The resolved config as saved (not re-resolved: the pretrained directory may be gone by now).
    cfg = build_config(read_config_file(cfg_path), [], source=str(cfg_path))
    model_cfg = cfg.model
    if (run_dir / MODEL_CONFIG_FILE).is_file():  # the exact HF config the run trained
        model_cfg = ModelConfig(hf_config=str(run_dir / MODEL_CONFIG_FILE),
                                attn_implementation=cfg.model.attn_implementation)
    state = load_train_state(ck)
    model = build_model(model_cfg, cfg.data.vocab_size, device="cpu", dtype=torch.bfloat16, seed=cfg.train.seed)
    check_compatible(ck, model, state)
    if is_dcp(ck):
        load_into(ck, model, None, state)
    else:
        load_model_weights(ck, model)
    model = model.to(torch.bfloat16)
    model.config.use_cache = True  # the exported model is for inference

    tok_dir = run_dir / TOKENIZER_DIR
    source_gen = Path(cfg.model.pretrained).expanduser() / GENERATION_CONFIG_FILE if cfg.model.pretrained else None
    if not cfg.model.pretrained and (tok_dir / "tokenizer_config.json").is_file():
        _set_special_ids(model, tok_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), max_shard_size=max_shard_size)
    if source_gen is not None and source_gen.is_file():
        shutil.copy2(source_gen, out_dir / GENERATION_CONFIG_FILE)
    if tok_dir.is_dir():
        for f in tok_dir.iterdir():
            shutil.copy2(f, out_dir / f.name)
    elif cfg.data.tokenizer:  # a run from before tokenizers were saved in the run directory
        from fp8kit.data.tokenizer import load_tokenizer_file

        tok, _ = load_tokenizer_file(cfg.data.tokenizer)
        save_run_tokenizer(tok, cfg.data.tokenizer, out_dir / ".tok")
        for f in (out_dir / ".tok").iterdir():
            os.replace(f, out_dir / f.name)
        (out_dir / ".tok").rmdir()
    return out_dir


def _set_special_ids(model, tok_dir: Path) -> None:
    """A run on fp8kit's own tokenizer: config and generation config get its EOS id (no BOS, no pad), not
    the architecture's defaults (Llama's bos 1 / eos 2 are ordinary tokens of a trained BPE)."""
    from tokenizers import Tokenizer

    tj = tok_dir / "tokenizer.json"
    if not tj.is_file():
        return
    tok = Tokenizer.from_file(str(tj))
    eos = eos_token_of(tok)
    eos_id = tok.token_to_id(eos) if eos else None
    for c in (model.config, getattr(model, "generation_config", None)):
        if c is not None:
            c.eos_token_id, c.bos_token_id, c.pad_token_id = eos_id, None, None


def exported_files(out_dir: Path) -> dict:
    """A short description of an export directory (for the CLI line): weight files, tokenizer, generation."""
    out_dir = Path(out_dir)
    weights = sorted(p.name for p in out_dir.glob("*.safetensors"))
    return {
        "weights": weights,
        "sharded": (out_dir / "model.safetensors.index.json").is_file(),
        "tokenizer": (out_dir / "tokenizer.json").is_file() or (out_dir / "tokenizer.model").is_file(),
        "generation_config": (out_dir / "generation_config.json").is_file(),
        "config": json.loads((out_dir / "config.json").read_text(encoding="utf-8")).get("model_type"),
    }
