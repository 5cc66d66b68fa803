"""``train.async_loss`` (opt-in): a plain step's loss is read after the next step is queued, with the same
numbers as reading it at once; evaluation / checkpoint / last steps are read at once; a non-finite loss still
stops the run at its own step. Real CPU runs of the small model (``tests/conftest.py``)."""

from __future__ import annotations

import math

import pytest

from fp8kit.config import load_config
from fp8kit.train import loop
from fp8kit.train.guard import LrSpike
from fp8kit.train.loop import TrainingDiverged, _needs_values
from fp8kit.train.metrics import read_metrics
from fp8kit.train.trainer import train

REAL = (loop.train_step, loop.evaluate, loop.peak_memory_gib)  # before any test patches them
KEYS = ("step", "loss", "grad_norm", "lr", "val_loss", "precision", "fp8_modules", "epoch")


def _run(small_run, tmp_path, name, monkeypatch, *extra):
    """Train 8 steps; returns the records and the order of events: ("step", i) when step i's train_step is
    called, ("record", None) when a step's record is built (its values read), ("eval", None) at an evaluation."""
    order = []
    real_step, real_eval, real_peak = REAL

    def step(setup, params, micro, scales, **kw):
        order.append(("step", len([o for o in order if o[0] == "step"]) + 1))
        return real_step(setup, params, micro, scales, **kw)

    monkeypatch.setattr(loop, "train_step", step)
    monkeypatch.setattr(loop, "evaluate", lambda setup: order.append(("eval", None)) or real_eval(setup))
    monkeypatch.setattr(loop, "peak_memory_gib", lambda dev: order.append(("record", None)) or real_peak(dev))
    cfg = load_config(None, [*small_run, "train.steps=8", "train.eval_every=4", "train.checkpoint_every=0",
                             "train.final_checkpoint=false", "train.lr=1e-3", *extra])
    train(cfg, tmp_path / name)
    records = read_metrics(tmp_path / name / "metrics.jsonl")
    return records, order


def test_async_loss_defers_plain_steps_and_changes_no_number(small_run, tmp_path, monkeypatch):
    sync, sync_order = _run(small_run, tmp_path, "sync", monkeypatch, "train.async_loss=false")
    late, late_order = _run(small_run, tmp_path, "async", monkeypatch, "train.async_loss=true")
    for a, b in zip(sync, late, strict=True):
        for k in KEYS:
            assert a.get(k) == b.get(k), f"step {a['step']}: {k} {a.get(k)} (sync) vs {b.get(k)} (async)"
    s, r, e = ("step",), ("record", None), ("eval", None)
    # sync: every step read at its end; async: steps 4 (evaluation) and 8 (last) are read at once, each other
    # step after the next one was queued (its record follows the next step's start)
    assert sync_order == [s + (1,), r, s + (2,), r, s + (3,), r, s + (4,), r, e, s + (5,), r, s + (6,), r,
                          s + (7,), r, s + (8,), r, e], f"sync: {sync_order}"
    assert late_order == [s + (1,), s + (2,), r, s + (3,), r, s + (4,), r, r, e, s + (5,), s + (6,), r,
                          s + (7,), r, s + (8,), r, r, e], f"async: {late_order}"
    assert all(math.isfinite(r["step_ms"]) and r["step_ms"] > 0 for r in late), [r["step_ms"] for r in late]


def test_needs_values_marks_eval_checkpoint_and_last_steps(small_run):
    t = load_config(None, [*small_run, "train.steps=12", "train.eval_every=5", "train.checkpoint_every=4"]).train
    assert [d for d in range(1, 13) if _needs_values(t, d)] == [4, 5, 8, 10, 12]
    t0 = load_config(None, [*small_run, "train.steps=3", "train.eval_every=0", "train.checkpoint_every=0"]).train
    assert [d for d in range(1, 4) if _needs_values(t0, d)] == [3]


@pytest.mark.slow
def test_async_loss_still_stops_at_the_non_finite_step(small_run, tmp_path):
    """NaN weights after step index 5 give a NaN loss at step 7, a deferred step: the run stops reporting step 7
    (step 8's update is dropped with the run), as the synchronous loop does."""
    cfg = load_config(None, [*small_run, "train.steps=12", "train.eval_every=0", "train.checkpoint_every=0",
                             "train.final_checkpoint=false", "train.lr=1e-3", "train.async_loss=true"])
    with pytest.raises(TrainingDiverged, match="at step 7"):
        train(cfg, tmp_path / "run", fault=LrSpike(5, math.inf))
    m = read_metrics(tmp_path / "run" / "metrics.jsonl", events=True)
    assert [r["step"] for r in m] == list(range(1, 8)) and m[-1]["loss"] is None, [r.get("loss") for r in m]
