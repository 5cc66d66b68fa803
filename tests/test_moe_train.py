"""The tiny-moe preset end to end on the CPU: experts in FP8 train, plan shows the grouped kinds, the
precision schedule swaps experts in and out, and a grouped policy decides per site."""

from __future__ import annotations

import json

import pytest
import torch

from fp8kit.cli.main import main
from fp8kit.config import load_config
from fp8kit.train.trainer import train

MOE = ["model.preset=tiny-moe"]


def _cfg(small_run, *extra):
    return load_config(None, [*small_run, *MOE, *extra])


@pytest.mark.slow
def test_tiny_moe_trains_with_fp8_experts(small_run, tmp_path):
    cfg = _cfg(small_run, "train.steps=25", "train.eval_every=0", "train.checkpoint_every=0", "train.lr=2e-3")
    res = train(cfg, tmp_path / "run")
    m = res.metrics
    # 2 layers: q, k, v, o (Float8Linear) + the experts module = 5 FP8 modules per layer
    assert all(r["precision"] == "fp8" and r["fp8_modules"] == 10 for r in m), [r["fp8_modules"] for r in m]
    first = sum(r["loss"] for r in m[:5]) / 5
    last = sum(r["loss"] for r in m[-5:]) / 5
    assert last < first - 0.5, f"train loss fell only from {first:.3f} to {last:.3f}"
    report = json.loads((tmp_path / "run" / "conversion_report.json").read_text())
    grouped = [d for d in report["sites"] if d["module_kind"] in ("column_grouped", "row_grouped")]
    assert len(grouped) == 4 and all(d["precision"] == "fp8" and d["recipe"] == "rowwise" for d in grouped), grouped
    assert {d["num_gemms"] for d in grouped} == {8}
    # the experts themselves learned (not only attention and embeddings)
    from safetensors.torch import load_file

    from fp8kit.models.build import build_model

    init = build_model(cfg.model, cfg.data.vocab_size, device="cpu", dtype=torch.bfloat16, seed=cfg.train.seed).state_dict()
    final = load_file(str(tmp_path / "run" / "checkpoints" / "step_000025" / "model.safetensors"))
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        moved = (final[name].float() - init[name].float()).abs().mean().item()
        assert moved > 1e-4, f"{name} barely changed: mean |delta| {moved:.2e}"


def test_plan_shows_grouped_kinds_and_policy_decisions(capsys, tmp_path, cache_dir):
    policy = {
        "version": 1,
        "rules": {
            "column_grouped": [{"etp": 1, "num_gemms": 8, "min_tokens": 2048, "measured_speedup": 1.2}],
            "row_grouped": [{"etp": 1, "num_gemms": 8, "min_tokens": 4096, "measured_speedup": 1.1}],
        },
    }
    path = tmp_path / "moe_policy.json"
    path.write_text(json.dumps(policy))
    # 512 tokens x topk 2 = 1024 pairs: both below; 2048 tokens x 2 = 4096 pairs: both at or above
    argv = ["plan", "--set", "model.preset=tiny-moe", "--set", "data.vocab_size=1024", "--set", "selective.selective_fp8=true",
            "--set", f"selective.fp8_dynamic_policy_path={path}", "--json"]
    for tokens, want in ((512, {"column_grouped": "bf16", "row_grouped": "bf16"}),
                         (1024, {"column_grouped": "fp8", "row_grouped": "bf16"}),
                         (2048, {"column_grouped": "fp8", "row_grouped": "fp8"})):
        assert main([*argv, "--set", f"selective.fp8_dynamic_num_tokens={tokens}"]) == 0
        rows = json.loads(capsys.readouterr().out)
        got = {r["module_kind"]: r["precision"] for r in rows if r["module_kind"] in want}
        assert got == want, f"{tokens} tokens: {got}"
        reasons = [r["reason"] for r in rows if r["module_kind"] == "column_grouped"]
        assert f"{tokens}x2={2 * tokens}" in reasons[0], reasons[0]
    # ep = 2 halves the local experts: no rule for num_gemms = 4 -> bf16, and the reason says so
    assert main([*argv, "--set", "distributed.ep=2"]) == 0
    rows = json.loads(capsys.readouterr().out)
    grouped = [r for r in rows if r["module_kind"] in ("column_grouped", "row_grouped")]
    assert all(r["num_gemms"] == 4 and r["precision"] == "bf16" for r in grouped), grouped


def test_experts_follow_the_precision_schedule(small_run, tmp_path):
    res = train(_cfg(small_run, "model.num_layers=1", "train.steps=5", "fp8.bf16_warmup_steps=2",
                     "fp8.bf16_cooldown_steps=1", "train.eval_every=0", "train.checkpoint_every=0",
                     "train.final_checkpoint=false"), tmp_path / "sched")
    assert [r["fp8_modules"] for r in res.metrics] == [0, 0, 5, 5, 0], [r["fp8_modules"] for r in res.metrics]


def test_exclude_experts_keeps_them_bf16(small_run, tmp_path):
    cfg = _cfg(small_run, "model.num_layers=1", "train.steps=2", "fp8.exclude=[\"experts\"]", "train.eval_every=0",
               "train.checkpoint_every=0", "train.final_checkpoint=false")
    res = train(cfg, tmp_path / "ex")
    assert [r["fp8_modules"] for r in res.metrics] == [4, 4]
    report = json.loads((tmp_path / "ex" / "conversion_report.json").read_text())
    assert all(d["precision"] == "bf16" and d["rule"] == "exclude" for d in report["sites"]
               if d["module_kind"] in ("column_grouped", "row_grouped"))
