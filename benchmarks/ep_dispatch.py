"""Expert-parallel dispatch all-to-all: bf16 rows vs the FP8 payload of ``distributed.ep_fp8_dispatch``.

    torchrun --nproc_per_node 2 benchmarks/ep_dispatch.py --out DIR                      # NCCL, 2 GPUs
    torchrun --nproc_per_node 2 benchmarks/ep_dispatch.py --device cpu --tokens 256 --out /tmp/x   # gloo smoke

Per model shape (``--models``: Qwen3-30B-A3B hidden 2048, DeepSeek-V3 hidden 7168), each rank holds
``--tokens`` tokens routed top-k (8) uniformly over the experts, i.e. ``tokens * k`` rows of which
``(N-1)/N`` go to the other ranks (the rows for local experts stay, but the all-to-all still carries them:
that is how ``moe/expert_parallel`` calls it). Timed, forward only (the backward of both is the bf16
reverse all-to-all), with the same collective fp8kit calls (``_functional_collectives.all_to_all_single``):

- ``bf16``: the rows in bf16 (what ``ep_fp8_dispatch = false`` sends);
- ``fp8``: ``moe/fp8_dispatch.fp8_all_to_all``: pack (1x128 E4M3 + float32 scales in one uint8 payload;
  one Triton pass on CUDA) -> all-to-all -> unpack to bf16; the issue's "all-to-all time with FP8 dispatch";
- ``fp8-exchange``: the uint8 payload's all-to-all alone (the bytes' share of the time);
- ``pack`` / ``unpack``: the two casts alone.

Time: ``fp8kit.bench.timing.time_ms`` (the GPU is held while the host enqueues, so launch overhead is
hidden), slowest rank's value. Writes ``OUT/ep_dispatch.json`` (rewritten after each shape) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from fp8kit.bench.timing import time_ms
from fp8kit.moe.fp8_dispatch import _exchange, fp8_all_to_all, pack, payload_row_bytes, unpack

MODELS = {"qwen3-30b-a3b": 2048, "deepseek-v3": 7168}


def slowest(v: float, device: torch.device) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_shape(name: str, hidden: int, args, device: torch.device, world: int) -> dict:
    rows = args.tokens * args.topk
    splits = [rows // world] * world
    splits[-1] += rows - sum(splits)
    recv = splits  # uniform routing: every rank sends and receives the same counts
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    x = (torch.randn(rows, hidden, generator=g, device=device) * 0.5).to(torch.bfloat16)
    group = dist.group.WORLD
    payload = pack(x)

    def t(fn):
        kw = {"before": dist.barrier} if device.type == "cpu" else {}
        return slowest(time_ms(fn, device=device, warmup=args.warmup, iters=args.iters, **kw), device)

    res = {
        "bf16": t(lambda: _exchange(x, recv, splits, group)),
        "fp8": t(lambda: fp8_all_to_all(x, recv, splits, group)),
        "fp8-exchange": t(lambda: _exchange(payload, recv, splits, group)),
        "pack": t(lambda: pack(x)),
        "unpack": t(lambda: unpack(payload, hidden, torch.bfloat16)),
    }
    # the FP8 path's result equals unpack(pack(x)) routed: check one rank's own rows round-trip
    y = fp8_all_to_all(x, recv, splits, group)
    ref = unpack(_exchange(payload, recv, splits, group), hidden, torch.bfloat16)
    assert torch.equal(y, ref), "fp8_all_to_all differs from pack -> exchange -> unpack"
    sent_bf16 = (rows - splits[dist.get_rank()]) * hidden * 2
    sent_fp8 = (rows - splits[dist.get_rank()]) * payload_row_bytes(hidden)
    return {"model": name, "hidden": hidden, "tokens_per_rank": args.tokens, "topk": args.topk, "rows": rows,
            "ms": res, "fp8_vs_bf16": res["fp8"] / res["bf16"],
            "exchange_vs_bf16": res["fp8-exchange"] / res["bf16"],
            "bytes_sent_bf16": sent_bf16, "bytes_sent_fp8": sent_fp8, "bytes_ratio": sent_fp8 / sent_bf16,
            "bf16_GBps": sent_bf16 / res["bf16"] / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per rank (seq x micro-batch)")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rows = []
    meta = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "world_size": world, "date": datetime.date.today().isoformat(), "args": vars(args),
            "command": f"torchrun --nproc_per_node {world} benchmarks/ep_dispatch.py"}
    for name in args.models.split(","):
        r = bench_shape(name, MODELS[name], args, device, world)
        rows.append(r)
        if rank == 0:
            print(json.dumps(r), flush=True)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "ep_dispatch.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    if rank == 0:
        print(f"\nEP dispatch all-to-all, {world} ranks, {meta['device']}, forward only (ms, slowest rank)")
        print("| model | rows/rank | bf16 | fp8 (pack+a2a+unpack) | fp8 / bf16 | a2a of payload | pack | unpack | bytes |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            m = r["ms"]
            print(f"| {r['model']} | {r['rows']} | {m['bf16']:.3f} | {m['fp8']:.3f} | {r['fp8_vs_bf16']:.3f}x | "
                  f"{m['fp8-exchange']:.3f} | {m['pack']:.3f} | {m['unpack']:.3f} | {r['bytes_ratio']:.3f} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
