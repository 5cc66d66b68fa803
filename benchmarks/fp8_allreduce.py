"""FP8 gradient all-reduce (``fp8kit.comm.fp8_all_reduce``) vs ``dist.all_reduce``, under torchrun.

    torchrun --nproc_per_node 2 benchmarks/fp8_allreduce.py --out DIR                 # NCCL, GPUs
    torchrun --nproc_per_node 2 benchmarks/fp8_allreduce.py --device cpu --sizes 100000 --out /tmp/x

For each buffer size (elements, default 25M, 100M, 400M on CUDA) a gradient-like tensor per rank
(``randn * 1e-3`` with 0.1 % outliers of 0.05, in ``--dtype``, default bf16) is averaged by

- ``dist.all_reduce`` (SUM) in the same dtype: the BF16 baseline (NCCL's ring/tree all-reduce), and
- ``fp8_all_reduce`` for each ``--fp8`` format (default e5m2 and e4m3), with a persistent
  ``AutoScaleState`` (mu initialised during warm-up), i.e. the steady state of training.

Reported per variant: time (ms, the slowest rank's median), bytes this rank sends (BF16: the ring model
``2 (N-1)/N * numel * 2``; FP8: ``fp8_allreduce_bytes``), bytes and time ratios to the baseline,
error vs the float32 mean (SQNR in dB and relative L2 error; the baseline's own rounding is shown
too: its SUM is done in bf16), and mu.

Timing (CUDA): ``ms`` is ``fp8kit.bench.timing.time_ms`` (the GPU is held while the host enqueues all
iterations, so the host's kernel-launch time is hidden, as when the host runs ahead in a training step);
``ms_events`` is the median of per-iteration CUDA events without that hold, so it includes the host
launching ~25 small kernels per ``fp8_all_reduce`` call when that is slower than the GPU. CPU:
``time.perf_counter`` with a barrier before each call. The iterations run in place (the baseline's
buffer doubles each call; the FP8 call's output is the next input), which changes no work done.

Prints a markdown table on rank 0 and writes ``OUT/fp8_allreduce.json`` (device, torch version,
date, world size, arguments, results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from fp8kit.bench.timing import time_ms
from fp8kit.comm import AutoScaleState, fp8_all_reduce, fp8_allreduce_bytes, ring_allreduce_bytes

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_sizes(text: str) -> list[int]:
    """``25M,100M,400000`` -> [25_000_000, 100_000_000, 400_000]."""
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}
    out = []
    for part in text.split(","):
        p = part.strip().upper()
        out.append(int(float(p[:-1]) * mult[p[-1]]) if p[-1:] in mult else int(p))
    return out


def gradient(n: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``randn * 1e-3`` with 0.1 % outliers of +-0.05, generated on ``device`` (no host loop)."""
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    g = torch.randn(n, generator=gen, device=device) * 1e-3
    mask = torch.rand(n, generator=gen, device=device) < 1e-3
    g = torch.where(mask, 0.05 * torch.sign(g), g)
    return g.to(dtype)


def errors(ref: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """SQNR (dB) and relative L2 error of ``x`` vs ``ref`` (float32 norms), and max |error|."""
    d = x.float() - ref
    noise, sig = torch.linalg.vector_norm(d).item(), torch.linalg.vector_norm(ref).item()
    return {
        "sqnr_db": math.inf if noise == 0 else 20 * math.log10(sig / noise),
        "rel_l2_err": noise / sig,
        "max_abs_err": d.abs().max().item(),
    }


def event_ms(fn, iters: int) -> float:
    """Median of per-iteration CUDA event times (host launch time included when it dominates)."""
    pairs = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
    ]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def slowest(value: float, device: torch.device) -> float:
    """The largest value over ranks (the collective is as slow as its slowest rank)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(fn, device: torch.device, warmup: int, iters: int) -> dict[str, float]:
    if device.type == "cuda":
        ms = time_ms(fn, device=device, warmup=warmup, iters=iters)
        return {"ms": slowest(ms, device), "ms_events": slowest(event_ms(fn, iters), device)}
    ms = time_ms(fn, device=device, warmup=warmup, iters=iters, before=dist.barrier)
    return {"ms": slowest(ms, device)}


def bench_size(n: int, args, device: torch.device, rank: int, world: int) -> list[dict]:
    dtype = DTYPES[args.dtype]
    g = gradient(n, rank, dtype, device)
    ref = g.float()
    dist.all_reduce(ref)
    ref /= world  # the float32 mean over ranks
    rows = []

    base = g.clone()
    dist.all_reduce(base)
    base_err = errors(ref, base.float() / world)
    buf = g.clone()
    t = measure(lambda buf=buf: dist.all_reduce(buf), device, args.warmup, args.iters)
    bf16_bytes = ring_allreduce_bytes(n, world, g.element_size())
    rows.append({"variant": f"{args.dtype} all_reduce", "numel": n, **t, "bytes_sent": bf16_bytes,
                 "bytes_ratio": 1.0, "speedup": 1.0, **base_err, "mu": None})  # fmt: skip
    del buf, base

    for fmt in args.fp8.split(","):
        state = AutoScaleState(fp8_dtype=fmt)
        out = fp8_all_reduce(g.clone(), state=state)  # first call: lazy init of mu from the amax
        err = errors(ref, out)
        del out
        buf = g.clone()
        t = measure(
            lambda buf=buf, state=state: fp8_all_reduce(buf, state=state), device, args.warmup, args.iters
        )
        assert state.last_bytes_sent == fp8_allreduce_bytes(n, world)
        stats = state.stats()
        rows.append({"variant": f"fp8_all_reduce {fmt}", "numel": n, **t, "bytes_sent": state.last_bytes_sent,
                     "bytes_ratio": state.last_bytes_sent / bf16_bytes, "speedup": rows[0]["ms"] / t["ms"],
                     **err, "mu": stats["mu"], "halvings": stats["halvings"]})  # fmt: skip
        del buf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], cuda: bool) -> str:
    head = "| numel | variant | ms | " + ("ms (events) | " if cuda else "")
    head += "MB sent / rank | bytes vs base | speed-up | SQNR dB | rel L2 err | mu |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ev = f"{r['ms_events']:.3f} | " if cuda else ""
        mu = "" if r["mu"] is None else f"{r['mu']:.4g}"
        lines.append(
            f"| {r['numel']:,} | {r['variant']} | {r['ms']:.3f} | {ev}{r['bytes_sent'] / 1e6:.2f} | "
            f"{r['bytes_ratio']:.3f} | {r['speedup']:.2f}x | {r['sqnr_db']:.1f} | {r['rel_l2_err']:.4f} | {mu} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for fp8_allreduce.json (rank 0)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda: NCCL; cpu: gloo")
    ap.add_argument(
        "--sizes", default=None, help="elements, comma-separated, K/M suffixes (cuda: 25M,100M,400M)"
    )
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="gradient dtype (and baseline's)")
    ap.add_argument("--fp8", default="e5m2,e4m3", help="FP8 formats to run, comma-separated")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        name = torch.cuda.get_device_name(device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        name = "cpu"
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = parse_sizes(args.sizes or ("25M,100M,400M" if args.device == "cuda" else "100K,1M"))

    rows = []
    for n in sizes:
        rows += bench_size(n, args, device, rank, world)
        if rank == 0:
            print(f"numel {n:,} done", flush=True)
    if rank == 0:
        report = {
            "format": "fp8kit-fp8-allreduce-bench",
            "version": 1,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "device": name,
            "device_type": device.type,
            "backend": dist.get_backend(),
            "world_size": world,
            "versions": {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
            },  # fmt: skip
            "args": vars(args),
            "gradient": "randn * 1e-3 with 0.1 % outliers of +-0.05, seed 1234 + rank",
            "timing": "ms: device queue (fp8kit.bench.timing.time_ms), slowest rank's median; "
            "ms_events: per-iteration CUDA events incl. host launch"
            if device.type == "cuda"
            else "perf_counter, barrier before each call, slowest rank's median",
            "results": rows,
        }
        print(f"\n{name}, world size {world}, {dist.get_backend()}, torch {torch.__version__}\n")
        print(table(rows, device.type == "cuda"))
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "fp8_allreduce.json").write_text(json.dumps(report, indent=1) + "\n")
            print(f"\nwrote {out / 'fp8_allreduce.json'}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
