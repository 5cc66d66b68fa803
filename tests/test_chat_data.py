"""Fine-tuning data: chat / alpaca records, assistant-only labels, packing without leaks, bad input, a tiny SFT run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fp8kit.base.errors import DataError
from fp8kit.config import DataConfig, ModelConfig, load_config
from fp8kit.data.chat import ChatStats, chat_renderer, encode_segments, to_messages
from fp8kit.data.prepare import prepare_data
from fp8kit.data.sft import IGNORE_INDEX, SFTData, pack_best_fit
from fp8kit.data.tokenizer import EOS_TOKEN, train_bpe

EOS = EOS_TOKEN
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six."},
]
# CONV under the default template, cut by hand: (text, learnt?)
CONV_PIECES = [
    ("<|system|>\nBe brief.\n<|user|>\nWhat is two plus two?\n<|assistant|>\n", False),
    (f"Four.{EOS}", True),
    ("<|user|>\nAnd three plus three?\n<|assistant|>\n", False),
    (f"Six.{EOS}", True),
]


@pytest.fixture(scope="module")
def bpe():
    """A small byte-level BPE (EOS special) trained on chat-like text."""
    texts = ["".join(t for t, _ in CONV_PIECES)] * 20 + ["What is the sum of the numbers? The sum is 12."] * 20
    return train_bpe(texts, 320)


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _expected(tok, pieces):
    """Token ids and labels built independently of fp8kit's renderer: each hand-cut piece encoded on its own."""
    ids, learnt = [], []
    for text, is_answer in pieces:
        piece = tok.encode(text, add_special_tokens=False).ids
        ids += piece
        learnt += [is_answer] * len(piece)
    labels = [ids[j + 1] if learnt[j + 1] else IGNORE_INDEX for j in range(len(ids) - 1)]
    return ids[:-1], labels


def _row(tok, pieces_or_conv, seq_length=64):
    renderer = chat_renderer("default", None, EOS)
    segs = renderer.segments(pieces_or_conv, "test")
    (ids, mask), = encode_segments(tok, [segs])
    data = SFTData([(ids, mask), (ids, mask)], seq_length, 0.5, 1, 0, pack=False, pad_id=0)
    b = data._batch([[0]])
    n = len(ids) - 1
    return b.input_ids[0, :n].tolist(), b.labels[0].tolist(), n


def test_chat_labels_are_masked_exactly_on_prompt_and_template_tokens(bpe):
    inputs, labels, n = _row(bpe, CONV)
    want_inputs, want_labels = _expected(bpe, CONV_PIECES)
    assert inputs == want_inputs
    for j, (got, want) in enumerate(zip(labels[:n], want_labels, strict=True)):
        assert got == want, f"position {j} (input {bpe.id_to_token(inputs[j])!r}): label {got}, expected {want}"
    assert labels[n:] == [IGNORE_INDEX] * (64 - n), "padding must not be learnt"
    learnt = [t for t in labels if t != IGNORE_INDEX]
    assert bpe.decode(learnt, skip_special_tokens=False) == f"Four.{EOS}Six.{EOS}"
    # as many masked labels as prompt/template tokens (less the first token, which is never a label)
    n_prompt_tokens = sum(len(bpe.encode(t, add_special_tokens=False).ids) for t, a in CONV_PIECES if not a)
    assert labels[:n].count(IGNORE_INDEX) == n_prompt_tokens - 1


def test_alpaca_records(bpe):
    stats = ChatStats()
    rec = {"instruction": "Add the numbers.", "input": "5 and 7", "output": "12", "system": "Be exact.",
           "history": [["Hi", "Hello."]]}
    msgs = to_messages(rec, "f:1", "messages", stats)
    assert msgs == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Add the numbers.\n5 and 7"},  # LLaMA-Factory: instruction + "\n" + input
        {"role": "assistant", "content": "12"},
    ]
    assert to_messages({"instruction": "Say hi.", "input": "", "output": "hi"}, "f:2", "messages", stats)[0] == {
        "role": "user", "content": "Say hi."}
    assert stats.alpaca == 2 and stats.records == 2
    pieces = [("<|system|>\nBe exact.\n<|user|>\nHi\n<|assistant|>\n", False), (f"Hello.{EOS}", True),
              ("<|user|>\nAdd the numbers.\n5 and 7\n<|assistant|>\n", False), (f"12{EOS}", True)]
    inputs, labels, n = _row(bpe, msgs)
    want_inputs, want_labels = _expected(bpe, pieces)
    assert inputs == want_inputs and labels[:n] == want_labels, f"labels {labels[:n]}\nexpected {want_labels}"


def test_records_without_assistant_are_skipped_and_counted(tmp_path):
    recs = [
        {"messages": CONV},
        {"messages": [{"role": "user", "content": "nobody answers"}]},
        {"instruction": "no output here"},
        {"messages": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                      {"from": "human", "value": "trailing question, dropped"}]},
    ] * 6
    path = _write_jsonl(tmp_path / "chat.jsonl", recs)
    data = prepare_data(DataConfig(format="chat", paths=[path], seq_length=64, vocab_size=320, val_fraction=0.5,
                                   cache_dir=str(tmp_path / "c")), micro_batch_size=1, seed=0)
    c = data.chat
    assert (c["records"], c["no_assistant"], c["samples"], c["alpaca"]) == (24, 12, 12, 6), c
    assert "12 skipped (no assistant turn)" in data.corpus
    tok = data.tokenizer_obj
    texts = [tok.decode(b.input_ids[0].tolist(), skip_special_tokens=False) for b in data.packed.val_batches(1, 99)]
    assert not any("trailing question" in t for t in texts) and any("<|user|>\nHi\n" in t for t in texts)


def test_chat_template_of_the_tokenizer(tmp_path, bpe):
    from transformers import PreTrainedTokenizerFast

    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, chat_template=chatml)
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.save_pretrained(tmp_path / "tok")
    renderer = chat_renderer(None, str(tmp_path / "tok" / "tokenizer.json"), EOS)
    assert "the tokenizer's chat template" in renderer.description
    segs = renderer.segments(CONV[1:3], "t")
    assert segs == [("<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n", False),
                    ("Four.<|im_end|>\n", True)]
    assert chat_renderer("default", str(tmp_path / "tok"), EOS).segments(CONV[1:3], "t")[1] == (f"Four.{EOS}", True)
    # the whole path with a tokenizer directory (as model.pretrained sets data.tokenizer)
    path = _write_jsonl(tmp_path / "c.jsonl", [{"messages": CONV}] * 4)
    data = prepare_data(DataConfig(format="chat", paths=[path], seq_length=64, vocab_size=512, val_fraction=0.5,
                                   tokenizer=str(tmp_path / "tok"), cache_dir=str(tmp_path / "c")),
                        micro_batch_size=1, seed=0)
    labels = data.packed.next_batch(1).labels[0]
    learnt = data.tokenizer_obj.decode(labels[labels != IGNORE_INDEX].tolist(), skip_special_tokens=False)
    assert learnt == "Four.<|im_end|>\nSix.<|im_end|>\n", learnt
    assert "the tokenizer's chat template" in data.corpus
    with pytest.raises(DataError, match=r"data.chat_template '.*nope.jinja' does not exist"):
        chat_renderer(str(tmp_path / "nope.jinja"), None, EOS)


def test_template_that_is_not_incremental_is_refused(tmp_path):
    # renders only the last assistant turn: a prefix renders differently from the full conversation
    (tmp_path / "t.jinja").write_text("{{ messages[-1]['content'] }}")
    r = chat_renderer(str(tmp_path / "t.jinja"), None, EOS)
    with pytest.raises(DataError, match=r"^rec:7: the chat template .* does not render the conversation incrementally"):
        r.segments(CONV, "rec:7")


def _assert_one_line_and_nothing_written(e: pytest.ExceptionInfo, cache):
    assert "\n" not in str(e.value), str(e.value)
    assert not cache.exists(), f"written on error: {list(cache.rglob('*'))}"


def test_bad_input_is_one_line_naming_file_and_line(tmp_path):
    cache = tmp_path / "cache"

    def prep(path, **kw):
        return prepare_data(DataConfig(format="chat", paths=[str(path)], seq_length=64, vocab_size=320,
                                       cache_dir=str(cache), **kw), micro_batch_size=1, seed=0)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONV}) + "\n\n" + '{"messages": [}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON") as e:
        prep(bad)
    _assert_one_line_and_nothing_written(e, cache)

    role = tmp_path / "role.jsonl"
    _write_jsonl(role, [{"messages": CONV}, {"messages": [{"role": "user", "content": "x"},
                                                          {"role": "bot", "content": "y"}]}])
    with pytest.raises(DataError, match=r"role\.jsonl:2: unknown role 'bot' in messages\[1\]") as e:
        prep(role)
    _assert_one_line_and_nothing_written(e, cache)

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"conversation": [json.dumps(CONV)], "id": [1]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=r"t\.parquet: no column 'messages' .*columns: conversation, id") as e:
        prep(tmp_path / "t.parquet")
    _assert_one_line_and_nothing_written(e, cache)
    with pytest.raises(DataError, match=r"t\.parquet: no column 'body' \(columns: conversation, id; set data.text_field\)"):
        prepare_data(DataConfig(paths=[str(tmp_path / "t.parquet")], text_field="body", cache_dir=str(cache)),
                     micro_batch_size=1, seed=0)
    assert not cache.exists()

    with pytest.raises(DataError, match=r"no field 'messages' \(or ShareGPT's 'conversations'\) and no alpaca 'instruction'"):
        prep(_write_jsonl(tmp_path / "other.jsonl", [{"text": "plain"}]))
    with pytest.raises(DataError, match=r"notes\.txt'.*reads \.jsonl, \.json or \.parquet"):
        (tmp_path / "notes.txt").write_text("hi")
        prep(tmp_path / "notes.txt")


def test_parquet_and_json_read_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = [{"messages": CONV}, {"messages": CONV[1:3]}] * 4
    jsonl = _write_jsonl(tmp_path / "a.jsonl", recs)
    (tmp_path / "a.json").write_text(json.dumps(recs))  # a JSON array, the alpaca_data.json layout
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "a.parquet")  # messages: list<struct<role, content>>
    kw = dict(format="chat", seq_length=64, vocab_size=320, val_fraction=0.5, cache_dir=str(tmp_path / "c"))
    runs = [prepare_data(DataConfig(paths=[p], **kw), micro_batch_size=1, seed=0)
            for p in (jsonl, str(tmp_path / "a.json"), str(tmp_path / "a.parquet"))]
    batches = [r.packed.next_batch(2) for r in runs]
    for b in batches[1:]:
        assert torch.equal(b.input_ids, batches[0].input_ids) and torch.equal(b.labels, batches[0].labels)
    # text format (pretraining) reads a parquet column and a JSON array too
    pq.write_table(pa.table({"body": ["def f():\n    return 1\n" * 50] * 4}), tmp_path / "t.parquet")
    (tmp_path / "t.json").write_text(json.dumps([{"body": "x = 1\n" * 100}]))
    from fp8kit.data.corpus import load_corpus

    corpus = load_corpus([str(tmp_path / "t.parquet"), str(tmp_path / "t.json")], text_field="body")
    assert len(corpus.texts) == 5 and corpus.names[0].endswith("t.parquet:row 1") and corpus.names[4].endswith("t.json[0]")


def test_best_fit_packing_places_every_sample_once():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, size=500).tolist()
    rows = pack_best_fit(lengths, 256)
    assert sorted(i for r in rows for i in r) == list(range(500))
    assert max(sum(lengths[i] for i in r) for r in rows) <= 256
    fill = sum(lengths) / (len(rows) * 256)
    assert fill > 0.95, f"best-fit decreasing filled only {fill:.3f} of the rows"


def test_packed_rows_do_not_leak_between_samples(bpe):
    """A packed row gives each sample the same logits as that sample alone (position ids restart per
    sample and transformers masks attention per sample); without the position ids it does not."""
    from fp8kit.models.build import build_model

    samples = []
    for n in (9, 14, 6):
        ids = torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)).numpy()
        samples.append((ids, np.ones(n, dtype=bool)))
    data = SFTData(samples + samples, 32, 0.5, 1, 0, pack=True, pad_id=0)
    row = next(r for r in data.train_rows if len(r) >= 2)
    batch = data._batch([row])
    assert batch.position_ids[0, :9].tolist() == list(range(9))  # the first sample is the longest (14 -> 13)
    model = build_model(ModelConfig(num_layers=2), 320, device=torch.device("cpu"), dtype=torch.float32, seed=0).eval()
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, **batch.model_kwargs()).logits[0]
        leaky = model(input_ids=batch.input_ids).logits[0]
        c, worst, worst_leaky = 0, 0.0, 0.0
        for s in row:
            ids = torch.as_tensor(data._ids[data._off[s] : data._off[s + 1] - 1])[None]
            alone = model(input_ids=ids).logits[0]
            worst = max(worst, (packed[c : c + len(alone)] - alone).abs().max().item())
            worst_leaky = max(worst_leaky, (leaky[c : c + len(alone)] - alone).abs().max().item())
            c += len(alone)
    assert worst < 1e-4, f"packed logits differ from per-sample logits by {worst}"
    assert worst_leaky > 1e-2, f"the check cannot fail: without position ids the difference is only {worst_leaky}"


def test_loss_is_the_mean_over_assistant_tokens_of_the_step(bpe):
    """CE ignores -100 and averages over the others; the token-weighted accumulation of two micro-batches
    equals the loss of both as one batch."""
    from fp8kit.train.loop import _loss_scales
    from fp8kit.train.setup import cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[1, -100, 3, -100, -100], [-100, -100, -100, -100, 7]])
    keep = labels != -100
    manual = -torch.log_softmax(logits, -1)[keep].gather(-1, labels[keep][:, None]).mean()
    got = cross_entropy(logits, labels).item()
    assert abs(got - manual.item()) < 1e-5, f"cross_entropy {got} != mean over the learnt labels {manual.item()}"

    samples = [(np.arange(n) % 300, np.arange(n) % 2 == 0) for n in (30, 8, 12, 25, 6, 9)]
    data = SFTData(samples, 32, 0.5, 1, 0, pack=False, pad_id=0)
    micro = [data.next_batch(1), data.next_batch(2)]

    class _One:  # the single-process parts of Setup that _loss_scales reads
        distributed = False

    scales, total = _loss_scales(_One(), micro)
    assert total == sum(b.num_supervised for b in micro) and abs(sum(scales) - 1) < 1e-12
    model = torch.nn.Sequential(torch.nn.Embedding(300, 300))
    per = [cross_entropy(model(b.input_ids), b.labels) * w for b, w in zip(micro, scales, strict=True)]
    pad = torch.full((1, 32), -100)
    both_ids = torch.cat([torch.cat([micro[0].input_ids, torch.zeros_like(micro[0].input_ids)]), micro[1].input_ids])
    both_labels = torch.cat([torch.cat([micro[0].labels, pad]), micro[1].labels])
    got, want = sum(per).item(), cross_entropy(model(both_ids), both_labels).item()
    assert abs(got - want) < 1e-5, f"token-weighted accumulation {got} != loss of the whole step {want}"


def test_sft_order_resumes(bpe):
    samples = [(np.arange(n) % 300, np.ones(n, dtype=bool)) for n in range(2, 40)]
    a = SFTData(samples, 48, 0.2, 2, 3, pack=True, pad_id=0)
    first = [a.next_batch(2) for _ in range(12)]
    b = SFTData(samples, 48, 0.2, 2, 3, pack=True, pad_id=0)
    for _ in range(5):
        b.next_batch(2)
    c = SFTData(samples, 48, 0.2, 2, 3, pack=True, pad_id=0)
    c.load_state_dict(b.state_dict())
    for i in range(5, 12):
        nb = c.next_batch(2)
        assert torch.equal(nb.input_ids, first[i].input_ids) and torch.equal(nb.position_ids, first[i].position_ids)


@pytest.mark.slow
def test_tiny_sft_run(tmp_path, small_run):
    recs = []
    for i in range(120):
        if i % 4 == 0:
            recs.append({"instruction": f"Add {i} and {i + 1}.", "output": f"The sum is {2 * i + 1}."})
        elif i % 10 == 1:
            recs.append({"messages": [{"role": "user", "content": "unanswered"}]})
        else:
            recs.append({"messages": [{"role": "user", "content": f"What is {i} squared?"},
                                      {"role": "assistant", "content": f"It is {i * i}."}]})
    path = _write_jsonl(tmp_path / "sft.jsonl", recs)
    from fp8kit.train.trainer import train

    cfg = load_config(None, [*small_run, "data.format=chat", f'data.paths=["{path}"]', "data.vocab_size=320",
                             "train.steps=5", "train.grad_accum=2", "train.eval_every=5", "train.eval_batches=2",
                             "train.checkpoint_every=0", "train.final_checkpoint=false"])
    res = train(cfg, tmp_path / "run")
    m = res.metrics
    assert len(m) == 5 and all(np.isfinite(r["loss"]) for r in m), [r["loss"] for r in m]
    assert all(0 < r["supervised_tokens"] < 2 * 4 * 64 for r in m), [r["supervised_tokens"] for r in m]
    assert np.isfinite(m[-1]["val_loss"])
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["chat"]["no_assistant"] == 12 and info["chat"]["records"] == 120, info["chat"]
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "| chat records | 108 trained of 120: 12 skipped (no assistant turn)" in summary, summary
    assert res.summary["supervised_tokens"] == sum(r["supervised_tokens"] for r in m)
