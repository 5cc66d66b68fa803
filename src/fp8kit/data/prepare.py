"""Corpus -> tokenizer -> token stream (cached) -> :class:`PackedData`: everything ``train`` needs.

``data.format = "chat"`` (fine-tuning on chat / instruction records) goes through
:mod:`fp8kit.data.prepare_chat` instead and gives a :class:`fp8kit.data.sft.SFTData`.

Tokenized corpora are cached as ``.npy`` files (uint16 when the vocabulary fits, else uint32) keyed
by the corpus fingerprint and the tokenizer's own serialisation, so a second run starts at once.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fp8kit.base.errors import DataError
from fp8kit.data.corpus import load_corpus, read_token_files
from fp8kit.data.loader import PackedData
from fp8kit.data.sft import SFTData
from fp8kit.data.tokenizer import atomic_write_bytes, load_or_train_tokenizer, resolve_cache_dir

if TYPE_CHECKING:  # the [data] section of the run config (a type only: config sits above this layer)
    from fp8kit.config import DataConfig


@dataclass
class PreparedData:
    """The data of a run.

    Attributes:
        packed: windows, split and batch order.
        num_tokens: tokens in the whole stream (chat data: of the kept samples, after the cut to seq_length + 1).
        corpus: description of the corpus.
        corpus_fingerprint: sha256 of the corpus (names + contents).
        tokenizer: description of the tokenizer (or of the token files).
        tokenizer_obj: the ``tokenizers.Tokenizer`` (None for pre-tokenized data).
        content_fingerprint: sha256 of the documents' contents only (chat data: with the chat template), the
            same under another path; what a resume compares (``train.setup.check_resume_data``). None for
            pre-tokenized data.
        chat: ``data.format = "chat"`` only: the counts of :class:`fp8kit.data.chat.ChatStats` (records,
            skipped without an assistant turn, truncated, supervised tokens, ...), ``pack``, ``fill`` and the
            chat template; ``packed`` is then a :class:`fp8kit.data.sft.SFTData`.
        chat_template: chat data only: the Jinja template the conversations were rendered with (saved with the
            run's tokenizer, so its export renders the training format).
    """

    packed: PackedData | SFTData
    num_tokens: int
    corpus: str
    corpus_fingerprint: str
    tokenizer: str
    tokenizer_obj: object | None = None
    content_fingerprint: str | None = None
    chat: dict | None = None
    chat_template: str | None = None


def tokenize(texts: list[str], tokenizer, eos_id: int | None, vocab_size: int) -> np.ndarray:
    """Encode documents (in order) into one stream, an EOS after each document."""
    dtype = np.uint16 if vocab_size <= 65536 else np.uint32
    parts = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=dtype))
        if eos_id is not None:
            parts.append(np.asarray([eos_id], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def prepare_data(cfg: DataConfig, *, micro_batch_size: int, seed: int, status=None) -> PreparedData:
    """Build the run's data from ``[data]``.

    Args:
        cfg: the ``[data]`` section.
        micro_batch_size: for the corpus-size check.
        seed: seed of the training order.
        status: optional callable ``status(message)`` for progress messages.

    Raises:
        DataError: see :func:`fp8kit.data.corpus.load_corpus`, the tokenizer and :class:`PackedData` (and
            :func:`fp8kit.data.prepare_chat.prepare_chat_data` for ``data.format = "chat"``).
    """
    if cfg.format == "chat":  # fine-tuning records: fp8kit.data.prepare_chat
        from fp8kit.data.prepare_chat import prepare_chat_data

        return prepare_chat_data(cfg, micro_batch_size=micro_batch_size, seed=seed, status=status)
    say = status or (lambda _msg: None)
    corpus = load_corpus(cfg.paths, cfg.text_field)
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    if corpus.token_files:
        tokens = read_token_files(corpus.token_files, cfg.token_dtype, cfg.vocab_size)
        tok_desc, tok_obj = f"pre-tokenized ({cfg.token_dtype})", None
    else:
        say(f"tokenizer: {corpus.description}, {corpus.num_bytes / 1e6:.1f} MB")
        tok_obj, eos_id, tok_desc = load_or_train_tokenizer(
            corpus.texts, corpus.fingerprint, cfg.vocab_size, cache_dir, cfg.tokenizer
        )
        tok_hash = hashlib.sha256(tok_obj.to_str().encode("utf-8")).hexdigest()
        key = hashlib.sha256(f"{corpus.fingerprint}:{tok_hash}:{cfg.vocab_size}".encode()).hexdigest()[:24]
        path = cache_dir / "tokens" / f"{key}.npy"
        if path.is_file():
            tokens = np.load(path, mmap_mode="r")
        else:
            say(f"tokenizing {len(corpus.texts)} documents")
            tokens = tokenize(corpus.texts, tok_obj, eos_id, cfg.vocab_size)
            buf = io.BytesIO()
            np.save(buf, tokens)
            atomic_write_bytes(path, buf.getvalue())
    if len(tokens) == 0:
        raise DataError(f"the corpus ({corpus.description}) produced no tokens")
    packed = PackedData(tokens, cfg.seq_length, cfg.val_fraction, micro_batch_size, seed)
    return PreparedData(packed, int(len(tokens)), corpus.description, corpus.fingerprint, tok_desc, tok_obj,
                        content_fingerprint=corpus.content_fingerprint or None)

