"""Where one whole ``fp8kit train`` step spends its time, and how long the GPU waits for the host (run on a GPU).

Builds the run as ``fp8kit train`` does (``train.setup.build_setup``: model, FP8 conversion, compile,
optimizer, data) and runs its step (``train.loop.train_step``: forward, backward, clipping, optimizer,
the one host sync). After ``--warmup`` steps, ``--steps`` steps are timed on the host (each ends with the
step's sync, so a step's wall time is what ``fp8kit train`` reports) and profiled with ``torch.profiler``.

Per variant it reports, per step:

- ``wall``: host time of the step (what tokens/s is computed from), median of ``--steps`` steps run without
  the profiler, then the same number of profiled steps (their wall time is recorded too);
- ``busy``: the union of the GPU's kernel / copy intervals inside the step (time the GPU was working);
- ``idle = profiled wall - busy``: time the GPU waited (host launch overhead, syncs);
- the kernel time by group: FP8 GEMMs, BF16 GEMMs, FP8 casts and amax (Triton kernels whose inductor
  name holds ``scaled_mm`` / ``amax`` / ``to_copy...clamp`` and fp8kit's own cast kernels), other Triton
  (norms, activations), attention, optimizer, other;
- the top kernels;
- with ``--trace``: one more step recorded with host activity (a Chrome trace) and the GPU's idle gaps in it,
  each with the host operators running when it began.

One process per variant (``--one``), so compile state and memory do not carry over. Variants are those of
``benchmarks/train_throughput.py`` (``bf16``, a recipe, ``@optimizer``, ``+key=value``). ``--nproc N`` runs each
variant under ``torchrun`` on N GPUs (a distributed workload, e.g. ``qwen3-30b-a3b-ep2``); rank 0's step and
kernels are reported (the ranks' steps end together: the step's collectives).

    python benchmarks/step_profile.py --out /tmp/step_profile --variants bf16,tensorwise,delayed
    python benchmarks/step_profile.py --workload llama-125m-seq1024 --variants bf16,delayed --steps 5
    python benchmarks/step_profile.py --workload qwen3-30b-a3b-ep2 --nproc 2 \
        --variants bf16,tensorwise,tensorwise+distributed.ep_fp8_dispatch=true
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from train_throughput import COMMON, WORKLOADS, split_variants, variant_sets  # noqa: E402

#: Workloads of several processes (``--nproc``), beside ``train_throughput.WORKLOADS``: Qwen3-30B-A3B layers under
#: expert parallelism on 2 GPUs (64 experts per GPU, micro-batch 2 per rank), as ``distributed_throughput.py``'s
#: ``moe-ep-*``.
DISTRIBUTED_WORKLOADS = {
    "qwen3-30b-a3b-ep2": ["model.preset=qwen3-30b-a3b", "model.num_layers=4", "data.seq_length=4096",
                          "train.micro_batch_size=2", "distributed.ep=2"],
}
ALL_WORKLOADS = {**WORKLOADS, **DISTRIBUTED_WORKLOADS}

GROUPS = ("fp8_gemm", "bf16_gemm", "fp8_cast", "triton_other", "attention", "optimizer", "other")


def kernel_group(name: str) -> str:
    """The group of a GPU kernel by its name (cuBLAS ``nvjet``: ``q`` in the tile tag marks FP8 operands)."""
    n = name.lower()
    if n.startswith("nvjet") or "gemm" in n or "cutlass" in n or "xmma" in n:
        tag = n.split("_")[2] if n.startswith("nvjet") and n.count("_") > 2 else ""
        return "fp8_gemm" if tag.startswith("q") or "f8" in n or "e4m3" in n else "bf16_gemm"
    if "adam" in n or "multi_tensor" in n or "foreach" in n or "optim" in n or "_step_kernel" in n:
        return "optimizer"
    if "sdpa" in n or "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if n.startswith("triton") or n.startswith("_"):
        fp8 = "scaled_mm" in n or "amax" in n or "cast" in n or "quant" in n or "clamp" in n
        return "fp8_cast" if fp8 else "triton_other"
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (microseconds)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def profile_one(sets: list[str], warmup: int, steps: int, top: int, trace: Path | None = None,
                gap_us: float = 50.0) -> dict:
    """Build the run from ``sets`` and profile ``steps`` training steps after ``warmup`` (see module docstring)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from fp8kit.config import load_config
    from fp8kit.train.loop import _loss_scales, next_micro_batch, train_step
    from fp8kit.train.setup import build_setup

    cfg = load_config(None, sets)
    setup = build_setup(cfg)
    setup.model.train()
    params = [p for p in setup.model.parameters() if p.requires_grad]

    def step() -> float:
        micro = [next_micro_batch(setup) for _ in range(cfg.train.grad_accum)]
        scales, _ = _loss_scales(setup, micro)
        return train_step(setup, params, micro, scales)[0]

    for _ in range(warmup):
        step()
    cuda = setup.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    clean = []  # the same steps without the profiler (its CUPTI callbacks add host time)
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        clean.append((time.perf_counter() - t0) * 1e3)
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            walls.append((time.perf_counter() - t0) * 1e3)
    gaps = None
    if trace is not None and cuda:  # one more step with the host side recorded: where the GPU waits
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as full:
            step()
        full.export_chrome_trace(str(trace))
        gaps = idle_gaps(full.events(), DeviceType, min_us=gap_us)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_ms = union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3 / steps
    groups = dict.fromkeys(GROUPS, 0.0)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        groups[kernel_group(e.name)] += us / 1e3 / steps
        row = by_name.setdefault(e.name, [0.0, 0])
        row[0] += us / 1e3 / steps
        row[1] += 1
    wall = sorted(walls)[len(walls) // 2]
    return {
        "wall_ms_median": sorted(clean)[len(clean) // 2], "wall_ms_unprofiled": clean,
        "wall_ms_profiled_median": wall, "wall_ms_profiled": walls, "busy_ms": busy_ms, "idle_ms": sum(walls) / steps - busy_ms,
        "kernel_ms": {k: round(v, 3) for k, v in groups.items()},
        "tokens_per_step": cfg.train.micro_batch_size * cfg.train.grad_accum * cfg.data.seq_length,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "top": [{"ms": round(v[0], 3), "calls": v[1] // steps, "group": kernel_group(n), "name": n[:140]}
                for n, v in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
        "idle_gaps": gaps,
    }


def idle_gaps(events, device_type, min_us: float = 50.0, top: int = 15) -> dict:
    """The GPU's idle gaps longer than ``min_us`` in one profiled step (CPU + CUDA activity), each with the
    host operators that were running when it began: where the host kept the GPU waiting."""
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == device_type.CUDA)
    host = [e for e in events if e.device_type == device_type.CPU]
    gaps, end = [], None
    for s, e in kernels:
        if end is not None and s - end > min_us:
            gaps.append((end, s))
        end = e if end is None else max(end, e)
    rows, by_op = [], {}
    for i, (a, b) in enumerate(sorted(gaps, key=lambda g: g[0] - g[1])):
        running = sorted((h for h in host if h.time_range.start <= a <= h.time_range.end),
                         key=lambda h: h.time_range.end - h.time_range.start)  # innermost first
        ops = list(dict.fromkeys(h.name for h in running))
        # the innermost operator that is not a bare launch / sync call says whose host code the GPU waited for
        who = next((o for o in ops if not o.startswith(("cuda", "cu"))), "(none)")
        by_op[who] = by_op.get(who, 0.0) + (b - a)
        if i < top:
            rows.append({"us": round(b - a, 1), "host_ops": ops[:12]})
    by_op = dict(sorted(((k, round(v, 1)) for k, v in by_op.items()), key=lambda kv: -kv[1])[:25])
    return {"min_us": min_us, "total_us": round(sum(b - a for a, b in gaps), 1), "count": len(gaps), "largest": rows,
            "by_host_op_us": by_op}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="bf16,tensorwise,delayed")
    ap.add_argument("--workload", default="llama3-8b-seq4096", choices=sorted(ALL_WORKLOADS))
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps (compilation, delayed-scaling warm start)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--trace", action="store_true",
                    help="also record one step with host activity: OUT/<variant>.trace.json and its GPU idle gaps")
    ap.add_argument("--gap-us", type=float, default=50.0,
                    help="with --trace: count GPU idle gaps longer than this (us), summed by the host operator running")
    ap.add_argument("--gpu", default="h100", help="suffix of the shipped policy for adaptive variants")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs per variant (torchrun --nproc_per_node)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra config override")
    ap.add_argument("--out", default="runs/step-profile")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: profile one variant in this process
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wl = ALL_WORKLOADS[args.workload]
    if args.workload in DISTRIBUTED_WORKLOADS and args.nproc < 2 and not args.one:
        ap.error(f"--workload {args.workload} runs on several GPUs: give --nproc (2)")
    preset = next(s.split("=", 1)[1] for s in wl if s.startswith("model.preset="))
    if args.one:
        sets = [*COMMON, *wl, f"data.cache_dir={out / 'cache'}", *variant_sets(args.one, preset, args.gpu), *args.sets]
        rank = int(os.environ.get("RANK", "0"))  # under torchrun (--nproc): every rank traces, rank 0 reports
        trace = out / (f"{args.one}.trace.json" if rank == 0 else f"{args.one}.trace.rank{rank}.json")
        row = profile_one(sets, args.warmup, args.steps, args.top, trace if args.trace else None, args.gap_us)
        row.update(variant=args.one, sets=sets, nproc=int(os.environ.get("WORLD_SIZE", "1")))  # tokens_per_step: per rank
        if rank == 0:
            (out / f"{args.one}.json").write_text(json.dumps(row, indent=1))
        return 0
    rows = []
    for v in split_variants(args.variants):
        launcher = [sys.executable] if args.nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
        cmd = [*launcher, __file__, "--one", v, "--workload", args.workload, "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--top", str(args.top), "--gpu", args.gpu, "--out", str(out)]
        cmd += ["--trace", "--gap-us", str(args.gap_us)] if args.trace else []
        for s in args.sets:
            cmd += ["--set", s]
        proc = subprocess.run(cmd, text=True, capture_output=True)
        (out / f"{v}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(f"{v}: failed\n{proc.stderr[-3000:]}", flush=True)
            continue
        rows.append(json.loads((out / f"{v}.json").read_text()))
        r = rows[-1]
        print(f"{v}: wall {r['wall_ms_median']:.1f} ms (profiled {r['wall_ms_profiled_median']:.1f}), "
              f"GPU busy {r['busy_ms']:.1f}, idle {r['idle_ms']:.1f}", flush=True)
        for k in r["top"][:args.top]:
            print(f"   {k['ms']:8.3f} ms x{k['calls']:<4} {k['group']:12} {k['name']}")
        if r.get("idle_gaps"):
            g = r["idle_gaps"]
            print(f"   idle gaps > 50 us in the traced step: {g['count']}, {g['total_us'] / 1e3:.2f} ms")
            for row in g["largest"]:
                print(f"     {row['us']:9.1f} us  host: {', '.join(row['host_ops'])[:200]}")
    import torch

    versions = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                "date": time.strftime("%Y-%m-%d")}
    base = next((r["wall_ms_median"] for r in rows if r["variant"] == "bf16"), None)
    lines = [f"workload {args.workload}; {versions}", "",
             "| variant | wall ms | vs bf16 | GPU busy ms | idle ms | " + " | ".join(GROUPS) + " | peak GiB |",
             "|---" * (6 + len(GROUPS)) + "|"]
    for r in rows:
        ratio = f"{base / r['wall_ms_median']:.3f}x" if base else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        lines.append(f"| {r['variant']} | {r['wall_ms_median']:.1f} | {ratio} | {r['busy_ms']:.1f} | {r['idle_ms']:.1f} | "
                     + " | ".join(f"{r['kernel_ms'][g]:.1f}" for g in GROUPS) + f" | {peak} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"versions": versions, "rows": rows}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
