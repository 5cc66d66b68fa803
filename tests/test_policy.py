"""Adaptive FP8: merging reports into LoongForge's policy format, lookups, decisions, bad policies."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fp8kit.base.errors import PolicyError
from fp8kit.config import load_config
from fp8kit.config.options import options_from_config
from fp8kit.selective.decide import DecideOptions, Selective, decide
from fp8kit.selective.policy import (
    grid_check,
    list_builtin_policies,
    load_policy,
    merge_reports,
    min_tokens_for,
    policy_from_json,
)
from fp8kit.selective.sites import find_sites
from tests.conftest import tiny_moe_model

LOONGFORGE_EXAMPLE = {  # LoongForge adaptive FP8 docs, the "FP8 Dynamic Policy" example, verbatim
    "version": 1,
    "speedup_threshold": 1.0,
    "rules": {
        "layernorm_column": {
            "qkv": [{"tp": 1, "min_tokens": 16384, "measured_speedup": 1.03}],
            "fc1": [{"tp": 1, "min_tokens": 4096, "measured_speedup": 1.18}],
        },
        "row": {
            "proj": [{"tp": 1, "min_tokens": 16384, "measured_speedup": 1.05}],
            "fc2": [{"tp": 1, "min_tokens": 8192, "measured_speedup": 1.23}],
        },
        "column_grouped": [{"etp": 1, "num_gemms": 64, "min_tokens": 424, "measured_speedup": 1.02}],
        "row_grouped": [{"etp": 1, "num_gemms": 64, "min_tokens": 424, "measured_speedup": 1.04}],
    },
}


def _report(device="NVIDIA H100", recipe="tensorwise", curves=None, tp=1):
    """A synthetic bench-layers report: curves = {(kind, ub, tp|etp, num_gemms): {tokens: speedup}}."""
    ms = []
    for (kind, ub, par, gemms), points in (curves or {}).items():
        for tokens, speedup in points.items():
            base = {"site": ub, "component": "llm", "module_kind": kind, "ub_name": ub, "num_tokens": tokens}
            if gemms is None:
                base.update(tp=par, etp=None, num_gemms=None)
            else:
                base.update(tp=None, etp=par, num_gemms=gemms)
            ms.append({**base, "precision": "bf16", "ms": 1.0})
            ms.append({**base, "precision": "fp8", "ms": 1.0 / speedup})
    return {"device": device, "device_type": "cuda", "recipe": recipe, "tp": tp, "measurements": ms}


def test_min_tokens_is_monotone():
    pts = [(t, s, 1.0, 1.0 / s) for t, s in [(256, 1.2), (512, 0.9), (1024, 1.05), (2048, 1.1), (4096, 1.3)]]
    assert min_tokens_for(pts, 1.0) == (1024, 1.05)  # the 256-token island is ignored
    assert min_tokens_for(pts, 1.08) == (2048, 1.1)
    assert min_tokens_for(pts, 1.5) is None
    pts.append((8192, 0.99))
    pts[-1] = (8192, 0.99, 1.0, 1.0 / 0.99)
    assert min_tokens_for(pts, 1.0) is None  # loses at the largest count: never FP8


def test_merge_writes_the_loongforge_layout():
    curves = {
        ("layernorm_column", "qkv", 1, None): {1024: 0.8, 4096: 0.97, 16384: 1.03},
        ("layernorm_column", "fc1", 1, None): {1024: 0.9, 4096: 1.18, 16384: 1.4},
        ("row", "proj", 1, None): {1024: 0.7, 4096: 0.8, 16384: 0.95},  # never wins: no rule
        ("column_grouped", "fc1", 1, 64): {256: 0.9, 424: 1.02, 1024: 1.2},
    }
    rep2 = _report(curves={("layernorm_column", "qkv", 2, None): {1024: 0.5, 4096: 0.9, 16384: 1.01}}, tp=2)
    policy = merge_reports([("r1.json", _report(curves=curves)), ("r2.json", rep2)], 1.0)
    j = policy.to_json()
    assert j["version"] == 1 and j["speedup_threshold"] == 1.0
    assert j["rules"]["layernorm_column"]["qkv"] == [
        {"tp": 1, "min_tokens": 16384, "measured_speedup": 1.03},
        {"tp": 2, "min_tokens": 16384, "measured_speedup": 1.01},
    ]
    assert j["rules"]["layernorm_column"]["fc1"][0]["min_tokens"] == 4096
    assert "row" not in j["rules"]  # proj never beat the threshold
    assert j["rules"]["column_grouped"] == [{"etp": 1, "num_gemms": 64, "min_tokens": 424, "measured_speedup": 1.02}]
    # a higher threshold moves min_tokens up
    strict = merge_reports([("r1.json", _report(curves=curves))], 1.1).to_json()
    assert strict["rules"]["layernorm_column"]["fc1"][0]["min_tokens"] == 4096
    assert "qkv" not in strict["rules"]["layernorm_column"]
    # round trip through the validator
    assert policy_from_json(json.loads(json.dumps(j))).to_json() == j
    g = grid_check([_report(curves=curves)], policy)
    assert g["points"] == 12 and g["worst_ratio"] == pytest.approx(1.0)


def test_merge_refuses_mixed_devices_and_recipes():
    a, b = _report(device="NVIDIA H100"), _report(device="NVIDIA A100")
    with pytest.raises(PolicyError, match="reports differ in device: a.json has 'NVIDIA H100', b.json has 'NVIDIA A100'"):
        merge_reports([("a.json", a), ("b.json", b)])
    with pytest.raises(PolicyError, match="differ in recipe"):
        merge_reports([("a.json", a), ("c.json", _report(recipe="rowwise"))])
    merge_reports([("a.json", a), ("b.json", b)], force=True)


def test_loongforge_policy_lookups():
    p = policy_from_json(LOONGFORGE_EXAMPLE, "loongforge.json")
    assert p.decide("row", "fc2", num_tokens=16384, tp=1).reason == "fc2 tp=1 min_tokens=8192 <= 16384 -> fp8"
    v = p.decide("layernorm_column", "qkv", num_tokens=8192, tp=1)
    assert not v.use_fp8 and v.reason == "qkv tp=1 min_tokens=16384 > 8192 -> bf16"
    assert p.decide("layernorm_column", "qkv", num_tokens=1 << 20, tp=4).reason == "no rule for qkv tp=4 -> bf16"
    # grouped: tokens x topk, keyed by etp and num_gemms
    v = p.decide("column_grouped", "fc1", num_tokens=100, etp=1, num_gemms=64, topk=8)
    assert v.use_fp8 and v.reason == "column_grouped etp=1 num_gemms=64 min_tokens=424 <= 100x8=800 -> fp8"
    assert not p.decide("row_grouped", "fc2", num_tokens=50, etp=1, num_gemms=64, topk=8).use_fp8
    assert not p.decide("row_grouped", "fc2", num_tokens=4096, etp=1, num_gemms=32, topk=8).use_fp8
    assert not p.decide("column", "qkv", num_tokens=1 << 20).use_fp8  # kind present in no rule


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d.update(version=2), "version: unknown policy version 2"),
        (lambda d: d["rules"].update(attention=[]), "rules.attention: unknown module kind 'attention'"),
        (lambda d: d["rules"]["row"]["fc2"][0].update(measured_speedup=-1.0), "rules.row.fc2[0].measured_speedup: must be a finite, non-negative number, got -1.0"),
        (lambda d: d["rules"]["row"]["fc2"][0].update(measured_speedup=math.nan), "rules.row.fc2[0].measured_speedup"),
        (lambda d: d["rules"]["row"]["fc2"][0].update(min_tokens=0), "rules.row.fc2[0].min_tokens: must be a positive integer, got 0"),
        (lambda d: d["rules"]["row"]["fc2"][0].update(min_tokens=8192.5), "rules.row.fc2[0].min_tokens: must be a positive integer, got 8192.5"),
        (lambda d: d["rules"]["column_grouped"][0].pop("num_gemms"), "rules.column_grouped[0].num_gemms"),
        (lambda d: d["rules"].update(row=[]), "rules.row: a dense kind maps ub_name -> list of rules"),
        (lambda d: d["rules"].update(row_grouped={}), "rules.row_grouped: a grouped kind holds a flat list"),
    ],
)
def test_bad_policies_name_file_and_key(tmp_path, mutate, expected):
    data = json.loads(json.dumps(LOONGFORGE_EXAMPLE))
    mutate(data)
    f = tmp_path / "p.json"
    f.write_text(json.dumps(data))
    with pytest.raises(PolicyError) as e:
        load_policy(f)
    assert str(f) in str(e.value) and expected in str(e.value), str(e.value)


def test_missing_and_invalid_policy_files(tmp_path):
    with pytest.raises(PolicyError, match="policy file .*missing.json' does not exist"):
        load_policy(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(PolicyError, match=r"bad\.json: invalid JSON"):
        load_policy(tmp_path / "bad.json")
    with pytest.raises(PolicyError, match="shipped policies: .*llama3-8b_tensorwise_h100"):
        load_policy("builtin:nope")


def test_shipped_policies_load_and_fit_their_grid():
    names = list_builtin_policies()
    for model in ("llama3-8b", "qwen2.5-72b"):
        for recipe in ("tensorwise", "rowwise"):
            assert f"{model}_{recipe}_h100" in names
    for name in names:
        p = load_policy(f"builtin:{name}")
        assert p.metadata["device"] == "NVIDIA H100 80GB HBM3"
        tps = {r["tp"]: r["simulated_tp"] for r in p.metadata["reports"]}
        assert tps.get(1) is False and all(tps[t] for t in tps if t > 1), tps


def test_decision_table_dense_moe_topk_and_explicit_tokens():
    policy = policy_from_json({
        "version": 1, "speedup_threshold": 1.0,
        "rules": {
            "layernorm_column": {"qkv": [{"tp": 1, "min_tokens": 4096, "measured_speedup": 1.1}],
                                 "fc1": [{"tp": 2, "min_tokens": 1024, "measured_speedup": 1.1}]},
            "column_grouped": [{"etp": 1, "num_gemms": 4, "min_tokens": 4000, "measured_speedup": 1.1}],
        },
    })
    model, hf_cfg = tiny_moe_model()
    sites = find_sites(model)

    def run(num_tokens, tp=1, ep=1):
        sel = Selective({"*": policy}, {"*": num_tokens}, topk=hf_cfg.num_experts_per_tok)
        return {d.fqn: d for d in decide(sites, DecideOptions(tp=tp, ep=ep, num_tokens=num_tokens, selective=sel))}

    d = run(4096)
    q = d["model.layers.0.self_attn.q_proj"]
    assert q.is_fp8 and q.rule == "policy" and q.reason == "qkv tp=1 min_tokens=4096 <= 4096 -> fp8"
    o = d["model.layers.0.self_attn.o_proj"]
    assert not o.is_fp8 and o.reason == "no rule for proj tp=1 -> bf16"
    ex = d["model.layers.0.mlp.experts.gate_up_proj"]
    # 8 local experts: no rule for num_gemms=8 -> bf16
    assert (ex.site.module_kind, ex.num_gemms, ex.rule, ex.is_fp8) == ("column_grouped", 8, "policy", False), ex
    assert not run(2048)["model.layers.1.self_attn.k_proj"].is_fp8
    d2 = run(2048, tp=2, ep=2)
    assert d2["model.layers.1.self_attn.k_proj"].reason == "no rule for qkv tp=2 -> bf16"
    assert d2["model.layers.0.mlp.experts.down_proj"].num_gemms == 4  # 8 experts over ep=2
    # ep=2 -> num_gemms=4: the rule applies to the tokens x topk pairs (2048 x 2 = 4096 >= 4000)
    up = d2["model.layers.0.mlp.experts.gate_up_proj"]
    assert up.is_fp8 and up.recipe == "rowwise" and "2048x2=4096" in up.reason, up
    # the grouped lookup itself: 2048 tokens x topk 2 = 4096 >= 4000
    v = policy.decide("column_grouped", "fc1", num_tokens=2048, etp=1, num_gemms=4, topk=2)
    assert v.use_fp8 and "2048x2=4096" in v.reason


def test_options_from_config_tokens_and_device_warning(tmp_path):
    f = tmp_path / "p.json"
    data = json.loads(json.dumps(LOONGFORGE_EXAMPLE))
    data["metadata"] = {"device": "NVIDIA H100 80GB HBM3", "recipe": "rowwise"}
    f.write_text(json.dumps(data))
    cfg = load_config(None, ["selective.selective_fp8=true", f"selective.fp8_dynamic_policy_path={f}",
                             "data.seq_length=1024", "train.micro_batch_size=8"])
    opts = options_from_config(cfg, None, device_name="NVIDIA A100-SXM4-80GB")
    assert opts.num_tokens == 8192
    assert any("measured on 'NVIDIA H100 80GB HBM3', this run trains on 'NVIDIA A100-SXM4-80GB'" in w for w in opts.warnings)
    assert any("recipe 'rowwise'" in w for w in opts.warnings)
    # the policy's own note (a stale or CPU-timed policy) reaches the run's warnings
    data["metadata"]["note"] = "stale: measured before the fused experts"
    f.write_text(json.dumps(data))
    opts = options_from_config(cfg, None, device_name="NVIDIA H100 80GB HBM3")
    assert [w for w in opts.warnings if "stale" in w] == [f"policy {f}: stale: measured before the fused experts"], \
        opts.warnings
    cfg2 = load_config(None, ["selective.selective_fp8=true", f"selective.fp8_dynamic_policy_path={f}", "selective.fp8_dynamic_num_tokens=16384"])
    assert options_from_config(cfg2).num_tokens == 16384


def test_per_component_policies_for_a_vlm(tmp_path):
    """A vision encoder and an LLM take their own policy and token count (LoongForge adaptive FP8, VLMs)."""
    from transformers import AutoConfig, Qwen2_5_VLForConditionalGeneration

    cfg = AutoConfig.for_model(
        "qwen2_5_vl",
        text_config={"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 1024},
        vision_config={"depth": 2, "hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "out_hidden_size": 256},
    )
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    llm_p = tmp_path / "llm.json"
    vit_p = tmp_path / "vit.json"
    rule = lambda n: {"version": 1, "rules": {"layernorm_column": {"qkv": [{"tp": 1, "min_tokens": n, "measured_speedup": 1.1}]}}}  # noqa: E731
    llm_p.write_text(json.dumps(rule(4096)))
    vit_p.write_text(json.dumps(rule(1024)))
    run_cfg = load_config(None, [
        "selective.selective_fp8=true", f"selective.fp8_dynamic_policy_path={llm_p}", f'selective.component_policy_paths={{vision="{vit_p}"}}',
        "selective.component_num_tokens={vision=2048}", "data.seq_length=2048", "train.micro_batch_size=1",
    ])
    d = {x.fqn: x for x in decide(find_sites(model), options_from_config(run_cfg))}
    vis = [x for x in d.values() if x.site.component == "vision" and x.site.ub_name == "qkv"]
    llm = [x for x in d.values() if x.site.component == "llm" and x.site.ub_name == "qkv"]
    assert vis and llm
    assert all(x.is_fp8 and x.num_tokens == 2048 for x in vis), [x.reason for x in vis]  # 2048 >= 1024
    assert all(not x.is_fp8 and x.num_tokens == 2048 for x in llm), [x.reason for x in llm]  # 2048 < 4096


def test_every_shipped_policy_is_measured_with_static_shapes_and_listed_without_a_note(capsys):
    """``plan --list-policies`` names every shipped policy. Since session 30 every shipped H100 policy is merged from
    reports compiled with static shapes (``compile_shapes = "static"``, bench-layers' default since session 28), so
    none carries the dynamic-compile note; a policy regenerated the old way would fail here."""
    from fp8kit.cli.main import main

    assert main(["plan", "--list-policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"builtin:{name}" for name in list_builtin_policies()], lines
    for name in list_builtin_policies():
        reports = load_policy(f"builtin:{name}").metadata["reports"]
        dynamic = [r["name"] for r in reports if r.get("compile_shapes") != "static"]
        assert reports and not dynamic, (name, dynamic)


def test_list_policies_shows_a_policys_note(capsys, monkeypatch, tmp_path):
    """A policy merged from a dynamic-shape report is listed with its note, which names that report."""
    from fp8kit.cli.main import main
    from fp8kit.selective import policy as policy_mod

    curves = {("layernorm_column", "qkv", 1, None): {1024: 0.9, 4096: 1.2}}
    static = {**_report(curves=curves), "compiled": True, "compile_shapes": "static"}
    dynamic = {**_report(curves=curves, tp=2), "compiled": True, "compile_shapes": "dynamic"}
    merge_reports([("s.json", static)]).save(tmp_path / "a_static.json")
    merge_reports([("s.json", static), ("dyn_tp2.json", dynamic)]).save(tmp_path / "b_dynamic.json")
    monkeypatch.setattr(policy_mod, "builtin_policy_dir", lambda: tmp_path)
    assert main(["plan", "--list-policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "builtin:a_static", lines
    assert lines[1].startswith("builtin:b_dynamic  (note: FP8 timed with a dynamic-shape compile (dyn_tp2.json)"), lines
    assert len(lines) == 2, lines


def test_merge_notes_reports_compiled_with_a_dynamic_token_dimension():
    """A policy merged from a compiled report that is not ``compile_shapes = "static"`` (``--dynamic``, or written
    before the field existed) says it under-uses FP8 and names the report; static or CPU (eager) reports do not."""
    curves = {("layernorm_column", "qkv", 1, None): {1024: 0.9, 4096: 1.2}}
    static = {**_report(curves=curves), "compiled": True, "compile_shapes": "static"}
    old = {**_report(curves=curves, tp=2), "compiled": True}
    dynamic = {**_report(curves=curves, tp=4), "compiled": True, "compile_shapes": "dynamic"}
    assert "note" not in merge_reports([("s.json", static)]).metadata
    note = merge_reports([("s.json", static), ("old.json", old), ("dyn.json", dynamic)]).metadata["note"]
    assert note.startswith("FP8 timed with a dynamic-shape compile (old.json, dyn.json)"), note
    meta = merge_reports([("s.json", static), ("old.json", old)]).metadata["reports"]
    assert [r["compile_shapes"] for r in meta] == ["static", "dynamic"], meta
    cpu = {**_report(curves=curves), "device_type": "cpu", "compiled": False}
    assert merge_reports([("cpu.json", cpu)]).metadata["note"] == "CPU timings: for testing the workflow, not for a GPU policy"
    both = merge_reports([("cpu.json", cpu), ("dyn.json", dynamic)]).metadata["note"]
    assert both.startswith("CPU timings") and "; FP8 timed with a dynamic-shape compile (dyn.json)" in both, both
