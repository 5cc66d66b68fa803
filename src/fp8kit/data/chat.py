"""Chat and instruction records -> rendered conversations -> token ids with the assistant tokens marked.

Records (one a JSONL line, a JSON array element or a parquet row; :mod:`fp8kit.data.tables`):

* messages: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}``, the
  OpenAI chat / LLaMA-Factory "sharegpt" shape (field name ``data.messages_field``; the sharegpt spelling
  ``{"from": "human" | "gpt", "value": ...}`` is accepted too). With ``data.messages_field`` at its default
  ``"messages"``, a record without ``messages`` but with ShareGPT's ``conversations`` is read from that
  (a real ShareGPT file, out of the box); another ``data.messages_field`` is the only field read;
* alpaca: ``{"instruction", "input" (optional), "output", "system" (optional), "history" (optional
  ``[[query, response], ...]``)}``, converted as LLaMA-Factory does: the user turn is
  ``instruction + "\\n" + input`` (input left out when empty), the assistant turn is ``output``.

Roles are ``system``, ``user`` and ``assistant`` (``human`` -> user, ``gpt`` -> assistant); any other role is
an error. Messages after the last assistant turn are dropped (nothing is learnt from them); a record without
an assistant turn is skipped and counted (:class:`ChatStats`).

Rendering: the chat template (Jinja) is the tokenizer's own (``chat_template.jinja`` or the
``chat_template`` of ``tokenizer_config.json`` next to ``data.tokenizer``, loaded with
``transformers.AutoTokenizer``), a template file (``data.chat_template = "path"``), or else
:data:`DEFAULT_CHAT_TEMPLATE`. It is applied with ``transformers``' ``apply_chat_template(tokenize=False)``.

Masking (which tokens are learnt): for the assistant turn ``i`` the conversation is rendered twice more,
``messages[:i]`` with the generation prompt (P) and ``messages[:i + 1]`` (F); the text between
``len(P)`` and ``len(F)`` of the full rendering is the assistant's (its content and the template's
end-of-turn marker, e.g. ``<|endoftext|>`` or ``<|im_end|>\\n``), everything else is prompt and template. The
text is cut at these boundaries and every piece is tokenized on its own, so a token never straddles a
prompt/answer boundary and the mask is exact (LLaMA-Factory's SFT preprocessing encodes prompt and
response apart the same way). A template that renders an earlier turn differently once later turns are
added (e.g. one that drops earlier reasoning) is refused with a one-line error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from fp8kit.base.errors import DataError

#: The template used when the tokenizer has none (or with ``data.chat_template = "default"``)::
#:
#:     <|system|>\n{system}\n<|user|>\n{user}\n<|assistant|>\n{assistant}<eos><|user|>\n...
#:
#: ``<eos>`` is the tokenizer's end-of-text token (``<|endoftext|>`` for the BPE fp8kit trains); the
#: learnt part of an assistant turn is ``{assistant}<eos>``: the model learns to stop.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- else -%}{{ '\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
ALPACA_KEYS = ("instruction", "input", "output", "system", "history")
DEFAULT_MESSAGES_FIELD = "messages"  # data.messages_field's default
SHAREGPT_FIELD = "conversations"  # ShareGPT's name of the messages, read when data.messages_field is the default


@dataclass
class ChatStats:
    """Counts of the chat data of a run (recorded in ``run_info.json`` under ``data``).

    Attributes:
        records: records read from all files.
        alpaca: of which in the alpaca shape.
        no_assistant: records skipped because they have no assistant turn.
        truncated: samples cut to ``seq_length + 1`` tokens (their first tokens kept).
        truncated_away: samples skipped because no assistant token was left after the cut.
        samples: samples kept (train + validation).
        supervised_tokens: assistant (learnt) label tokens of the kept samples.
        tokens: all tokens of the kept samples, after the cut (what training sees).
        tokens_before_cut: all tokens of the rendered conversations, before the cut and the drops.
    """

    records: int = 0
    alpaca: int = 0
    no_assistant: int = 0
    truncated: int = 0
    truncated_away: int = 0
    samples: int = 0
    supervised_tokens: int = 0
    tokens: int = 0
    tokens_before_cut: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def messages_key(keys, messages_field: str) -> str | None:
    """The field (or column) of ``keys`` that holds the messages: ``messages_field``, else, when that is the
    default ``"messages"``, ShareGPT's ``"conversations"``; None when there is neither."""
    if messages_field in keys:
        return messages_field
    if messages_field == DEFAULT_MESSAGES_FIELD and SHAREGPT_FIELD in keys:
        return SHAREGPT_FIELD
    return None


def _looked_for(messages_field: str) -> str:
    """``'messages' (or ShareGPT's 'conversations')`` at the default, else just the configured name."""
    also = f" (or ShareGPT's {SHAREGPT_FIELD!r})" if messages_field == DEFAULT_MESSAGES_FIELD else ""
    return f"{messages_field!r}{also}"


def pick_chat_columns(path: Path, columns: list[str], messages_field: str) -> list[str]:
    """The parquet columns to read: the messages column (:func:`messages_key`), else the alpaca columns present.

    Raises:
        DataError: neither a messages column nor an ``instruction`` column is in the file.
    """
    key = messages_key(columns, messages_field)
    if key is not None:
        return [key]
    if "instruction" in columns:
        return [c for c in ALPACA_KEYS if c in columns]
    raise DataError(
        f"{path}: no column {_looked_for(messages_field)} and no alpaca column 'instruction' "
        f"(columns: {', '.join(columns)}; set data.messages_field)"
    )


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} is not a string ({type(value).__name__})")
    return value


def _from_messages(value, where: str, field: str) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise DataError(f"{where}: field {field!r} is not a list of messages ({type(value).__name__})")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {field}[{i}] is not an object")
        # parquet gives every struct field of the column, absent ones as None
        role_key, content_key = ("role", "content") if m.get("role") is not None else ("from", "value")
        if m.get(role_key) is None:
            raise DataError(f"{where}: {field}[{i}] has no 'role' (or sharegpt 'from')")
        role = ROLES.get(m[role_key]) if isinstance(m[role_key], str) else None
        if role is None:
            raise DataError(
                f"{where}: unknown role {m[role_key]!r} in {field}[{i}] (expected system, user, assistant; "
                f"sharegpt: human, gpt)"
            )
        out.append({"role": role, "content": _text(m.get(content_key), where, f"{field}[{i}].{content_key}")})
    return out


def _from_alpaca(obj: dict, where: str) -> list[dict[str, str]]:
    msgs = []
    if obj.get("system"):
        msgs.append({"role": "system", "content": _text(obj["system"], where, "'system'")})
    for j, pair in enumerate(obj.get("history") or []):
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise DataError(f"{where}: history[{j}] is not a [query, response] pair")
        msgs.append({"role": "user", "content": _text(pair[0], where, f"history[{j}][0]")})
        msgs.append({"role": "assistant", "content": _text(pair[1], where, f"history[{j}][1]")})
    query = [_text(obj["instruction"], where, "'instruction'")]
    if obj.get("input"):
        query.append(_text(obj["input"], where, "'input'"))
    msgs.append({"role": "user", "content": "\n".join(query)})
    if obj.get("output") is not None:
        msgs.append({"role": "assistant", "content": _text(obj["output"], where, "'output'")})
    return msgs


def to_messages(obj: dict, where: str, messages_field: str, stats: ChatStats) -> list[dict[str, str]] | None:
    """One record -> ``[{"role", "content"}, ...]`` up to its last assistant turn; ``None`` (counted in
    ``stats.no_assistant``) when it has no assistant turn. The messages are read from ``messages_field``
    (at its default ``"messages"``, from ShareGPT's ``"conversations"`` when there is no ``"messages"``).

    Raises:
        DataError: no messages field and no alpaca ``instruction``; an unknown role; a message or
            field that is not a string.
    """
    stats.records += 1
    key = messages_key(obj, messages_field)
    if key is not None:
        msgs = _from_messages(obj[key], where, key)
    elif "instruction" in obj:
        stats.alpaca += 1
        msgs = _from_alpaca(obj, where)
    else:
        raise DataError(
            f"{where}: no field {_looked_for(messages_field)} and no alpaca 'instruction' (set data.messages_field)"
        )
    last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
    if last is None:
        stats.no_assistant += 1
        return None
    return msgs[: last + 1]


class ChatRenderer:
    """Renders conversations with a Jinja chat template and cuts them into prompt / assistant pieces.

    Args:
        template: the Jinja chat template.
        description: where the template came from (for logs and ``run_info.json``).
        hf_tokenizer: a ``transformers`` tokenizer whose ``apply_chat_template`` renders (its special
            tokens, e.g. ``eos_token``, fill the template's variables; its vocabulary is not used).
    """

    def __init__(self, template: str, description: str, hf_tokenizer):
        self.template = template
        self.description = description
        self.hf = hf_tokenizer

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool, where: str) -> str:
        """The template's text of ``messages``. Raises DataError (naming ``where``) when the template fails."""
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{where}: the chat template ({self.description}) failed: {msg}") from None

    def segments(self, messages: list[dict[str, str]], where: str) -> list[tuple[str, bool]]:
        """``[(text, is_assistant), ...]`` whose concatenation is the full rendering (module docstring).

        Raises:
            DataError: the template fails, or does not render the conversation incrementally.
        """
        full = self.render(messages, False, where)
        out: list[tuple[str, bool]] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], True, where)
            upto = self.render(messages[: i + 1], False, where)
            if not (upto.startswith(prompt) and full.startswith(upto) and len(prompt) >= cursor):
                raise DataError(
                    f"{where}: the chat template ({self.description}) does not render the conversation "
                    f"incrementally at message {i} (a prefix renders differently), so the assistant tokens "
                    f"cannot be found; set data.chat_template = \"default\" or to a template file"
                )
            if len(prompt) > cursor:
                out.append((full[cursor : len(prompt)], False))
            if len(upto) > len(prompt):
                out.append((full[len(prompt) : len(upto)], True))
            cursor = len(upto)
        if cursor < len(full):
            out.append((full[cursor:], False))
        return out


def _tokenizer_dir(tokenizer_path: str | None) -> Path | None:
    if not tokenizer_path:
        return None
    p = Path(tokenizer_path)
    return p if p.is_dir() else p.parent


def chat_renderer(setting: str | None, tokenizer_path: str | None, eos_token: str | None) -> ChatRenderer:
    """The renderer of a run: template from ``data.chat_template`` / the tokenizer / the default.

    Args:
        setting: ``data.chat_template``: None (the tokenizer's template, else the default), ``"default"``,
            or a path to a Jinja template file.
        tokenizer_path: ``data.tokenizer`` (a ``tokenizer.json`` file, or a directory); when its directory
            holds ``tokenizer_config.json`` it is loaded with ``AutoTokenizer`` (offline) for its template
            and special tokens.
        eos_token: the end-of-text token of the run's tokenizer (used when no ``tokenizer_config.json``).

    Raises:
        DataError: the template file does not exist, the tokenizer directory cannot be loaded, or the
            default template is needed and the tokenizer has no end-of-text token.
    """
    hf = None
    d = _tokenizer_dir(tokenizer_path)
    if d is not None and (d / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
            first = " ".join(str(e).split())[:200]
            raise DataError(f"data.tokenizer {str(d)!r}: cannot load its tokenizer_config.json: {first}") from None
    if setting == "default":
        template, desc = DEFAULT_CHAT_TEMPLATE, "the default chat template"
    elif setting:
        p = Path(setting)
        if not p.is_file():
            raise DataError(f"data.chat_template {setting!r} does not exist (a Jinja file, or \"default\")")
        template, desc = p.read_text(encoding="utf-8"), f"chat template file {p}"
    elif hf is not None and getattr(hf, "chat_template", None):
        template = hf.chat_template
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default") or next(iter(template.values()))
        desc = f"the tokenizer's chat template ({d})"
    else:
        template, desc = DEFAULT_CHAT_TEMPLATE, "the default chat template (the tokenizer has none)"
    if hf is None:
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        # only the special tokens the template reads; rendering never touches the vocabulary
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), eos_token=eos_token)
    if template is DEFAULT_CHAT_TEMPLATE and not hf.eos_token:
        raise DataError(
            "the default chat template ends each assistant turn with the end-of-text token, and the tokenizer "
            "(data.tokenizer) has none; give a tokenizer with one, or a template file (data.chat_template)"
        )
    return ChatRenderer(template, desc, hf)


def encode_segments(tokenizer, conversations: list[list[tuple[str, bool]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Tokenize the pieces of each conversation (each piece on its own, no special tokens added).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        conversations: :meth:`ChatRenderer.segments` of each conversation.

    Returns:
        per conversation ``(ids, assistant)``: int64 token ids ``[L]`` and a bool mask ``[L]``, True on
        the tokens of assistant pieces.
    """
    flat = [text for segs in conversations for text, _ in segs]
    encs = tokenizer.encode_batch(flat, add_special_tokens=False) if flat else []
    out, k = [], 0
    for segs in conversations:
        ids, flags = [], []
        for _, is_assistant in segs:
            piece = encs[k].ids
            k += 1
            ids.extend(piece)
            flags.extend([is_assistant] * len(piece))
        out.append((np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=bool)))
    return out
