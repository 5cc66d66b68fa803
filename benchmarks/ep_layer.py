"""One expert-parallel MoE layer, forward + backward, with a bf16 or an FP8 token dispatch: the EP step's MoE part alone.

    torchrun --nproc_per_node 2 benchmarks/ep_layer.py --out DIR                                  # NCCL, 2 GPUs
    torchrun --nproc_per_node 2 benchmarks/ep_layer.py --device cpu --models tiny --tokens 64 --out /tmp/x  # gloo

Why: the whole EP=2 training step with FP8 experts was 0.860x of the same step with a bf16 dispatch (session 53,
``distributed_throughput.py``) while the forward dispatch alone (``ep_dispatch.py``) takes 0.56x of the bf16
dispatch's time. This times the layer itself, as ``moe/expert_parallel.ep_experts_forward`` runs it in training
(eagerly, its helpers compiled): the routing's split sizes (one all-to-all and one host sync), the dispatch
all-to-all, the local experts, the return all-to-all and the combine, then the backward of all of it. If the layer
alone is faster with FP8 dispatch, the step's loss lies outside it.

Per model shape (``--models``; ``--tokens`` tokens per rank routed top-k uniformly over distinct experts; the
layer's weights are those of transformers' ``Qwen3MoeExperts``, bf16 on CUDA, float32 on the CPU) and variant:

- ``bf16``: BF16 experts, bf16 dispatch;
- ``fp8``: FP8 experts on the fused rowwise kernel (``fp8.grouped_kernel = "fused"``), bf16 dispatch;
- ``fp8-dispatch``: the same experts fed the rowwise E4M3 payload (``distributed.ep_fp8_dispatch = true``).

Each iteration is one forward + backward, timed on the host between two device synchronizations (the layer waits
for the host once per call anyway, for its split sizes); the median over ``--iters`` iterations after ``--warmup``,
the slowest rank's. On CUDA, one more iteration runs under ``torch.cuda.set_sync_debug_mode("warn")``: ``syncs`` is
the number of synchronizing CUDA calls it made, forward and backward (expected: 1, the split sizes' ``tolist``). ``out_vs_fp8`` is the
largest absolute difference of ``fp8-dispatch``'s output from ``fp8``'s on the same tokens (0 expected: the payload
carries the bits the experts' own cast makes). Writes ``OUT/ep_layer.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from ep_dispatch import print_table, run_meta, save_rows, slowest  # benchmarks/ (this script's directory)

from fp8kit.parallel.mesh import end_distributed

#: model -> (hidden, experts, top-k, expert intermediate)
MODELS = {"qwen3-30b-a3b": (2048, 128, 8, 768), "deepseek-v3": (7168, 256, 8, 2048), "tiny": (256, 8, 2, 128)}
VARIANTS = ("bf16", "fp8", "fp8-dispatch")


def build_layer(model: str, variant: str, device: torch.device, world: int):
    """The variant's ``Float8GroupedExperts`` with this rank's ``E / world`` experts (expert parallelism over all
    ``world`` ranks, which are also the data-parallel ranks), the same weights on every call."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fp8kit.moe.expert_parallel import EPGroup, ep_mesh, shard_experts
    from fp8kit.moe.experts import WEIGHTS, Float8GroupedExperts
    from fp8kit.moe.grouped_mm import GroupedGemmConfig

    hidden, experts, topk, inter = MODELS[model]
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                               num_experts_per_tok=topk)
    torch.manual_seed(0)
    with torch.device(device):
        src = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        src.gate_up_proj.normal_(0, hidden ** -0.5)
        src.down_proj.normal_(0, inter ** -0.5)
    if device.type == "cuda":
        src = src.to(torch.bfloat16)
    fp8 = variant != "bf16"
    mod = Float8GroupedExperts(src, frozenset(WEIGHTS), GroupedGemmConfig(kernel="fused")) if fp8 else \
        Float8GroupedExperts(src, frozenset())
    shard_experts(mod, EPGroup(ep_mesh(device.type, world, world, 1), world, world,
                               fp8_dispatch=variant == "fp8-dispatch"))
    return mod


def inputs(model: str, tokens: int, device: torch.device, dtype: torch.dtype, rank: int):
    """This rank's tokens (T, H), routing (T, k) of distinct experts, router weights and output gradient."""
    hidden, experts, topk, _ = MODELS[model]
    g = torch.Generator(device=device).manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    ids = torch.rand(tokens, experts, generator=g, device=device).argsort(dim=1)[:, :topk]
    w = torch.rand(tokens, topk, generator=g, device=device).softmax(-1).to(dtype)
    dy = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    return x, ids, w, dy


#: the warning ``torch.cuda.set_sync_debug_mode("warn")`` gives for each synchronizing call (c10/cuda)
SYNC_WARNING = "called a synchronizing CUDA operation"


def count_syncs(fn) -> int:
    """Synchronizing CUDA calls ``fn()`` makes, forward and backward (``torch.cuda.set_sync_debug_mode("warn")``; the
    backward runs on this thread for the count, so that its warnings reach ``warnings`` here too). ``fn`` runs once
    under the same conditions before the counted call: a first backward on the calling thread may do one-time work
    (session 55 counted 2 for whichever variant came first, 1 for the same path later)."""
    counts = []
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught, torch.autograd.set_multithreading_enabled(False):
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum(SYNC_WARNING in str(w.message) for w in caught))
    return counts[-1]


def profile_step(step, iters: int, top: int = 25) -> dict:
    """``iters`` calls of ``step`` under ``torch.profiler`` (CPU + CUDA): the top rows by device time (kernels, and
    CPU operators with their kernels' time), in us per call, the device time per call by group
    (``delayed_block_profile.kernel_table``: NCCL kernels fall in ``other``) and ``nccl_us_in_top``, the NCCL rows of
    the top list (an all-to-all kernel's time includes its wait for the peer)."""
    from delayed_block_profile import kernel_table
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    table = kernel_table(prof, top)
    for r in table["top"]:
        r["us"] /= iters
        r["calls"] /= iters
    nccl = sum(r["us"] for r in table["top"] if "nccl" in r["name"].lower())
    return {"per_call_us": {k: v / iters for k, v in table["groups_us"].items()}, "nccl_us_in_top": nccl,
            "top": table["top"]}


def bench_variant(model: str, variant: str, args, device: torch.device, world: int) -> tuple[dict, torch.Tensor]:
    """``{"ms", "syncs", "peak_gib"}`` of one variant, and its output on the first call."""
    cuda = device.type == "cuda"
    mod = build_layer(model, variant, device, world)
    x, ids, w, dy = inputs(model, args.tokens, device, torch.bfloat16 if cuda else torch.float32, dist.get_rank())
    x.requires_grad_(True)
    w.requires_grad_(True)

    def step() -> torch.Tensor:
        for t in (x, w, *mod.parameters()):
            t.grad = None
        y = mod(x, ids, w)
        y.backward(dy)
        return y

    first = step().detach()
    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.iters):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    row = {"ms": slowest(statistics.median(times), device),
           "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
           "syncs": None}
    if cuda:
        torch.cuda.synchronize(device)
        row["syncs"] = int(slowest(count_syncs(step), device))
        if args.profile:
            row["profile"] = profile_step(step, args.profile)
    return row, first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3", help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank (seq 4096 x micro-batch 2)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile", type=int, default=0, help="profile this many more iterations per variant (CUDA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        raise SystemExit(f"ep_layer.py: unknown variant or model {unknown}; variants {VARIANTS}, models {list(MODELS)}")
    meta = run_meta(args, device, world, "ep_layer.py")
    rows = []
    for model in args.models.split(","):
        row, outs = {"model": model, "tokens_per_rank": args.tokens, "variants": {}}, {}
        for v in variants:
            row["variants"][v], outs[v] = bench_variant(model, v, args, device, world)
            if cuda:
                torch.cuda.empty_cache()
        if "fp8" in outs and "fp8-dispatch" in outs:
            row["out_vs_fp8"] = slowest((outs["fp8-dispatch"].float() - outs["fp8"].float()).abs().max().item(), device)
        if "fp8" in row["variants"] and "fp8-dispatch" in row["variants"]:
            row["fp8_dispatch_vs_fp8"] = row["variants"]["fp8-dispatch"]["ms"] / row["variants"]["fp8"]["ms"]
        rows.append(row)
        if rank == 0:
            save_rows(args.out, "ep_layer.json", meta, rows)
    if rank == 0:
        print_table(f"One EP MoE layer, forward + backward, {world} ranks, {meta['device']} (ms, slowest rank; syncs "
                    "per call)", ("model", *variants, "fp8-dispatch / fp8", "out vs fp8"),
                    [(r["model"], *(f"{r['variants'][v]['ms']:.3f} ({r['variants'][v]['syncs']})" for v in variants),
                      f"{r['fp8_dispatch_vs_fp8']:.3f}x" if "fp8_dispatch_vs_fp8" in r else "-",
                      r.get("out_vs_fp8", "-")) for r in rows])
        for r in rows:
            for v, res in r["variants"].items():
                if "profile" in res:
                    g = res["profile"]["per_call_us"]
                    print(f"\n{r['model']} / {v}: device us per call: " + ", ".join(f"{k} {u:.0f}" for k, u in g.items()))
                    for k in res["profile"]["top"]:
                        print(f"  {k['us']:9.1f} us  {k['calls']:5.1f}x  {k['kind']:6s} {k['name']}")
    end_distributed(completed=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
