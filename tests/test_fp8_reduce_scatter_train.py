"""``distributed.fp8_reduce_scatter``: FSDP2's gradient reduce-scatter in FP8 through ``fp8kit train`` (CPU, gloo).

- ONE torchrun launch of 2 gloo ranks (this file is the rank script, like tests/test_fp8_allreduce.py), three
  runs of :func:`fp8kit.train.trainer.train` (what ``torchrun -m fp8kit train`` calls) in one process group:
  FSDP2 (dp_shard 2), 6 steps, ``fp8_reduce_scatter`` ``"off"`` and ``"e5m2"`` (checkpoint at step 3), then the
  e5m2 run resumed from its step-3 checkpoint. Checked: the e5m2 losses stay within 2% of the off run's (the
  reduction's FP8 rounding; the CPU run measures < 0.1%) yet differ (it really ran), the summary names the FP8
  reduce-scatter, the checkpoint's train state holds the auto-scale state of every FSDP module (3 calls each),
  and ``--resume`` from step 3 gives the uninterrupted run's losses of steps 4-6 bit for bit;
- one process (no FSDP2): the run trains and says loudly that the setting has no effect;
- bad input: an unknown format names the field; HSDP (``dp_replicate > 1``) is refused before anything is built.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from fp8kit.base.errors import ConfigError
from fp8kit.config import load_config
from fp8kit.train import checkpoint as ckpt
from fp8kit.train.setup import check_distributed_config
from fp8kit.train.trainer import train
from tests.conftest import small_run_overrides

#: Largest relative per-step loss difference, FP8 reduce-scatter vs float32 (the CPU run measures < 0.1%).
LOSS_REL_TOL = 0.02
STEPS, CKPT_STEP = 6, 3
#: run name -> fp8_reduce_scatter; "resumed" continues "e5m2" from its step-CKPT_STEP checkpoint
RUNS = {"off": "off", "e5m2": "e5m2", "resumed": "e5m2"}


def _run_sets(cache_dir, fmt: str) -> list[str]:
    return small_run_overrides(cache_dir) + [
        f"train.steps={STEPS}", "train.eval_every=0", f"train.checkpoint_every={CKPT_STEP}",
        "train.final_checkpoint=false", "train.micro_batch_size=2", "train.mixed_precision=bf16",
        f"distributed.fp8_reduce_scatter={fmt}",
    ]


def _checkpoint(root: Path) -> Path:
    return root / "e5m2" / "checkpoints" / ckpt.checkpoint_name(CKPT_STEP)


# ------------------------------------------------------------------------------------------------
# The rank script (run under torchrun by the `runs` fixture)
# ------------------------------------------------------------------------------------------------


def _worker(out: Path) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cache_dir = json.loads((out / "args.json").read_text())["cache_dir"]
    losses = {}
    for name, fmt in RUNS.items():  # the data cache is prepared by rank 0 first (then the others read it)
        resume = _checkpoint(out) if name == "resumed" else None
        result = train(load_config(None, _run_sets(cache_dir, fmt)), out / name, resume=resume)
        losses[name] = [r["loss"] for r in result.metrics]
    rank = dist.get_rank()
    (out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "world": dist.get_world_size(), "losses": losses}))
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


# ------------------------------------------------------------------------------------------------
# The tests (parent process)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    """(output root, per-rank records) of the one 2-rank launch."""
    from tests.test_distributed import torchrun_rank_results

    root = tmp_path_factory.mktemp("fp8_rs_train")
    (root / "args.json").write_text(json.dumps({"cache_dir": str(cache_dir)}))
    return root, torchrun_rank_results(__file__, 2, root, timeout=600)


def _losses(run_dir: Path) -> list[float]:
    from tests.test_distributed import _losses as read

    return read(run_dir)


def test_fp8_reduce_scatter_trains_like_float32(runs):
    root, ranks = runs
    off, fp8 = _losses(root / "off"), _losses(root / "e5m2")
    assert len(off) == len(fp8) == STEPS, (off, fp8)
    worst = max(abs(a - b) / abs(a) for a, b in zip(off, fp8, strict=True))
    print(f"FP8 E5M2 reduce-scatter vs float32: worst per-step relative loss difference {worst:.4%}")
    assert worst < LOSS_REL_TOL, f"FP8 reduce-scatter vs float32: worst per-step loss difference {worst:.3%}\n{off}\n{fp8}"
    assert fp8 != off, "the FP8 reduce-scatter did not change a single bit of the losses: did it run?"
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["losses"]["e5m2"] == fp8, (ranks[0]["losses"]["e5m2"], fp8)
    summary = json.loads((root / "e5m2" / "summary.json").read_text())
    assert "fp8-reduce-scatter-e5m2" in summary["parallel"], summary["parallel"]
    assert "FP8 E5M2 gradient reduce-scatter" in summary["parallel"], summary["parallel"]
    off_summary = json.loads((root / "off" / "summary.json").read_text())
    assert "reduce-scatter" not in off_summary["parallel"], off_summary["parallel"]
    state = ckpt.load_train_state(_checkpoint(root))["grad_comm"]
    keys = state["keys"]
    assert keys and all(k.startswith("fsdp:") for k in keys), sorted(keys)
    assert all(v["calls"] == CKPT_STEP and v["initialized"] for v in keys.values()), keys
    assert state["fp8_dtype"] == "e5m2" and state["scaling"] == "delayed", state
    assert ckpt.load_train_state(root / "off" / "checkpoints" / ckpt.checkpoint_name(CKPT_STEP))["grad_comm"] is None


def test_fp8_reduce_scatter_resumes_exactly(runs):
    root, _ = runs
    resumed, full = _losses(root / "resumed"), _losses(root / "e5m2")
    assert len(resumed) == STEPS - CKPT_STEP, resumed
    assert resumed == full[CKPT_STEP:], f"resumed {resumed} != uninterrupted {full[CKPT_STEP:]}"


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


if __name__ == "__main__":  # run by the `runs` fixture under torchrun
    _worker(Path(sys.argv[1]))
