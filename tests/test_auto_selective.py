"""``selective.selective_fp8 = "auto"``: units and shapes, the decision from a measured table, the cache, the
CPU measurement path (real timings at tiny shapes, not asserted), the CPU fallback, bad values (CPU)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fp8kit.base.errors import CapabilityError, ConfigError
from fp8kit.bench.auto import FP8SiteOptions, lookup_cached, measure_shapes, resolve_auto
from fp8kit.config import FP8Config, ModelConfig, SelectiveConfig, load_config
from fp8kit.config.options import decide_options, options_from_config
from fp8kit.models.build import build_hf_config, build_model
from fp8kit.selective.auto import (
    AutoShape,
    Timing,
    auto_units,
    auto_verdict,
    distinct_shapes,
    slower_in_fp8,
)
from fp8kit.selective.auto_cache import AutoCache, cache_key, key_digest
from fp8kit.selective.decide import decide
from fp8kit.selective.sites import find_sites

CPU = torch.device("cpu")
VERSIONS = {"torch": "2.11.0", "torchao": "0.18.0", "fp8kit": "0.1.0", "cuda": "12.8", "triton": "3.6.0"}


def _tiny_sites(preset: str = "tiny", layers: int = 1):
    return find_sites(build_model(ModelConfig(preset=preset, num_layers=layers), 1024, device="meta"))


def _auto_options(tokens: int = 64, **selective):
    return decide_options(FP8Config(), SelectiveConfig(**selective), num_tokens=tokens)


def _with_table(options, table):
    return replace(options, auto=replace(options.auto, timings=table))


def _units(sites, options, tp=1, ep=1):
    fp8 = [d.site for d in decide(sites, options) if d.is_fp8]
    return auto_units(fp8, tp=tp, ep=ep, num_tokens=options.auto.num_tokens, topk=options.auto.topk)


def test_llama3_8b_has_four_distinct_shapes():
    """224 candidate linears of Llama-3-8B -> 32 x 4 units -> 4 shapes timed (per-rank shapes under TP 2)."""
    sites = find_sites(build_model(ModelConfig(preset="llama3-8b"), 128256, device="meta"))
    options = _auto_options(tokens=8192)
    units = _units(sites, options)
    assert len(units) == 32 * 4 and sum(len(u.fqns) for u in units) == 224, len(units)
    shapes = distinct_shapes(units)
    got = {tuple(u.name for u in us): s.gemms for s, us in shapes.items()}
    assert got == {
        ("qkv",) * 32: ((4096, 4096), (4096, 1024), (4096, 1024)), ("proj",) * 32: ((4096, 4096),),
        ("fc1",) * 32: ((4096, 14336), (4096, 14336)), ("fc2",) * 32: ((14336, 4096),),
    }, got
    assert {s.num_tokens for s in shapes} == {8192}
    tp2 = {us[0].name: s.gemms for s, us in distinct_shapes(_units(sites, options, tp=2)).items()}
    assert tp2["qkv"] == ((4096, 2048), (4096, 512), (4096, 512)) and tp2["fc2"] == ((7168, 4096),), tp2


def test_a_site_measured_slower_in_fp8_stays_bf16():
    """decide() is a pure function of (sites, table): injected timings decide, no timing runs."""
    sites = _tiny_sites()
    options = _auto_options()
    by_name = {us[0].name: s for s, us in distinct_shapes(_units(sites, options)).items()}
    table = {
        by_name["qkv"]: Timing(1.0, 2.0),  # FP8 0.50x: bf16
        by_name["fc1"]: Timing(2.0, 1.0),  # FP8 2.00x: fp8
        by_name["fc2"]: Timing(1.03, 1.0, source="cache"),  # 1.03x < 1.05: bf16
    }  # proj not measured: its static rule
    d = {x.fqn: x for x in decide(sites, _with_table(options, table))}
    q = d["model.layers.0.self_attn.q_proj"]
    assert not q.is_fp8 and q.rule == "auto" and "FP8 0.50x BF16" in q.reason and q.reason.endswith("-> bf16"), q
    assert q.measured == table[by_name["qkv"]] and q.to_dict()["measured"]["speedup"] == 0.5
    assert all(d[f"model.layers.0.mlp.{n}_proj"].is_fp8 for n in ("gate", "up"))
    down = d["model.layers.0.mlp.down_proj"]
    assert not down.is_fp8 and "1.03x" in down.reason and "cached" in down.reason, down.reason
    o = d["model.layers.0.self_attn.o_proj"]
    assert o.is_fp8 and o.rule == "linear" and o.reason.endswith("auto: not measured yet"), o.reason
    assert not d["lm_head"].is_fp8 and d["lm_head"].rule == "head"
    # the margin is the config's: 1.0 takes fc2's 1.03x
    options1 = _auto_options(auto_min_speedup=1.0)
    d1 = {x.fqn: x for x in decide(sites, _with_table(options1, table))}
    assert d1["model.layers.0.mlp.down_proj"].is_fp8
    # without a table, auto leaves the static decisions untouched
    assert [x.precision for x in decide(sites, options)] == [x.precision for x in decide(
        sites, decide_options(FP8Config(), None, num_tokens=64))]


def test_auto_verdict_errors_and_forced_warning_rows():
    assert auto_verdict(Timing(1.0, None, error="fp8: no kernel"), 1.05, 64) == (
        False, "auto: not timed (fp8: no kernel) -> bf16")
    assert auto_verdict(None, 1.05, 64)[0] is None
    sites = _tiny_sites()
    units = _units(sites, _auto_options())
    shapes = list(distinct_shapes(units))
    slow = slower_in_fp8(units, {shapes[0]: Timing(1.0, 1.25), shapes[1]: Timing(1.0, 0.5)},
                         {s.fqn for s in sites})
    assert slow == [("qkv", 0.8, 64)], slow


def test_cache_key_changes_with_recipe_gpu_versions_and_shape():
    shape = AutoShape(((4096, 4096),), 8192)
    base = dict(device="NVIDIA H100 80GB HBM3", versions=VERSIONS, recipe="tensorwise", tp=1, ep=1, compiled=True)
    ref = key_digest(cache_key(shape, **base))
    assert key_digest(cache_key(shape, **base)) == ref  # stable
    variants = {
        "recipe": {**base, "recipe": "blockwise"},
        "gpu": {**base, "device": "NVIDIA H200"},
        "torch": {**base, "versions": {**VERSIONS, "torch": "2.12.0"}},
        "torchao": {**base, "versions": {**VERSIONS, "torchao": "0.19.0"}},
        "fp8kit": {**base, "versions": {**VERSIONS, "fp8kit": "0.2.0"}},
        "tp": {**base, "tp": 2},
        "ep": {**base, "ep": 2},
        "compiled": {**base, "compiled": False},
    }
    digests = {name: key_digest(cache_key(shape, **kw)) for name, kw in variants.items()}
    digests["tokens"] = key_digest(cache_key(AutoShape(((4096, 4096),), 4096), **base))
    digests["dtype"] = key_digest(cache_key(shape, dtype="float16", **base))
    assert ref not in digests.values() and len(set(digests.values())) == len(digests), digests
    # a library that does not change GEMM speed is not part of the key
    assert key_digest(cache_key(shape, **{**base, "versions": {**VERSIONS, "transformers": "9"}})) == ref


def _cpu_shapes():
    """The tiny preset's 4 dense shapes at 32 tokens + one grouped shape of tiny-moe (emulated FP8 on CPU)."""
    dense = [(s, us[0].name) for s, us in distinct_shapes(_units(_tiny_sites(), _auto_options(32))).items()]
    return dense + [(AutoShape(((64, 128),), 64, 4), "fc1 experts")]


def test_measurement_runs_on_cpu_then_the_cache_is_hit(tmp_path):
    """Real CPU timings at tiny shapes (values not asserted), then a second run reads every shape from the cache:
    nothing is measured (counter) and no file is rewritten (mtime)."""
    cache = AutoCache(tmp_path)
    shapes = _cpu_shapes()
    kw = dict(device=CPU, tp=1, ep=1, cache=cache, compile=False, warmup=0, iters=1)
    seen = []
    tw = FP8SiteOptions("tensorwise")
    first = measure_shapes(shapes, tw, progress=lambda done, total, what: seen.append((done, total)), **kw)
    assert first.measured == len(shapes) == 5 and first.cached == 0 and first.warnings == [], first
    assert seen[-1] == (10, 10) and len(seen) == 11, seen  # bf16 + fp8 per shape, then done
    assert all(t.source == "measured" and t.error is None and t.bf16_ms > 0 and t.fp8_ms > 0
               for t in first.timings.values()), first.timings
    files = sorted(cache.dir.glob("*.json"))
    assert len(files) == 5, files
    mtimes = {f: f.stat().st_mtime_ns for f in files}
    second = measure_shapes(shapes, tw, **kw)
    assert second.measured == 0 and second.cached == 5 and second.warnings == [], second
    assert {s: (t.bf16_ms, t.fp8_ms) for s, t in second.timings.items()} == {
        s: (t.bf16_ms, t.fp8_ms) for s, t in first.timings.items()}
    assert all(t.source == "cache" for t in second.timings.values())
    assert {f: f.stat().st_mtime_ns for f in files} == mtimes
    # another recipe is another key: measured again
    assert measure_shapes(shapes[:1], FP8SiteOptions("rowwise"), **kw).measured == 1


@pytest.mark.parametrize("content, problem", [
    ("{not json", "is unreadable"),
    ('{"format": "fp8kit-auto-timing", "version": 3, "key": {}, "bf16_ms": 1.0, "fp8_ms": 1.0}',
     "holds another key than its name says"),
    ('{"format": "fp8kit-auto-timing", "version": 2, "key": {}, "bf16_ms": 1.0, "fp8_ms": 1.0}',
     "has version 2, not 3"),
    (None, "has fp8_ms = -1.0, not a positive number of milliseconds"),
    ('["a list"]', "is not a fp8kit-auto-timing file"),
])
def test_a_corrupt_cache_file_warns_in_one_line_and_is_measured_again(tmp_path, content, problem):
    cache = AutoCache(tmp_path)
    shape = AutoShape(((32, 48),), 16)
    kw = dict(device=CPU, tp=1, ep=1, cache=cache, compile=False, warmup=0, iters=1)
    assert measure_shapes([(shape, "x")], FP8SiteOptions("tensorwise"), **kw).measured == 1
    (path,) = cache.dir.glob("*.json")
    if content is None:  # the right key, a bad value
        data = json.loads(path.read_text())
        data["fp8_ms"] = -1.0
        content = json.dumps(data)
    path.write_text(content)
    again = measure_shapes([(shape, "x")], FP8SiteOptions("tensorwise"), **kw)
    assert again.measured == 1 and again.cached == 0, again
    (w,) = again.warnings
    assert "\n" not in w and str(path) in w and problem in w and w.endswith("measuring again"), w
    assert measure_shapes([(shape, "x")], FP8SiteOptions("tensorwise"), **kw).cached == 1  # rewritten, trusted again


def test_selective_fp8_values_and_one_line_errors():
    assert load_config(None, []).selective.selective_fp8 == "auto"  # the default
    for text, mode in (("true", "policy"), ("on", "policy"), ("false", "off"), ("off", "off"), ("auto", "auto")):
        extra = ["selective.fp8_dynamic_policy_path=p.json"] if mode == "policy" else []
        assert load_config(None, [f"selective.selective_fp8={text}", *extra]).selective.selective_fp8 == mode
    assert SelectiveConfig(fp8_dynamic_policy_path="p.json").selective_fp8 == "policy"  # a path without the key
    assert SelectiveConfig(selective_fp8=False).model_dump()["selective_fp8"] is False  # saved as LoongForge writes it
    cases = [
        (["selective.selective_fp8=autoo"], "--set selective.selective_fp8=autoo: unknown value 'autoo' (did you "
         "mean 'auto'?); choose one of auto, policy, off"),
        (["selective.auto_min_speedup=0.9"], "--set selective.auto_min_speedup=0.9: must be >= 1.0, got 0.9"),
        (["selective.selective_fp8=auto", "selective.fp8_dynamic_policy_path=p.json"],
         "--set selective.selective_fp8=auto: is \"auto\" (measure at start-up) but a policy file is given too"),
    ]
    for overrides, expected in cases:
        with pytest.raises(ConfigError) as e:
            load_config(None, overrides)
        msg = str(e.value)
        assert msg.startswith(expected) and "\n" not in msg and "pydantic" not in msg, msg
    with pytest.raises(ConfigError) as e:
        SelectiveConfig(selective_fp8=2)
    assert "\n" not in str(e.value) and "selective.selective_fp8" in str(e.value), str(e.value)


def test_auto_on_the_cpu_falls_back_to_the_static_rules_loudly(tmp_path):
    cfg = load_config(None, ["model.num_layers=1", "data.vocab_size=1024", f"data.cache_dir={tmp_path}"])
    hf_cfg = build_hf_config(cfg.model, cfg.data.vocab_size)
    sites = find_sites(build_model(cfg.model, 1024, device="meta"))
    options = options_from_config(cfg, hf_cfg)
    static = decide(sites, options)
    out = resolve_auto(cfg, sites, static, options, CPU, emulated=False)
    assert out.decisions == static and not out.info["applied"], out.info
    (w,) = out.warnings
    assert w.startswith('selective.selective_fp8 = "auto" on the CPU') and "static rules decide" in w, w
    assert "7 of 9 sites in FP8" in w, w  # embedding and lm_head stay BF16
    assert not (tmp_path / "selective_auto").exists()  # nothing measured, nothing cached
    # selective_fp8 = false on the CPU: no warning, nothing looked up
    off = cfg.model_copy(update={"selective": SelectiveConfig(selective_fp8=False)})
    assert resolve_auto(off, sites, static, options_from_config(off, hf_cfg), CPU, emulated=False).warnings == []


def test_cached_timings_are_found_for_a_forced_run(tmp_path):
    """What `false` / a policy run warns from: the cache's timings of this run's units (no measuring)."""
    cfg = load_config(None, ["model.num_layers=1", "data.vocab_size=1024", f"data.cache_dir={tmp_path}",
                             "train.compile=false", "data.seq_length=16", "train.micro_batch_size=2"])
    sites = find_sites(build_model(cfg.model, 1024, device="meta"))
    options = options_from_config(cfg, build_hf_config(cfg.model, 1024))
    units = _units(sites, options)
    shapes = [(s, us[0].name) for s, us in distinct_shapes(units).items()]
    cache = AutoCache(tmp_path)  # data.cache_dir
    assert lookup_cached(units, cfg, CPU, cache) == {}
    measure_shapes(shapes[:2], FP8SiteOptions("tensorwise"), device=CPU, tp=1, ep=1, cache=cache, compile=False,
                   warmup=0, iters=1)
    found = lookup_cached(units, cfg, CPU, cache)
    assert set(found) == {s for s, _ in shapes[:2]} and all(t.source == "cache" for t in found.values())


def test_the_measured_path_decides_prints_and_records_on_cpu(tmp_path):
    """The CUDA path of resolve_auto run on the CPU (tiny shapes, real timings, values not asserted): every FP8
    candidate is decided by its unit's measurement, the table prints, the summary line names the ratios, and a
    second start-up reads everything from the cache."""
    from rich.console import Console

    from fp8kit.bench.auto import measure_and_decide
    from fp8kit.selective.report import auto_summary, print_auto_table

    cfg = load_config(None, ["model.preset=tiny-moe", "model.num_layers=1", "data.vocab_size=1024",
                             "data.seq_length=16", "train.micro_batch_size=2", "train.compile=false",
                             f"data.cache_dir={tmp_path}", "selective.auto_min_speedup=1.0"])
    hf_cfg = build_hf_config(cfg.model, 1024)
    sites = find_sites(build_model(cfg.model, 1024, device="meta"))
    options = options_from_config(cfg, hf_cfg)
    static = decide(sites, options)
    lines = []
    out = measure_and_decide(cfg, sites, static, options, CPU, AutoCache(tmp_path), status=lines.append,
                             warmup=0, iters=1)
    info = out.info
    assert info["applied"] and info["measured"] == info["shapes"] and info["cached"] == 0, info
    grouped = [r for r in info["rows"] if "experts" in r["shape"]]
    assert len(grouped) == 2 and all(r["error"] is None for r in grouped), info["rows"]  # gate_up and down
    assert "64 pairs" in grouped[0]["shape"] and grouped[0]["units"] == "experts.fc1", grouped  # 32 tokens x top-2
    assert lines[-1].startswith("selective_fp8 = auto ━") and "done" in lines[-1], lines[-1]
    by_fqn = {d.fqn: d for d in out.decisions}
    for d in static:
        new = by_fqn[d.fqn]
        if not d.is_fp8:
            assert new == d  # only FP8 candidates are re-decided
            continue
        assert new.rule == "auto" and new.measured is not None, new
        assert new.is_fp8 == (new.measured.speedup >= 1.0), (new.reason, new.measured)
    console = Console(record=True, width=200)
    print_auto_table(info, console)
    text = console.export_text()
    assert "selective_fp8 = auto: tensorwise vs BF16" in text and f"{info['shapes']} measured, 0 from the cache" in text
    assert auto_summary(info).startswith(f"selective_fp8 = auto on {info['device']}: qkv "), auto_summary(info)
    again = measure_and_decide(cfg, sites, static, options, CPU, AutoCache(tmp_path), warmup=0, iters=1)
    assert again.info["measured"] == 0 and again.info["cached"] == info["shapes"], again.info
    assert [d.precision for d in again.decisions] == [d.precision for d in out.decisions]


def test_plan_says_what_auto_does_without_a_gpu(capsys, tmp_path):
    from fp8kit.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("the note of a machine without a GPU")
    code = main(["plan", "--set", "model.num_layers=1", "--set", "data.vocab_size=1024"])
    out = capsys.readouterr().out
    assert code == 0 and "selective_fp8 = auto" in out and "static rules are shown" in " ".join(out.split()), out


@pytest.mark.slow
def test_cpu_train_records_the_fallback(small_run, tmp_path):
    from fp8kit.train.trainer import train

    cfg = load_config(None, [*small_run, "train.steps=2"])
    res = train(cfg, tmp_path / "run")
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["selective_auto"]["mode"] == "auto" and not info["selective_auto"]["applied"], info["selective_auto"]
    assert any(w.startswith('selective.selective_fp8 = "auto" on the CPU') for w in info["warnings"]), info["warnings"]
    header = json.loads((tmp_path / "run" / "conversion_report.json").read_text())["header"]
    assert header["selective_fp8"] == "auto" and "static rules decide" in header["warnings"], header
    assert "selective_fp8 = auto: not measured, static rules" in res.summary["fp8_sites"], res.summary["fp8_sites"]


def test_experts_running_the_fused_mlp_are_one_unit_timed_and_decided_together():
    """With the fused rowwise FP8 MLP (``fused_experts``), both expert weights of a layer are one ``experts.mlp``
    unit whose shape is the gated MLP (gate_up (H, 2I) -> down (I, H)) at the routed pairs; without it, or when
    only one weight is a candidate, or when the experts' gate is not the fused one, each weight is its own unit.
    A measured table then decides both weights alike."""
    sites = _tiny_sites("tiny-moe", layers=2)
    options = _auto_options(tokens=32)
    fp8 = [d.site for d in decide(sites, options) if d.is_fp8]
    kw = dict(tp=1, num_tokens=options.auto.num_tokens, topk=2)
    units = auto_units(fp8, ep=1, fused_experts=True, **kw)
    mlp = [u for u in units if u.name == "experts.mlp"]
    assert len(mlp) == 2 and all(len(u.fqns) == 2 for u in mlp), [(u.name, u.fqns) for u in units]
    shape = mlp[0].shape
    assert shape.mlp and shape.gemms == ((256, 256), (128, 256)) and shape.num_tokens == 64 and shape.num_gemms == 8
    assert shape.describe() == "8 experts, 64 pairs (top-2): MLP 256x256 -> 128x256", shape.describe()
    assert shape.topk == 2 and shape.to_dict()["topk"] == 2, shape  # timed with the run's routing, keyed by it
    ep2 = auto_units(fp8, ep=2, fused_experts=True, **kw)[-1].shape
    assert ep2.num_gemms == 4 and ep2.topk == 1 and "topk" not in ep2.to_dict(), ep2  # EP: one row per received token
    assert not any(u.shape.mlp for u in auto_units(fp8, ep=1, **kw))  # per weight: experts.fc1 / experts.fc2
    one = [s for s in fp8 if not s.fqn.endswith("layers.0.mlp.experts.down_proj")]
    names = [u.name for u in auto_units(one, ep=1, fused_experts=True, **kw) if "experts" in u.name]
    assert names == ["experts.fc1", "experts.mlp"], names
    custom = [replace(s, fused_mlp=False) if s.is_grouped_weight and ".0." in s.fqn else s for s in fp8]
    names = [u.name for u in auto_units(custom, ep=1, fused_experts=True, **kw) if "experts" in u.name]
    assert names == ["experts.fc1", "experts.fc2", "experts.mlp"], names
    assert shape.to_dict()["mlp"] is True and "mlp" not in AutoShape(((2, 4),), 8, 2).to_dict()  # old keys stay

    table = {u.shape: Timing(1.0, 2.0) for u in units}  # FP8 slower everywhere ...
    table[shape] = Timing(2.0, 1.0)  # ... but the expert MLP
    auto = replace(options.auto, timings=table, fused_experts=True, topk=2)
    decided = {d.fqn: d for d in decide(sites, replace(options, auto=auto))}
    experts = [d for f, d in decided.items() if ".experts." in f]
    assert len(experts) == 4 and all(d.is_fp8 and d.rule == "auto" for d in experts), \
        [(d.fqn, d.precision, d.reason) for d in experts]
    assert "2.00x" in experts[0].reason and "64 pairs" in experts[0].reason, experts[0].reason


def test_fused_expert_mlp_is_measured_on_cpu_and_its_wgrad_is_part_of_the_cache_key(tmp_path):
    """The measured path with ``fp8.grouped_kernel = fused`` (the fused MLP, emulated GEMMs on the CPU): one
    ``experts.mlp`` row timed by ``bench/experts_timer.py``, both weights decided by it; another
    ``fp8.grouped_wgrad`` is another measurement (it changes what is timed)."""
    from fp8kit.bench.auto import measure_and_decide

    def run(wgrad: str):
        cfg = load_config(None, ["model.preset=tiny-moe", "model.num_layers=1", "data.vocab_size=1024",
                                 "data.seq_length=16", "train.micro_batch_size=2", "train.compile=false",
                                 f"data.cache_dir={tmp_path}", "fp8.grouped_kernel=fused", f"fp8.grouped_wgrad={wgrad}"])
        sites = find_sites(build_model(cfg.model, 1024, device="meta"))
        options = options_from_config(cfg, build_hf_config(cfg.model, 1024))
        return measure_and_decide(cfg, sites, decide(sites, options), options, CPU, AutoCache(tmp_path),
                                  warmup=0, iters=1)

    out = run("auto")
    rows = [r for r in out.info["rows"] if "experts" in r["shape"]]
    assert len(rows) == 1 and rows[0]["units"] == "experts.mlp" and rows[0]["error"] is None, out.info["rows"]
    assert rows[0]["shape"] == "8 experts, 64 pairs (top-2): MLP 256x256 -> 128x256" and rows[0]["bf16_ms"] > 0
    experts = [d for d in out.decisions if d.site.is_grouped_weight]
    assert len(experts) == 2 and len({d.precision for d in experts}) == 1 and all(d.rule == "auto" for d in experts)
    assert run("auto").info["measured"] == 0, "the second start-up must read the cache"
    again = run("fp8").info
    assert again["measured"] == 1 and again["cached"] == again["shapes"] - 1, again


def test_train_and_plan_build_the_units_decide_builds():
    """``run_auto_options`` is the one place that says whether the experts run the fused MLP (train's measured and
    forced paths and ``plan`` all use it with ``run_units``): with ``fp8.grouped_kernel = fused`` the experts are one
    ``experts.mlp`` unit, and ``decide`` keys every expert weight by that unit's shape; on the CPU's default kernel
    (emulated) they stay per weight."""
    from fp8kit.bench.auto import run_auto_options, run_units
    from fp8kit.selective.decide import _auto_shapes
    from fp8kit.selective.rules import StaticRules

    for kernel, fused in (("fused", True), ("auto", False)):
        cfg = load_config(None, ["model.preset=tiny-moe", "model.num_layers=1", "data.vocab_size=1024",
                                 "data.seq_length=16", "train.micro_batch_size=2", f"fp8.grouped_kernel={kernel}"])
        sites = find_sites(build_model(cfg.model, 1024, device="meta"))
        options = options_from_config(cfg, build_hf_config(cfg.model, 1024))
        auto = run_auto_options(options.auto, cfg, CPU)
        assert auto.fused_experts is fused, kernel
        units = run_units(decide(sites, options), cfg, auto)
        assert any(u.shape.mlp for u in units) is fused, [u.name for u in units]
        shapes = _auto_shapes(sites, StaticRules(), replace(options, auto=replace(auto, timings={})))
        assert {shapes[f] for u in units for f in u.fqns} == {u.shape for u in units}


def test_the_expert_mlp_timer_runs_the_layer_in_both_precisions():
    """``bench/experts_timer.py`` times the real layer: ``Float8GroupedExperts.local_experts`` over the same weights,
    BF16 per-weight grouped GEMMs vs the fused FP8 MLP (CPU: emulated GEMMs); the two outputs agree to FP8 accuracy
    (>= 20 dB) and the FP8 one took the fused path."""
    from fp8kit.bench.experts_timer import ExpertsMLPTimer
    from tests.conftest import sqnr

    kw = dict(device=CPU, wgrad="fp8")
    bf16 = ExpertsMLPTimer(((128, 192), (96, 128)), 4, 70, "bf16", **kw)
    fp8 = ExpertsMLPTimer(((128, 192), (96, 128)), 4, 70, "fp8", **kw)
    assert not bf16.layer.fp8_weights and fp8.layer.runs_fused(CPU)
    a, b = bf16.fn(bf16.x).float(), fp8.fn(fp8.x).float()
    assert a.shape == b.shape == (70, 128) and sqnr(a, b) >= 20, sqnr(a, b)
    assert fp8(warmup=0, iters=1) > 0
    with pytest.raises(ValueError, match="not \\(\\(H, 2I\\), \\(I, H\\)\\)"):
        ExpertsMLPTimer(((128, 192), (128, 96)), 4, 70, "bf16", **kw)
    # one GPU's layer routes top-k as the run does: 72 pairs = 18 tokens x 4 distinct experts each, 18 pairs per
    # expert (the dispatch's scatter path from top-2 on CUDA); under expert parallelism one row per received token
    whole = ExpertsMLPTimer(((128, 192), (96, 128)), 4, 72, "fp8", whole_layer=True, topk=4, **kw)
    assert whole.x.shape == (18, 128) and whole.ids.shape == (18, 4) and whole.ones.shape == (18, 4), whole.ids.shape
    assert all(len(set(r.tolist())) == 4 for r in whole.ids), whole.ids
    assert torch.bincount(whole.ids.flatten(), minlength=4).tolist() == [18] * 4
    assert whole.fn(whole.x).shape == (18, 128) and whole(warmup=0, iters=1) > 0
    ep = ExpertsMLPTimer(((128, 192), (96, 128)), 4, 72, "fp8", whole_layer=False, topk=4, **kw)
    assert ep.x.shape == (72, 128) and ep.ids.shape == (72, 1), ep.ids.shape
    with pytest.raises(ValueError, match="topk 5 must be in \\[1, 4\\]"):
        ExpertsMLPTimer(((128, 192), (96, 128)), 4, 72, "fp8", whole_layer=True, topk=5, **kw)


def test_with_accumulation_the_expert_mlp_is_timed_casting_its_weights_once_per_optimizer_step(tmp_path):
    """``accumulate = N`` (``train.grad_accum`` where the weight cache applies): the FP8 expert MLP timer runs the layer
    with its cached FP8 weights (one cast, then cache hits) and adds a 1/N share of the two weights' cast, timed alone;
    with N = 1 every call casts (the cache is not used). The measurement is cached under its own key (another N is
    another measurement), and a closed timer holds no tensors."""
    from fp8kit.bench.auto import measure_and_decide
    from fp8kit.bench.experts_timer import ExpertsMLPTimer
    from fp8kit.moe.rowwise_quant import _EXPERTS_CACHE

    kw = dict(device=CPU, wgrad="fp8")
    for accumulate in (1, 4):
        timer = ExpertsMLPTimer(((128, 192), (96, 128)), 4, 70, "fp8", accumulate=accumulate, **kw)
        assert timer.layer.config.cache_weights is (accumulate > 1)
        before = dict(_EXPERTS_CACHE.stats())
        ms = timer(warmup=0, iters=8)
        after = _EXPERTS_CACHE.stats()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        if accumulate == 1:
            assert (hits, misses) == (0, 0), "without accumulation the weights are cast in every call, uncached"
            assert "weight_cast_ms" not in timer.parts and ms == timer.parts["step_ms"]
        else:  # 1 warm-up call + 8 timed calls, two weights each: one miss per weight, then hits
            assert (hits, misses) == (2 * 8, 2), (hits, misses)
            p = timer.parts
            assert p["weight_cast_ms"] > 0 and abs(ms - (p["step_ms"] + p["weight_cast_ms"] / 4)) < 1e-9, p
        timer.close()
        assert timer.layer is None and timer.fn is None and timer.x is None

    cfg = load_config(None, ["model.preset=tiny-moe", "model.num_layers=1", "data.vocab_size=1024",
                             "data.seq_length=16", "train.micro_batch_size=2", "train.compile=false",
                             f"data.cache_dir={tmp_path}", "fp8.grouped_kernel=fused"])
    sites = find_sites(build_model(cfg.model, 1024, device="meta"))
    options = options_from_config(cfg, build_hf_config(cfg.model, 1024))

    def run(accumulate: int) -> dict:  # train.grad_accum: the experts' weight-cast accumulation of this run
        run_cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"grad_accum": accumulate})})
        return measure_and_decide(run_cfg, sites, decide(sites, options), options, CPU, AutoCache(tmp_path),
                                  warmup=0, iters=1).info

    first = run(1)
    assert run(4)["measured"] == 1, "accumulation changes what the expert MLP costs: measured again"
    assert run(4)["measured"] == 0 and run(1)["measured"] == 0, "each setting is read from the cache next time"
    assert first["measured"] == first["shapes"]


def test_on_one_gpu_the_bf16_side_of_the_expert_mlp_is_the_transformers_module_the_run_keeps():
    """With ``whole_layer`` (ep = 1) BF16 experts are timed as the run holds them: the transformers experts module (not
    swapped: only experts with an FP8 weight are), through the experts implementation transformers gives a model's
    experts (checked here on a built model), with its own routing; FP8 experts as ``Float8GroupedExperts.forward``.
    Both compute the same layer (>= 20 dB apart, FP8 accuracy)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fp8kit.bench.experts_timer import HF_EXPERTS_IMPLEMENTATION, ExpertsMLPTimer
    from fp8kit.moe.experts import Float8GroupedExperts
    from tests.conftest import sqnr

    cfg = load_config(None, ["model.preset=tiny-moe", "model.num_layers=1"])
    model = build_model(cfg.model, 1024, device="meta")
    impls = {m.config._experts_implementation for n, m in model.named_modules() if n.endswith(".experts")}
    assert impls == {HF_EXPERTS_IMPLEMENTATION}, impls

    kw = dict(device=CPU, wgrad="fp8", whole_layer=True)
    bf16 = ExpertsMLPTimer(((128, 192), (96, 128)), 4, 70, "bf16", **kw)
    fp8 = ExpertsMLPTimer(((128, 192), (96, 128)), 4, 70, "fp8", **kw)
    assert type(bf16.layer) is Qwen3MoeExperts and bf16.layer.config._experts_implementation == HF_EXPERTS_IMPLEMENTATION
    assert isinstance(fp8.layer, Float8GroupedExperts) and fp8.layer.runs_fused(CPU)
    a, b = bf16.fn(bf16.x).float(), fp8.fn(fp8.x).float()
    assert a.shape == b.shape == (70, 128) and sqnr(a, b) >= 20, sqnr(a, b)
    assert bf16(warmup=0, iters=1) > 0 and fp8(warmup=0, iters=1) > 0


@pytest.mark.parametrize("recipe", ["blockwise", "delayed"])
def test_with_accumulation_dense_sites_are_timed_with_cached_weights_and_a_share_of_their_cast(recipe, tmp_path):
    """``BenchLayersArgs.accumulate = N`` for fp8kit's own dense recipes: the site's linears run with their weight
    cache (the timed steps hit it; nothing is cast in them) and the time adds a 1/N share of the weights' cast, timed
    alone; ``auto``'s cache keys those timings apart (``:accum=N``), and the run-level accumulation follows
    ``fp8.weight_cache``, ``train.grad_accum`` and (delayed) ``train.cuda_graphs``."""
    from fp8kit.bench.auto import shape_keys
    from fp8kit.bench.layers import BenchLayersArgs, _Timer
    from fp8kit.bench.sites import BenchSite
    from fp8kit.config.prepare_options import dense_weight_cast_accumulation, weight_cast_accumulation
    from fp8kit.fp8.delayed_weight_cache import CACHE as DELAYED_CACHE
    from fp8kit.fp8.kernels import ops

    stats = ops.weight_cache_stats if recipe == "blockwise" else DELAYED_CACHE.stats
    site = BenchSite("llm", "column", "qkv", [(256, 128), (256, 128)], [(256, 128), (256, 128)], tp=1)
    for accumulate in (1, 3):
        args = BenchLayersArgs(model=ModelConfig(), vocab_size=0, recipe=recipe, warmup=0, iters=4, compile=False,
                               accumulate=accumulate)
        timer = _Timer(site, "fp8", args, CPU)
        before = dict(stats())
        ms = timer(128)
        after = stats()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        if accumulate == 1:
            assert (hits, misses) == (0, 0), "one micro-batch per step: every step casts, uncached"
            assert "weight_cast_ms" not in timer.parts and ms == timer.parts["step_ms"]
        else:  # two linears, 4 calls (iters): each linear misses in the first call and hits in the other 3
            assert (hits, misses) == (2 * 3, 2), (hits, misses)
            p = timer.parts
            assert p["weight_cast_ms"] > 0 and abs(ms - (p["step_ms"] + p["weight_cast_ms"] / 3)) < 1e-9, p
    bf16 = _Timer(site, "bf16", BenchLayersArgs(model=ModelConfig(), vocab_size=0, recipe=recipe, warmup=0, iters=1,
                                                compile=False, accumulate=3), CPU)
    assert bf16.accumulate == 1, "BF16 has no weight cast to share"

    base = ["train.grad_accum=4", f"fp8.recipe={recipe}", f"data.cache_dir={tmp_path}"]
    assert dense_weight_cast_accumulation(load_config(None, base), weight_cast_accumulation(load_config(None, base))) == 4
    # FSDP2 turns the cache off: plan (no mesh) reads it from the config's data-parallel sizes, as train's mesh says
    for extra in (["fp8.weight_cache=false"], ["train.grad_accum=1"], ["distributed.dp_shard=2"],
                  ["distributed.dp_replicate=2"]):
        cfg = load_config(None, [*base, *extra])
        assert dense_weight_cast_accumulation(cfg, weight_cast_accumulation(cfg)) == 1, extra
    filled = load_config(None, [*base, "distributed.dp_shard=-1", "distributed.tp=1"])
    assert weight_cast_accumulation(filled) == 4, "dp_shard = -1 fills a mesh plan cannot see: one process"
    graphs = load_config(None, [*base, "train.compile=true", "train.cuda_graphs=true"])
    want = 4 if recipe == "blockwise" else 1  # the delayed linears' cache is off with CUDA graphs
    assert dense_weight_cast_accumulation(graphs, 4) == want
    assert dense_weight_cast_accumulation(load_config(None, [*base, "fp8.recipe=tensorwise"]), 4) == 1

    shape = AutoShape(((128, 256), (128, 256)), num_tokens=128)
    keys = [shape_keys([shape], FP8SiteOptions(recipe, dense_accumulate=n), device=CPU, tp=1, ep=1,
                       compiled=False)[shape]
            for n in (1, 3)]
    assert keys[0] != keys[1] and ":accum=3" in json.dumps(keys[1]) and ":accum" not in json.dumps(keys[0])


def test_with_accumulation_blockwise_experts_are_timed_with_cached_weights_and_a_share_of_their_cast():
    """The blockwise-loop experts of a grouped site (``_GroupedTimer``) with ``accumulate = N``: cached expert weights
    in the timed steps (one miss per expert with rows and weight, then hits) plus 1/N of those experts' cast timed
    alone; the rowwise grouped GEMM (other recipes) ignores it. Keys: ``:accum=N`` for blockwise-loop expert weights
    only."""
    from fp8kit.bench.auto import shape_keys
    from fp8kit.bench.layers import BenchLayersArgs, _GroupedTimer
    from fp8kit.bench.sites import BenchSite
    from fp8kit.fp8.kernels import ops

    site = BenchSite("llm", "column_grouped", "experts.gate_up_proj", [(128, 256)], [(128, 256)], tp=1, num_gemms=4)
    args = BenchLayersArgs(model=ModelConfig(), vocab_size=0, recipe="blockwise", warmup=0, iters=3, compile=False,
                           accumulate=2)
    timer = _GroupedTimer(site, "fp8", args, CPU)
    assert timer.backend == "blockwise_loop" and timer.accumulate == 2
    before = dict(ops.weight_cache_stats())
    ms = timer(3)  # 3 pairs over 4 experts: 3 experts with a row (padded to 16), one empty (the loop skips it)
    after = ops.weight_cache_stats()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    assert (hits, misses) == (3 * 2, 3), (hits, misses)  # 3 calls: a miss per live expert, then hits
    p = timer.parts
    assert p["weight_cast_ms"] > 0 and abs(ms - (p["step_ms"] + p["weight_cast_ms"] / 2)) < 1e-9, p
    rowwise = _GroupedTimer(site, "fp8", replace(args, recipe="tensorwise", grouped=None), CPU)
    assert rowwise.accumulate == 1, rowwise.backend
    grouped = AutoShape(((128, 256),), num_tokens=48, num_gemms=4)
    for recipe, tagged in (("blockwise", True), ("tensorwise", False)):
        key = shape_keys([grouped], FP8SiteOptions(recipe, dense_accumulate=2), device=CPU, tp=1, ep=1,
                         compiled=False)[grouped]
        assert (":accum=2" in json.dumps(key)) is tagged, (recipe, key)


def test_expert_parallel_experts_keep_their_weight_cache_under_fsdp2(tmp_path):
    """FSDP2 turns the FP8 weight cache off (it would hold unsharded copies), but not for the experts under expert
    parallelism, which FSDP2 leaves alone (``ignored_params``): each rank holds its experts whole, as one process
    does. ``weight_cache_applies(not_fsdp=)`` decides it for ``prepare_model``'s grouped config and for ``auto``'s
    expert timings (``weight_cast_accumulation(experts=True)``, ``FP8SiteOptions.for_run``); the dense linears keep
    the FSDP2 rule."""
    from fp8kit.bench.auto import FP8SiteOptions
    from fp8kit.config.prepare_options import weight_cast_accumulation
    from fp8kit.parallel.prepare import weight_cache_applies

    assert not weight_cache_applies(True, None, (2, 1)) and weight_cache_applies(True, None, (2, 1), not_fsdp=True)
    assert not weight_cache_applies(False, None, (1, 1), not_fsdp=True), "fp8.weight_cache = false is kept"
    base = ["model.preset=tiny-moe", "train.mixed_precision=fp8", "train.grad_accum=2", f"data.cache_dir={tmp_path}"]
    ep_fsdp = load_config(None, [*base, "distributed.ep=2", "distributed.dp_shard=2"])
    assert (weight_cast_accumulation(ep_fsdp), weight_cast_accumulation(ep_fsdp, experts=True)) == (1, 2)
    opts = FP8SiteOptions.for_run(load_config(None, [*base, "fp8.recipe=blockwise", "distributed.ep=2",
                                                     "distributed.dp_shard=2"]))
    assert (opts.accumulate, opts.dense_accumulate) == (2, 1), opts
    fsdp_only = load_config(None, [*base, "distributed.dp_shard=2"])
    assert weight_cast_accumulation(fsdp_only, experts=True) == 1, "without EP the experts are FSDP2's"


def test_auto_keys_and_times_grouped_sites_on_the_kernel_the_run_forces(tmp_path):
    """A run that forces ``fp8.grouped_kernel`` is timed on that kernel and its cache key says so
    (``FP8SiteOptions.grouped`` reaches ``shape_keys`` and the grouped timer), instead of the recipe's default
    kernel: on the CPU the default resolves to ``emulated`` while a forced ``scaled_grouped_mm`` cannot run
    (``grouped:unavailable``)."""
    from fp8kit.bench.auto import FP8SiteOptions, shape_keys
    from fp8kit.bench.layers import _GroupedTimer
    from fp8kit.bench.sites import BenchSite

    base = ["model.preset=tiny-moe", "train.mixed_precision=fp8", f"data.cache_dir={tmp_path}"]
    grouped = AutoShape(((128, 256),), num_tokens=48, num_gemms=4)
    keys = {}
    for kernel in ("auto", "fused", "scaled_grouped_mm"):
        opts = FP8SiteOptions.for_run(load_config(None, [*base, f"fp8.grouped_kernel={kernel}"]))
        keys[kernel] = shape_keys([grouped], opts, device=CPU, tp=1, ep=1, compiled=False)[grouped]["recipe"]
        args = opts.bench_args(warmup=0, iters=1, compile=False)
        assert args.grouped is opts.grouped and args.grouped.kernel == kernel, (kernel, args.grouped)
    assert keys == {"auto": "grouped:emulated", "fused": "grouped:fused", "scaled_grouped_mm": "grouped:unavailable"}, keys
    site = BenchSite("llm", "column_grouped", "experts.gate_up_proj", [(128, 256)], [(128, 256)], tp=1, num_gemms=4)
    forced = FP8SiteOptions.for_run(load_config(None, [*base, "fp8.grouped_kernel=scaled_grouped_mm"]))
    with pytest.raises(CapabilityError, match="scaled_grouped_mm|grouped"):
        _GroupedTimer(site, "fp8", forced.bench_args(warmup=0, iters=1, compile=False), CPU)
