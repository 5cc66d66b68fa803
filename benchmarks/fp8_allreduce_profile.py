"""Where the time of one FP8 all-reduce goes: ``torch.profiler`` device time per kernel, under torchrun on 2 GPUs.

    torchrun --nproc_per_node 2 benchmarks/fp8_allreduce_profile.py --sizes 32M,128M --out DIR

For each size (elements of a bf16 gradient, ``randn * 1e-3`` with 0.1 % outliers) and each variant (``bf16``:
``dist.all_reduce``; ``gather current`` / ``gather delayed`` / ``scatter current`` / ``scatter delayed``:
``fp8_all_reduce`` in E5M2 with that algorithm and ``AutoScaleState(scaling=...)``, mu initialised by two
warm-up calls), rank 0 profiles ``--iters`` calls and prints the device time per kernel name (ms per call,
NCCL kernels included), and the host's enqueue time per call (median of 20 calls while the GPU is held busy,
so nothing blocks the host: the path's launch cost, which bounds the call when the GPU work is shorter). Writes ``OUT/fp8_allreduce_profile.json`` (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from fp8kit.comm import AutoScaleState, fp8_all_reduce

VARIANTS = ("bf16", "gather current", "gather delayed", "scatter current", "scatter delayed")


def _sizes(text: str) -> list[int]:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return [int(float(p[:-1]) * mult[p[-1].upper()]) if p[-1].upper() in mult else int(p) for p in text.split(",")]


def _grad(n: int, rank: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    g = torch.randn(n, generator=gen, device=device) * 1e-3
    return torch.where(torch.rand(n, generator=gen, device=device) < 1e-3, 0.05 * torch.sign(g), g).bfloat16()


def _call(variant: str, buf: torch.Tensor, state: AutoScaleState | None):
    if variant == "bf16":
        return lambda: dist.all_reduce(buf)
    alg = variant.split()[0]
    return lambda: fp8_all_reduce(buf, state=state, algorithm=alg)


def profile_variant(variant: str, n: int, rank: int, device: torch.device, iters: int) -> dict:
    buf = _grad(n, rank, device)
    state = None if variant == "bf16" else AutoScaleState(scaling=variant.split()[1])
    fn = _call(variant, buf, state)
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
            torch.cuda.synchronize()
            dist.barrier()
    per_name: dict[str, float] = defaultdict(float)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in kernels:
        per_name[e.name] += e.device_time / 1e3 / iters  # ms per call
    # span per call: kernels grouped by call, split where the GPU idles > 1 ms (the host barrier between calls)
    kernels.sort(key=lambda e: e.time_range.start)
    spans, start, end = [], None, None
    for e in kernels:
        s, t = e.time_range.start, e.time_range.end
        if start is not None and s - end > 1000:
            spans.append((end - start) / 1e3)
            start = None
        start = s if start is None else start
        end = t if end is None or start == s else max(end, t)
    if start is not None:
        spans.append((end - start) / 1e3)
    top = sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
    # host enqueue time per call, the GPU held busy (nothing blocks the host): the launch cost of the path
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(int(0.2 * 1.5e9))  # ~0.1-0.2 s of GPU spin at 1.5-2 GHz: longer than 20 enqueues
    host = []
    for _ in range(20):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return {"variant": variant, "numel": n, "span_ms": statistics.median(spans) if spans else None,
            "busy_ms": sum(per_name.values()), "host_us_per_call": statistics.median(host), "kernels_ms": dict(top)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32M,128M")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank()
    results = []
    for n in _sizes(args.sizes):
        for v in VARIANTS:
            r = profile_variant(v, n, rank, device, args.iters)
            if rank == 0:
                results.append(r)
                print(f"\n{n:,} elements, {v}: span {r['span_ms']:.3f} ms per call on the GPU, kernels busy "
                      f"{r['busy_ms']:.3f} ms, host enqueue {r['host_us_per_call']:.0f} us per call", flush=True)
                for name, ms in r["kernels_ms"].items():
                    print(f"  {ms:8.3f} ms  {name[:100]}")
    if rank == 0 and args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_allreduce_profile.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "results": results}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
