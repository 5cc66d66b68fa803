"""benchmarks/fsdp_max_model.py on CPU: its ``--tiny`` mode on 2 gloo ranks, and its search on synthetic memory.

The tiny run (``torchrun --nproc_per_node 2 ... --tiny --cap-gib CAP``: in-process probes through the trainer's
setup and loop, FSDP2 + meta init + FP8 + activation checkpointing, simulated memory = parameter, gradient
and optimizer-state bytes counted from one rank's tensors) must find, for AdamW (fp32 master) and FP8AdamW,
a layer count whose counted bytes fit the cap next to one whose bytes do not, with 16 and 9 bytes/param
counted (4+4+4+4; 2+2+2+1+2 plus the flat layout's padding), so FP8AdamW fits 1.5-1.9x the parameters.
The search (``plan_next``) is checked alone on synthetic memory curves: it must land on the exact boundary
when the linear fit is right, overshoots, undershoots, or memory runs out below what the fit sees.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.script_loader import load_script
from tests.test_distributed import ROOT, _env

SCRIPT = ROOT / "benchmarks" / "fsdp_max_model.py"
CAP = 0.01  # GiB per rank: about 6 tiny layers with AdamW (16 B/param), 11 with FP8AdamW (9 B/param)


def _module():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the JSON document, stdout) of one tiny run on 2 gloo ranks."""
    out = tmp_path_factory.mktemp("fsdp_max_model")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           "--tiny", "--cap-gib", str(CAP), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert proc.returncode == 0, f"fsdp_max_model --tiny failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads((out / "fsdp_max_model.json").read_text()), proc.stdout


@pytest.mark.parametrize("opt", ["adamw", "fp8_adamw"])
def test_boundary_found_and_verified(tiny, opt):
    doc, _ = tiny
    s = doc["summary"][opt]
    probes = {p["n_layers"]: p for p in doc["probes"] if p["optimizer"] == opt}
    table = {n: (p["status"], round(p["counted_gib"], 5)) for n, p in sorted(probes.items())}
    assert s["boundary_verified"] and s["stopped"] is None, f"{opt}: {s} (probes {table})"
    n = s["max_layers"]
    assert n >= 3, f"{opt}: max {n} layers under a {CAP} GiB cap (probes {table})"
    assert probes[n]["status"] == "ok" and probes[n]["counted_gib"] <= CAP, table
    assert probes[n + 1]["status"] == "oom" and probes[n + 1]["phase"] == "simulated", table
    assert probes[n + 1]["counted_gib"] > CAP, table
    for k, p in probes.items():  # one boundary: everything below fits, everything above does not
        assert p["status"] == ("ok" if k <= n else "oom"), f"{opt}: {table}"
    assert len(probes) <= 5, f"{opt}: {len(probes)} probes on a linear memory curve: {table}"
    assert s["params"] == doc["model"]["params_outside_layers"] + n * doc["model"]["params_per_layer"]


def test_counted_bytes_per_param(tiny):
    doc, _ = tiny
    for p in doc["probes"]:
        bpp = p["measured_bytes_per_param"]
        lo, hi = (16.0, 16.0) if p["optimizer"] == "adamw" else (9.0, 9.1)  # FP8AdamW pads tensors to 128
        assert lo - 1e-9 <= bpp <= hi, f"{p['optimizer']} at {p['n_layers']} layers: {bpp} B/param counted"
        assert p["fp8kit_bytes_per_param"]["total"] > 0  # fp8kit's own report, recorded as it is


def test_ratio_b_over_a(tiny):
    doc, _ = tiny
    s = doc["summary"]
    ratio = s["fp8_adamw"]["params"] / s["adamw"]["params"]
    assert s["ratio_params_b_over_a"] == pytest.approx(ratio, rel=1e-12)
    assert 1.5 <= ratio <= 1.9, f"FP8AdamW / AdamW parameters {ratio:.3f} (16 vs 9 B/param: about 1.78)"
    assert s["complete"] and s["target_met"] is True


def test_probe_records_the_training_path(tiny):
    doc, stdout = tiny
    for key in ("date", "command", "device", "versions", "model", "settings"):
        assert doc.get(key), key
    assert doc["versions"]["torch"] and doc["versions"]["torchao"]
    assert doc["world_size"] == 2 and doc["settings"]["launch"] == "inprocess"
    for p in doc["probes"]:
        where = f"{p['optimizer']} {p['n_layers']} layers"
        assert p["ranks"] == 2 and p["meta_init"] is True, where
        assert p["prepare_steps"] == ["fp8", "ac", "fsdp2"] and p["fp8_all_gather"] is True, where
        assert p["fp8_sites"] >= 7 * p["n_layers"], f"{where}: {p['fp8_sites']} FP8 linears"
        assert len(p["step_s"]) == 2 and all(math.isfinite(x) for x in p["losses"]), where
        assert p["params"] == p["params_est"], where
    assert "| A: AdamW, fp32 master |" in stdout and "| B: FP8AdamW |" in stdout, stdout[-2000:]


# ------------------------------------------------------------------------------ the search, synthetic memory


def _search(fits, metric, *, limit=100.0, max_layers=200, guess=4.0):
    """Run ``plan_next`` against a synthetic GPU: ``fits(n)`` decides OOM, ``metric(n)`` is the fitted memory."""
    mod = _module()
    history = []
    while (n := mod.plan_next(history, limit=limit, start=2, max_layers=max_layers, slope_guess=guess)) is not None:
        assert all(h["n"] != n for h in history), f"probed {n} twice: {history}"
        ok = fits(n)
        history.append({"n": n, "status": "ok" if ok else "oom", "metric": metric(n) if ok else None})
        assert len(history) < 30, history
    best = max((h["n"] for h in history if h["status"] == "ok"), default=0)
    return best, [h["n"] for h in history]


@pytest.mark.parametrize("name, metric, fits, expected, most", [
    # the fit is exact: 2, the guess, the prediction, the prediction + 1
    ("linear", lambda n: 10 + 3 * n, lambda n: 10 + 3 * n <= 100, 30, 4),
    # memory grows faster than the first two points say: the prediction overshoots
    ("convex", lambda n: 10 + 3 * n + 0.05 * n * n, lambda n: 10 + 3 * n + 0.05 * n * n <= 100, 21, 8),
    # the metric overstates (allocator cache): more fits than predicted, one layer at a time
    ("undershoot", lambda n: 10 + 3 * n, lambda n: n <= 33, 33, 8),
    # memory runs out below what the metric sees (a transient it misses): halve the gap, then step
    ("hidden transient", lambda n: 10 + 3 * n, lambda n: n <= 14, 14, 8),
    ("nothing fits", lambda n: 10 + 3 * n, lambda n: False, 0, 2),
    ("one layer fits", lambda n: 10 + 3 * n, lambda n: n <= 1, 1, 2),
    ("everything fits", lambda n: 10 + 0.1 * n, lambda n: True, 200, 3),
])
def test_search_lands_on_the_boundary(name, metric, fits, expected, most):
    best, probed = _search(fits, metric)
    assert best == expected, f"{name}: found {best}, expected {expected} (probed {probed})"
    assert len(probed) <= most, f"{name}: {len(probed)} probes {probed} (at most {most})"


def test_merge_ranks_oom_wins():
    mod = _module()
    merged = mod.merge_ranks([
        {"rank": 1, "status": "error", "phase": "train", "error": "NCCL: remote rank exited"},
        {"rank": 0, "status": "oom", "phase": "setup", "error": "OutOfMemoryError: CUDA out of memory",
         "peak_alloc_gib": 120.0, "steps": []},
    ])
    assert merged["status"] == "oom" and merged["phase"] == "setup" and merged["peak_alloc_gib"] == 120.0
    assert mod.merge_ranks([{"rank": 0, "status": "ok"}, {"rank": 1, "status": "ok"}])["status"] == "ok"


def _decide_worker(rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from fp8kit.parallel.mesh import end_distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    completed = False
    try:
        decide = _module().rank0_decides
        got = {"rank1_says_stop": decide("inprocess", rank == 1), "rank0_says_stop": decide("inprocess", rank == 0),
               "torchrun_own": decide("torchrun", rank == 1)}
        torch.save(got, f"{out}/rank{rank}.pt")
        completed = True
    finally:
        end_distributed(completed=completed)


def test_inprocess_ranks_take_rank0s_budget_decision(tmp_path):
    """With in-process probes every rank runs the search and each probe is collective: a stop decided on each
    rank's own clock could leave one rank probing while the other has stopped (a hang). Rank 0's decision holds on
    both ranks; torchrun launches (rank 0 alone searches) keep their own."""
    import torch
    import torch.multiprocessing as mp

    mp.start_processes(_decide_worker, args=(str(tmp_path),), nprocs=2, start_method="spawn", join=True)
    r = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    assert [x["rank1_says_stop"] for x in r] == [False, False], r
    assert [x["rank0_says_stop"] for x in r] == [True, True], r
    assert [x["torchrun_own"] for x in r] == [False, True], r
