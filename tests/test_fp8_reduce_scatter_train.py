"""``distributed.fp8_reduce_scatter``: FSDP2's gradient reduce-scatter in FP8 through ``fp8kit train`` (CPU, gloo).

- 2 torchrun ranks, FSDP2, 6 steps: with ``fp8_reduce_scatter = "e5m2"`` the losses stay within 2% of the same run
  with it off (the reduction's FP8 rounding; measured < 0.1%), the summary names the FP8 reduce-scatter, the
  checkpoint's train state holds the auto-scale state of every FSDP module (calls counted), and ``--resume`` from
  step 3 gives the uninterrupted run's losses of steps 4-6 exactly;
- one process (no FSDP2): the run trains and says loudly that the setting has no effect;
- bad input: an unknown format names the field; HSDP (``dp_replicate > 1``) is refused before anything is built.
"""

from __future__ import annotations

import json

import pytest

from fp8kit.base.errors import ConfigError
from fp8kit.config import load_config
from fp8kit.train import checkpoint as ckpt
from fp8kit.train.setup import check_distributed_config
from fp8kit.train.trainer import train
from tests.conftest import small_run_overrides
from tests.test_distributed import _losses, _sets, _torchrun

#: Largest relative per-step loss difference, FP8 reduce-scatter vs float32 (the CPU run measures < 0.1%).
LOSS_REL_TOL = 0.02


def _run_sets(cache_dir, fmt: str) -> list[str]:
    return small_run_overrides(cache_dir) + [
        "train.steps=6", "train.eval_every=0", "train.checkpoint_every=3", "train.final_checkpoint=false",
        "train.micro_batch_size=2", "train.mixed_precision=bf16", f"distributed.fp8_reduce_scatter={fmt}",
    ]


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """The off / e5m2 runs on 2 ranks and the e5m2 run resumed from its step-3 checkpoint."""
    root = tmp_path_factory.mktemp("fp8_rs_train")
    # the data cache is prepared by the first launch's rank 0 (rank 0 first, then the others)
    for name, fmt in (("off", "off"), ("e5m2", "e5m2")):
        _torchrun(2, ["-m", "fp8kit", "train", "--out", str(root / name), *_sets(_run_sets(cache_dir, fmt))],
                  timeout=600)
    ck = root / "e5m2" / "checkpoints" / "step_000003"
    _torchrun(2, ["-m", "fp8kit", "train", "--resume", str(ck), "--out", str(root / "resumed")], timeout=600)
    return root


def test_fp8_reduce_scatter_trains_like_float32(runs):
    off, fp8 = _losses(runs / "off"), _losses(runs / "e5m2")
    assert len(off) == len(fp8) == 6
    worst = max(abs(a - b) / abs(a) for a, b in zip(off, fp8, strict=True))
    assert worst < LOSS_REL_TOL, f"FP8 reduce-scatter vs float32: worst per-step loss difference {worst:.3%}"
    assert fp8 != off, "the FP8 reduce-scatter did not change a single bit of the losses: did it run?"
    summary = json.loads((runs / "e5m2" / "summary.json").read_text())
    assert "fp8-reduce-scatter-e5m2" in summary["parallel"], summary["parallel"]
    assert "FP8 E5M2 gradient reduce-scatter" in summary["parallel"], summary["parallel"]
    state = ckpt.load_train_state(runs / "e5m2" / "checkpoints" / "step_000003")["grad_comm"]
    keys = state["keys"]
    assert keys and all(k.startswith("fsdp:") for k in keys), sorted(keys)
    assert all(v["calls"] == 3 and v["initialized"] for v in keys.values()), keys
    assert state["fp8_dtype"] == "e5m2" and state["scaling"] == "delayed", state


def test_fp8_reduce_scatter_resumes_exactly(runs):
    resumed, full = _losses(runs / "resumed"), _losses(runs / "e5m2")
    assert len(resumed) == 3, resumed
    assert resumed == full[3:], f"resumed {resumed} != uninterrupted {full[3:]}"


def test_fp8_reduce_scatter_without_fsdp_warns(cache_dir, tmp_path):
    cfg = load_config(None, _run_sets(cache_dir, "e4m3") + ["train.steps=1", "train.checkpoint_every=0"])
    result = train(cfg, tmp_path / "one")
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    notes = " ".join(summary["parallel_notes"])
    assert "distributed.fp8_reduce_scatter = 'e4m3' has no effect: no FSDP2 (dp_shard = 1)" in notes, notes
    assert len(result.metrics) == 1


def test_fp8_reduce_scatter_bad_input(cache_dir):
    with pytest.raises(ConfigError, match="distributed.fp8_reduce_scatter"):
        load_config(None, ["distributed.fp8_reduce_scatter=e3m4"])
    cfg = load_config(None, small_run_overrides(cache_dir) + ["distributed.dp_replicate=2",
                                                              "distributed.fp8_reduce_scatter=e5m2"])
    with pytest.raises(ConfigError, match=r"fp8_reduce_scatter = 'e5m2' with dp_replicate = 2 \(HSDP\): not supported"):
        check_distributed_config(cfg)
