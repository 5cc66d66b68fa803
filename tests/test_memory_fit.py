"""The memory check before a one-process run builds its model (``fp8kit.train.memory_fit``)."""

from __future__ import annotations

import pytest
import torch

from fp8kit.base.errors import CapabilityError
from fp8kit.config import load_config
from fp8kit.config.optim_choice import resolve_optimizer
from fp8kit.models.build import build_hf_config
from fp8kit.optim import FP8AdamW, FP8AdamWPrecision
from fp8kit.train.memory_fit import GIB, activation_bytes, check_state_fits, state_bytes_per_param


def _resolved(*sets: str):
    cfg, _choice = resolve_optimizer(load_config(None, list(sets)), None, distributed=False)
    return cfg


@pytest.mark.parametrize(("sets", "expected"), [
    ((), 9),  # FP8AdamW over bf16 parameters: working 2 + grad 2 + master 2 + m 1 + v 2
    (("optim.name=adamw",), 16),  # fp32 master: weights, gradients, m, v at 4 bytes
    (("optim.name=adamw", "train.param_dtype=bf16"), 8),
    (("optim.master=fp32", "optim.grad=e5m2"), 10),  # 2 + 1 + 4 + 1 + 2
    (("optim.master=bf16_sr",), 7),  # the bf16 working weights are the master
])
def test_state_bytes_per_param_follow_the_resolved_optimizer(sets, expected):
    per, what = state_bytes_per_param(_resolved(*sets))
    assert per == expected, (sets, per, what)


@pytest.mark.parametrize("master", ["fp16", "fp32", "bf16_sr"])
def test_the_estimate_matches_a_built_fp8_adamw(master):
    """Before the optimizer exists the estimate must agree with what a built FP8AdamW holds (scales and padding
    aside: under 0.1 byte/param at block size 128 and tensors of whole blocks)."""
    params = [torch.nn.Parameter(torch.randn(256, 128, dtype=torch.bfloat16)) for _ in range(3)]
    precision = FP8AdamWPrecision(master=master, granularity="block")
    built = FP8AdamW(params, lr=1e-3, precision=precision).memory_bytes()
    per_built = sum(built[k] for k in ("master", "grad", "m", "v", "working")) / built["params"]
    per_estimated = sum(precision.bytes_per_param(2).values())
    assert per_estimated <= per_built < per_estimated + 0.1, (master, per_estimated, per_built)


def test_a_state_larger_than_the_free_memory_is_refused_with_its_sizes():
    cfg = _resolved()
    with pytest.raises(CapabilityError) as e:
        check_state_fits(2_000_000_000, cfg, torch.device("cpu"), free=16 * GIB)
    msg = str(e.value)
    assert "2.00B parameters x 9 bytes" in msg and "16.8 GiB" in msg and "16.0 GiB free on cpu" in msg, msg
    assert "model.num_layers" in msg and "[distributed]" in msg, msg


def test_warns_when_the_activations_push_it_over_and_is_quiet_with_room():
    cfg = _resolved()
    dev = torch.device("cpu")
    assert check_state_fits(1_000_000_000, cfg, dev, free=40 * GIB, activations=10 * GIB) is None
    note = check_state_fits(1_000_000_000, cfg, dev, free=12 * GIB, activations=5 * GIB)  # 8.4 + 5 > 12
    assert note and "activations of about 5.0 GiB" in note and "activation_checkpointing" in note, note
    note = check_state_fits(1_000_000_000, cfg, dev, free=10 * GIB)  # 8.4 GiB > 80% of 10
    assert note and "8.4 GiB" in note, note
    assert check_state_fits(1_000_000_000, cfg, dev, free=0) is None  # unknown: not checked


def test_activation_estimate_follows_korthikanti_and_checkpointing():
    cfg = _resolved("model.preset=llama3-8b", "model.num_layers=8", "data.seq_length=4096",
                    "train.micro_batch_size=2", "data.vocab_size=32000")
    hf = build_hf_config(cfg.model, cfg.data.vocab_size)
    s, b, h = 4096, 2, 4096
    assert activation_bytes(hf, cfg) == 8 * 34 * s * b * h + 4 * s * b * 32000
    ac = _resolved("model.preset=llama3-8b", "model.num_layers=8", "data.seq_length=4096",
                   "train.micro_batch_size=2", "data.vocab_size=32000", "train.activation_checkpointing=true")
    assert activation_bytes(hf, ac) == 8 * 2 * s * b * h + 34 * s * b * h + 4 * s * b * 32000


def test_train_refuses_a_model_that_cannot_fit_before_writing_anything(tmp_path, capsys):
    """``fp8kit train`` of 100 Llama-3-8B layers in one process (about 22B parameters, ~180 GiB of training state)
    stops at once with one line and no run directory, on any machine CI runs on."""
    from fp8kit.cli.main import main

    out = tmp_path / "run"
    rc = main(["train", "--set", "model.preset=llama3-8b", "--set", "model.num_layers=100", "--out", str(out)])
    err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert "the model does not fit: 21.84B parameters" in err.out + err.err, err
    assert not out.exists()


def test_the_memory_warning_is_printed_once(tmp_path, capsys, monkeypatch, cache_dir):
    """A state taking most of the free memory is warned about during set-up, before the long stages, and the run's
    header does not print the same warning a second time (it stays in the conversion report's warnings)."""
    from fp8kit.cli.main import main
    from fp8kit.models.build import build_model, count_params
    from fp8kit.train import memory_fit

    sets = ["model.num_layers=2", "data.seq_length=32", "data.vocab_size=1024", f"data.cache_dir={cache_dir}",
            "train.steps=1", "train.micro_batch_size=2", "train.eval_batches=1"]
    cfg = _resolved(*sets)
    state = count_params(build_model(cfg.model, cfg.data.vocab_size, device="meta"))["total"] * \
        state_bytes_per_param(cfg)[0]
    monkeypatch.setattr(memory_fit, "free_bytes", lambda device: int(state / 0.9))  # state = 90% of "free"
    out = tmp_path / "run"
    args = ["train", "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert text.count("will likely run out of memory") == 1 and "2.0M parameters x 9 bytes" in text, text
    assert "MiB of weights, gradients and optimizer states" in text, text  # a small state is not "0.0 GiB"
    assert "free on cpu" in (out / "conversion_report.md").read_text()
