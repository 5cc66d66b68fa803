"""``benchmarks/ep_layer.py`` on 2 gloo ranks (its CPU path): one expert-parallel MoE layer with BF16 experts, FP8
experts fed bf16 rows, and FP8 experts fed the rowwise E4M3 payload, forward + backward. The timings are not checked
(performance lives in benchmarks); what is: every variant ran on both ranks, and FP8 dispatch hands the experts the
bits their own cast makes (the outputs of the two FP8 variants equal: 0 difference)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ep_layer_benchmark_runs_and_fp8_dispatch_feeds_the_same_bits(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "benchmarks" / "ep_layer.py"), "--device", "cpu", "--models", "tiny", "--tokens", "48",
           "--warmup", "1", "--iters", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = json.loads((tmp_path / "ep_layer.json").read_text())
    (row,) = rep["rows"]
    assert rep["world_size"] == 2 and row["model"] == "tiny", rep
    assert set(row["variants"]) == {"bf16", "fp8", "fp8-dispatch"} and all(
        v["ms"] > 0 for v in row["variants"].values()), row
    assert row["out_vs_fp8"] == 0.0, f"FP8 dispatch changed the experts' output by {row['out_vs_fp8']}"
    assert "| tiny |" in proc.stdout, proc.stdout[-2000:]
