"""Where one training step of the ``delayed`` recipe spends its GPU time, next to bf16 and tensorwise (run on a
GPU): Llama decoder blocks (default Llama-3-8B shapes, 2 layers, seq 4096, micro-batch 2), each block
``torch.compile``d as ``fp8kit train`` does, forward + backward of the LM loss.

Per variant: the median step time over ``--iters`` steps after warm-up (CUDA events), the number of
compilations and graph breaks (``torch._dynamo.utils.counters``), and for ``--profile`` variants a
``torch.profiler`` table of the top CUDA kernels grouped as GEMM (``scaled_mm`` / cuBLAS / cutlass),
Triton (inductor's fused kernels: casts, norms, activations, amax) and other.

    python benchmarks/delayed_block_profile.py --out /tmp/delayed_profile.json
    python benchmarks/delayed_block_profile.py --set model.num_layers=1 --variants delayed --iters 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fp8kit import convert_to_fp8  # noqa: E402
from fp8kit.config import load_config  # noqa: E402
from fp8kit.models.build import build_model, transformer_blocks  # noqa: E402

BASE = ["model.preset=llama3-8b", "model.num_layers=2", "data.vocab_size=32000", "data.seq_length=4096",
        "train.micro_batch_size=2"]


def build(variant: str, sets: list[str], device: str):
    cfg = load_config(None, [*BASE, *sets, f"fp8.recipe={'tensorwise' if variant == 'bf16' else variant}"])
    model = build_model(cfg.model, cfg.data.vocab_size, device=device, dtype=torch.bfloat16, seed=0)
    if variant != "bf16":
        convert_to_fp8(model, cfg.fp8)
    for block in transformer_blocks(model):
        block.compile()
    return model, cfg


def step(model, tokens):
    logits = model(input_ids=tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    for p in model.parameters():
        p.grad = None


def kernel_table(prof, top: int) -> dict:
    groups = {"gemm": 0.0, "triton": 0.0, "other": 0.0}
    rows = []
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        if us <= 0 or evt.key.startswith(("ProfilerStep", "aten::", "cuda")):
            continue
        name = evt.key.lower()
        kind = "gemm" if any(s in name for s in ("gemm", "scaled_mm", "cutlass", "sm90_xmma", "nvjet")) else (
            "triton" if name.startswith("triton") else "other")
        groups[kind] += us
        rows.append((us, evt.count, kind, evt.key[:110]))
    rows.sort(reverse=True)
    return {"groups_us": groups, "top": [{"us": r[0], "calls": r[1], "kind": r[2], "name": r[3]} for r in rows[:top]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="bf16,tensorwise,delayed")
    ap.add_argument("--profile", default="tensorwise,delayed", help="variants to profile with torch.profiler")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override, e.g. model.num_layers=1")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from torch._dynamo.utils import counters

    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "sets": BASE + args.sets, "variants": {}}
    for variant in filter(None, args.variants.split(",")):
        torch._dynamo.reset()
        counters.clear()
        model, cfg = build(variant, args.sets, args.device)
        g = torch.Generator(device=args.device).manual_seed(0)
        tokens = torch.randint(0, cfg.data.vocab_size, (cfg.train.micro_batch_size, cfg.data.seq_length),
                               generator=g, device=args.device)
        for _ in range(3):  # warm-up: the first-step graph, then the steady-state graph (delayed)
            step(model, tokens)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.iters):
            if args.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(model, tokens)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                step(model, tokens)
        row = {"ms_median": statistics.median(times) if times else None,
               "graph_breaks": sum(counters["graph_break"].values()),
               "compilations": counters["stats"]["unique_graphs"],
               "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None}
        if variant in args.profile.split(",") and args.device == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step(model, tokens)
                torch.cuda.synchronize()
            row["kernels_3_steps"] = kernel_table(prof, args.top)
        out["variants"][variant] = row
        print(variant, json.dumps({k: v for k, v in row.items() if k != "kernels_3_steps"}), flush=True)
        for r in row.get("kernels_3_steps", {}).get("top", []):
            print(f"  {r['us'] / 1e3:9.2f} ms  x{r['calls']:<5} {r['kind']:6} {r['name']}")
        if "kernels_3_steps" in row:
            print("  groups (ms, 3 steps):", {k: round(v / 1e3, 2) for k, v in row["kernels_3_steps"]["groups_us"].items()})
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    base = out["variants"].get("bf16", {}).get("ms_median")
    for v, row in out["variants"].items():
        if base and row["ms_median"]:
            print(f"{v}: {row['ms_median']:.2f} ms/step, {base / row['ms_median']:.3f}x bf16, "
                  f"graph breaks {row['graph_breaks']}, graphs {row['compilations']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
