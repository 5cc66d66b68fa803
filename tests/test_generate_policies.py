"""benchmarks/generate_policies.py on the CPU: the report list per preset, and ``--gpus N``'s workers sharing it
through exclusive claims (a report another worker claimed is not measured twice; ``spread`` clears a killed run's
claims)."""

from __future__ import annotations

import argparse

from tests.script_loader import load_script
from tests.test_distributed import ROOT


def _module():
    return load_script(ROOT / "benchmarks" / "generate_policies.py")


def _args(tmp_path, **kw):
    base = dict(out=str(tmp_path), presets="tiny", recipes="tensorwise", warmup=0, iters=1, max_tokens=256,
                budget_s=600.0, dynamic=False, worker=True, gpus=1)
    return argparse.Namespace(**{**base, **kw})


def test_jobs_cover_each_preset_recipe_and_layout_in_order(tmp_path):
    mod = _module()
    got = mod.jobs(_args(tmp_path, presets="llama3-8b,qwen3-30b-a3b", recipes="tensorwise,delayed"))
    assert got[:4] == [("llama3-8b", "tensorwise", tp, None) for tp in (1, 2, 4, 8)], got
    assert got[-2:] == [("qwen3-30b-a3b", "delayed", 1, 1), ("qwen3-30b-a3b", "delayed", 1, 8)], got
    assert len(got) == 2 * 4 + 2 * 2
    # a preset without a shipped layout list (tiny, llama-125m, ...) is measured at TP 1 alone
    assert mod.jobs(_args(tmp_path, presets="tiny")) == [("tiny", "tensorwise", 1, None)]


def test_a_worker_skips_a_report_another_worker_claimed(tmp_path):
    mod = _module()
    reports = tmp_path / "reports"
    reports.mkdir()
    path = reports / mod.report_name("tiny", "tensorwise", 1)
    assert mod._claim(path) and not mod._claim(path), "a claim must be exclusive"
    mod.bench(_args(tmp_path))  # the one report is claimed: nothing is measured
    assert not path.exists() and path.with_suffix(".claim").exists()


def test_spread_measures_every_report_once_on_two_workers_after_clearing_stale_claims(tmp_path):
    """Two worker processes (on the CPU here; ``CUDA_VISIBLE_DEVICES`` picks each one's GPU on a GPU host) write
    both reports, though a killed run left a claim on one of them, and leave no claim behind."""
    mod = _module()
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "tiny_tensorwise_tp1.claim").touch()
    assert mod.spread(_args(tmp_path, recipes="tensorwise,rowwise", gpus=2, worker=False)) == 0
    written = sorted(p.name for p in reports.iterdir())  # no .claim left either
    assert written == ["tiny_rowwise_tp1.json", "tiny_tensorwise_tp1.json"], written


def test_a_zero_budget_measures_exactly_one_report(tmp_path, capsys):
    """``--budget-s 0`` ("one report, then stop") measures the first report and starts no other."""
    mod = _module()
    mod.bench(_args(tmp_path, recipes="tensorwise,rowwise", budget_s=0.0, worker=False))
    written = sorted(p.name for p in (tmp_path / "reports").iterdir())
    assert written == ["tiny_tensorwise_tp1.json"], written
    assert "budget reached, stopping before tiny_rowwise_tp1.json" in capsys.readouterr().out
