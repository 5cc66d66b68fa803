"""FP8 gradient all-reduce (``fp8kit.comm.fp8_all_reduce``) vs ``dist.all_reduce``, under torchrun.

    # NVLink (NCCL's default transports), 2 GPUs:
    torchrun --nproc_per_node 2 benchmarks/fp8_allreduce.py --out DIR
    # sockets only (a stand-in for a slow cross-node link): the LAUNCHER must set both variables
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 torchrun --nproc_per_node 2 benchmarks/fp8_allreduce.py \\
        --transport sockets --out DIR
    # CPU (gloo), a smoke run:
    torchrun --nproc_per_node 2 benchmarks/fp8_allreduce.py --device cpu --out /tmp/x

``--transport`` only labels the run and checks the environment: NCCL reads ``NCCL_P2P_DISABLE`` /
``NCCL_SHM_DISABLE`` when it starts, so they must come from the launcher. The script reads them in ``main()``,
records them in the JSON and prints them, and refuses a ``sockets`` run without both set to 1 (and an
``nvlink`` run with either set), so a result is never mislabelled.

For each buffer size (elements; default 32M, 128M, 512M, 1G on CUDA over NVLink = 64 MB .. 2 GB of bf16;
32M, 128M over sockets, which is slow; 100K, 1M on CPU) a gradient-like tensor per rank (``randn * 1e-3``
with 0.1 % outliers of 0.05, in ``--dtype``, default bf16) is averaged by

- ``dist.all_reduce`` (SUM) in the same dtype: the baseline (NCCL's ring/tree all-reduce), and
- ``fp8_all_reduce`` for each ``--fp8`` format (default e5m2 and e4m3) and each ``--algorithm`` (default
  ``scatter,gather``: all-to-all + float32 sum + requantize + all-gather, or one all-gather of every rank's
  FP8 tensor + float32 sum; the library's ``auto`` takes gather at 2 ranks), with a persistent
  ``AutoScaleState`` (mu initialised during warm-up), i.e. the steady state of training: the fused path with
  each ``--pipeline`` setting (default ``1,2,4,auto``: pieces of the FP8 exchange; ``auto`` is the library's
  default) and, unless ``--no-reference``, the unfused PyTorch path (``reference=True``, the passes as plain
  torch ops: the "before" of the fused kernels), whose result must equal the fused one of the same algorithm
  bit for bit (the two algorithms' results differ: scatter rounds to FP8 twice, gather once).

and each ``--scaling`` (default ``current,delayed``: ``AutoScaleState(scaling=...)``; delayed scaling quantizes
with the mu of earlier calls and sends its statistics with the payload, one pipeline piece only). Each variant's
first call initialises mu (current scaling in both); errors and the bit check are taken on its second call (the
steady state), which both scalings compute with the same mu on this input.

Rows are labelled ``fp8 FORMAT ALGORITHM SCALING VARIANT`` (and carry ``algorithm`` and ``scaling`` in the JSON), so
one run compares the algorithms and scalings at every size.

Reported per variant: time (ms, the slowest rank's median), bus bandwidth (``busbw``: nccl-tests' convention
on the payload, ``2 (N-1)/N * numel * element_size / time``, so FP8 and bf16 rows compare directly; and
``wire_gbps``, the bytes this rank really sends / time), bytes sent (BF16: ``2 (N-1)/N * numel * 2``; FP8:
``fp8_allreduce_bytes`` of the row's algorithm), speed-up vs the baseline, error vs the float32 mean (SQNR in
dB and relative L2 error; the baseline's own rounding is shown too: its SUM is done in bf16), mu, and whether
the fused result equals the reference path's of the same algorithm.

With ``--repeats R`` every variant is timed R times, interleaved with the others, and the median is reported
(the list in ``ms_repeats``): NCCL's bf16 time at 32M elements moved between 0.25 and 0.69 ms across runs.

Timing (CUDA): ``ms`` is ``fp8kit.bench.timing.time_ms`` (the GPU is held while the host enqueues all
iterations, so the host's launch time is hidden, as when the host runs ahead in a training step);
``ms_events`` is the median of per-iteration CUDA events without that hold (host launch included when it is
slower than the GPU). CPU: ``time.perf_counter`` with a barrier before each call. The iterations run in place
(the baseline's buffer doubles each call; the FP8 call's output is the next input), which changes no work.

Writes ``OUT/fp8_allreduce.json`` (or ``OUT/fp8_allreduce_sockets.json`` for ``--transport sockets``) on rank 0
after every size (device, versions, date, world size, arguments, environment, results so far), so a time
limit loses only the size in progress, and prints a markdown table at the end.
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
from fp8kit.comm.autoscale import ALGORITHMS, SCALINGS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SIZES = {"nvlink": "32M,128M,512M,1G", "sockets": "32M,128M", "cpu": "100K,1M"}
NCCL_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE")


def parse_sizes(text: str) -> list[int]:
    """``32M,1G,400000`` -> [33_554_432, 1_073_741_824, 400_000] (K, M, G are binary: 2^10, 2^20, 2^30)."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for part in text.split(","):
        p = part.strip().upper()
        out.append(int(float(p[:-1]) * mult[p[-1]]) if p[-1:] in mult else int(p))
    return out


def parse_algorithms(text: str) -> list[str]:
    """``scatter,gather`` -> ["scatter", "gather"]; each must be one of ``fp8_all_reduce``'s algorithms."""
    out = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in out if a not in ALGORITHMS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--algorithm: {bad or text!r} not in {', '.join(ALGORITHMS)}")
    return out


def parse_scalings(text: str) -> list[str]:
    """``current,delayed`` -> ["current", "delayed"]; each must be one of ``AutoScaleState``'s scalings."""
    out = [a.strip() for a in text.split(",") if a.strip()]
    bad = [a for a in out if a not in SCALINGS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--scaling: {bad or text!r} not in {', '.join(SCALINGS)}")
    return out


def parse_pipeline(text: str) -> list[int | None]:
    """``1,2,4,auto`` -> [1, 2, 4, None] (None: ``fp8_all_reduce``'s default)."""
    return [None if p.strip() == "auto" else int(p) for p in text.split(",")]


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


def all_ranks_true(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([0.0 if flag else 1.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0.0


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
    payload = ring_allreduce_bytes(n, world, g.element_size())  # nccl-tests' bus bytes of the payload

    def row(variant: str, t: dict, sent: int, **extra) -> dict:
        return {"variant": variant, "numel": n, "payload_mb": n * g.element_size() / 1e6, **t,
                "busbw_gbps": payload / t["ms"] / 1e6, "wire_gbps": sent / t["ms"] / 1e6, "bytes_sent": sent,
                "bytes_ratio": sent / payload, **extra}  # fmt: skip

    base = g.clone()
    dist.all_reduce(base)
    base_err = errors(ref, base.float() / world)
    del base
    # (label, call, row fields, state): every call is timed --repeats times, interleaved with the others
    base_buf = g.clone()
    timed = [(f"{args.dtype} all_reduce", lambda buf=base_buf: dist.all_reduce(buf),
              {"sent": payload, **base_err, "mu": None, "algorithm": None}, None)]  # fmt: skip
    for fmt in args.fp8.split(","):
        for alg in args.algorithm:
            variants = [(scaling, f"fused pipeline={'auto' if p is None else p}", {"pipeline_chunks": p})
                        for scaling in args.scaling for p in args.pipeline
                        if scaling == "current" or p in (None, 1)]  # fmt: skip
            if not args.no_reference:
                variants += [(scaling, "reference (unfused)", {"reference": True}) for scaling in args.scaling]
            first = None  # the first variant of this format and algorithm: the others must give its bits
            for scaling, label, kw in variants:
                kw = {**kw, "algorithm": alg}
                state = AutoScaleState(fp8_dtype=fmt, scaling=scaling)
                fp8_all_reduce(g.clone(), state=state, **kw)  # first call: lazy init of mu from the amax (current)
                out = fp8_all_reduce(g.clone(), state=state, **kw)  # the steady state (delayed: mu of the first)
                err = errors(ref, out)
                if first is None:
                    first, same = out, True
                else:
                    same = all_ranks_true(torch.equal(out, first), device)
                    del out
                buf = g.clone()  # one buffer per variant (the calls run in place)
                timed.append((f"fp8 {fmt} {alg} {scaling} {label}",
                              lambda buf=buf, state=state, kw=kw: fp8_all_reduce(buf, state=state, **kw),
                              {**err, "equals_first_variant": same, "algorithm": alg, "scaling": scaling,
                               "expect_bytes": fp8_allreduce_bytes(n, world, alg, scaling)}, state))  # fmt: skip
            del first
    times: dict[str, list[dict]] = {label: [] for label, *_ in timed}
    for _ in range(args.repeats):
        for label, fn, _, _ in timed:
            times[label].append(measure(fn, device, args.warmup, args.iters))
    rows = []
    for label, _, fields, state in timed:
        ts = times[label]
        t = {k: statistics.median(x[k] for x in ts) for k in ts[0]}
        t["ms_repeats"] = [x["ms"] for x in ts]
        if state is None:
            rows.append(row(label, t, fields.pop("sent"), speedup=1.0, **fields))
            base_ms = t["ms"]
            continue
        assert state.last_bytes_sent == fields.pop("expect_bytes"), (label, state.last_bytes_sent)
        stats = state.stats()
        rows.append(row(label, t, state.last_bytes_sent, speedup=base_ms / t["ms"], mu=stats["mu"],
                        halvings=stats["halvings"], **fields))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict], cuda: bool) -> str:
    head = "| numel | variant | ms | " + ("ms (events) | " if cuda else "")
    head += "busbw GB/s | wire GB/s | MB sent / rank | speed-up | SQNR dB | mu | same bits |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ev = f"{r['ms_events']:.3f} | " if cuda else ""
        mu = "" if r["mu"] is None else f"{r['mu']:.4g}"
        same = "" if "equals_first_variant" not in r else ("yes" if r["equals_first_variant"] else "NO")
        lines.append(
            f"| {r['numel']:,} | {r['variant']} | {r['ms']:.3f} | {ev}{r['busbw_gbps']:.1f} | {r['wire_gbps']:.1f} | "
            f"{r['bytes_sent'] / 1e6:.2f} | {r['speedup']:.2f}x | {r['sqnr_db']:.1f} | {mu} | {same} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for the JSON report (rank 0)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda: NCCL; cpu: gloo")
    ap.add_argument("--transport", default="nvlink", choices=["nvlink", "sockets"],
                    help="label and environment check (cuda); sockets needs NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "
                         "set by the launcher")
    ap.add_argument("--sizes", default=None,
                    help="elements, comma-separated, K/M/G binary suffixes (cuda nvlink: 32M,128M,512M,1G; "
                         "sockets: 32M,128M; cpu: 100K,1M)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="gradient dtype (and baseline's)")
    ap.add_argument("--fp8", default="e5m2,e4m3", help="FP8 formats to run, comma-separated")
    ap.add_argument("--algorithm", default="scatter,gather", type=parse_algorithms,
                    help="fp8_all_reduce algorithms to run, comma-separated: scatter, gather, auto")
    ap.add_argument("--scaling", default="current,delayed", type=parse_scalings,
                    help="AutoScaleState scalings to run, comma-separated: current (this call's statistics, a "
                         "scalar all-reduce before the transfer), delayed (earlier calls' mu; one piece only)")
    ap.add_argument("--pipeline", default="1,2,4,auto", type=parse_pipeline,
                    help="pipeline_chunks settings of the fused path, comma-separated ints or 'auto'")
    ap.add_argument("--no-reference", action="store_true", help="skip the unfused reference path")
    ap.add_argument("--warmup", type=int, default=None, help="default 5 (sockets: 2)")
    ap.add_argument("--iters", type=int, default=None, help="default 20 (sockets: 8)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="time every variant this many times, interleaved (bf16, fp8 ..., bf16, fp8 ...); the "
                         "median is reported, every repeat in ms_repeats (NCCL's time drifts between runs)")
    args = ap.parse_args()
    sockets = args.device == "cuda" and args.transport == "sockets"
    args.warmup = args.warmup if args.warmup is not None else (2 if sockets else 5)
    args.iters = args.iters if args.iters is not None else (8 if sockets else 20)

    nccl_env = {k: os.environ.get(k) for k in NCCL_ENV}  # read here only: NCCL itself reads them at init
    if args.device == "cuda":
        disabled = all(nccl_env[k] == "1" for k in NCCL_ENV)
        if sockets and not disabled:
            raise SystemExit("--transport sockets: the launcher must set NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "
                             f"(got {nccl_env})")
        if not sockets and any(nccl_env[k] not in (None, "0") for k in NCCL_ENV):
            raise SystemExit(f"--transport nvlink with {nccl_env}: unset them or pass --transport sockets")

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
    transport = args.transport if args.device == "cuda" else "gloo"
    sizes = parse_sizes(args.sizes or DEFAULT_SIZES["cpu" if args.device == "cpu" else args.transport])
    if rank == 0:
        print(f"{name} x {world}, transport {transport}, NCCL env {nccl_env}, sizes {sizes}", flush=True)

    out_path = None
    if args.out:
        out_path = Path(args.out) / ("fp8_allreduce_sockets.json" if sockets else "fp8_allreduce.json")
        if rank == 0:
            out_path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "format": "fp8kit-fp8-allreduce-bench",
        "version": 4,
        "device": name,
        "device_type": device.type,
        "backend": dist.get_backend(),
        "transport": transport,
        "nccl_env": nccl_env,
        "world_size": world,
        "versions": {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        },
        "args": {**vars(args), "pipeline": ["auto" if p is None else p for p in args.pipeline]},
        "gradient": "randn * 1e-3 with 0.1 % outliers of +-0.05, seed 1234 + rank",
        "timing": "ms: device queue (fp8kit.bench.timing.time_ms), slowest rank's median; "
        "ms_events: per-iteration CUDA events incl. host launch"
        if device.type == "cuda"
        else "perf_counter, barrier before each call, slowest rank's median",
        "busbw": "2 (N-1)/N * numel * element_size(payload) / ms; wire_gbps: bytes this rank sends / ms",
        "results": [],
    }
    for n in sizes:
        rows = bench_size(n, args, device, rank, world)
        if rank == 0:
            report["results"] += rows
            report["date"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
            print(f"numel {n:,} done", flush=True)
            print(table(rows, device.type == "cuda"), flush=True)
            if out_path is not None:  # rewritten after every size: a time limit loses only the current one
                out_path.write_text(json.dumps(report, indent=1) + "\n")
    if rank == 0:
        print(f"\n{name}, world size {world}, {dist.get_backend()}, transport {transport}, NCCL env {nccl_env}, "
              f"torch {torch.__version__}\n")
        print(table(report["results"], device.type == "cuda"))
        if out_path is not None:
            print(f"\nwrote {out_path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
