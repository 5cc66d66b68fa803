"""``selective_fp8 = "auto"`` on a CUDA GPU (marker ``gpu``; skipped without CUDA): the Llama-3-8B start-up cost
(at most 60 s for its 4 distinct shapes, compiled, at 8192 tokens), a cache hit that measures nothing, the
warning of a forced full-FP8 run, and an MoE grouped shape timed through the FP8 grouped GEMM.

Run on the H100: ``pytest -m gpu -s tests/test_auto_selective_gpu.py`` (``-s`` prints the tables).
"""

from __future__ import annotations

import pytest
import torch

from fp8kit.bench.auto import FP8SiteOptions, measure_shapes, resolve_auto
from fp8kit.config import SelectiveConfig, load_config
from fp8kit.config.options import options_from_config
from fp8kit.models.build import build_hf_config, build_model
from fp8kit.selective.auto import AutoShape
from fp8kit.selective.auto_cache import AutoCache
from fp8kit.selective.decide import decide
from fp8kit.selective.report import print_auto_table
from fp8kit.selective.sites import find_sites

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: The issue's start-up budget for the llama3-8b preset (4 distinct linear shapes, compiled).
MAX_STARTUP_S = 60.0
#: A cache hit reads 4 small JSON files: no timing at all.
MAX_CACHED_S = 2.0


def _llama8b(tmp_path, *extra):
    cfg = load_config(None, ["model.preset=llama3-8b", "model.num_layers=2", "data.vocab_size=32000",
                             "data.seq_length=4096", "train.micro_batch_size=2", "train.compile=true",
                             f"data.cache_dir={tmp_path}", *extra])
    hf_cfg = build_hf_config(cfg.model, cfg.data.vocab_size)
    sites = find_sites(build_model(cfg.model, cfg.data.vocab_size, device="meta"))
    options = options_from_config(cfg, hf_cfg)
    return cfg, sites, options, decide(sites, options)


def test_llama3_8b_startup_budget_then_cache_hit(tmp_path):
    cfg, sites, options, static = _llama8b(tmp_path)
    dev = torch.device("cuda")
    first = resolve_auto(cfg, sites, static, options, dev, emulated=False)
    print_auto_table(first.info)
    info = first.info
    assert info["applied"] and info["shapes"] == 4 and info["measured"] == 4 and info["cached"] == 0, info
    assert info["seconds"] <= MAX_STARTUP_S, f"auto start-up {info['seconds']:.1f} s > {MAX_STARTUP_S} s"
    assert all(r["bf16_ms"] > 0 and r["fp8_ms"] > 0 and r["error"] is None for r in info["rows"]), info["rows"]
    # every site follows its shape's measured speed-up and the 1.05 margin
    for r in info["rows"]:
        assert r["precision"] == ("fp8" if r["speedup"] >= cfg.selective.auto_min_speedup else "bf16"), r
    second = resolve_auto(cfg, sites, static, options, dev, emulated=False)
    print_auto_table(second.info)
    assert second.info["measured"] == 0 and second.info["cached"] == 4, second.info
    assert second.info["seconds"] <= MAX_CACHED_S, second.info["seconds"]
    assert [d.precision for d in second.decisions] == [d.precision for d in first.decisions]
    # forcing full FP8 with the same cache: a warning names each shape measured slower in FP8
    off_cfg = cfg.model_copy(update={"selective": SelectiveConfig(selective_fp8=False)})
    off_opts = options_from_config(off_cfg, build_hf_config(cfg.model, cfg.data.vocab_size))
    forced = resolve_auto(off_cfg, sites, decide(sites, off_opts), off_opts, dev, emulated=False)
    slower = [r for r in info["rows"] if r["speedup"] < 1.0]
    assert bool(forced.warnings) == bool(slower), (forced.warnings, info["rows"])
    for r in slower:
        assert f"{r['units']} {r['speedup']:.2f}x" in forced.warnings[0], forced.warnings


def test_grouped_expert_shape_is_timed_through_the_fp8_grouped_gemm(tmp_path):
    """Qwen3-30B-A3B's expert gate_up at 16384 tokens x top-8 = 131072 routed pairs over 128 experts."""
    shape = AutoShape(((2048, 1536),), 16384 * 8, 128)
    m = measure_shapes([(shape, "fc1 experts")], FP8SiteOptions("tensorwise"), device=torch.device("cuda"), tp=1,
                       ep=1, cache=AutoCache(tmp_path), compile=True)
    t = m.timings[shape]
    print(f"grouped {shape.describe()}: bf16 {t.bf16_ms} ms, fp8 {t.fp8_ms} ms, {t.speedup}x, error {t.error}")
    assert m.measured == 1 and t.error is None and t.bf16_ms > 0 and t.fp8_ms > 0, t


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a Hopper GPU (the fused FP8 experts)")
def test_expert_mlp_unit_is_timed_through_the_fused_fp8_mlp(tmp_path):
    """Qwen3-30B-A3B's experts as one ``experts.mlp`` unit (what ``auto`` times where the fused kernel runs): 16384
    tokens x top-8 = 131072 routed pairs over 128 experts, fused rowwise FP8 (default wgrad) vs BF16 grouped GEMMs,
    compiled; the Qwen3 preset's ``auto`` start-up then has one MLP row per distinct expert shape."""
    from fp8kit.moe.grouped_mm import GroupedGemmConfig

    shape = AutoShape(((2048, 1536), (768, 2048)), 16384 * 8, 128, mlp=True, topk=8)
    m = measure_shapes([(shape, "experts.mlp")], FP8SiteOptions("tensorwise", grouped=GroupedGemmConfig()),
                       device=torch.device("cuda"), tp=1, ep=1, cache=AutoCache(tmp_path), compile=True)
    t = m.timings[shape]
    print(f"expert MLP {shape.describe()}: bf16 {t.bf16_ms} ms, fp8 {t.fp8_ms} ms, {t.speedup}x, error {t.error}")
    assert m.measured == 1 and t.error is None and t.bf16_ms > 0 and t.fp8_ms > 0, t
    cfg = load_config(None, ["model.preset=qwen3-30b-a3b", "model.num_layers=2", "data.seq_length=4096",
                             "train.micro_batch_size=4", "train.compile=true", f"data.cache_dir={tmp_path}"])
    sites = find_sites(build_model(cfg.model, cfg.data.vocab_size, device="meta"))
    options = options_from_config(cfg, build_hf_config(cfg.model, cfg.data.vocab_size))
    out = resolve_auto(cfg, sites, decide(sites, options), options, torch.device("cuda"), emulated=False)
    print_auto_table(out.info)
    rows = [r for r in out.info["rows"] if "experts" in r["shape"]]
    assert [r["units"] for r in rows] == ["experts.mlp"] and "MLP 2048x1536 -> 768x2048" in rows[0]["shape"], rows
    assert rows[0]["source"] == "cache", rows  # the shape timed above, at the same 131072 pairs
    experts = [d for d in out.decisions if d.site.is_grouped_weight]
    assert len({d.precision for d in experts}) == 1, [(d.fqn, d.precision) for d in experts]
