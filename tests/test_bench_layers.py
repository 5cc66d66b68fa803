"""bench-layers measures the run config's recipe and [distributed] sizes unless a flag overrides them (CPU).

Every run is the tiny preset with one layer, one sweep point of 64 tokens and one timed iteration: the
tests check what is measured (the recipe of the timed Float8Linear modules, the per-rank shapes, the
policy key), not how fast.
"""

from __future__ import annotations

import json

import pytest
import torch

from fp8kit.bench.layers import (
    BenchLayersArgs,
    build_site_module,
    float8_linear_scaling,
    run_bench_layers,
)
from fp8kit.bench.sites import layer_sites
from fp8kit.cli.main import main
from fp8kit.config import ModelConfig
from fp8kit.fp8.delayed_state import FUSED_CASTS
from fp8kit.fp8.recipes import RECIPE_NAMES, RECIPES

TINY = ["--set", "model.num_layers=1", "--set", "data.vocab_size=1024"]
FAST = ["--device", "cpu", "--shape-sweep", "64x1", "--warmup", "0", "--iters", "1"]
CPU = torch.device("cpu")
# torchao Float8LinearConfig per recipe: (input, grad_output, input_for_grad_weight) casts
EXPECTED_CASTS = {
    "tensorwise": ("tensorwise", "tensorwise", "tensorwise"),
    "rowwise": ("axiswise", "axiswise", "axiswise"),
    "rowwise_with_gw_hp": ("axiswise", "axiswise", "high precision"),
}


def _config(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def _bench(capsys, tmp_path, argv) -> tuple[dict, str]:
    report = tmp_path / "report.json"
    code = main(["bench-layers", *argv, *TINY, *FAST, "--report", str(report)])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(report.read_text()), out.out


@pytest.mark.parametrize("recipe", [r for r in RECIPE_NAMES if RECIPES[r].engine == "torchao"])
def test_site_module_is_built_from_the_recipe(recipe):
    """The FP8 site module's Float8Linear casts are the recipe's (torchao Float8LinearConfig.from_recipe_name)."""
    from torchao.float8.float8_linear import Float8Linear

    sites, _ = layer_sites(ModelConfig(num_layers=1), 1024)
    qkv = next(s for s in sites if s.name == "qkv")
    module = build_site_module(qkv, "fp8", recipe, CPU)
    assert len(module.linears) == 3 and all(isinstance(lin, Float8Linear) for lin in module.linears), module
    cfg = module.linears[0].config
    got = (cfg.cast_config_input.scaling_granularity.value, cfg.cast_config_grad_output.scaling_granularity.value,
           "high precision" if cfg.cast_config_input_for_grad_weight.scaling_type.value == "disabled"
           else cfg.cast_config_input_for_grad_weight.scaling_granularity.value)
    assert got == EXPECTED_CASTS[recipe], f"{recipe}: casts {got}"
    scaling = float8_linear_scaling(module)
    assert (scaling["input"], scaling["grad_output"], scaling["input_for_grad_weight"]) == EXPECTED_CASTS[recipe]
    assert float8_linear_scaling(build_site_module(qkv, "bf16", recipe, CPU)) is None
    # the module runs forward + backward in its recipe (gradients reach the input)
    x = torch.randn(32, 256, dtype=torch.bfloat16, requires_grad=True)
    torch.autograd.backward(module(x), [torch.ones(32, n, dtype=torch.bfloat16) for _, n in qkv.gemms])
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def test_blockwise_site_module_is_fp8kits_blockwise_linear():
    """recipe blockwise builds fp8kit's Float8BlockwiseLinear (1x128 / 128x128) and runs fwd + bwd."""
    from fp8kit.fp8.linear import Float8BlockwiseLinear

    sites, _ = layer_sites(ModelConfig(num_layers=1), 1024)
    qkv = next(s for s in sites if s.name == "qkv")
    module = build_site_module(qkv, "fp8", "blockwise", CPU)
    assert all(isinstance(lin, Float8BlockwiseLinear) for lin in module.linears), module
    assert float8_linear_scaling(module)["weight"] == "128x128"
    x = torch.randn(32, 256, dtype=torch.bfloat16, requires_grad=True)
    torch.autograd.backward(module(x), [torch.ones(32, n, dtype=torch.bfloat16) for _, n in qkv.gemms])
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def test_delayed_site_module_is_fp8kits_delayed_linear():
    """recipe delayed builds fp8kit's Float8DelayedLinear (not the blockwise linear) and runs fwd + bwd twice
    (the second call scales from the first call's amax history)."""
    from fp8kit.fp8.delayed import Float8DelayedLinear

    sites, _ = layer_sites(ModelConfig(num_layers=1), 1024)
    fc1 = next(s for s in sites if s.name == "fc1")
    module = build_site_module(fc1, "fp8", "delayed", CPU)
    assert all(isinstance(lin, Float8DelayedLinear) for lin in module.linears), module
    assert float8_linear_scaling(module)["recipe"] == "delayed"
    for _ in range(2):
        x = torch.randn(32, 256, dtype=torch.bfloat16, requires_grad=True)
        torch.autograd.backward(module(x), [torch.ones(32, n, dtype=torch.bfloat16) for _, n in fc1.gemms])
        assert x.grad is not None and torch.isfinite(x.grad.float()).all()


def test_run_bench_layers_times_the_recipe_it_is_given():
    """The report's fp8_linear_scaling is read back from the Float8Linear modules that were timed."""
    args = BenchLayersArgs(model=ModelConfig(num_layers=1), vocab_size=1024, recipe="rowwise",
                           sources={"recipe": "test"}, precisions=("fp8",), warmup=0, iters=1,
                           shape_sweep=[(64, 1)], device="cpu")
    rep = run_bench_layers(args)
    assert rep["recipe"] == "rowwise" and rep["sources"]["recipe"] == "test", rep["sources"]
    assert rep["fp8_linear_scaling"]["input"] == "axiswise", rep["fp8_linear_scaling"]
    assert {m["site"] for m in rep["measurements"]} == {"qkv", "proj", "fc1", "fc2"}


def test_config_recipe_is_measured_without_recipe_flag(capsys, tmp_path):
    cfg = _config(tmp_path, '[fp8]\nrecipe = "rowwise"\n')
    rep, out = _bench(capsys, tmp_path, [str(cfg), "--precisions", "fp8"])
    assert rep["recipe"] == "rowwise", rep["recipe"]
    assert rep["sources"] == {"recipe": f"config file {cfg}", "tp": "default", "ep": "default"}, rep["sources"]
    assert rep["fp8_linear_scaling"]["input"] == "axiswise", rep["fp8_linear_scaling"]
    assert rep["fp8_linear_scaling"]["weight"] == "axiswise", rep["fp8_linear_scaling"]
    assert len(rep["measurements"]) == 4 and all(m["ms"] > 0 for m in rep["measurements"])
    assert f"recipe rowwise (config file {cfg})" in " ".join(out.split()), out


def test_recipe_flag_overrides_the_config(capsys, tmp_path):
    cfg = _config(tmp_path, '[fp8]\nrecipe = "rowwise"\n')
    rep, out = _bench(capsys, tmp_path, [str(cfg), "--recipe", "tensorwise", "--precisions", "fp8"])
    assert rep["recipe"] == "tensorwise" and rep["sources"]["recipe"] == "--recipe", rep["sources"]
    assert rep["fp8_linear_scaling"]["input"] == "tensorwise", rep["fp8_linear_scaling"]
    assert "recipe tensorwise (--recipe)" in " ".join(out.split()), out


def test_recipe_sources_set_variable_default(capsys, tmp_path, monkeypatch):
    cfg = _config(tmp_path, '[fp8]\nrecipe = "rowwise"\n')
    rep, _ = _bench(capsys, tmp_path, [str(cfg), "--set", "fp8.recipe=rowwise_with_gw_hp", "--precisions", "bf16"])
    assert rep["recipe"] == "rowwise_with_gw_hp", rep["recipe"]
    assert rep["sources"]["recipe"] == "--set fp8.recipe=rowwise_with_gw_hp", rep["sources"]
    assert rep["fp8_linear_scaling"] is None  # no FP8 module timed
    rep, _ = _bench(capsys, tmp_path, ["--precisions", "bf16"])
    assert rep["recipe"] == "tensorwise" and rep["sources"]["recipe"] == "default", rep["sources"]
    monkeypatch.setenv("TE_LAYER_PERF_FP8_RECIPE", "rowwise")  # the variable counts as the flag
    rep, _ = _bench(capsys, tmp_path, ["--precisions", "bf16"])
    assert rep["recipe"] == "rowwise" and rep["sources"]["recipe"] == "$TE_LAYER_PERF_FP8_RECIPE", rep["sources"]


def test_config_tp_is_the_policy_key(capsys, tmp_path):
    """[distributed] tp = 2 without --tp: the per-rank shapes of TP 2 are timed and the policy rules say tp=2."""
    cfg = _config(tmp_path, "[distributed]\ntp = 2\n")
    policy = tmp_path / "policy.json"
    rep, out = _bench(capsys, tmp_path, [str(cfg), "--simulate-tp", "--policy", str(policy),
                                         "--speedup-threshold", "0.001"])
    assert rep["tp"] == 2 and rep["simulated_tp"] is True and rep["sources"]["tp"] == f"config file {cfg}", rep
    qkv = next(s for s in rep["sites"] if s["name"] == "qkv")
    assert qkv["gemms"] == [[256, 128], [256, 64], [256, 64]], qkv  # column-parallel: N / 2
    assert {m["tp"] for m in rep["measurements"]} == {2}
    p = json.loads(policy.read_text())
    assert {r["tp"] for r in p["rules"]["layernorm_column"]["qkv"]} == {2}, p["rules"]
    assert f"tp 2 (config file {cfg}; simulated on one device)" in " ".join(out.split()), out
    # --tp wins over the config
    rep, _ = _bench(capsys, tmp_path, [str(cfg), "--simulate-tp", "--tp", "1", "--precisions", "bf16"])
    assert rep["tp"] == 1 and rep["sources"]["tp"] == "--tp", rep["sources"]


def test_config_ep_splits_the_experts(capsys, tmp_path):
    cfg = _config(tmp_path, '[model]\npreset = "tiny-moe"\n[distributed]\nep = 2\n')
    rep, _ = _bench(capsys, tmp_path, [str(cfg), "--precisions", "bf16"])
    assert rep["ep"] == 2 and rep["sources"]["ep"] == f"config file {cfg}", rep["sources"]
    grouped = [s for s in rep["sites"] if s["num_gemms"] is not None]
    assert grouped and all(s["num_gemms"] == 4 for s in grouped), grouped  # 8 experts / ep 2


def test_config_tp_without_processes_names_its_source(capsys, tmp_path):
    cfg = _config(tmp_path, "[distributed]\ntp = 2\n")
    code = main(["bench-layers", str(cfg), *TINY, *FAST])
    err = capsys.readouterr().err
    assert code == 2 and f"tp 2 (config file {cfg}) times the real tensor-parallel layer" in err, err


def test_suspect_points_flag_the_spike_of_a_real_report():
    """The session-14 delayed TP 1 report's proj bf16 sweep had one disturbed point (1024 tokens); only it is flagged."""
    from fp8kit.bench.timing import suspect_points

    tokens = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    ms = [0.0667, 0.0862, 1.4029, 0.2684, 0.5218, 1.0278, 2.0687, 4.2799]  # H100, as measured
    assert suspect_points(tokens, ms) == [2]
    smooth = [0.152, 0.178, 0.241, 0.366, 0.618, 1.125, 2.118, 4.187]  # the fp8 sweep of the same site
    assert suspect_points(tokens, smooth) == []
    # order-free, None skipped; growth beyond linear x 1.25 flags the last point too
    assert suspect_points([4096, 1024, 2048], [1.0, 0.1, 0.2]) == [0]
    assert suspect_points([1024, 2048, 4096], [0.1, None, 0.3]) == []


def _spike_once(monkeypatch, timer_cls, at: int) -> list[float]:
    """Make ``timer_cls``'s first timing at ``at`` tokens 1000x too slow; the returned list gets that spiked value."""
    real_call, spiked = timer_cls.__call__, []

    def call(self, num_tokens):
        ms = real_call(self, num_tokens)
        if num_tokens == at and not spiked:
            spiked.append(ms * 1000)
            return spiked[0]
        return ms

    monkeypatch.setattr(timer_cls, "__call__", call)
    return spiked


def test_run_bench_layers_retimes_a_spiked_point_and_keeps_the_fastest(monkeypatch):
    """A point timed 1000x too slow once is timed again; the report keeps the re-timed value and the spike."""
    from fp8kit.bench import layers

    spiked = _spike_once(monkeypatch, layers._Timer, 128)
    args = BenchLayersArgs(model=ModelConfig(num_layers=1), vocab_size=1024, recipe="tensorwise",
                           precisions=("bf16",), warmup=0, iters=1,
                           shape_sweep=[(64, 1), (128, 1), (256, 1)], device="cpu")
    rep = run_bench_layers(args)
    (rec,) = [m for m in rep["measurements"] if m["site"] == "qkv" and m["num_tokens"] == 128]
    assert spiked and rec["timings"][0] == spiked[0] and len(rec["timings"]) >= 2, rec
    assert rec["ms"] == min(rec["timings"]) < spiked[0] / 10, (rec["ms"], spiked[0])
    assert rep["retime"] == 2
    rep_off = run_bench_layers(BenchLayersArgs(**{**args.__dict__, "retime": 0, "precisions": ("bf16",)}))
    assert not any("timings" in m for m in rep_off["measurements"])


def test_blockwise_sites_not_of_128_blocks_are_noted_not_fatal():
    """The tiny preset's MLP (intermediate 688) is not whole 128-blocks: its sites are left untimed in FP8 with
    the reason (training keeps them BF16), the attention sites are timed. (Qwen2.5-72B at TP 2, intermediate
    29568 / 2, stopped a policy run this way.)"""
    args = BenchLayersArgs(model=ModelConfig(num_layers=1), vocab_size=1024, recipe="blockwise",
                           precisions=("bf16", "fp8"), warmup=0, iters=1, shape_sweep=[(128, 1)], device="cpu")
    rep = run_bench_layers(args)
    fp8_sites = {m["site"] for m in rep["measurements"] if m["precision"] == "fp8"}
    assert fp8_sites == {"qkv", "proj"}, fp8_sites
    assert {m["site"] for m in rep["measurements"] if m["precision"] == "bf16"} == {"qkv", "proj", "fc1", "fc2"}
    noted = [n for n in rep["notes"] if "not timed" in n]
    assert len(noted) == 2 and all("multiples of 128" in n for n in noted), rep["notes"]


def test_fused_experts_are_timed_as_one_mlp_and_both_grouped_sites_carry_it(capsys, tmp_path):
    """Where the run's FP8 experts take the fused MLP path (``fp8.grouped_kernel = "fused"``; on a Hopper GPU
    ``auto``), gate_up and down are timed together as that MLP (``ExpertsMLPTimer``, ``auto``'s ``experts.mlp`` unit),
    in both precisions; both sites carry the unit's times, so the merged policy decides them alike. With the CPU's
    default (emulated) kernel each grouped site is timed alone, as before."""
    from fp8kit.moe.grouped_mm import GroupedGemmConfig
    from fp8kit.selective.policy import merge_reports

    fused = GroupedGemmConfig.for_fp8_recipe("tensorwise", kernel="fused", wgrad="fp8")
    args = BenchLayersArgs(model=ModelConfig(preset="tiny-moe", num_layers=1), vocab_size=1024, recipe="tensorwise",
                           warmup=0, iters=1, shape_sweep=[(32, 1), (64, 1)], device="cpu", retime=0, grouped=fused)
    rep = run_bench_layers(args)
    grouped = [m for m in rep["measurements"] if m["num_gemms"] is not None]
    assert len(grouped) == 8, grouped  # 2 sites x 2 precisions x 2 points, none twice
    by_kind = {k: {(m["precision"], m["num_tokens"]): m for m in grouped if m["module_kind"] == k}
               for k in ("column_grouped", "row_grouped")}
    assert len(by_kind["column_grouped"]) == len(by_kind["row_grouped"]) == 4, grouped  # 2 precisions x 2 points
    (h, two_i), = next(s for s in rep["sites"] if s["module_kind"] == "column_grouped")["gemms"]
    for key, up in by_kind["column_grouped"].items():
        down = by_kind["row_grouped"][key]
        assert up["unit"] == down["unit"] == "experts.mlp" and up["ms"] == down["ms"] > 0, (up, down)
        unit_tflops = 6 * up["num_tokens"] * (h * two_i + two_i // 2 * h) / (up["ms"] * 1e-3) / 1e12
        assert up["tflops"] == pytest.approx(unit_tflops) and down["tflops"] == pytest.approx(unit_tflops), (up, down)
        assert up["unit_sites"] == [up["site"], down["site"]], up
    assert rep["grouped"] == {"kernel": "fused", "wgrad": "fp8", "gemm": "auto"}, rep["grouped"]
    assert rep["fast_accum"] == ["fprop"], rep["fast_accum"]  # the dense linears' (the recipe's default here)
    assert any("timed together as the experts' MLP" in n and "tokens routed top-2" in n for n in rep["notes"]), \
        rep["notes"]
    policy = merge_reports([("unit", rep)], 0.0)
    up_rules, down_rules = policy.grouped.get("column_grouped", []), policy.grouped.get("row_grouped", [])
    assert [(r.min_tokens, r.measured_speedup) for r in up_rules] == [
        (r.min_tokens, r.measured_speedup) for r in down_rules], (up_rules, down_rules)
    # the CPU default: emulated experts, each grouped site its own GEMMs, no unit
    plain = run_bench_layers(BenchLayersArgs(**{**args.__dict__, "grouped": None, "precisions": ("bf16",)}))
    g = [m for m in plain["measurements"] if m["num_gemms"] is not None]
    assert g and not any("unit" in m for m in g) and plain["grouped"]["kernel"] == "auto", g
    ups = {m["num_tokens"]: m["ms"] for m in g if m["module_kind"] == "column_grouped"}
    assert len(ups) == 2, g


def test_config_grouped_kernel_reaches_bench_layers(capsys, tmp_path):
    """``fp8.grouped_kernel`` / ``grouped_wgrad`` / ``grouped_gemm`` of the run config decide how bench-layers times
    the experts (here fused: one MLP unit), and the report records them."""
    cfg = _config(tmp_path, '[model]\npreset = "tiny-moe"\n[fp8]\ngrouped_kernel = "fused"\ngrouped_wgrad = "fp8"\n')
    rep, _ = _bench(capsys, tmp_path, [str(cfg), "--precisions", "bf16"])
    assert rep["grouped"] == {"kernel": "fused", "wgrad": "fp8", "gemm": "auto"}, rep["grouped"]
    units = {m["module_kind"] for m in rep["measurements"] if m.get("unit") == "experts.mlp"}
    assert units == {"column_grouped", "row_grouped"}, rep["measurements"]


def test_a_retimed_unit_point_reaches_both_expert_sites(monkeypatch):
    """A spiked experts.mlp point is timed again; both the gate_up and the down site keep the re-timed ms, with
    TFLOP/s of that ms (the down site copies the unit's records after the re-timing)."""
    from fp8kit.bench import layers
    from fp8kit.moe.grouped_mm import GroupedGemmConfig

    spiked = _spike_once(monkeypatch, layers._ExpertsMLPSiteTimer, 256)
    args = BenchLayersArgs(model=ModelConfig(preset="tiny-moe", num_layers=1), vocab_size=1024, recipe="tensorwise",
                           precisions=("bf16",), warmup=0, iters=1, shape_sweep=[(64, 1), (128, 1), (256, 1)],
                           device="cpu", retime=2,
                           grouped=GroupedGemmConfig.for_fp8_recipe("tensorwise", kernel="fused", wgrad="fp8"))
    rep = run_bench_layers(args)
    recs = [m for m in rep["measurements"] if m.get("unit") == "experts.mlp" and m["num_tokens"] == 256]
    assert len(recs) == 2 and {m["module_kind"] for m in recs} == {"column_grouped", "row_grouped"}, recs
    (h, two_i), = next(s for s in rep["sites"] if s["module_kind"] == "column_grouped")["gemms"]
    for m in recs:  # 256 pairs: the (128, 1) point at top-2
        assert spiked and m["timings"][0] == spiked[0] and m["ms"] == min(m["timings"]) < spiked[0] / 10, m
        tflops = 6 * 256 * (h * two_i + two_i // 2 * h) / (m["ms"] * 1e-3) / 1e12  # of the re-timed ms
        assert m["tflops"] == pytest.approx(tflops), (m, tflops)
    assert recs[0]["ms"] == recs[1]["ms"], recs


def test_sites_compile_each_token_count_for_its_static_shape_unless_dynamic():
    """Default (``dynamic = False``): every token count of a sweep is its own static-shape compile, as training
    compiles its one shape (a dynamic compile timed Qwen3's FP8 qkv 1.6x slower than training runs it on the
    H100); ``dynamic = True``: one compile serves the sweep. Counted by dynamo's compiled frames."""
    from torch._dynamo.utils import counters

    from fp8kit.bench.layers import _Timer
    from fp8kit.bench.sites import BenchSite

    torch._dynamo.reset()
    site = BenchSite("llm", "column", "qkv", [(64, 64)], [(64, 64)], tp=1)
    frames = {}
    for dynamic in (False, True):
        args = BenchLayersArgs(model=ModelConfig(), vocab_size=0, warmup=0, iters=1, compile=True, dynamic=dynamic,
                               device="cpu")
        timer = _Timer(site, "bf16", args, torch.device("cpu"))
        before = counters["frames"]["ok"]
        for tokens in (32, 64, 128, 64):
            assert timer(tokens) > 0
        frames[dynamic] = counters["frames"]["ok"] - before
    assert frames == {False: 4, True: 1}, f"compiled frames per sweep of 4 points (static, dynamic): {frames}"


@pytest.mark.parametrize("flags,expected", [([], None), (["--compile"], "static"),
                                             (["--compile", "--dynamic"], "dynamic")])
def test_the_report_says_how_its_sites_were_compiled(capsys, tmp_path, flags, expected):
    """``compile_shapes`` in the report (what ``merge-policy`` reads for its note): None when eager (the CPU
    default), ``static`` by default when compiled, ``dynamic`` with ``--dynamic``."""
    rep, _ = _bench(capsys, tmp_path, [*flags, "--precisions", "bf16"])
    assert rep["compiled"] is bool(flags) and rep["compile_shapes"] == expected, (rep["compiled"], rep["compile_shapes"])


def test_delayed_sites_are_timed_with_the_runs_fused_cast(tmp_path):
    """``fp8.delayed_fused_cast`` reaches the timed delayed linears (``BenchLayersArgs.delayed_fused_cast``, from
    ``bench-layers`` and ``auto``) and ``auto``'s cache key; the default's key is unchanged."""
    from fp8kit.bench.auto import FP8SiteOptions, shape_keys, shape_recipe_key
    from fp8kit.bench.layers import _Timer
    from fp8kit.selective.auto import AutoShape

    sites, _ = layer_sites(ModelConfig(num_layers=1), 1024)
    fc1 = next(s for s in sites if s.name == "fc1")
    for fused in ("none", "all"):
        args = BenchLayersArgs(model=ModelConfig(num_layers=1), vocab_size=1024, recipe="delayed", warmup=0, iters=1,
                               compile=False, delayed_fused_cast=fused)
        timer = _Timer(fc1, "fp8", args, CPU)
        assert timer.module.delayed_state.config.fused_cast == fused
        assert [lin._fused_casts() for lin in timer.module.linears][0] == FUSED_CASTS[fused]
        assert timer(32) > 0
    shape = AutoShape(gemms=((4096, 4096),), num_tokens=8192)
    assert shape_recipe_key(shape, FP8SiteOptions("delayed"), None) == "delayed:fast_accum=fprop+wgrad"
    assert shape_recipe_key(shape, FP8SiteOptions("delayed", fused_cast="all"), None) == \
        "delayed:fast_accum=fprop+wgrad:fused_cast=all"
    assert shape_recipe_key(shape, FP8SiteOptions("blockwise", fused_cast="all"), None) == "blockwise"  # the delayed recipe's only
    grouped = AutoShape(gemms=((4096, 4096),), num_tokens=8192, num_gemms=8)
    assert ":fused_cast" not in shape_recipe_key(grouped, FP8SiteOptions("delayed", fused_cast="all"), "grouped:rowwise")
    keys = [shape_keys([shape], FP8SiteOptions("delayed", fused_cast=f), device=CPU, tp=1, ep=1, compiled=False)[shape]
            for f in ("none", "grad_output")]
    assert keys[0] != keys[1], keys
