"""A one-process FP8AdamW checkpoint (per-block scales, ``optim.granularity = auto``) resumed on 2 GPUs under FSDP2
(per-tensor scales): the recast at load, as a user runs it (session 23 tested it on 2 gloo ranks only).

Runs, through the CLI (``python -m fp8kit train``), on CUDA:

1. ``ref``: one process, ``--steps`` steps, a checkpoint at ``--at`` (safetensors + train_state.pt);
2. ``async``: the same with ``train.async_checkpoint = true`` (DCP files), stopped after the checkpoint;
3. for each checkpoint: ``torchrun --nproc_per_node 2 -m fp8kit train --resume CKPT`` with half the micro-batch per
   rank (the same global batch), FP8AdamW recast per tensor at load.

Prints and writes (``--out``/results.json) whether each resumed run printed the recast warning and kept it in
``run_info.json``, its losses against the uninterrupted one-process run, and the largest relative difference.

    python benchmarks/resume_recast.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

COMMON = ["model.preset=llama-125m", "model.num_layers=4", "data.seq_length=1024", "data.vocab_size=32000",
          "train.mixed_precision=fp8", "fp8.recipe=tensorwise", "selective.selective_fp8=false",
          "optim.name=fp8_adamw", "train.eval_every=0", "train.log_every=1", "train.final_checkpoint=false",
          "train.compile=false"]
WARNING = "recast with per-tensor scales once, at load"


def _cmd(prefix: list[str], out: Path, sets: list[str], resume: Path | None = None) -> list[str]:
    cmd = [*prefix, "-m", "fp8kit", "train", "--out", str(out)]
    if resume is not None:
        cmd += ["--resume", str(resume)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def _run(cmd: list[str], log: Path) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    text = proc.stdout + proc.stderr
    log.write_text(text)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:8])} ... failed (rc {proc.returncode}); see {log}")
    return " ".join(text.split())


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--at", type=int, default=10, help="checkpoint step")
    ap.add_argument("--mbs", type=int, default=8, help="one-process micro-batch (each of 2 ranks gets half)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra config override")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    py = [sys.executable]
    base = COMMON + [f"train.steps={args.steps}", f"data.cache_dir={out / 'cache'}", *args.sets]
    one = base + [f"train.micro_batch_size={args.mbs}", f"train.checkpoint_every={args.at}"]
    _run(_cmd(py, out / "ref", one), out / "ref.log")
    _run(_cmd(py, out / "async", one + ["train.async_checkpoint=true", f"train.steps={args.at}"]), out / "async.log")
    ref = _losses(out / "ref")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    results = {"steps": args.steps, "checkpoint_step": args.at, "ref_losses": ref, "resumed": {}}
    for name in ("ref", "async"):
        ck = out / name / "checkpoints" / f"step_{args.at:06d}"
        two = base + [f"train.micro_batch_size={args.mbs // 2}"]
        said = _run(_cmd(torchrun, out / f"resumed_{name}", two, resume=ck), out / f"resumed_{name}.log")
        got = _losses(out / f"resumed_{name}")
        info = json.loads((out / f"resumed_{name}" / "run_info.json").read_text())
        diff = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in got)
        results["resumed"][name] = {
            "checkpoint": "DCP (async)" if name == "async" else "safetensors + train_state.pt",
            "warning_printed": WARNING in said,
            "warning_in_run_info": any(WARNING in w for w in info.get("warnings", [])),
            "losses": got, "max_rel_diff_vs_ref": diff,
        }
        print(f"{name}: warning printed {WARNING in said}, steps {min(got)}-{max(got)}, "
              f"max relative loss difference vs one process {diff:.2e}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
