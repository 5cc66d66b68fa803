"""Chat data a new user gets wrong: samples cut away by data.seq_length, ShareGPT files, resuming on changed data."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fp8kit.base.errors import DataError
from fp8kit.config import DataConfig
from fp8kit.data.loader import PackedData
from fp8kit.data.prepare import prepare_data
from fp8kit.data.sft import SFTData

# ~51 tokens under the default template with the BPE these tests train; the assistant turn starts at token ~45
LONG_PROMPT = "Please read this question with care and then answer it in one short sentence: what is {i} plus {i}?"


def _write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _long(i: int) -> dict:
    return {"messages": [{"role": "user", "content": LONG_PROMPT.format(i=i)},
                         {"role": "assistant", "content": f"It is {2 * i}."}]}


def _prep(path, tmp_path, seq_length, **kw):
    return prepare_data(DataConfig(format="chat", paths=[str(path)], seq_length=seq_length, vocab_size=320,
                                   cache_dir=str(tmp_path / "cache"), **kw), micro_batch_size=1, seed=0)


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# -- 1. every sample too long for data.seq_length ----------------------------------------------------------


def test_all_records_cut_away_says_raise_seq_length(tmp_path):
    path = _write_jsonl(tmp_path / "long.jsonl", [_long(i) for i in range(40)])
    with pytest.raises(DataError) as e:
        _prep(path, tmp_path, 24)
    msg = _one_line(e)
    want = ("all 40 records with an assistant turn lost it to the cut at data.seq_length = 24 "
            "(no assistant token in their first 25 tokens): raise data.seq_length")
    assert msg == want, f"got:  {msg}\nwant: {want}"
    # the same data at a length that keeps the assistant turns trains
    ok = _prep(path, tmp_path, 64, val_fraction=0.5)
    assert ok.chat["samples"] == 40 and ok.chat["truncated_away"] == 0, ok.chat


def test_most_records_cut_away_says_raise_seq_length(tmp_path):
    """30 long records lose their assistant turn at seq_length 24, 3 short ones survive: too few rows, and the
    advice is to raise data.seq_length, never to lower it."""
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there, friend!"}]}
    path = _write_jsonl(tmp_path / "mixed.jsonl", [_long(i) for i in range(30)] + [short] * 3)
    with pytest.raises(DataError) as e:
        _prep(path, tmp_path, 24)
    msg = _one_line(e)
    assert msg.startswith("the chat data is too small: 30 of its 33 records lost their assistant turn to the cut "
                          "at data.seq_length = 24, and the 3 samples make "), msg
    assert msg.endswith("; raise data.seq_length") and "lower" not in msg, msg


def test_too_small_without_cut_gives_advice_that_fits_the_layout():
    """Nothing cut away: packed rows can be made shorter; one sample per row (pack = false) cannot gain rows
    from a shorter data.seq_length, so only the micro-batch is named."""
    samples = [(np.arange(10) % 300, np.ones(10, dtype=bool))] * 3
    with pytest.raises(DataError) as e:
        SFTData(samples, 16, 0.5, 4, 0, pack=False, pad_id=0)
    msg = _one_line(e)
    assert msg.endswith("add data or lower train.micro_batch_size (data.pack = false: one sample per row)"), msg
    with pytest.raises(DataError) as e:
        SFTData(samples, 16, 0.5, 4, 0, pack=True, pad_id=0)
    msg = _one_line(e)
    assert msg.endswith("add data or lower data.seq_length / train.micro_batch_size"), msg


def test_token_count_is_after_the_cut(tmp_path):
    """Every record is longer than 41 tokens and learns from its first ones: at seq_length 40 each sample is
    cut to 41 tokens, and the reported count is 41 x samples; the count before the cut is the uncut run's."""
    recs = [{"messages": [{"role": "user", "content": f"Q{i}"},
                          {"role": "assistant", "content": f"Answer {i}: hello there, friend! " * 4}]} for i in range(20)]
    path = _write_jsonl(tmp_path / "a.jsonl", recs)
    uncut = _prep(path, tmp_path, 256, val_fraction=0.5)
    assert uncut.chat["truncated"] == 0 and uncut.num_tokens > 20 * 41, (uncut.chat, uncut.num_tokens)
    cut = _prep(path, tmp_path, 40, val_fraction=0.5)
    c = cut.chat
    assert (c["truncated"], c["truncated_away"], c["samples"]) == (20, 0, 20), c
    assert cut.num_tokens == c["tokens"] == 20 * 41, f"reported {cut.num_tokens} tokens, expected 20 x 41 = {20 * 41}"
    assert c["tokens_before_cut"] == uncut.num_tokens, (c["tokens_before_cut"], uncut.num_tokens)
    want = f"20 cut to their first 41 tokens (data.seq_length + 1; {uncut.num_tokens:,} tokens before the cut)"
    assert want in cut.corpus, cut.corpus


# -- 2. ShareGPT files -------------------------------------------------------------------------------------


def _sharegpt(i: int) -> dict:
    return {"conversations": [{"from": "human", "value": f"What is {i} squared?"},
                              {"from": "gpt", "value": f"It is {i * i}."}]}


def _as_messages(rec: dict) -> dict:
    roles = {"human": "user", "gpt": "assistant"}
    return {"messages": [{"role": roles[m["from"]], "content": m["value"]} for m in rec["conversations"]]}


def test_sharegpt_file_reads_out_of_the_box(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = [_sharegpt(i) for i in range(12)]
    share = _write_jsonl(tmp_path / "sharegpt.jsonl", recs)
    msgs = _write_jsonl(tmp_path / "messages.jsonl", [_as_messages(r) for r in recs])
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "sharegpt.parquet")
    runs = {name: _prep(p, tmp_path, 64, val_fraction=0.5)
            for name, p in [("messages", msgs), ("sharegpt", share), ("parquet", tmp_path / "sharegpt.parquet")]}
    explicit = _prep(share, tmp_path, 64, val_fraction=0.5, messages_field="conversations")
    want = runs["messages"].packed.next_batch(4)
    for name, run in [*runs.items(), ("explicit", explicit)]:
        assert run.chat["samples"] == 12, (name, run.chat)
        if name != "messages":
            got = run.packed.next_batch(4)
            assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.labels, want.labels), name


def test_explicit_messages_field_is_authoritative_and_errors_name_conversations(tmp_path):
    share = _write_jsonl(tmp_path / "sharegpt.jsonl", [_sharegpt(i) for i in range(6)])
    with pytest.raises(DataError) as e:
        _prep(share, tmp_path, 64, messages_field="dialog")
    msg = _one_line(e)
    want = "sharegpt.jsonl:1: no field 'dialog' and no alpaca 'instruction' (set data.messages_field)"
    assert msg.endswith(want), msg
    # a record with both: the default reads 'messages'
    both = dict(_sharegpt(1), messages=[{"role": "user", "content": "from messages"},
                                        {"role": "assistant", "content": "yes"}])
    run = _prep(_write_jsonl(tmp_path / "both.jsonl", [both] * 4), tmp_path, 64, val_fraction=0.5)
    text = run.tokenizer_obj.decode(run.packed.next_batch(1).input_ids[0].tolist(), skip_special_tokens=False)
    assert "from messages" in text and "squared" not in text, text
    # neither: the default's error names ShareGPT's field too
    with pytest.raises(DataError) as e:
        _prep(_write_jsonl(tmp_path / "plain.jsonl", [{"text": "x"}]), tmp_path, 64)
    msg = _one_line(e)
    want = "plain.jsonl:1: no field 'messages' (or ShareGPT's 'conversations') and no alpaca 'instruction' "
    assert want in msg, msg


# -- 3. resuming with a saved data position that does not fit the data -------------------------------------


def _samples(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.arange(k % 30 + 2) % 300, np.ones(k % 30 + 2, dtype=bool)) for k in range(n)]


def test_sft_resume_past_the_data_is_a_one_line_error():
    big = SFTData(_samples(60), 48, 0.5, 1, 0, pack=False, pad_id=0)
    for _ in range(24):
        big.next_batch(1)
    saved = big.state_dict()
    assert saved == {"epoch": 0, "cursor": 24}, saved
    small = SFTData(_samples(20), 48, 0.5, 1, 0, pack=False, pad_id=0)
    assert len(small.train_rows) == 10, len(small.train_rows)
    with pytest.raises(DataError) as e:
        small.load_state_dict(saved)
    msg = _one_line(e)
    want = ("the saved data cursor 24 (epoch 0) is not a position of this data's 10 training rows: the run's data "
            "(data.paths, or data.seq_length / data.val_fraction) changed since the checkpoint")
    assert msg.startswith(want), msg
    # a position that fits resumes, and the next batch is the one the saved run would have had
    again = SFTData(_samples(60), 48, 0.5, 1, 0, pack=False, pad_id=0)
    again.load_state_dict(saved)
    assert torch.equal(again.next_batch(2).input_ids, big.next_batch(2).input_ids)


def test_text_resume_past_the_data_is_a_one_line_error():
    tokens = np.arange(65 * 40) % 500
    big = PackedData(tokens, 64, 0.5, 1, 0)
    for _ in range(15):
        big.next_batch(1)
    saved = big.state_dict()
    small = PackedData(tokens[: 65 * 10], 64, 0.5, 1, 0)
    assert len(small.train_windows) == 5, len(small.train_windows)
    with pytest.raises(DataError) as e:
        small.load_state_dict(saved)
    msg = _one_line(e)
    assert msg.startswith("the saved data cursor 15 (epoch 0) is not a position of this data's 5 training "
                          "sequences: "), msg
    again = PackedData(tokens, 64, 0.5, 1, 0)
    again.load_state_dict(saved)
    assert torch.equal(again.next_batch(2), big.next_batch(2))
