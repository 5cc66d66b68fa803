"""``fp8kit export``: a single-process (safetensors) checkpoint -> plain BF16 HF model that transformers loads.

The DCP (distributed) checkpoint case is in tests/test_distributed.py (it needs the 2-rank run). A chat run's
export carries the chat template it trained with; bad input is in tests/test_export_errors.py.
"""

from __future__ import annotations

import json

import torch

from fp8kit.cli.main import main
from fp8kit.config import load_config, save_config
from fp8kit.train.trainer import train
from tests.conftest import assert_hf_logits_equal_run


def test_export_single_process_checkpoint(small_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # fp32 parameters: the export must still be bf16
        run = train(load_config(None, small_run + ["train.steps=2", "train.param_dtype=fp32"]), tmp_path / "run").out_dir
        assert main(["export", str(run), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
        assert "exported" in capsys.readouterr().out
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
        assert_hf_logits_equal_run(hf, run)
        # the weights are as readable as the config beside them (safetensors alone writes 0600), in the export
        # and in the run's checkpoint
        for d in (tmp_path / "hf", next((run / "checkpoints").iterdir())):
            modes = {f.name: oct(f.stat().st_mode & 0o777) for f in d.iterdir() if f.is_file()}
            want = modes["config.json" if "config.json" in modes else "train_state.pt"]
            assert set(modes.values()) == {want}, f"{d}: file modes {modes}"
        # a second export into the same, now non-empty, directory is refused in one line
        assert main(["export", str(run), str(tmp_path / "hf")]) == 2
        assert "exists and is not empty" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


# A conversation and its text under fp8kit's default template (EOS <|endoftext|>), written out by hand.
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
]
CONV_DEFAULT = ("<|system|>\nBe brief.\n<|user|>\nWhat is two plus two?\n<|assistant|>\nFour.<|endoftext|>"
                "<|user|>\nAnd three plus three?\n<|assistant|>\n")


def _chat_records(path):
    recs = [{"messages": [{"role": "user", "content": f"What is {i} squared?"},
                          {"role": "assistant", "content": f"It is {i * i}."}]} for i in range(64)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def _one_error_line(err: str) -> str:
    """The CLI's one ``error: ...`` line of ``err`` (transformers' progress bars may come before it)."""
    lines = err.strip().splitlines()
    assert [ln for ln in lines if "error" in ln.lower()] == lines[-1:] and lines[-1].startswith("error: "), err
    return lines[-1]


def test_export_of_a_chat_run_carries_the_chat_template_it_trained_with(small_run, tmp_path, capsys):
    """A chat run on fp8kit's BPE and default template: the exported tokenizer's apply_chat_template renders the
    training format; an export of a run from before the template was saved adds it; a failure leaves nothing."""
    from transformers import AutoTokenizer

    from fp8kit.data.chat import chat_renderer
    from fp8kit.data.tokenizer import EOS_TOKEN

    data = _chat_records(tmp_path / "sft.jsonl")
    cfg = load_config(None, [*small_run, "data.format=chat", f'data.paths=["{data}"]', "data.vocab_size=320",
                             "train.steps=1", "train.eval_every=0"])
    run = train(cfg, tmp_path / "run").out_dir
    ours = chat_renderer("default", None, EOS_TOKEN).render(CONV, True, "test")
    assert ours == CONV_DEFAULT, ours  # fp8kit's template renders the text written out above

    assert main(["export", str(run), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    got = tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    assert got == CONV_DEFAULT, got
    got = tok.apply_chat_template(CONV[:3], tokenize=False)  # ends with the learnt answer and EOS
    assert got == CONV_DEFAULT[: CONV_DEFAULT.index("<|user|>\nAnd")], got

    # a chat run from before the template was saved with the run's tokenizer: the export adds the default one
    (run / "tokenizer" / "chat_template.jinja").unlink()
    assert main(["export", str(run), str(tmp_path / "hf2")]) == 0, capsys.readouterr().err
    got = AutoTokenizer.from_pretrained(tmp_path / "hf2").apply_chat_template(CONV, tokenize=False,
                                                                                add_generation_prompt=True)
    assert got == CONV_DEFAULT, got

    # ... unless its template file is gone: one line naming it, and nothing written
    gone = tmp_path / "gone.jinja"
    other = load_config(str(run / "resolved_config.toml"), [f"data.chat_template={gone}"])
    save_config(other, tmp_path / "other.toml")
    capsys.readouterr()
    out = tmp_path / "new" / "deeper" / "hf3"
    assert main(["export", str(run), str(out), "--config", str(tmp_path / "other.toml")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"data.chat_template {str(gone)!r} does not exist" in line, line
    assert not (tmp_path / "new").exists(), sorted(p.name for p in (tmp_path / "new").rglob("*"))


def test_chat_template_file_replaces_the_pretrained_tokenizers_in_the_run_tokenizer(tmp_path):
    """data.chat_template = FILE over a pretrained tokenizer with its own template: the run's tokenizer files
    (what the export copies) carry FILE's template; without data.chat_template they are the source's, as they are."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from fp8kit.config import DataConfig
    from fp8kit.data.tokenizer import EOS_TOKEN, load_tokenizer_file, train_bpe
    from fp8kit.train.export import run_chat_template, save_run_tokenizer

    chatml = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    bpe = train_bpe([CONV_DEFAULT] * 20, 300)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN, chat_template=chatml).save_pretrained(
        tmp_path / "pretrained")
    hashes = "{% for m in messages %}{{ '### ' + m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    (tmp_path / "hashes.jinja").write_text(hashes)
    data = _chat_records(tmp_path / "sft.jsonl")
    tok, _ = load_tokenizer_file(tmp_path / "pretrained")

    for setting, want in [(str(tmp_path / "hashes.jinja"),
                           "### system: Be brief.\n### user: What is two plus two?\n### assistant: Four.\n"
                           "### user: And three plus three?\n"),
                          (None, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is two plus two?"
                                 "<|im_end|>\n<|im_start|>assistant\nFour.<|im_end|>\n<|im_start|>user\n"
                                 "And three plus three?<|im_end|>\n")]:
        dcfg = DataConfig(format="chat", paths=[data], tokenizer=str(tmp_path / "pretrained"), chat_template=setting)
        out = save_run_tokenizer(tok, dcfg.tokenizer, tmp_path / f"run-{setting is None}" / "tokenizer",
                                 chat_template=run_chat_template(dcfg, tok))
        got = AutoTokenizer.from_pretrained(out).apply_chat_template(CONV, tokenize=False)
        assert got == want, f"data.chat_template={setting}: {got!r}"
    # the template came from the tokenizer: its files as they are; and the source is never changed
    for f in (tmp_path / "pretrained").iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name
    assert AutoTokenizer.from_pretrained(tmp_path / "pretrained").chat_template == chatml
