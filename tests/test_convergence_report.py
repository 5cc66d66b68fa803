"""benchmarks/convergence.py's report: the train-loss gap by window, and the table and plot from metrics files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.script_loader import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "convergence.py"


@pytest.fixture(scope="module")
def convergence():
    return load_script(SCRIPT)


def _losses(n: int, offset: float = 1.0) -> list[dict]:
    # a decaying curve with a batch-to-batch swing far larger than the offset, as real runs have
    return [{"step": s, "loss": offset * (3.0 + 5.0 / s + 0.5 * math.sin(s)), "step_ms": 1.0} for s in range(1, n + 1)]


def test_a_constant_ratio_reads_as_that_gap_in_every_window(convergence):
    base = {r["step"]: r["loss"] for r in _losses(400)}
    windows = convergence.train_gap_windows(_losses(400, offset=1.007), base)
    assert len(windows) == convergence.WINDOWS
    gaps = [g for _, g in windows]
    assert all(abs(g - 0.7) < 1e-9 for g in gaps), f"expected +0.70% in each window, got {gaps}"
    assert windows[-1][0] == 400 and windows[0][0] == 400 // convergence.WINDOWS


def test_windows_compare_only_the_steps_both_runs_logged(convergence):
    # the baseline logged every step, the other run every second step: its window means use its own steps only
    base = {r["step"]: r["loss"] for r in _losses(400)}
    every_other = [r for r in _losses(400, offset=0.99) if r["step"] % 2 == 0]
    gaps = [g for _, g in convergence.train_gap_windows(every_other, base)]
    assert all(abs(g + 1.0) < 1e-9 for g in gaps), f"expected -1.00% in each window, got {gaps}"
    assert convergence.train_gap_windows(_losses(convergence.WINDOWS - 1), base) == []


def test_plot_only_report_writes_the_table_and_the_png(convergence, tmp_path):
    for name, offset in (("bf16-default-optim", 1.0), ("delayed-head-default-optim", 1.01)):
        recs = _losses(100, offset)
        for r in recs:
            if r["step"] % 50 == 0:
                r["val_loss"] = offset * 3.5
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    table = convergence.report(tmp_path, "llama3-8b")
    assert "| delayed-head-default-optim | 100 |" in table and "+1.00%" in table, table
    assert "| delayed-head-fprop-default-optim | no run |" in table, table
    png = tmp_path / "llama3-8b.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # with --variants, only the requested variants (and other runs in the folder) are listed, not the study's rest
    table = convergence.report(tmp_path, "llama3-8b", ["bf16-default-optim"])
    assert "| delayed-head-default-optim | 100 |" in table and "no run" not in table, table
