"""The tokenizer: a byte-level BPE trained locally with HF ``tokenizers`` (cached), or a user's file or
Hugging Face model directory (``model.pretrained``'s tokenizer).

Byte-level BPE (the GPT-2 / Llama-3 family's scheme) needs no unknown token: every byte is in the
initial alphabet, so any text round-trips. One special token, ``<|endoftext|>``, separates documents.
Training on the default 12 MB corpus takes seconds; the result is cached under the cache directory,
keyed by the corpus fingerprint and the vocabulary size.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from fp8kit.base.errors import DataError

EOS_TOKEN = "<|endoftext|>"
_EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")
_ALGO_VERSION = "bytelevel-bpe-v1"


def resolve_cache_dir(configured: str | None) -> Path:
    """``data.cache_dir``, else ``$XDG_CACHE_HOME/fp8kit``, else ``~/.cache/fp8kit`` (read at call time)."""
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fp8kit"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write a file through a temporary name and a rename, so a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def train_bpe(texts: list[str], vocab_size: int):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with ``vocab_size`` entries (EOS included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def load_tokenizer_file(tokenizer_path: str | Path):
    """``(tokenizers.Tokenizer, path read)`` from a ``tokenizer.json`` file or a Hugging Face model / tokenizer
    directory (its ``tokenizer.json``; without one, transformers' ``AutoTokenizer`` converts the slow
    tokenizer files, e.g. ``tokenizer.model``, to a fast tokenizer when it can).

    Raises:
        DataError: nothing there, or no fast tokenizer can be made of it (one line naming the path).
    """
    from tokenizers import Tokenizer

    p = Path(tokenizer_path).expanduser()
    if p.is_dir() and (p / "tokenizer.json").is_file():
        p = p / "tokenizer.json"
    if p.is_file():
        try:
            return Tokenizer.from_file(str(p)), p
        except Exception as e:  # tokenizers raises a plain Exception on bad files
            raise DataError(f"data.tokenizer {str(p)!r} is not a valid tokenizer.json: {e}") from None
    if not p.is_dir():
        raise DataError(f"data.tokenizer {str(p)!r} does not exist")
    try:
        from transformers import AutoTokenizer

        fast = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
        return fast.backend_tokenizer, p
    except Exception as e:  # transformers raises OSError / ValueError / ImportError for unusable dirs
        first = " ".join(str(e).split())[:200]
        raise DataError(
            f"data.tokenizer {str(p)!r}: no tokenizer.json and no fast tokenizer can be built from it: {first}"
        ) from None


def load_or_train_tokenizer(
    texts: list[str], corpus_fingerprint: str, vocab_size: int, cache_dir: Path, tokenizer_path: str | None
):
    """Return ``(tokenizer, eos_id, description)``.

    With ``tokenizer_path`` (a ``tokenizer.json``, or a model / tokenizer directory: :func:`load_tokenizer_file`)
    that tokenizer is used; otherwise a BPE is trained on ``texts`` (or taken from the cache).

    Raises:
        DataError: the tokenizer file is missing or invalid, or its vocabulary exceeds ``vocab_size``.
    """
    from tokenizers import Tokenizer

    if tokenizer_path:
        tok, p = load_tokenizer_file(tokenizer_path)
        desc = f"tokenizer file {p}"
    else:
        key = hashlib.sha256(f"{_ALGO_VERSION}:{corpus_fingerprint}:{vocab_size}".encode()).hexdigest()[:20]
        path = cache_dir / "tokenizers" / f"bpe-{vocab_size}-{key}.json"
        if path.is_file():
            tok = Tokenizer.from_file(str(path))
            desc = f"byte-level BPE (cached {path})"
        else:
            tok = train_bpe(texts, vocab_size)
            atomic_write_bytes(path, tok.to_str().encode("utf-8"))
            desc = f"byte-level BPE trained on the corpus (saved {path})"
    size = tok.get_vocab_size()
    if size > vocab_size:
        if tokenizer_path:
            raise DataError(
                f"data.tokenizer {str(p)!r} has {size} tokens, more than data.vocab_size = {vocab_size} (the "
                f"model's vocabulary; with model.pretrained its config.json vocab_size)"
            )
        raise DataError(
            f"the tokenizer has {size} tokens, more than data.vocab_size = {vocab_size}; raise data.vocab_size"
        )
    eos_id = next((tok.token_to_id(t) for t in _EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
    return tok, eos_id, desc
