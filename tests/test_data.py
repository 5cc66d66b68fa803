"""Corpus, tokenizer cache, packing, split and the resumable batch order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fp8kit.base.errors import DataError
from fp8kit.config import DataConfig
from fp8kit.data.corpus import load_corpus, stdlib_files
from fp8kit.data.loader import PackedData
from fp8kit.data.prepare import prepare_data


def test_default_corpus_is_the_stdlib():
    root, files = stdlib_files()
    corpus = load_corpus([])
    assert len(corpus.texts) == len(files) > 300
    assert 5e6 < corpus.num_bytes < 40e6, corpus.num_bytes
    assert any(n == "json/decoder.py" for n in corpus.names)
    assert not any("site-packages" in n or n.startswith("test/") for n in corpus.names)
    skipped = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    nested = [n for n in corpus.names if skipped & set(n.split("/")[:-1])]
    assert not nested, f"files under skipped directories: {nested[:5]}"
    assert {"unittest/case.py", "json/decoder.py", "os.py"} <= set(corpus.names)  # "unittest" is not "test"


def test_text_jsonl_and_globs(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "b.txt").write_text("second file\n")
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "one"}) + "\n\n" + json.dumps({"body": "two"}) + "\n")
    c = load_corpus([str(tmp_path / "*.txt"), str(tmp_path / "d.jsonl")], text_field="body")
    assert c.texts == ["hello world\n", "second file\n", "one", "two"]
    assert c.names[-1].endswith("d.jsonl:3")
    with pytest.raises(DataError, match=r"d\.jsonl:1: no field 'text'"):
        load_corpus([str(tmp_path / "d.jsonl")])
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(DataError, match=r"bad\.jsonl:1: invalid JSON"):
        load_corpus([str(tmp_path / "bad.jsonl")])


def test_tokenizer_is_cached_and_round_trips(cache_dir):
    cfg = DataConfig(seq_length=64, vocab_size=1024, cache_dir=str(cache_dir))
    a = prepare_data(cfg, micro_batch_size=4, seed=0)
    b = prepare_data(cfg, micro_batch_size=4, seed=0)
    assert "cached" in b.tokenizer
    assert a.num_tokens == b.num_tokens > 2_000_000
    tok = b.tokenizer_obj
    text = "def f(x):\n    return x + 1  # ünïcode\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.get_vocab_size() <= 1024


def test_bin_token_files(tmp_path):
    toks = (np.arange(5000) % 700).astype(np.uint16)
    toks.tofile(tmp_path / "t.bin")
    data = prepare_data(DataConfig(paths=[str(tmp_path / "t.bin")], seq_length=32, vocab_size=700), micro_batch_size=2, seed=0)
    assert data.num_tokens == 5000
    batch = data.packed.next_batch(2)
    assert batch.shape == (2, 33)
    with pytest.raises(DataError, match="token id 699, which does not fit data.vocab_size = 600"):
        prepare_data(DataConfig(paths=[str(tmp_path / "t.bin")], vocab_size=600), micro_batch_size=2, seed=0)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="not a multiple of 2"):
        prepare_data(DataConfig(paths=[str(tmp_path / "odd.bin")]), micro_batch_size=2, seed=0)


def test_split_is_disjoint_and_order_resumes():
    tokens = np.arange(100 * 17, dtype=np.int64)
    data = PackedData(tokens, seq_length=16, val_fraction=0.1, micro_batch_size=3, seed=5)
    assert set(data.train_windows).isdisjoint(data.val_windows)
    assert len(data.val_windows) == 10 and len(data.train_windows) == 90
    first = [data.next_batch(3) for _ in range(40)]  # crosses an epoch boundary (90 windows)
    assert data.state.epoch == 1
    again = PackedData(tokens, seq_length=16, val_fraction=0.1, micro_batch_size=3, seed=5)
    for _ in range(17):
        again.next_batch(3)
    resumed = PackedData(tokens, seq_length=16, val_fraction=0.1, micro_batch_size=3, seed=5)
    resumed.load_state_dict(again.state_dict())
    for i in range(17, 40):
        assert (resumed.next_batch(3) == first[i]).all()
    # windows are contiguous slices of the stream: labels are inputs shifted by one
    b = first[0]
    assert (b[:, 1:] - b[:, :-1] == 1).all()
    other_seed = PackedData(tokens, seq_length=16, val_fraction=0.1, micro_batch_size=3, seed=6)
    assert not (other_seed.next_batch(3) == first[0]).all()


def test_sequence_longer_than_corpus(tmp_path):
    (tmp_path / "small.txt").write_text("x = 1\n" * 50)
    cfg = DataConfig(paths=[str(tmp_path / "small.txt")], seq_length=4096, vocab_size=300, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match="data.seq_length = 4096 is too long for the corpus"):
        prepare_data(cfg, micro_batch_size=2, seed=0)


def test_user_tokenizer_file(tmp_path, cache_dir):
    trained = prepare_data(DataConfig(seq_length=64, vocab_size=1024, cache_dir=str(cache_dir)), micro_batch_size=4, seed=0)
    path = tmp_path / "tokenizer.json"
    trained.tokenizer_obj.save(str(path))
    (tmp_path / "doc.txt").write_text("def add(a, b):\n    return a + b\n" * 400)
    data = prepare_data(DataConfig(paths=[str(tmp_path / "doc.txt")], seq_length=32, vocab_size=1024,
                                   tokenizer=str(path), cache_dir=str(tmp_path / "c")), micro_batch_size=2, seed=0)
    assert data.tokenizer == f"tokenizer file {path}"
    with pytest.raises(DataError, match="tokenizer.json' has 1024 tokens, more than data.vocab_size = 512"):
        prepare_data(DataConfig(paths=[str(tmp_path / "doc.txt")], vocab_size=512, tokenizer=str(path),
                                cache_dir=str(tmp_path / "c")), micro_batch_size=2, seed=0)
    with pytest.raises(DataError, match="does not exist"):
        prepare_data(DataConfig(tokenizer=str(tmp_path / "nope.json")), micro_batch_size=2, seed=0)
