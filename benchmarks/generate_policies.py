"""Generate the shipped adaptive-FP8 policies on a GPU: bench-layers reports + merged policies.

For each model preset and FP8 recipe: TP 1 measured, TP 2/4/8 simulated (per-rank shard shapes on one
GPU; ``simulated_tp: true`` in the report and ``_sim`` in its file name; any other dense preset, such as ``tiny``:
TP 1 only); for a MoE preset TP 1 at each of its
EP sizes (``_ep<N>`` in the file name; the experts timed as the fused MLP where they run fused). Reports go to
``OUT/reports/``; ``--merge`` then writes ``src/fp8kit/policies/<preset>_<recipe>_<gpu>.json`` and copies the
reports it merged to ``benchmarks/results/policy_reports/`` (what ``check_policies.py`` reads; run it on any
machine: merging needs no GPU). Configs whose report exists are skipped, and the run
stops cleanly before ``--budget-s`` so a lease's time limit never loses finished reports (each run, or each
``--gpus`` worker, measures at least one report: ``--budget-s 0`` measures exactly one).

    python benchmarks/generate_policies.py --out /tmp/pol --presets llama3-8b,qwen2.5-72b --budget-s 500
    python benchmarks/generate_policies.py --out /tmp/pol --merge --gpu h100
    python benchmarks/generate_policies.py --out /tmp/pol --presets qwen3-30b-a3b --recipes tensorwise --max-tokens 16384
    python benchmarks/generate_policies.py --out /tmp/pol --presets qwen2.5-72b --recipes delayed,blockwise --gpus 4

``--gpus N`` runs one worker per GPU of the host (each takes the next unclaimed report), N times the throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PRESET_TPS = {"llama3-8b": (1, 2, 4, 8), "qwen2.5-72b": (1, 2, 4, 8), "llama3-1b": (1,)}
#: MoE presets: TP 1 at each EP size (one GPU: 128 local experts; EP 8: 16), as the shipped policy was measured
PRESET_EPS = {"qwen3-30b-a3b": (1, 8)}
RECIPES = ("tensorwise", "rowwise")


def layouts(preset: str) -> list[tuple[int, int | None]]:
    """``(tp, ep)`` of each report of ``preset`` (``ep`` None for a dense preset)."""
    if preset in PRESET_EPS:
        return [(1, ep) for ep in PRESET_EPS[preset]]
    return [(tp, None) for tp in PRESET_TPS.get(preset, (1,))]  # any other dense preset: TP 1


def report_name(preset: str, recipe: str, tp: int, ep: int | None = None) -> str:
    if ep is not None:
        return f"{preset}_{recipe}_tp{tp}_ep{ep}.json"
    return f"{preset}_{recipe}_tp{tp}{'_sim' if tp > 1 else ''}.json"


def jobs(args) -> list[tuple[str, str, int, int | None]]:
    """Every ``(preset, recipe, tp, ep)`` report of ``--presets`` x ``--recipes``, in order."""
    return [(preset, recipe, tp, ep) for preset in args.presets.split(",") for recipe in args.recipes.split(",")
            for tp, ep in layouts(preset)]


def _claim(path: Path) -> bool:
    """Take ``path``'s report for this worker (an exclusively created ``.claim`` file beside it); False when
    another worker has it."""
    try:
        os.close(os.open(path.with_suffix(".claim"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def bench(args) -> None:
    from fp8kit.bench.layers import BenchLayersArgs, auto_sweep, run_bench_layers
    from fp8kit.config import load_config
    from fp8kit.config.options import grouped_gemm_config

    out = Path(args.out) / "reports"
    out.mkdir(parents=True, exist_ok=True)
    start, measured = time.time(), 0
    for preset, recipe, tp, ep in jobs(args):
        path = out / report_name(preset, recipe, tp, ep)
        if path.exists():
            continue
        if measured and time.time() - start > args.budget_s:  # at least one report per run, even at --budget-s 0
            print(f"budget reached, stopping before {path.name}", flush=True)
            return
        if args.worker and not _claim(path):  # another GPU's worker measures it
            continue
        t0 = time.time()
        cfg = load_config(None, [f"model.preset={preset}", "model.num_layers=1", f"fp8.recipe={recipe}"])
        rep = run_bench_layers(BenchLayersArgs(
            model=cfg.model, vocab_size=cfg.data.vocab_size, tp=tp, ep=ep or 1, simulate_tp=tp > 1,
            recipe=recipe, warmup=args.warmup, iters=args.iters, shape_sweep=auto_sweep(args.max_tokens),
            grouped=grouped_gemm_config(cfg), dynamic=args.dynamic,
        ))
        path.write_text(json.dumps(rep, indent=1) + "\n")
        path.with_suffix(".claim").unlink(missing_ok=True)
        measured += 1
        print(f"{path.name}: {time.time() - t0:.0f} s", flush=True)


def spread(args) -> int:
    """``--gpus N``: one worker process per GPU (``CUDA_VISIBLE_DEVICES=i``), each taking the next report no other
    worker has claimed, so the reports of one host's GPUs are measured at once. Returns the number of workers that
    failed."""
    out = Path(args.out) / "reports"
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.claim"):  # a killed earlier run's claims
        stale.unlink()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", args.out, "--presets", args.presets,
           "--recipes", args.recipes, "--warmup", str(args.warmup), "--iters", str(args.iters),
           "--max-tokens", str(args.max_tokens), "--budget-s", str(args.budget_s), "--worker"]
    cmd += ["--dynamic"] if args.dynamic else []
    procs = [subprocess.Popen(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": str(i)}) for i in range(args.gpus)]
    failed = [i for i, p in enumerate(procs) if p.wait() != 0]
    for i in failed:
        print(f"worker on GPU {i} failed (exit {procs[i].returncode}); its claimed report is left to a rerun")
    return len(failed)


def merge(args) -> None:
    from fp8kit.selective.policy import builtin_policy_dir, merge_reports

    src = Path(args.out) / "reports"
    dest = builtin_policy_dir()
    kept = Path(__file__).resolve().parent / "results" / "policy_reports"  # what check_policies.py reads
    kept.mkdir(parents=True, exist_ok=True)
    for preset in args.presets.split(","):
        for recipe in args.recipes.split(","):
            names = [report_name(preset, recipe, tp, ep) for tp, ep in layouts(preset)]
            found = [(n, json.loads((src / n).read_text())) for n in names if (src / n).exists()]
            if not found:
                continue
            for n, rep in found:
                (kept / n).write_text(json.dumps(rep, indent=1) + "\n")
            policy = merge_reports(found, args.speedup_threshold)
            policy.save(dest / f"{preset}_{recipe}_{args.gpu}.json")
            print(f"{preset}_{recipe}_{args.gpu}.json from {len(found)} report(s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--presets", default="llama3-8b,qwen2.5-72b,llama3-1b")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32768)
    ap.add_argument("--budget-s", type=float, default=480)
    ap.add_argument("--dynamic", action="store_true",
                    help="one dynamic-shape compilation per site (the pre-session-28 method; it rates FP8 too slow)")
    ap.add_argument("--gpus", type=int, default=1,
                    help="measure on this many GPUs of the host at once, one worker process per GPU")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one of --gpus' processes
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--speedup-threshold", type=float, default=1.0)
    args = ap.parse_args()
    if args.gpus < 1:
        ap.error(f"--gpus {args.gpus}: must be at least 1")
    if args.merge:
        merge(args)
    elif args.gpus > 1:
        return 1 if spread(args) else 0
    else:
        bench(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
