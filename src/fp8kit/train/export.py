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
:func:`save_run_tokenizer`): the pretrained directory's tokenizer files copied as they are, or fp8kit's
trained byte-level BPE wrapped as a ``PreTrainedTokenizerFast`` (EOS ``<|endoftext|>``) and saved with
``save_pretrained``. A chat run (``data.format = "chat"``) saves the chat template its conversations were
rendered with (``data.chat_template``, the tokenizer's own, or fp8kit's default) as ``chat_template.jinja``, so ``apply_chat_template`` of the exported tokenizer renders the training format.
The run's exact HF config is saved beside it (``<run>/model_config.json``), so an export does not need the
pretrained directory any more.

An export is written into a temporary directory: a sibling of a new output directory, renamed into place when
complete, or one inside an existing empty output directory (``.``, a mount point), whose files are moved up when
complete. An export that fails leaves nothing behind.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from fp8kit.base.errors import CheckpointError
from fp8kit.base.files import ordinary_mode
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
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def eos_token_of(tokenizer) -> str | None:
    """The EOS token of a ``tokenizers.Tokenizer`` (the first of the data layer's EOS names it knows)."""
    from fp8kit.data.tokenizer import _EOS_CANDIDATES  # the one list of EOS names (data layer)

    return next((t for t in _EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)


def parse_max_shard_size(size: str | int) -> int:
    """A shard size in bytes: an int, or text: a whole number of bytes, or what transformers' ``save_pretrained``
    reads (``transformers.utils.hub.convert_file_size_to_int``: ``"5GB"``, ``"500MB"``, ``"5GiB"``, ``"500MiB"``;
    ``"5Gb"`` is gigabits there).

    Raises:
        ValueError: anything else, or a size that is not above zero (one line naming the accepted form).
    """
    from transformers.utils.hub import convert_file_size_to_int

    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif str(size).strip().isdigit():
        n = int(str(size).strip())
    else:
        try:
            n = convert_file_size_to_int(str(size).strip())
        except ValueError:
            n = 0
    if n <= 0:
        raise ValueError(f"{size!r} is not a shard size: give bytes, or a whole number with GB, MB, KB (or GiB, MiB, "
                         f"KiB) above zero, e.g. 5GB or 500MB")
    return n


def run_chat_template(data_cfg, tokenizer) -> str | None:
    """The chat template a run trains with, chosen again from its config as the data layer chooses it
    (:func:`fp8kit.data.chat.chat_renderer`: ``data.chat_template``, the tokenizer's own, or fp8kit's default):
    for exporting a chat run from before its tokenizer carried its template (a new run saves the template it
    rendered with, ``PreparedData.chat_template``).

    Args:
        data_cfg: the run's ``[data]`` section.
        tokenizer: the run's ``tokenizers.Tokenizer`` (its EOS token fills the default template).

    Returns:
        the Jinja template; None unless ``data.format = "chat"`` (or without a tokenizer).

    Raises:
        DataError: the template file or the tokenizer directory cannot be read.
    """
    if data_cfg.format != "chat" or tokenizer is None:
        return None
    from fp8kit.data.chat import chat_renderer

    return chat_renderer(data_cfg.chat_template, data_cfg.tokenizer, eos_token_of(tokenizer)).template


def _saved_chat_template(tok_dir: Path) -> str | None:
    """The chat template that ``AutoTokenizer.from_pretrained(tok_dir)`` gets: ``chat_template.jinja``, else
    the ``chat_template`` of ``tokenizer_config.json`` (of named templates the default, as the data layer picks)."""
    if (tok_dir / CHAT_TEMPLATE_FILE).is_file():
        return (tok_dir / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    cfg_file = tok_dir / "tokenizer_config.json"
    t = json.loads(cfg_file.read_text(encoding="utf-8")).get("chat_template") if cfg_file.is_file() else None
    if isinstance(t, list):  # transformers' layout of named templates
        t = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
    if isinstance(t, dict):
        t = t.get("default") or next(iter(t.values()), None)
    return t if isinstance(t, str) else None


def _write_chat_template(tok_dir: Path, template: str) -> None:
    """Make ``template`` the chat template of the tokenizer saved in ``tok_dir``: ``chat_template.jinja`` (which
    transformers reads first), a different template in ``tokenizer_config.json`` removed (as ``save_pretrained``
    does); nothing changes when the saved tokenizer has this template already."""
    if _saved_chat_template(tok_dir) == template:
        return
    (tok_dir / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    cfg_file = tok_dir / "tokenizer_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        if cfg.pop("chat_template", None) is not None:
            cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


#: errors that are about the output whatever file an OSError names (a copy's source, with ``os.sendfile``)
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})


def _temp_dir_beside(out: Path) -> Path:
    """A new empty hidden directory next to ``out`` (same file system, so it can be renamed to ``out``), with the
    permissions of any new directory (``tempfile.mkdtemp`` would make it private, and so the renamed result)."""
    while True:
        tmp = out.parent / f".{out.name}.{os.urandom(4).hex()}.tmp"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def save_run_tokenizer(tokenizer, source: str | None, out: Path, chat_template: str | None = None) -> Path | None:
    """Save the run's tokenizer in the Hugging Face layout into ``out`` (replaced atomically).

    Args:
        tokenizer: the run's ``tokenizers.Tokenizer`` (None for pre-tokenized data: nothing is written).
        source: ``data.tokenizer``: a Hugging Face directory (its tokenizer files are copied), a
            ``tokenizer.json`` file, or None (fp8kit's trained BPE); the latter two are wrapped as a
            ``PreTrainedTokenizerFast`` with their EOS token.
        out: the directory to write.
        chat_template: the chat template the run trains with (``PreparedData.chat_template``), saved as the
            tokenizer's (``chat_template.jinja``) unless the tokenizer has it already; None: the tokenizer's
            files as they are.

    Returns:
        ``out``, or None when there is no tokenizer.
    """
    if tokenizer is None:
        return None
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_dir_beside(out)
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
        if chat_template is not None:
            _write_chat_template(tmp, chat_template)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def from_run_files(cfg, run_dir: Path):
    """``(cfg, note)``: a resumed run whose ``model.pretrained`` directory is gone, rebuilt from the run's own
    files (``<run>/model_config.json``, the exact HF config, and ``<run>/tokenizer/``, saved at its start by
    :func:`save_run_files`), which is all a resume needs: it loads its checkpoint's weights, not the pretrained
    ones. ``model.pretrained`` becomes ``model.hf_config`` = the saved config and ``data.tokenizer`` (where it was
    the pretrained directory) the saved tokenizer; ``note`` says so. ``(cfg, None)`` unchanged when the directory
    exists, none is set, or the run lacks those files (then ``resolve_pretrained`` names the missing directory).

    Args:
        cfg: the run config as loaded, not yet through ``resolve_pretrained`` (``load_config(resolve=False)``).
        run_dir: the resumed run's directory.
    """
    gone = cfg.model.pretrained
    if not gone or Path(gone).expanduser().is_dir():
        return cfg, None
    saved_cfg, saved_tok = Path(run_dir) / MODEL_CONFIG_FILE, Path(run_dir) / TOKENIZER_DIR
    if not (saved_cfg.is_file() and saved_tok.is_dir()):
        return cfg, None
    tokenizer = str(saved_tok) if cfg.data.tokenizer in (None, gone) else cfg.data.tokenizer
    new = cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"pretrained": None, "hf_config": str(saved_cfg)}),
        "data": cfg.data.model_copy(update={"tokenizer": tokenizer}),
    })
    new._notes = list(cfg.notes)
    return new, (f"model.pretrained {gone!r} is gone: the resumed run is rebuilt from its own {saved_cfg} and "
                 f"{saved_tok}/ (a resume loads its checkpoint's weights, not the pretrained ones)")


def save_run_files(setup, out_dir: Path) -> None:
    """At the start of a run (rank 0): ``<run>/tokenizer/`` (chat runs: with the chat template they train with)
    and ``<run>/model_config.json`` (the HF config)."""
    tok = setup.data.tokenizer_obj
    save_run_tokenizer(tok, setup.cfg.data.tokenizer, Path(out_dir) / TOKENIZER_DIR,
                       chat_template=setup.data.chat_template)  # the one its conversations were rendered with
    setup.hf_cfg.to_json_file(str(Path(out_dir) / MODEL_CONFIG_FILE))


def export_checkpoint(path: Path, out_dir: Path, *, config: str | Path | None = None,
                      max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """Write a checkpoint of any format as a Hugging Face model directory (see the module docstring).

    The model is rebuilt from the run's ``model_config.json`` (or from the run config: ``config``, default
    the run's ``resolved_config.toml``), the weights are loaded (safetensors, or DCP files of any layout,
    read in this one process), cast to bfloat16 and written with transformers' ``save_pretrained``
    (safetensors, HF key layout, tied weights once, sharded above ``max_shard_size``). Everything is written
    into a temporary directory first (module docstring), so a failed export leaves nothing.

    Args:
        path: a run directory (its latest checkpoint) or a checkpoint directory.
        out_dir: the output directory (created; must be empty if it exists).
        config: the run config; default: the ``resolved_config.toml`` of the checkpoint's run.
        max_shard_size: largest safetensors file (``"5GB"``, ``"500MB"`` or bytes: :func:`parse_max_shard_size`);
            larger models are sharded with a ``model.safetensors.index.json``.

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: a bad ``max_shard_size``, no such ``path``, no checkpoint, no config, weights that do
            not fit, an ``out_dir`` that is a file or a non-empty directory, or an output that cannot be
            written (an OSError; the message names ``out_dir``). Nothing is left behind in any error case.
        DataError: a chat run from before chat templates were saved with the run's tokenizer, whose template
            (``data.chat_template``) cannot be read any more (raised before anything is written).
    """
    from fp8kit.config import ModelConfig, build_config, read_config_file
    from fp8kit.models.build import build_model
    from fp8kit.models.pretrained import GENERATION_CONFIG_FILE

    try:
        max_shard_size = parse_max_shard_size(max_shard_size)
    except ValueError as e:
        raise CheckpointError(f"export: max_shard_size {e}") from None
    if not Path(path).exists():
        raise CheckpointError(
            f"export {str(path)!r}: the directory does not exist (give a run directory or a checkpoint directory)"
        )
    ck = find_checkpoint(Path(path), what="export")
    run_dir = ck.parent.parent
    cfg_path = Path(config) if config is not None else run_dir / "resolved_config.toml"
    if not cfg_path.is_file():
        raise CheckpointError(
            f"export {str(path)!r}: no run config at {str(cfg_path)!r}; pass the run's config with --config"
        )
    out_dir = Path(out_dir)
    if out_dir.is_file():
        raise CheckpointError(f"export: the output path {str(out_dir)!r} is a file (give a new or empty directory)")
    if out_dir.is_dir() and any(out_dir.iterdir()):
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
    chat_template = None  # a chat run from before its tokenizer carried its chat template: the one it trained with
    if cfg.data.format == "chat" and (tok_dir / "tokenizer.json").is_file() and _saved_chat_template(tok_dir) is None:
        from tokenizers import Tokenizer

        chat_template = run_chat_template(cfg.data, Tokenizer.from_file(str(tok_dir / "tokenizer.json")))
    dest = out_dir.resolve()  # "." or a link to an empty directory: the directory itself
    # An existing (empty) directory is filled in place, through a temporary directory inside it: its owner, mode
    # and mount stay (a rename onto ".", a mount point or a directory in an unwritable parent cannot work). A new
    # one is a temporary sibling renamed into place.
    existing = dest.is_dir()
    made = [] if existing else [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]
    tmp, done, moved = None, False, []
    read = [tok_dir] + ([source_gen] if source_gen is not None else [])  # what the copies below read
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_dir_beside(dest / "export") if existing else _temp_dir_beside(dest)
        model.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        ordinary_mode(*tmp.glob("*.safetensors"))  # safetensors writes 0600; config.json has the umask's mode
        if source_gen is not None and source_gen.is_file():
            shutil.copy2(source_gen, tmp / GENERATION_CONFIG_FILE)
        if tok_dir.is_dir():
            for f in tok_dir.iterdir():
                read.append(f)
                shutil.copy2(f, tmp / f.name)
            if chat_template is not None:
                _write_chat_template(tmp, chat_template)
        elif cfg.data.tokenizer:  # a run from before tokenizers were saved in the run directory
            from fp8kit.data.tokenizer import load_tokenizer_file

            tok, _ = load_tokenizer_file(cfg.data.tokenizer)
            save_run_tokenizer(tok, cfg.data.tokenizer, tmp / ".tok", chat_template=run_chat_template(cfg.data, tok))
            for f in (tmp / ".tok").iterdir():
                os.replace(f, tmp / f.name)
            (tmp / ".tok").rmdir()
        if existing:
            for f in sorted(tmp.iterdir()):
                os.replace(f, dest / f.name)
                moved.append(dest / f.name)
            tmp.rmdir()
        else:
            os.replace(tmp, dest)
        done = True
    except (OSError, SafetensorError) as e:  # safetensors reports its write errors (a full disk) as its own
        detail = (e.strerror if isinstance(e, OSError) else None) or " ".join(str(e).split())
        failed = getattr(e, "filename", None)
        # shutil.copy2's fast copy (sendfile) names the source in ``filename`` and the destination in ``filename2``
        # even when the write failed (a full disk): only a failure naming a source alone is a read
        if (failed is not None and str(failed) in {str(p) for p in read} and getattr(e, "filename2", None) is None
                and getattr(e, "errno", None) not in _WRITE_ERRNOS):
            # a file of the run (its tokenizer) or of the pretrained model that could not be read
            raise CheckpointError(f"export: cannot read {str(failed)!r}: {detail}") from None
        raise CheckpointError(f"export: cannot write the output directory {str(out_dir)!r}: {detail}") from None
    finally:
        if not done:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            for f in moved:  # an existing directory goes back to empty
                if f.is_dir():
                    shutil.rmtree(f, ignore_errors=True)
                else:
                    f.unlink(missing_ok=True)
            for p in made:  # the parent directories this export created, innermost first
                try:
                    p.rmdir()
                except OSError:
                    break
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
