"""Real training runs on the stdlib corpus, on the CPU: loss falls, compare, resume, schedule, AC, compile."""

from __future__ import annotations

import json

import pytest

from fp8kit.base.errors import Fp8kitError
from fp8kit.config import load_config
from fp8kit.train.compare import compare
from fp8kit.train.metrics import read_metrics
from fp8kit.train.trainer import train


def _cfg(small_run, *extra):
    return load_config(None, [*small_run, *extra])


@pytest.mark.slow
def test_fp8_training_loss_falls(small_run, tmp_path):
    res = train(_cfg(small_run, "train.steps=30", "train.eval_every=10", "train.checkpoint_every=0", "train.lr=1e-3"),
                tmp_path / "run")
    m = res.metrics
    assert len(m) == 30 and all(r["precision"] == "fp8" and r["fp8_modules"] == 14 for r in m)
    first = sum(r["loss"] for r in m[:5]) / 5
    last = sum(r["loss"] for r in m[-5:]) / 5
    assert last < first - 1.0, f"train loss fell only from {first:.3f} to {last:.3f}"
    vals = [r["val_loss"] for r in m if "val_loss" in r]
    # ln(1024) = 6.93 is the loss of a uniform prediction, about where training starts
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.15 and vals[-1] < 6.3, f"validation loss {vals}"
    out = tmp_path / "run"
    for name in ("resolved_config.toml", "conversion_report.md", "conversion_report.json", "metrics.jsonl",
                 "summary.md", "summary.json", "run_info.json", "checkpoints/step_000030/model.safetensors"):
        assert (out / name).exists(), name
    report = json.loads((out / "conversion_report.json").read_text())
    assert report["summary"]["fp8_sites"] == 14
    for key in ("step", "loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "peak_mem_gib", "mfu"):
        assert key in m[-1], key


@pytest.mark.slow
def test_compare_tiny_gap_under_5pct(small_run, tmp_path):
    cfg = _cfg(small_run, "train.steps=40", "train.eval_every=20", "train.checkpoint_every=0", "train.lr=1e-3")
    table = compare(cfg, tmp_path / "cmp")
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000
    assert abs(table["val_loss_gap_pct"]) < 5.0, f"val loss gap {table['val_loss_gap_pct']:.2f}%"
    assert abs(table["train_loss_gap_pct"]) < 5.0, f"train loss gap {table['train_loss_gap_pct']:.2f}%"
    assert table["bf16_final_val_loss"] < 6.3  # both learned something (ln 1024 = 6.93)
    assert table["tokens_per_s_ratio"] > 0
    bf16 = read_metrics(tmp_path / "cmp" / "bf16" / "metrics.jsonl")
    assert all(r["precision"] == "bf16" and r["fp8_modules"] == 0 for r in bf16)
    # again into the same --out: refused in one line that suggests what compare can do (it has no --resume)
    with pytest.raises(Fp8kitError) as e:
        compare(cfg, tmp_path / "cmp")
    assert str(e.value) == (f"--out {str(tmp_path / 'cmp')!r} already holds a comparison (bf16 and fp8 hold runs); "
                            f"choose another --out"), str(e.value)


@pytest.mark.slow
def test_resume_is_bit_exact(small_run, tmp_path):
    base = ["train.steps=8", "train.checkpoint_every=4", "train.eval_every=4", "fp8.bf16_warmup_steps=2"]
    full = train(_cfg(small_run, *base), tmp_path / "full").metrics
    # stop at step 4: the same config with 4 steps would change the LR schedule, so resume from the
    # uninterrupted run's step-4 checkpoint into a fresh directory
    resumed = train(_cfg(small_run, *base), tmp_path / "resumed", resume=tmp_path / "full" / "checkpoints" / "step_000004")
    assert [r["step"] for r in resumed.metrics] == [5, 6, 7, 8]
    assert [r["loss"] for r in resumed.metrics] == [r["loss"] for r in full[4:]]
    assert [r.get("val_loss") for r in resumed.metrics] == [r.get("val_loss") for r in full[4:]]
    assert [r["grad_norm"] for r in resumed.metrics] == [r["grad_norm"] for r in full[4:]]


@pytest.mark.slow
def test_resume_into_same_run_dir_continues(small_run, tmp_path):
    """Interrupt (a shorter run of the same schedule is not possible), so: run, then resume the run dir
    from its last checkpoint with more steps; metrics continue without duplicates."""
    cfg = _cfg(small_run, "train.steps=3", "train.warmup_steps=0", "train.min_lr_ratio=1.0")
    train(cfg, tmp_path / "run")
    more = _cfg(small_run, "train.steps=5", "train.warmup_steps=0", "train.min_lr_ratio=1.0")
    train(more, resume=tmp_path / "run")
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,fp8_sites", [("tensorwise", 14), ("blockwise", 8), ("delayed", 14)])
def test_precision_schedule_switches_at_configured_steps(small_run, tmp_path, recipe, fp8_sites):
    """The BF16 warm-up / cool-down phases with each recipe: the switch steps, the FP8 module count per step
    (blockwise converts fewer sites: dims not multiples of 128 stay BF16), and a falling loss."""
    res = train(_cfg(small_run, "train.steps=10", "fp8.bf16_warmup_steps=3", "fp8.bf16_cooldown_steps=2",
                     f"fp8.recipe={recipe}"), tmp_path / "s")
    assert [r["precision"] for r in res.metrics] == ["bf16"] * 3 + ["fp8"] * 5 + ["bf16"] * 2
    assert [r["fp8_modules"] for r in res.metrics] == [0] * 3 + [fp8_sites] * 5 + [0] * 2
    assert res.loop.switches == [(3, "fp8"), (8, "bf16")]
    assert res.metrics[-1]["loss"] < res.metrics[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "delayed"])
def test_activation_checkpointing_gives_identical_losses(small_run, tmp_path, recipe):
    """Activation checkpointing recomputes each block's forward in the backward: with every recipe the
    recomputed casts (blockwise: the same blocks; delayed: this step's scales, nothing recorded twice) give
    the same losses, bit for bit."""
    a = train(_cfg(small_run, "train.steps=3", f"fp8.recipe={recipe}"), tmp_path / "a").metrics
    b = train(_cfg(small_run, "train.steps=3", "train.activation_checkpointing=true", f"fp8.recipe={recipe}"),
              tmp_path / "b").metrics
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["grad_norm"] for r in a] == [r["grad_norm"] for r in b]


@pytest.mark.slow
def test_compile_with_precision_switch(small_run, tmp_path):
    """Per-block torch.compile through a BF16 -> FP8 switch (the compiled blocks are rebuilt)."""
    eager = train(_cfg(small_run, "train.steps=4", "fp8.bf16_warmup_steps=2"), tmp_path / "e").metrics
    comp = train(_cfg(small_run, "train.steps=4", "fp8.bf16_warmup_steps=2", "train.compile=true"), tmp_path / "c").metrics
    assert [r["precision"] for r in comp] == ["bf16", "bf16", "fp8", "fp8"]
    for e, c in zip(eager, comp, strict=True):
        assert abs(e["loss"] - c["loss"]) < 0.05, (e["loss"], c["loss"])


@pytest.mark.slow
def test_grad_accum_matches_larger_micro_batch(small_run, tmp_path):
    a = train(_cfg(small_run, "train.steps=3", "train.micro_batch_size=4", "train.mixed_precision=bf16"), tmp_path / "a").metrics
    b = train(_cfg(small_run, "train.steps=3", "train.micro_batch_size=2", "train.grad_accum=2",
                   "train.mixed_precision=bf16"), tmp_path / "b").metrics
    for x, y in zip(a, b, strict=True):
        assert abs(x["loss"] - y["loss"]) < 0.02, (x["loss"], y["loss"])


@pytest.mark.slow
def test_hf_config_json_trains(small_run, tmp_path):
    """model.hf_config: any causal-LM config.json (here a small Qwen2, with qkv biases) replaces the preset."""
    cfg_json = tmp_path / "config.json"
    cfg_json.write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 2048,
        "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "bfloat16",
    }))
    res = train(_cfg(small_run, f"model.hf_config={cfg_json}", "train.steps=3"), tmp_path / "run")
    assert res.summary["model"].startswith("hf_config")
    report = json.loads((tmp_path / "run" / "conversion_report.json").read_text())
    q = next(s for s in report["sites"] if s["fqn"] == "model.layers.0.self_attn.q_proj")
    assert q["precision"] == "fp8" and q["shape"] == [128, 128]
    emb = next(s for s in report["sites"] if s["fqn"] == "model.embed_tokens")
    assert emb["shape"] == [1024, 128]  # vocab taken from data.vocab_size, not the file


@pytest.mark.slow
def test_compiled_eval_runs_a_short_last_batch_without_compiling_again(small_run):
    """The validation set's short last batch runs eagerly: compiled, it compiled every block again (and made
    Dynamo treat their batch dimension as dynamic in every later compile)."""
    import torch._dynamo.utils as dyn

    from fp8kit.train.loop import evaluate
    from fp8kit.train.setup import build_setup

    setup = build_setup(load_config(None, [*small_run, "train.compile=true", "train.eval_batches=3"]))
    packed = setup.data.packed
    windows = packed.val_windows
    packed.val_windows = windows[:8]  # two full batches of 4
    full = evaluate(setup)
    before = dyn.counters["frames"]["ok"]
    packed.val_windows = windows[:9]  # and a last batch of one window
    with_short = evaluate(setup)
    compiled = dyn.counters["frames"]["ok"] - before
    assert compiled == 0, f"the short batch compiled {compiled} frames"
    assert with_short != full and abs(with_short - full) < 1.0, (full, with_short)

