"""``train.log_to``: TensorBoard event files hold the logged scalars (read back with tensorboard's own reader),
a resume purges the events after its checkpoint, and W&B without the package is a one-line error."""

from __future__ import annotations

import email
import importlib.util
import os

import pytest
import torch

from fp8kit.cli.main import main
from fp8kit.config import load_config
from fp8kit.train.metrics import read_metrics
from fp8kit.train.trainer import train

CORPUS = os.path.join(os.path.dirname(email.__file__), "*.py")


def _sets(cache_dir) -> list[str]:
    return [
        "model.num_layers=2", "data.seq_length=64", "data.vocab_size=1024", f"data.cache_dir={cache_dir}",
        f'data.paths=["{CORPUS}"]', "train.micro_batch_size=4", "train.log_every=1000", "train.eval_batches=2",
        "train.mixed_precision=bf16",
    ]


def _scalars(run, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert tag in acc.Tags()["scalars"], acc.Tags()["scalars"]
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_events_hold_the_metrics_and_resume_purges(cache_dir, tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_config(None, [*_sets(cache_dir), "train.steps=4", "train.eval_every=2", "train.checkpoint_every=2",
                                 "train.log_to=jsonl,tensorboard"])
        run = train(cfg, tmp_path / "run").out_dir
        records = read_metrics(run / "metrics.jsonl")
        for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                         ("val/loss", "val_loss"), ("train/tokens_per_s", "tokens_per_s")):
            want = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            got = _scalars(run, tag)
            assert [s for s, _ in got] == [s for s, _ in want], (tag, got, want)
            for (_, g), (_, w) in zip(got, want, strict=True):
                assert abs(g - w) <= 1e-6 * max(1.0, abs(w)), f"{tag}: {got} vs {want}"  # float32 in the event file
        # resume from step 2 into the same directory: steps 3-4 are redone, their old events purged
        train(cfg, run, resume=run / "checkpoints" / "step_000002")
        steps = [s for s, _ in _scalars(run, "train/loss")]
        assert steps == [1, 2, 3, 4], f"events after resume: {steps}"
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_without_the_package_is_one_line(cache_dir, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out)]
    for s in [*_sets(cache_dir), "train.steps=1", "train.log_to=jsonl,wandb"]:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "wandb package is not installed" in err, err
    assert not out.exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed")
def test_wandb_offline_run(cache_dir, tmp_path):
    cfg = load_config(None, [*_sets(cache_dir), "train.steps=2", "train.log_to=jsonl,wandb"])
    run = train(cfg, tmp_path / "run").out_dir
    assert list((run / "wandb").glob("offline-run-*")), sorted(p.name for p in (run / "wandb").iterdir())
