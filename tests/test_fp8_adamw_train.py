"""FP8AdamW through the trainer (optim.name = fp8_adamw): the tiny preset on the stdlib corpus, on the CPU.

The reference is AdamW with FP32 master weights (train.param_dtype = fp32: FP32 weights, gradients and
states, bf16 forward through autocast, 16 bytes/param). Both runs use FP8 matmuls, the same seed, data
order and schedule (150 steps, lr 1e-3, 10 warmup steps, cosine to 10 %). Threshold: FP8AdamW's mean train
loss over the last 10 % of steps and its final validation loss within 2 % of AdamW's (the issue's bar;
measured with the one-process default's per-block scales +0.02 % and +0.06 %: 5.4319 vs 5.4307 and 5.8073 vs
5.8037; per tensor, until session 23, +0.12 % and +0.16 %; at 250 steps, until session 18, +0.22 % and +0.38 %).
Training state recorded per step: 9.097 B/param (7 for the states and bf16 gradients, 2 for the bf16 working
weights, 0.094 for the per-block scales, and the flat layout's padding) against 16. The two runs take about 100 s together on 2 cores (eager step).
"""

from __future__ import annotations

import contextlib
import io
import statistics

import pytest
import torch

from fp8kit.base.errors import ConfigError
from fp8kit.config import load_config
from fp8kit.train.checkpoint import STATE_FILE
from fp8kit.train.trainer import train
from tests.conftest import small_run_overrides

STEPS = 150
GAP = 0.02  # the issue: FP8AdamW's loss within 2 % of AdamW's
RUNS = {
    "adamw_fp32": ["optim.name=adamw", "train.param_dtype=fp32"],
    "fp8_adamw": ["optim.name=fp8_adamw"],
}


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """The two 150-step runs, once for the tests below: ``{name: (TrainResult, console output)}``."""
    out = {}
    base = [
        f"train.steps={STEPS}",
        "train.lr=1e-3",
        "train.eval_every=50",
        "train.checkpoint_every=0",
        "train.final_checkpoint=false",
    ]
    for name, extra in RUNS.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            res = train(
                load_config(None, [*small_run_overrides(cache_dir), *base, *extra]),
                tmp_path_factory.mktemp(name) / "run",
            )
        out[name] = (res, buf.getvalue())
    return out


def _tail(metrics: list[dict]) -> float:
    return statistics.fmean(r["loss"] for r in metrics[-len(metrics) // 10 :])


@pytest.mark.slow
def test_fp8_adamw_loss_within_2pct_of_fp32_adamw(runs):
    ref, fp8 = runs["adamw_fp32"][0].metrics, runs["fp8_adamw"][0].metrics
    assert len(ref) == len(fp8) == STEPS and all(r["precision"] == "fp8" for r in fp8)
    tail_ref, tail = _tail(ref), _tail(fp8)
    val_ref, val = ref[-1]["val_loss"], fp8[-1]["val_loss"]
    ms = {n: statistics.median(r["step_ms"] for r in runs[n][0].metrics[5:]) for n in runs}
    print(
        f"train loss (mean last 10%): adamw_fp32 {tail_ref:.4f}, fp8_adamw {tail:.4f} ({tail / tail_ref - 1:+.2%}); "
        f"final val loss {val_ref:.4f} vs {val:.4f} ({val / val_ref - 1:+.2%}); step ms {ms}"
    )
    assert abs(tail / tail_ref - 1) < GAP, (
        f"train loss {tail:.4f} vs AdamW {tail_ref:.4f} ({tail / tail_ref - 1:+.2%})"
    )
    assert abs(val / val_ref - 1) < GAP, (
        f"val loss {val:.4f} vs AdamW {val_ref:.4f} ({val / val_ref - 1:+.2%})"
    )
    # both learned: ln(1024) = 6.93 is where training starts (measured: train 7.00 -> 5.43, val 6.08 at step 50 -> 5.80)
    first = statistics.fmean(r["loss"] for r in fp8[:5])
    vals = [r["val_loss"] for r in fp8 if r.get("val_loss") is not None]
    assert tail < first - 1.2, f"fp8_adamw train loss fell only from {first:.3f} to {tail:.3f}"
    assert len(vals) == STEPS // 50 and vals[-1] < vals[0] - 0.15 and vals[-1] < 6.0, (
        f"fp8_adamw val losses {vals}"
    )
    assert tail_ref < first - 1.2


@pytest.mark.slow
def test_state_bytes_per_param_recorded(runs):
    (ref, ref_out), (fp8, fp8_out) = runs["adamw_fp32"], runs["fp8_adamw"]
    b_ref, b = ref.metrics[-1]["state_bytes_per_param"], fp8.metrics[-1]["state_bytes_per_param"]
    print(f"state bytes/param (with working weights): adamw_fp32 {b_ref:.4f}, fp8_adamw {b:.4f}")
    # fp8_adamw defaults: 2 master + 2 bf16 grad (read in place) + 1 m + 2 v + 2 bf16 working weights, and one
    # process's per-block scales: 3 float32 per 128 elements (0.094); padding adds < 0.01
    assert abs(b - (9.0 + 12 / 128)) < 0.01, f"fp8_adamw: {b:.4f} B/param"
    assert b_ref == 16.0, f"adamw_fp32: {b_ref:.4f} B/param"
    assert all(r["state_bytes_per_param"] == b for r in fp8.metrics)
    assert fp8.summary["state_bytes_per_param"] == b and fp8.summary["optimizer"].startswith(
        "FP8AdamW (master fp16"
    )
    assert (
        "optimizer: FP8AdamW (master fp16, grad param, m e4m3 rounded stochastic, v fp16, per block) "
        "(train.param_dtype = auto -> bf16; optim.granularity = auto -> block (one process: the step in one pass)); "
        "training state master 2.03 + grad 2.00 + m 1.03 + v 2.03 = 7.10 B/param (9.10 with working weights)"
        in " ".join(fp8_out.split())
    ), fp8_out[:2000]  # the console wraps long lines: compare with whitespace runs joined
    assert (
        "optimizer: AdamW (fp32 parameters and states); training state master 4.00 + grad 4.00 + m 4.00 + "
        "v 4.00 = 16.00 B/param" in ref_out
    ), ref_out[:2000]


@pytest.mark.slow
@pytest.mark.parametrize("grad, saved", [("e5m2", "auto"), ("param", "tensor")])
def test_fp8_adamw_resume_is_bit_exact(cache_dir, tmp_path, grad, saved):
    """Both gradient modes through the trainer (FP8 hooks; autograd's gradients read by the step), with
    the stochastic rounding of m: the random numbers are a function of the step, so resume is exact. The resumed
    run leaves ``optim.granularity`` at ``auto``: it continues with the scales the checkpoint was saved with
    (``block``, the one-process default, or ``tensor`` set explicitly, as every checkpoint before ``auto``)."""
    base = [
        *small_run_overrides(cache_dir),
        "train.steps=8",
        "train.checkpoint_every=4",
        "train.eval_every=4",
        "fp8.bf16_warmup_steps=2",
        "optim.name=fp8_adamw",
        f"optim.grad={grad}",
    ]
    full = train(load_config(None, [*base, f"optim.granularity={saved}"]), tmp_path / "full").metrics
    ckpt = tmp_path / "full" / "checkpoints" / "step_000004"
    state = torch.load(ckpt / STATE_FILE, weights_only=True)
    want = "block" if saved == "auto" else saved
    assert state["optimizer"]["fp8adamw"]["step"] == 4
    assert state["optimizer"]["fp8adamw"]["precision"] == state["fp8adamw_precision"]
    assert state["fp8adamw_precision"]["granularity"] == want
    assert all(
        g["m"].dtype == torch.float8_e4m3fn and g["v_scale"] is not None for g in state["optimizer"]["flat"]
    )
    if saved == "tensor":  # a checkpoint written before the key existed: the optimizer's precision tells
        del state["fp8adamw_precision"]
        torch.save(state, ckpt / STATE_FILE)
    resumed = train(load_config(None, base), tmp_path / "resumed", resume=ckpt)
    assert f"per {want})" in resumed.summary["optimizer"], resumed.summary["optimizer"]
    assert [r["step"] for r in resumed.metrics] == [5, 6, 7, 8]
    assert [r["loss"] for r in resumed.metrics] == [r["loss"] for r in full[4:]]
    assert [r.get("val_loss") for r in resumed.metrics] == [r.get("val_loss") for r in full[4:]]
    assert [r["grad_norm"] for r in resumed.metrics] == [r["grad_norm"] for r in full[4:]]


@pytest.mark.parametrize(
    "override, match",
    [
        (
            "optim.name=fp8adamw",
            r"optim.name=fp8adamw: unknown value 'fp8adamw' \(did you mean 'fp8_adamw'\?\)",
        ),
        (
            "optim.name=unknown",
            r"optim.name=unknown: unknown value 'unknown'; choose one of adamw, fp8_adamw",
        ),
        ("optim.v=bf16", r"optim.v=bf16: unknown value 'bf16' \(did you mean 'fp16'\?\)"),
        ("optim.nmae=adamw", r"unknown key 'optim.nmae'; did you mean 'optim.name'\?"),
        ("optim.block_size=100", r"optim.block_size=100: must be a positive multiple of 16, got 100"),
    ],
)
def test_bad_optim_config(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_bad_block_size_in_config_file_names_the_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[optim]\nname = "fp8_adamw"\ngranularity = "block"\nblock_size = 100\n')
    with pytest.raises(ConfigError, match=r"optim.block_size: must be a positive multiple of 16, got 100"):
        load_config(path, [])
