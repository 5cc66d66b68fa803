"""FP8AdamW under FSDP2 on 2 gloo ranks (tests/distributed_worker.py, scenarios ``fsdp_fp8adamw*``).

One torchrun launch trains 10 steps with ``optim.name = "fp8_adamw"`` (dp_shard = 2, bf16, global batch 4,
DCP checkpoint at step 5) and resumes that checkpoint on the same 2 ranks for steps 6-10. Checked here:

- the 2-rank losses track one process (same global batch, meta init) within 2e-3 per step (measured
  6.4e-4, torch 2.13 CPU: the scales are reduced over the shards and stochastic rounding uses the
  unsharded index, so only the gradient reduce-scatter's summation order and bf16 rounding differ);
- the resume at dp_shard = 2 equals the uninterrupted run bit for bit (loss per step, ``==``);
- the DCP checkpoint resumes in one process (dp_shard = 1, resharded) within 2e-3 (measured 7.2e-4);
- bad input: resuming it into AdamW, or with another optim precision, or into another model shape, and
  tensor parallel with fp8_adamw, are one-line errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fp8kit.base.errors import CheckpointError, ConfigError
from fp8kit.config import load_config
from fp8kit.train.trainer import train
from tests.conftest import small_run_overrides
from tests.test_distributed import ROOT, _close, _losses, _torchrun

BASE = ["train.steps=10", "train.eval_every=0", "train.checkpoint_every=0", "train.final_checkpoint=false",
        "train.mixed_precision=bf16"]
FP8ADAMW = ["optim.name=fp8_adamw", "optim.grad=param"]
TOL = 2e-3


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """(2-rank output root, single-process reference losses)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train(load_config(None, small_run_overrides(cache_dir) + BASE + FP8ADAMW + ["distributed.meta_init=true"]),
                    tmp_path_factory.mktemp("ref") / "r")
        out = tmp_path_factory.mktemp("dist")
        _torchrun(2, [str(ROOT / "tests" / "distributed_worker.py"), str(out), str(cache_dir), "fsdp_fp8adamw",
                      "fsdp_fp8adamw_resumed"], timeout=600)
    finally:
        torch.set_num_threads(before)
    return out, [r["loss"] for r in ref.metrics]


def _ckpt(out: Path) -> Path:
    return out / "fsdp_fp8adamw" / "checkpoints" / "step_000005"


def test_two_ranks_track_one_process(runs):
    out, ref = runs
    _close(_losses(out / "fsdp_fp8adamw"), ref, TOL, "fp8_adamw dp_shard=2 vs 1 process")


def test_resume_on_two_ranks_is_exact(runs):
    out, _ = runs
    assert (_ckpt(out) / "dcp" / ".metadata").is_file()
    resumed, whole = _losses(out / "fsdp_fp8adamw_resumed"), _losses(out / "fsdp_fp8adamw")[5:]
    assert resumed == whole, f"resumed at dp_shard=2 {resumed} != uninterrupted {whole}"


def test_resume_on_one_process_reshards(runs, cache_dir, tmp_path):
    out, _ = runs
    cfg = load_config(None, small_run_overrides(cache_dir) + BASE + FP8ADAMW)
    resumed = [r["loss"] for r in train(cfg, tmp_path / "r1", resume=_ckpt(out)).metrics]
    _close(resumed, _losses(out / "fsdp_fp8adamw")[5:], TOL, "dp_shard=2 -> 1 process resume")


@pytest.mark.parametrize("sets, match", [
    (["optim.name=adamw"], r"holds FP8AdamW optimizer states, this run's optimizer is AdamW .*optim.name = "
                           r"\"fp8_adamw\", or switch optimizers explicitly: `fp8kit export`"),
    (FP8ADAMW + ["optim.m=fp16"], r"optimizer state '.*\.m' is torch.float8_e4m3fn \[.*\] in the checkpoint but "
                                  r"torch.float16"),
    (FP8ADAMW + ["model.num_layers=1"], r"the checkpoint has parameter 'model.layers.1.*', which the configured "
                                        r"model lacks"),
])
def test_resume_mismatch_is_one_line(runs, cache_dir, tmp_path, sets, match):
    out, _ = runs
    cfg = load_config(None, small_run_overrides(cache_dir) + BASE + sets)
    with pytest.raises(CheckpointError, match=match) as e:
        train(cfg, tmp_path / "bad", resume=_ckpt(out))
    assert "\n" not in str(e.value), str(e.value)


def test_adamw_checkpoint_into_fp8_adamw_is_refused(cache_dir, tmp_path):
    sets = small_run_overrides(cache_dir) + ["train.steps=1", "train.eval_every=0", "train.mixed_precision=bf16"]
    train(load_config(None, sets), tmp_path / "adamw")
    with pytest.raises(CheckpointError, match=r"holds AdamW \(torch.optim.AdamW\) optimizer states, this run's "
                                              r"optimizer is FP8AdamW") as e:
        train(load_config(None, sets + FP8ADAMW), tmp_path / "bad", resume=tmp_path / "adamw")
    assert "\n" not in str(e.value)


def test_fp8_adamw_with_tensor_parallel_is_refused(monkeypatch, small_run):
    from fp8kit.train.setup import build_setup

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"FP8AdamW steps FSDP2 / HSDP shards \(dim 0\) only"):
        build_setup(load_config(None, small_run + FP8ADAMW + ["distributed.tp=2"]))
    with pytest.raises(ConfigError, match=r"needs optim.granularity = \"tensor\" and optim.grad = \"param\""):
        build_setup(load_config(None, small_run + ["optim.name=fp8_adamw", "optim.grad=e5m2"]))
