"""bench-layers -> merge-policy -> plan -> train with selective FP8, end to end on the tiny preset (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fp8kit.cli.main import main
from fp8kit.config import load_config
from fp8kit.train.trainer import train

TINY = ["--set", "model.num_layers=1", "--set", "data.vocab_size=1024"]


def _ok(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.fixture(scope="module")
def cpu_reports(tmp_path_factory):
    """Two real CPU reports of the tiny preset (TP 1 measured, TP 2 simulated)."""
    d = tmp_path_factory.mktemp("reports")
    for tp in (1, 2):
        argv = ["bench-layers", *TINY, "--device", "cpu", "--tp", str(tp), "--shape-sweep", "128x1,256x1,512x1",
                "--warmup", "1", "--iters", "2", "--report", str(d / f"r{tp}.json")]
        if tp > 1:
            argv.append("--simulate-tp")
        assert main(argv) == 0
    return d


def test_bench_layers_report(cpu_reports):
    rep = json.loads((cpu_reports / "r1.json").read_text())
    assert rep["device_type"] == "cpu" and "not meant for a GPU policy" in rep["note"]
    assert rep["recipe"] == "tensorwise" and rep["versions"]["torchao"]
    assert rep["sources"] == {"recipe": "default", "tp": "--tp", "ep": "default"}, rep["sources"]
    assert rep["fp8_linear_scaling"]["input"] == "tensorwise", rep["fp8_linear_scaling"]
    sites = {s["name"]: s for s in rep["sites"]}
    assert set(sites) == {"qkv", "proj", "fc1", "fc2"}
    assert sites["qkv"]["module_kind"] == "layernorm_column" and sites["qkv"]["gemms"] == [[256, 256], [256, 128], [256, 128]]
    assert sites["fc2"]["module_kind"] == "row" and sites["fc2"]["gemms"] == [[688, 256]]
    assert len(rep["measurements"]) == 4 * 3 * 2 and all(m["ms"] > 0 for m in rep["measurements"])
    sim = json.loads((cpu_reports / "r2.json").read_text())
    assert sim["simulated_tp"] is True
    s2 = {s["name"]: s for s in sim["sites"]}
    assert s2["qkv"]["gemms"] == [[256, 128], [256, 64], [256, 64]]  # column: N / tp
    assert s2["proj"]["gemms"] == [[128, 256]]  # row: K / tp
    assert "fc1" not in s2 and any("not divisible by 16" in n for n in sim["notes"])  # 688 / 2 = 344


def test_merge_then_plan_then_train(cpu_reports, capsys, tmp_path, small_run):
    policy = tmp_path / "policy.json"
    _ok(capsys, ["merge-policy", "--reports", str(cpu_reports / "r1.json"), str(cpu_reports / "r2.json"),
                 "--output", str(policy), "--speedup-threshold", "0.001"])
    p = json.loads(policy.read_text())
    assert p["version"] == 1 and set(p["rules"]) <= {"layernorm_column", "row"}
    assert p["metadata"]["note"].startswith("CPU timings")
    # the policy's own note is printed with it, and a policy of no rules says what that means
    out = _ok(capsys, ["merge-policy", "--reports", str(cpu_reports / "r1.json"), "--output", str(tmp_path / "none.json"),
                       "--speedup-threshold", "1000"])
    assert "note: CPU timings" in out and "no measured site reached the speed-up threshold 1000" in out, out
    # Which precision wins on a CPU depends on its load (timings are not asserted): a threshold of 0.001
    # makes every measured point pass, so every timed site gets a rule from the smallest token count
    assert {r["tp"] for r in p["rules"]["layernorm_column"]["qkv"]} == {1, 2}
    assert all(r["min_tokens"] == 128 for r in p["rules"]["layernorm_column"]["qkv"])
    sets = ["--set", "selective.selective_fp8=true", "--set", f"selective.fp8_dynamic_policy_path={policy}",
            "--set", "data.seq_length=64", "--set", "train.micro_batch_size=2"]  # 128 tokens
    rows = json.loads(_ok(capsys, ["plan", *TINY, *sets, "--json"]))
    q = next(r for r in rows if r["fqn"] == "model.layers.0.self_attn.q_proj")
    min_q = p["rules"]["layernorm_column"]["qkv"][0]["min_tokens"]
    assert q["num_tokens"] == 128 and q["tp"] == 1 and q["module_kind"] == "layernorm_column"
    assert q["precision"] == ("fp8" if min_q <= 128 else "bf16")
    assert q["reason"].startswith("qkv tp=1 min_tokens=")
    assert {"fqn", "module_kind", "ub_name", "tp", "etp", "num_gemms", "num_tokens", "precision", "reason"} <= set(q)
    rows4 = json.loads(_ok(capsys, ["plan", *TINY, *sets, "--set", "distributed.tp=4", "--json"]))
    assert all(r["precision"] == "bf16" for r in rows4)
    assert next(r for r in rows4 if r["ub_name"] == "fc2")["reason"] == "no rule for fc2 tp=4 -> bf16"
    table = _ok(capsys, ["plan", *TINY, *sets, "--set", "selective.fp8_dynamic_num_tokens=512"])
    assert "FP8 plan" in table and "num_tokens=512" in table
    # train with the policy: the decisions of plan are applied, and recorded in the conversion report
    cfg = load_config(None, [*small_run, "train.steps=2", "selective.selective_fp8=true",
                             f"selective.fp8_dynamic_policy_path={policy}", "selective.fp8_dynamic_num_tokens=512"])
    res = train(cfg, tmp_path / "run")
    rep = json.loads((tmp_path / "run" / "conversion_report.json").read_text())
    policy_rows = [s for s in rep["sites"] if s["rule"] == "policy"]
    assert len(policy_rows) == 2 * 7 and all("min_tokens" in s["reason"] for s in policy_rows)
    assert res.metrics[-1]["fp8_modules"] == sum(s["precision"] == "fp8" for s in rep["sites"])


def test_seed_environment_variables(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TE_LAYER_PERF_PRECISIONS", "bf16")
    monkeypatch.setenv("TE_LAYER_PERF_SHAPE_SWEEP", "128x1")
    monkeypatch.setenv("TE_LAYER_PERF_ITERS", "1")
    monkeypatch.setenv("TE_LAYER_PERF_WARMUP", "0")
    monkeypatch.setenv("TE_LAYER_PERF_REPORT_PATH", str(tmp_path / "env.json"))
    monkeypatch.setenv("TE_LAYER_PERF_TP_SIZE", "2")
    _ok(capsys, ["bench-layers", *TINY, "--device", "cpu", "--simulate-tp", "--tp", "1"])  # flag wins over env
    rep = json.loads((tmp_path / "env.json").read_text())
    assert rep["tp"] == 1 and rep["precisions"] == ["bf16"] and {m["num_tokens"] for m in rep["measurements"]} == {128}


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--tp", "2"], "--tp 2 times the real tensor-parallel layer and needs torchrun --nproc_per_node 2"),
        (["--recipe", "blockwize"], "--recipe: unknown recipe 'blockwize'"),
        (["--precisions", "fp16"], "unknown precision 'fp16'"),
        (["--shape-sweep", "4096by2"], "--shape-sweep: '4096by2' is not SEQxMBS"),
        (["--tp", "3", "--simulate-tp"], "is not divisible by the parallel size 3"),
    ],
)
def test_bench_layers_bad_input(capsys, argv, expected):
    code = main(["bench-layers", *TINY, "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 2 and expected in err, err


def test_merge_policy_bad_reports(capsys, tmp_path):
    (tmp_path / "x.json").write_text('{"a": 1}')
    code = main(["merge-policy", "--reports", str(tmp_path / "x.json"), "--output", str(tmp_path / "p.json")])
    assert code == 2 and "not a bench-layers report" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_merge_policy_refuses_to_write_over_one_of_its_reports(capsys, cpu_reports, tmp_path):
    report = tmp_path / "r1.json"
    report.write_bytes((cpu_reports / "r1.json").read_bytes())
    before = report.read_bytes()
    code = main(["merge-policy", "--reports", str(report), "--output", str(report)])
    err = capsys.readouterr().err
    assert code == 2 and f"--output {str(report)!r} is one of the --reports" in err, err
    assert report.read_bytes() == before


def test_plan_with_tp_refuses_what_a_gpu_run_refuses(capsys):
    """A torchao-recipe FP8 linear whose tp shard is no FP8 GEMM shape (the tiny preset's 688-wide MLP over tp 2:
    344 per rank, not a multiple of 16) fails on a GPU's torch._scaled_mm; plan says so, naming every kind of layer
    refused (not one per retry) and one exclude for all of them, which then plans."""
    code = main(["plan", *TINY, "--set", "distributed.tp=2"])
    err = capsys.readouterr().err.strip()
    shard = "not an FP8 GEMM shape (torch._scaled_mm)"
    assert code == 2 and err == (
        "error: fp8.recipe = 'tensorwise' with distributed.tp = 2: 3 kinds of FP8 linear split into shards the recipe "
        "cannot run (the first refused layer of each kind named): "
        f"model.layers.0.mlp.gate_proj is column-parallel and its weight [688, 256] splits into [344, 256] per rank, "
        f"{shard}: out_features / tp must be a multiple of 16; "
        f"model.layers.0.mlp.up_proj is column-parallel and its weight [688, 256] splits into [344, 256] per rank, "
        f"{shard}: out_features / tp must be a multiple of 16; "
        f"model.layers.0.mlp.down_proj is row-parallel and its weight [256, 688] splits into [256, 344] per rank, "
        f"{shard}: in_features / tp must be a multiple of 16. Keep them BF16 (add "
        '"*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj" to fp8.exclude) or use a tp for which they are'), err
    # one kind left: check_shard's own one-layer message
    code = main(["plan", *TINY, "--set", "distributed.tp=2", "--set", 'fp8.exclude=["*.mlp.gate_proj", "*.mlp.up_proj"]'])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "error: fp8.recipe = 'tensorwise' with distributed.tp = 2: model.layers.0.mlp.down_proj is row-parallel and its "
        f"weight [256, 688] splits into [256, 344] per rank, {shard}: in_features / tp must be a multiple of 16; keep "
        'it BF16 (add "*.mlp.down_proj" to fp8.exclude) or use a tp for which it is'), err
    rows = json.loads(_ok(capsys, ["plan", *TINY, "--set", "distributed.tp=2", "--set",
                                   'fp8.exclude=["*.mlp.gate_proj", "*.mlp.up_proj", "*.mlp.down_proj"]', "--json"]))
    assert {r["fqn"].rsplit(".", 1)[-1] for r in rows if r["precision"] == "fp8"} == {
        "q_proj", "k_proj", "v_proj", "o_proj"}, rows


def test_train_names_the_key_of_a_missing_policy_before_preparing_data(capsys, tmp_path):
    out = tmp_path / "run"
    for path, what in ((tmp_path / "nope.json", "does not exist"), (tmp_path, "is a directory")):
        code = main(["train", "--out", str(out), "--set", f"selective.fp8_dynamic_policy_path={path}"])
        cap = capsys.readouterr()
        err = cap.err
        assert code == 2 and f"error: selective.fp8_dynamic_policy_path: policy file {str(path)!r} {what}" in err, err
        assert "preparing data" not in cap.out + err and not out.exists(), cap.out + err


def test_train_refuses_a_bad_policy_before_writing(capsys, tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"version": 3, "rules": {}}))
    out = tmp_path / "run"
    code = main(["train", "--out", str(out), "--set", "selective.selective_fp8=true", "--set", f"selective.fp8_dynamic_policy_path={bad}"])
    assert code == 2 and "unknown policy version 3" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_real_tensor_parallel_bf16_under_torchrun(tmp_path):
    """--tp 2 under torchrun times the DTensor layer with its collectives (gloo: bf16 only)."""
    report = tmp_path / "tp2.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "fp8kit", "bench-layers",
           *TINY, "--device", "cpu", "--tp", "2", "--precisions", "bf16", "--shape-sweep", "64x1",
           "--warmup", "1", "--iters", "2", "--report", str(report)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert rep["simulated_tp"] is False and rep["world_size"] == 2 and rep["tp"] == 2
    assert {m["site"] for m in rep["measurements"]} == {"qkv", "proj"} and all(m["ms"] > 0 for m in rep["measurements"])


def test_plan_names_a_pretrained_model_and_prints_the_configs_notes(capsys, tmp_path):
    """plan reads its config as train does (``cli/config_load.load_cli_config``): the notes of an old key are
    printed, and the model is named as train names it (the pretrained directory, not the ignored preset)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=4, vocab_size=512)
    AutoModelForCausalLM.from_config(hf).save_pretrained(tmp_path / "m")
    old = tmp_path / "old.toml"
    old.write_text("[distributed]\nep = 1\netp = 1\n")
    code = main(["plan", str(old), "--set", f"model.pretrained={tmp_path / 'm'}"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "distributed.etp = 1 is ignored (the key was removed" in out.err, out.err
    head = " ".join(out.out.split())  # the console may wrap a long path
    assert f"plan: pretrained {tmp_path / 'm'}," in head and "tiny" not in head.split("FP8 plan")[0], out.out
