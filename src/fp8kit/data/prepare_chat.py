"""``data.format = "chat"``: chat / instruction records -> rendered, tokenized, masked, packed :class:`SFTData`.

Steps (each can fail with a one-line :class:`~fp8kit.base.errors.DataError` before anything is written):
read every record (:mod:`fp8kit.data.tables`) -> messages (:func:`fp8kit.data.chat.to_messages`; records
without an assistant turn skipped and counted) -> the tokenizer (``data.tokenizer``) or, without one, a
byte-level BPE trained on the rendered conversations (cached like the pretraining one) -> the pieces of
every conversation (:class:`fp8kit.data.chat.ChatRenderer`) -> token ids and the assistant mask -> cut to
``seq_length + 1`` tokens -> :class:`fp8kit.data.sft.SFTData`.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from fp8kit.base.errors import DataError
from fp8kit.data.chat import ChatStats, chat_renderer, encode_segments, pick_chat_columns, to_messages
from fp8kit.data.corpus import expand_paths
from fp8kit.data.prepare import PreparedData
from fp8kit.data.sft import SFTData
from fp8kit.data.tables import RECORD_SUFFIXES, read_records
from fp8kit.data.tokenizer import EOS_TOKEN, load_or_train_tokenizer, resolve_cache_dir

if TYPE_CHECKING:
    from fp8kit.config import DataConfig


def read_conversations(paths: list[str], messages_field: str, stats: ChatStats) -> list[tuple[str, list[dict]]]:
    """``(where, messages)`` of every record with an assistant turn, in file order.

    Raises:
        DataError: no ``data.paths``, a file that is not ``.jsonl`` / ``.json`` / ``.parquet``, any bad record
            (see :func:`fp8kit.data.chat.to_messages`), or no record with an assistant turn at all.
    """
    if not paths:
        raise DataError("data.format = \"chat\" needs data.paths (.jsonl, .json or .parquet chat records)")
    convs = []
    for f in expand_paths(paths):
        if f.suffix not in RECORD_SUFFIXES:
            raise DataError(f"data file {str(f)!r}: data.format = \"chat\" reads .jsonl, .json or .parquet records")
        for where, obj in read_records(f, lambda cols, f=f: pick_chat_columns(f, cols, messages_field)):
            msgs = to_messages(obj, where, messages_field, stats)
            if msgs is not None:
                convs.append((where, msgs))
    if not convs:
        raise DataError(
            f"data.paths holds no record with an assistant turn ({stats.records} records read, "
            f"{stats.no_assistant} without one)"
        )
    return convs


def prepare_chat_data(cfg: DataConfig, *, micro_batch_size: int, seed: int, status=None) -> PreparedData:
    """Build the fine-tuning data of a run from ``[data]`` (module docstring).

    Args:
        cfg: the ``[data]`` section (``format = "chat"``).
        micro_batch_size: for the data-size check.
        seed: seed of the training order.
        status: optional callable ``status(message)`` for progress messages.

    Raises:
        DataError: see :func:`read_conversations`, :func:`fp8kit.data.chat.chat_renderer`, the tokenizer and
            :class:`fp8kit.data.sft.SFTData`.
    """
    say = status or (lambda _msg: None)
    stats = ChatStats()
    convs = read_conversations(cfg.paths, cfg.messages_field, stats)
    cache_dir = resolve_cache_dir(cfg.cache_dir)
    tok, eos = None, EOS_TOKEN  # without data.tokenizer: the BPE trained below, whose EOS is EOS_TOKEN
    if cfg.tokenizer:
        tok, eos_id, tok_desc = load_or_train_tokenizer([], "", cfg.vocab_size, cache_dir, cfg.tokenizer)
        eos = tok.id_to_token(eos_id) if eos_id is not None else None
    renderer = chat_renderer(cfg.chat_template, cfg.tokenizer, eos)
    say(f"rendering {len(convs)} conversations ({renderer.description})")
    pieces = [renderer.segments(msgs, where) for where, msgs in convs]
    h = hashlib.sha256(renderer.template.encode())
    content = hashlib.sha256(renderer.template.encode())  # without the records' file:line names
    texts = []
    for (where, _), segs in zip(convs, pieces, strict=True):
        text = "".join(t for t, _ in segs)
        texts.append(text)
        digest = hashlib.sha256(text.encode()).digest()
        h.update(where.encode() + b"\0" + digest)
        content.update(digest)
    fingerprint = h.hexdigest()
    if tok is None:
        say(f"tokenizer: {len(texts)} conversations")
        tok, eos_id, tok_desc = load_or_train_tokenizer(texts, fingerprint, cfg.vocab_size, cache_dir, None)
    samples = []
    for ids, assistant in encode_segments(tok, pieces):
        stats.tokens_before_cut += len(ids)
        cut = len(ids) > cfg.seq_length + 1
        if cut:
            ids, assistant = ids[: cfg.seq_length + 1], assistant[: cfg.seq_length + 1]
            stats.truncated += 1
        if not assistant[1:].any():  # nothing to learn (after the cut, or an assistant turn of no tokens)
            if cut:
                stats.truncated_away += 1
            else:
                stats.no_assistant += 1
            continue
        samples.append((ids, assistant))
        stats.tokens += len(ids)
        stats.supervised_tokens += int(assistant[1:].sum())
    stats.samples = len(samples)
    data = SFTData(samples, cfg.seq_length, cfg.val_fraction, micro_batch_size, seed, cfg.pack,
                   pad_id=eos_id if eos_id is not None else 0, cut_away=stats.truncated_away)
    skipped = f", {stats.no_assistant} skipped (no assistant turn)" if stats.no_assistant else ""
    cut = (f", {stats.truncated} cut to their first {cfg.seq_length + 1} tokens (data.seq_length + 1; "
           f"{stats.tokens_before_cut:,} tokens before the cut)" if stats.truncated else "")
    away = f" ({stats.truncated_away} of them dropped: no assistant token left)" if stats.truncated_away else ""
    layout = "packed" if cfg.pack else "one per row"
    desc = (
        f"chat: {stats.records} records ({stats.alpaca} alpaca){skipped}{cut}{away}; {stats.samples} samples, "
        f"{layout} into {len(data.train_rows)} + {len(data.val_rows)} rows of {cfg.seq_length} "
        f"({data.fill:.0%} filled); {renderer.description}"
    )
    info = {**stats.to_dict(), "pack": cfg.pack, "fill": data.fill, "template": renderer.description,
            "train_rows": len(data.train_rows), "val_rows": len(data.val_rows)}
    return PreparedData(data, stats.tokens, desc, fingerprint, tok_desc, tok, chat=info,
                        content_fingerprint=content.hexdigest(), chat_template=renderer.template)
