"""Delayed scaling (``fp8.recipe = "delayed"``, Transformer Engine's DelayedScaling): numerics against float64,
the amax history (scale of step t from steps < t, max vs most_recent, margin, length), state round trip,
exact resume and the one-line errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8kit.base.errors import CheckpointError, ConfigError
from fp8kit.config import load_config
from fp8kit.fp8.delayed import DelayedScaling, DelayedScalingState, Float8DelayedLinear, sqnr_db
from fp8kit.train.trainer import train

torch.manual_seed(0)


def _layer(k=256, n=512, **cfg):
    lin = nn.Linear(k, n, bias=False)
    state = DelayedScalingState(DelayedScaling(**cfg))
    return Float8DelayedLinear.from_linear(lin, state, "l"), state


def _fwd_bwd(layer, x, dy):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y, x.grad, layer.weight.grad


def test_numerics_against_float64():
    """Output (E4M3 x E4M3) >= 25 dB; dgrad / wgrad (E5M2 gradients) >= 18 dB, against float64 math."""
    layer, _ = _layer()
    x, dy = torch.randn(512, 256), torch.randn(512, 512)
    for _ in range(2):  # step 0 takes a dynamic scale; step 1 the delayed one (same distribution)
        layer.weight.grad = None
        y, dx, dw = _fwd_bwd(layer, x, dy)
    w = layer.weight.detach().double()
    ref_y, ref_dx, ref_dw = x.double() @ w.T, dy.double() @ w, dy.double().T @ x.double()
    got = {"out": sqnr_db(ref_y, y), "dgrad": sqnr_db(ref_dx, dx), "wgrad": sqnr_db(ref_dw, dw)}
    assert got["out"] >= 25 and got["dgrad"] >= 18 and got["wgrad"] >= 18, got
    assert got["out"] < 45, f"output {got['out']:.1f} dB: not quantized at all?"


def test_scale_of_step_t_comes_from_earlier_steps_and_a_jump_saturates_once():
    layer, state = _layer(amax_history_len=4)
    x = torch.randn(256, 256)
    w = layer.weight.detach().double()
    dbs = []
    for mult in [1.0, 1.0, 100.0, 100.0]:
        y = layer(x * mult)
        y.sum().backward()
        dbs.append(sqnr_db((x * mult).double() @ w.T, y.detach()))
    # steps 0-1 well scaled; step 2 jumps 100x with step 0-1's scale: saturates; step 3 has the jump in its history
    assert dbs[0] > 25 and dbs[1] > 25, dbs
    assert dbs[2] < 10, f"a 100x jump did not saturate with the stale scale: {dbs}"
    assert dbs[3] > 25, f"the step after the jump did not recover: {dbs}"


def test_max_vs_most_recent_margin_and_history_length():
    def scales_after(amaxes, **cfg):
        state = DelayedScalingState(DelayedScaling(**cfg))
        e = state.entry("l", torch.device("cpu"))
        for a in amaxes:
            e.pending = torch.tensor([a, 1.0, 1.0])
            e.has_pending = True
            state.advance(e)
        return state.scales(e)[0].item()

    assert scales_after([8.0, 2.0]) == pytest.approx(448 / 8)  # max of the history
    assert scales_after([8.0, 2.0], amax_compute_algo="most_recent") == pytest.approx(448 / 2)
    assert scales_after([8.0, 2.0], margin=2) == pytest.approx(448 / 8 / 4)
    # length 2: the oldest amax (8) falls out after two newer steps
    assert scales_after([8.0, 2.0, 1.0], amax_history_len=2) == pytest.approx(448 / 2)
    assert scales_after([8.0, 2.0, 1.0], amax_history_len=3) == pytest.approx(448 / 8)


def test_state_dict_round_trip_and_length_mismatch():
    layer, state = _layer()
    for _ in range(3):
        layer(torch.randn(64, 256)).sum().backward()
    other = DelayedScalingState(DelayedScaling())
    other.load_state_dict(state.state_dict())
    e1, e2 = state.entries["l"], other.entries["l"]
    assert torch.equal(e1.history, e2.history) and e1.steps == e2.steps
    assert torch.equal(state.scales(e1), other.scales(e2))
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScalingState(DelayedScaling(amax_history_len=8)).load_state_dict(state.state_dict())


def test_eval_forward_records_nothing():
    layer, state = _layer()
    layer(torch.randn(64, 256)).sum().backward()
    before = state.entries["l"].steps
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(64, 256) * 1000)
    layer.train()
    layer(torch.randn(64, 256))  # advances with step 0's amax, not the eval one
    assert state.entries["l"].steps == before + 1
    assert state.entries["l"].history[0, 0] < 100


def test_bad_settings_are_one_line_errors():
    for bad, match in (("fp8.amax_history_len=0", "amax_history_len"), ("fp8.amax_compute_algo=mean", "max"),
                       ("fp8.margin=-1", "margin")):
        with pytest.raises(ConfigError, match=match) as e:
            load_config(None, [bad])
        assert "\n" not in str(e.value)


def _cfg(small_run, *extra):
    return load_config(None, [*small_run, "fp8.recipe=delayed", "train.warmup_steps=2", *extra])


@pytest.mark.slow
def test_resume_is_exact_and_another_recipe_is_refused(small_run, tmp_path):
    base = ["train.steps=6", "train.checkpoint_every=3", "train.eval_every=3"]
    full = train(_cfg(small_run, *base), tmp_path / "full").metrics
    ck = tmp_path / "full" / "checkpoints" / "step_000003"
    resumed = train(_cfg(small_run, *base), tmp_path / "resumed", resume=ck).metrics
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]], (resumed, full)
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[3:]]
    with pytest.raises(CheckpointError, match="fp8.recipe = 'delayed'"):
        train(load_config(None, [*small_run, *base, "fp8.recipe=tensorwise"]), tmp_path / "other", resume=ck)
    assert not (tmp_path / "other").exists()
