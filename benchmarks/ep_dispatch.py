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

And the whole dispatch as the FP8 experts see it, from this rank's tokens in their order to the fprop GEMM's
E4M3 operand in local-expert order on the receiving rank (routing: every token picks ``topk`` distinct experts of
``E`` uniformly at random; pairs sorted by expert, i.e. by destination rank; the receiver's rows grouped by local
expert with ``routing.dispatch``, as ``moe/expert_parallel.py`` does):

- ``dispatch-bf16``: bf16 gather of the sorted pairs -> all-to-all (bf16) -> ``gather_quantize_rows`` (the fused
  experts' own gather + rowwise cast on the receiver): what ``ep_fp8_dispatch = false`` costs with FP8 experts;
- ``dispatch-fp8``: ``gather_quantize_payload`` (the same cast, on the sender, written into the uint8 payload; from
  the tokens' side: each token read once, as ``distributed.ep_fp8_dispatch`` runs it since session 51) ->
  all-to-all (uint8, H + 16 bytes per row) -> ``payload_rows`` (a gather of the E4M3 bytes and scales): what
  ``ep_fp8_dispatch = true`` costs (``moe/fp8_dispatch.rowwise_dispatch``); both end in the same bits (checked);
- ``rowwise-exchange``: the rowwise payload's all-to-all alone;
- ``dispatch-fp8-gather``: ``dispatch-fp8`` with the sender's gather kernel (each row read through the index: the
  path before session 51); ``payload-scatter`` / ``payload-gather`` / ``payload-rows``: the sender's two kernels and
  the receiver's regroup alone (``payload-rows``: the Triton kernel since session 52; ``payload-rows-torch``: the
  compiled PyTorch gather it replaced, its reference).

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
from fp8kit.moe import routing
from fp8kit.moe import rowwise_quant as rq
from fp8kit.moe.fp8_dispatch import _exchange, fp8_all_to_all, pack, payload_row_bytes, unpack
from fp8kit.moe.rowwise_payload import (
    gather_quantize_payload,
    payload_rows,
    payload_rows_reference,
    rowwise_payload_bytes,
)
from fp8kit.parallel.mesh import end_distributed

MODELS = {"qwen3-30b-a3b": 2048, "deepseek-v3": 7168}
EXPERTS = {"qwen3-30b-a3b": 128, "deepseek-v3": 256}


def routed(tokens: int, experts: int, topk: int, world: int, device: torch.device, seed: int) -> dict:
    """One rank's routing (uniform top-k of distinct experts) and the split sizes and local dispatch it implies
    (one all-to-all of the per-expert counts, as ``moe/expert_parallel.py``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=g, device=device).argsort(dim=1)[:, :topk].reshape(-1)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    local = experts // world
    send, recv = torch.stack([counts.view(world, local).sum(1), recv_counts.view(world, local).sum(1)]).tolist()
    local_ids = torch.repeat_interleave(torch.arange(local, device=device).repeat(world), recv_counts)
    d = routing.dispatch(local_ids[:, None], local,
                         rows=routing.bucketed_rows(local_ids.numel(), local, ids.numel()))
    pair_rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    return {"token_rows": order // topk, "pair_rows": pair_rows, "send": send, "recv": recv, "local": d}


def bench_whole_dispatch(name: str, hidden: int, args, device: torch.device, world: int, t) -> dict:
    """``dispatch-bf16`` vs ``dispatch-fp8`` (module docstring)."""
    r = routed(args.tokens, EXPERTS[name], args.topk, world, device, seed=dist.get_rank())
    g = torch.Generator(device=device).manual_seed(100 + dist.get_rank())
    x = (torch.randn(args.tokens, hidden, generator=g, device=device) * 0.5).to(torch.bfloat16)
    group, token_rows, d = dist.group.WORLD, r["token_rows"], r["local"]

    def bf16():
        recv = _exchange(routing.gather_rows(x, token_rows), r["recv"], r["send"], group)
        return rq.gather_quantize_rows(recv, d.gather_idx)

    def fp8(pairs=r["pair_rows"]):
        received = _exchange(gather_quantize_payload(x, token_rows, pairs), r["recv"], r["send"], group)
        return payload_rows(received, d.gather_idx, hidden)

    (q1, s1), (q2, s2), (q3, s3) = bf16(), fp8(), fp8(None)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2), \
        "FP8 dispatch does not deliver the bits the experts' own cast makes"
    assert torch.equal(q2.view(torch.uint8), q3.view(torch.uint8)) and torch.equal(s2, s3), \
        "the payload's scatter kernel and its gather kernel differ"
    payload = gather_quantize_payload(x, token_rows)
    received = _exchange(payload, r["recv"], r["send"], group)
    ms = {"dispatch-bf16": t(bf16), "dispatch-fp8": t(fp8), "dispatch-fp8-gather": t(lambda: fp8(None)),
          "rowwise-exchange": t(lambda: _exchange(payload, r["recv"], r["send"], group)),
          "payload-scatter": t(lambda: gather_quantize_payload(x, token_rows, r["pair_rows"])),
          "payload-gather": t(lambda: gather_quantize_payload(x, token_rows)),
          "payload-rows": t(lambda: payload_rows(received, d.gather_idx, hidden)),
          "payload-rows-torch": t(lambda: payload_rows_reference(received, d.gather_idx, hidden))}
    rows_sent = sum(r["send"]) - r["send"][dist.get_rank()]
    return {"ms": ms, "dispatch_fp8_vs_bf16": ms["dispatch-fp8"] / ms["dispatch-bf16"],
            "rowwise_exchange_vs_bf16": ms["rowwise-exchange"] / ms["dispatch-bf16"],
            "experts": EXPERTS[name], "rowwise_bytes_ratio": rowwise_payload_bytes(hidden) / (2 * hidden),
            "rows_sent_to_other_ranks": rows_sent}


def run_meta(args, device: torch.device, world: int, script: str) -> dict:
    """The run's record beside its rows: device, torch, world size, date, arguments and command."""
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "world_size": world, "date": datetime.date.today().isoformat(),
            "args": vars(args), "command": f"torchrun --nproc_per_node {world} benchmarks/{script}"}


def save_rows(out: str | None, filename: str, meta: dict, rows: list[dict]) -> None:
    """Print the newest row as JSON and (with ``out``) rewrite ``OUT/filename`` with every row so far (rank 0)."""
    print(json.dumps(rows[-1]), flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / filename).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


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
    whole = bench_whole_dispatch(name, hidden, args, device, world, t)
    res.update(whole.pop("ms"))
    return {**whole, "model": name, "hidden": hidden, "tokens_per_rank": args.tokens, "topk": args.topk, "rows": rows,
            "ms": res, "fp8_vs_bf16": res["fp8"] / res["bf16"],
            "exchange_vs_bf16": res["fp8-exchange"] / res["bf16"],
            "bytes_sent_bf16": sent_bf16, "bytes_sent_fp8": sent_fp8, "bytes_ratio": sent_fp8 / sent_bf16,
            "bf16_GBps": sent_bf16 / res["bf16"] / 1e6}


def print_table(title: str, columns: tuple[str, ...], cells: list[tuple]) -> None:
    """Print a markdown table under ``title``."""
    print(f"\n{title}")
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in cells:
        print("| " + " | ".join(str(c) for c in row) + " |")


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
    meta = run_meta(args, device, world, "ep_dispatch.py")
    for name in args.models.split(","):
        rows.append(bench_shape(name, MODELS[name], args, device, world))
        if rank == 0:
            save_rows(args.out, "ep_dispatch.json", meta, rows)
    if rank == 0:
        print_table(f"EP dispatch all-to-all, {world} ranks, {meta['device']}, forward only (ms, slowest rank)",
                   ("model", "rows/rank", "bf16", "fp8 (pack+a2a+unpack)", "fp8 / bf16", "a2a of payload", "pack",
                    "unpack", "bytes"),
                   [(r["model"], r["rows"], f"{r['ms']['bf16']:.3f}", f"{r['ms']['fp8']:.3f}", f"{r['fp8_vs_bf16']:.3f}x",
                     f"{r['ms']['fp8-exchange']:.3f}", f"{r['ms']['pack']:.3f}", f"{r['ms']['unpack']:.3f}",
                     f"{r['bytes_ratio']:.3f}") for r in rows])
        print_table("Whole dispatch to the FP8 experts' fprop operand (ms, slowest rank)",
                   ("model", "experts", "dispatch-bf16", "dispatch-fp8 (rowwise)", "fp8 / bf16", "with the gather kernel",
                    "rowwise a2a alone", "sender scatter / gather", "receiver regroup (torch's)", "bytes"),
                   [(r["model"], r["experts"], f"{r['ms']['dispatch-bf16']:.3f}", f"{r['ms']['dispatch-fp8']:.3f}",
                     f"{r['dispatch_fp8_vs_bf16']:.3f}x",
                     f"{r['ms']['dispatch-fp8-gather']:.3f} ({r['ms']['dispatch-fp8-gather'] / r['ms']['dispatch-bf16']:.3f}x)",
                     f"{r['ms']['rowwise-exchange']:.3f}", f"{r['ms']['payload-scatter']:.3f} / {r['ms']['payload-gather']:.3f}",
                     f"{r['ms']['payload-rows']:.3f} ({r['ms']['payload-rows-torch']:.3f})", f"{r['rowwise_bytes_ratio']:.3f}")
                    for r in rows])
    end_distributed(completed=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
