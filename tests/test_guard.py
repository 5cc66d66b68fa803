"""The divergence guard (``train.on_divergence``, ``fp8kit.train.guard``) on real CPU runs with injected faults:
``stop`` stops at the fault, ``recover`` rolls back, skips, runs the worst FP8 layers in BF16 for a while and
finishes with a finite loss; the events reach the metrics and the summary; the one-line refusals."""

from __future__ import annotations

import json
import math

import pytest

from fp8kit.base.errors import ConfigError
from fp8kit.config import load_config
from fp8kit.train.guard import LrSpike
from fp8kit.train.loop import TrainingDiverged
from fp8kit.train.metrics import read_metrics
from fp8kit.train.setup import check_distributed_config
from fp8kit.train.summary import summarize_run
from fp8kit.train.trainer import train

# lr x 1e4 at one step: the loss jumps from ~6.5 to thousands (finite: a spike); lr x inf: NaN weights.
SPIKE, NAN = 1e4, math.inf


def _cfg(small_run, *extra):
    return load_config(None, [*small_run, "train.eval_every=0", "train.lr=1e-3", "train.log_every=100", *extra])


@pytest.mark.slow
def test_stop_stops_at_a_non_finite_loss(small_run, tmp_path):
    cfg = _cfg(small_run, "train.steps=24", "train.checkpoint_every=4")
    with pytest.raises(TrainingDiverged, match="at step 11"):
        train(cfg, tmp_path / "run", fault=LrSpike(9, NAN))  # weights NaN after step index 9: loss NaN at step 11
    m = read_metrics(tmp_path / "run" / "metrics.jsonl", events=True)
    assert [r["step"] for r in m] == list(range(1, 12)) and m[-1]["loss"] is None, [r.get("loss") for r in m]
    assert not any("event" in r or "fp8_health" in r for r in m)  # no guard events, no stats when off
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "diverged"


@pytest.mark.slow
def test_recover_rolls_back_skips_moves_layers_to_bf16_and_finishes(small_run, tmp_path):
    cfg = _cfg(small_run, "train.steps=16", "train.checkpoint_every=3", "train.on_divergence=recover",
               "train.recover_bf16_steps=3", "fp8.stats_every=2")
    # a spike at step index 6 (detected at step 8: loss in the thousands), NaN weights at step index 12 (step 14)
    res = train(cfg, tmp_path / "run", fault=[LrSpike(6, SPIKE), LrSpike(12, NAN)])
    m = res.metrics
    assert [r["step"] for r in m] == list(range(1, 17)), [r["step"] for r in m]
    assert all(math.isfinite(r["loss"]) and r["loss"] < 7.5 for r in m), [r["loss"] for r in m]
    assert m[-1]["loss"] < m[0]["loss"] - 0.3, f"loss {m[0]['loss']} -> {m[-1]['loss']}: did not keep training"

    events = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl", events=True) if "event" in r]
    assert [(e["event"], e["step"], e["rolled_back_to"]) for e in events] == [("recovery", 8, 6), ("recovery", 14, 12)]
    assert events[0]["cause"].startswith("loss spike") and events[1]["cause"].startswith("non-finite loss")
    assert [e["skipped_micro_batches"] for e in events] == [2, 2]
    # skipped, not replayed: the redone step 7 draws the batch after the abandoned step 8's
    written = read_metrics(tmp_path / "run" / "metrics.jsonl", events=True)
    abandoned_8, redone_7 = written[7], written[9]
    assert (abandoned_8["step"], redone_7["step"]) == (8, 7) and redone_7["epoch"] > abandoned_8["epoch"], (
        abandoned_8["epoch"], redone_7["epoch"])
    # the spike: the worst five layers by the latest health stats; the NaN step (a stats step): every layer
    # shows non-finite values, so all 14 move; in BF16 for 3 steps from the rollback step
    assert [len(e["layers_to_bf16"]) for e in events] == [5, 14], events
    assert all(e["bf16_until_step"] == e["rolled_back_to"] + 3 for e in events), events

    # FP8 modules per step: 14, minus the moved layers for the 3 steps after each rollback, then 14 again
    fp8 = [r["fp8_modules"] for r in m]
    assert fp8 == [14] * 6 + [9] * 3 + [14] * 3 + [0] * 3 + [14], fp8
    assert all(len(r["fp8_health"]) == 3 * r["fp8_modules"] for r in m if r["step"] % 2 == 0), "3 operands per layer"
    assert not any("fp8_health" in r for r in m if r["step"] % 2)

    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "## FP8 health: worst five layers" in summary and "## Divergence events" in summary
    assert "| 8 | recovery | loss spike" in summary and "| 14 | recovery | non-finite loss" in summary
    assert res.summary["status"] == "ok" and len(res.summary["recoveries"]) == 2
    # throughput over the whole run: a rollback moves the loop's start step back, not the session's start
    whole = summarize_run(m, switches=[s for s, _ in res.summary["switches"]], info={}, setup_desc={})
    assert res.summary["tokens_per_s"] == whole["tokens_per_s"], (res.summary["tokens_per_s"], whole["tokens_per_s"])


@pytest.mark.slow
def test_recover_stops_after_max_recoveries(small_run, tmp_path):
    cfg = _cfg(small_run, "train.steps=8", "train.checkpoint_every=2", "train.on_divergence=recover",
               "train.max_recoveries=0")
    with pytest.raises(TrainingDiverged, match="at step 5"):
        train(cfg, tmp_path / "run", fault=LrSpike(3, NAN))
    events = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl", events=True) if "event" in r]
    assert [(e["event"], e["step"]) for e in events] == [("divergence", 5)], events
    assert "train.max_recoveries = 0 reached" in events[0]["note"]


def test_refusals_are_one_line(small_run):
    with pytest.raises(ConfigError) as e:
        _cfg(small_run, "train.on_divergence=recover", "train.checkpoint_every=0")
    assert "train.on_divergence" in str(e.value) and "checkpoint_every > 0" in str(e.value) and "\n" not in str(e.value)
    for key, words in (("train.on_divergence=recover", "one process only"), ("fp8.stats_every=5", "one process only")):
        with pytest.raises(ConfigError) as e:
            check_distributed_config(_cfg(small_run, key))
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="spike_factor"):
        _cfg(small_run, "train.spike_factor=1.0")


class _Writer:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def test_rollback_points_restore_state_skip_data_and_fall_back(small_run):
    """Unit level: a rollback restores weights, optimizer and schedule but not the data position; a point
    with non-finite weights is not kept; diverging again from a point goes back to the one before."""
    import torch

    from fp8kit.train.guard import DivergenceGuard
    from fp8kit.train.loop import LoopResult
    from fp8kit.train.setup import build_setup

    setup = build_setup(_cfg(small_run, "train.steps=20", "train.checkpoint_every=3", "train.on_divergence=recover",
                             "train.recover_bf16_steps=0"))
    guard, writer = DivergenceGuard(setup), _Writer()
    w = setup.model.model.layers[0].mlp.down_proj.weight
    snap = {}
    for step in (3, 6):
        with torch.no_grad():
            w.add_(1.0)
        setup.data.packed.next_batch(4)
        setup.optimizer.step()  # no gradients: nothing changes; the scheduler expects it first
        setup.scheduler.step()
        guard.take_snapshot(step)
        snap[step] = (w.detach().clone(), setup.scheduler.last_epoch)
    with torch.no_grad():
        w.fill_(float("nan"))
    guard.take_snapshot(9)  # NaN weights: not kept
    assert [p.step for p in guard.snapshots] == [3, 6]
    setup.data.packed.next_batch(4)
    position = setup.data.packed.state_dict()

    nan = {"step": 8, "loss": float("nan"), "grad_norm": float("nan")}
    assert guard.try_recover(LoopResult(records=[nan]), writer, lambda _m: None)
    assert torch.equal(w, snap[6][0]) and setup.scheduler.last_epoch == snap[6][1] and setup.start_step == 6
    assert setup.data.packed.state_dict() == position, "the batches since the rollback point were not skipped"
    assert guard.try_recover(LoopResult(records=[{**nan, "step": 7}]), writer, lambda _m: None)
    assert torch.equal(w, snap[3][0]) and setup.start_step == 3, "a second divergence from 6 must go back to 3"
    assert [(e["rolled_back_to"], e["skipped_micro_batches"]) for e in writer.records] == [(6, 2), (3, 4)]
