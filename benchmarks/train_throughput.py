"""End-to-end training throughput through ``fp8kit train``'s own code path (run on a GPU).

Default workload (the foundation issue): Llama-3-8B layer shapes, 8 layers, seq 4096, micro-batch 2,
vocab 32000, per-block torch.compile, AdamW(fused), on the embedded stdlib corpus; precisions bf16,
fp8 tensorwise and fp8 rowwise. Each variant is a separate ``python -m fp8kit train`` process (fresh
memory and compile state); the script reads each run's ``summary.json`` and prints one table of
median tokens/s, step time, MFU and peak memory, with speed-ups over bf16 measured in the same run.

    python benchmarks/train_throughput.py --out /tmp/bench --steps 30
    python benchmarks/train_throughput.py --variants bf16,tensorwise --set model.num_layers=4
    python benchmarks/train_throughput.py --workload llama3-1b-seq2048 --repeats 4 \
        --variants bf16,tensorwise,adaptive-tensorwise

``--repeats N`` runs the variants interleaved (v1 v2 v3 v1 v2 v3 ...) so slow drift of the machine hits
every variant alike, and reports the median over repeats with the range.

The reference (shared/anchors.md, H100, torch 2.11, torchao 0.18): plain HF Llama + torchao + per-block
compile gave bf16 44.7K tok/s, tensorwise 57.3K (1.28x), rowwise 47.9K (1.07x).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

COMMON = [
    "data.vocab_size=32000",
    "train.compile=true",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.checkpoint_every=0",
    "train.final_checkpoint=false",
    "train.log_every=5",
    "train.warmup_steps=5",
    "train.lr=3e-4",
]
WORKLOADS = {
    # the foundation issue's benchmark (anchors: HF Llama + torchao + per-block compile)
    "llama3-8b-seq4096": ["model.preset=llama3-8b", "model.num_layers=8", "data.seq_length=4096",
                          "train.micro_batch_size=2"],
    # adaptive FP8, case (a): small hidden size and short sequences, where full FP8 loses
    "llama3-1b-seq2048": ["model.preset=llama3-1b", "data.seq_length=2048", "train.micro_batch_size=1"],
    "llama3-1b-seq2048-mbs4": ["model.preset=llama3-1b", "data.seq_length=2048", "train.micro_batch_size=4"],
    # adaptive FP8, case (b): 8B layer shapes at seq 8192, where FP8 wins on the MLP
    "llama3-8b-seq8192": ["model.preset=llama3-8b", "model.num_layers=8", "data.seq_length=8192",
                          "train.micro_batch_size=1"],
    # FP8 engine issue: a small model with default settings (selective_fp8 = "auto") must not lose to BF16
    "llama-125m-seq1024": ["model.preset=llama-125m", "data.seq_length=1024", "train.micro_batch_size=16"],
    # MoE issue: Qwen3-30B-A3B layer shapes (128 experts, 8 per token), 4 layers; 16384 tokens per step
    # = 131072 routed pairs = 1024 per expert
    "qwen3-30b-a3b-seq4096": ["model.preset=qwen3-30b-a3b", "model.num_layers=4", "data.seq_length=4096",
                              "train.micro_batch_size=4"],
}


#: ``<variant>@<optimizer>`` suffixes: the optimizer settings of the FP8-LM-at-scale issue's step-time comparison.
OPTIMIZERS = {
    "adamw32": ["optim.name=adamw", "train.param_dtype=fp32"],  # fused torch AdamW, FP32 master weights
    "adamw-bf16": ["optim.name=adamw", "train.param_dtype=bf16"],  # bf16 weights updated in place
    "fp8adamw": ["optim.name=fp8_adamw"],  # FP8AdamW defaults
    "fp8adamw-param": ["optim.name=fp8_adamw", "optim.grad=param"],  # reads param.grad, no hooks
}


def split_variants(text: str) -> list[str]:
    """``--variants`` split at its commas, except those inside ``[...]`` or ``{...}`` (a list or table value of a
    ``+key=value`` setting, e.g. ``delayed+fp8.fast_accum=[fprop,dgrad]``); empty names dropped."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [v for v in [*out, cur] if v]


def variant_sets(name: str, preset: str, gpu: str) -> list[str]:
    """bf16 | <recipe> (full FP8) | adaptive-<recipe> (selective FP8 with the shipped policy) | auto-<recipe>
    (``selective.selective_fp8 = "auto"``: each site shape measured at start-up, FP8 where it measured faster);
    any of them with ``@<optimizer>`` (:data:`OPTIMIZERS`), e.g. ``tensorwise@fp8adamw``, and with extra config
    settings after ``+``, e.g. ``delayed+fp8.delayed_fused_cast=none``."""
    if "+" in name:
        base, *extra = name.split("+")
        return variant_sets(base, preset, gpu) + extra
    if "@" in name:
        base, opt = name.split("@", 1)
        if opt not in OPTIMIZERS:
            raise SystemExit(f"variant {name!r}: unknown optimizer {opt!r}; choose one of {', '.join(OPTIMIZERS)}")
        return variant_sets(base, preset, gpu) + OPTIMIZERS[opt]
    if name == "bf16":
        return ["train.mixed_precision=bf16"]
    if name.startswith("adaptive-"):
        recipe = name.removeprefix("adaptive-")
        return ["train.mixed_precision=fp8", f"fp8.recipe={recipe}", "selective.selective_fp8=true",
                f"selective.fp8_dynamic_policy_path=builtin:{preset}_{recipe}_{gpu}"]
    if name.startswith("auto-"):
        return ["train.mixed_precision=fp8", f"fp8.recipe={name.removeprefix('auto-')}", "selective.selective_fp8=auto"]
    return ["train.mixed_precision=fp8", f"fp8.recipe={name}", "selective.selective_fp8=false"]


def run_variant(name: str, workload: str, sets: list[str], out: Path, steps: int, cache: Path, gpu: str,
                tag: str = "") -> dict:
    run_dir = out / f"{name}{tag}"
    cmd = [sys.executable, "-m", "fp8kit", "train", "--out", str(run_dir)]
    wl = WORKLOADS[workload]
    preset = next(s.split("=", 1)[1] for s in wl if s.startswith("model.preset="))
    for s in [*COMMON, *wl, f"train.steps={steps}", f"data.cache_dir={cache}", *variant_sets(name, preset, gpu), *sets]:
        cmd += ["--set", s]
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, text=True, capture_output=True)
    (out / f"{name}{tag}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], flush=True)
        return {"variant": name, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["variant"] = name
    summary["process_s"] = time.time() - t0
    return summary


def median_run(name: str, runs: list[dict]) -> dict:
    """The repeat with the median tokens/s, annotated with every repeat's tokens/s (or the first error)."""
    ok = [r for r in runs if "error" not in r]
    if len(ok) < len(runs):
        return next(r for r in runs if "error" in r)
    ok.sort(key=lambda r: r["tokens_per_s"])
    med = dict(ok[(len(ok) - 1) // 2])
    med["variant"] = name
    med["repeats_tokens_per_s"] = [r["tokens_per_s"] for r in runs]
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-throughput")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workload", default="llama3-8b-seq4096", choices=sorted(WORKLOADS))
    ap.add_argument("--variants", default="bf16,tensorwise,rowwise",
                    help="bf16, a recipe (full FP8), or adaptive-<recipe> (selective FP8, shipped policy)")
    ap.add_argument("--gpu", default="h100", help="suffix of the shipped policy for adaptive variants")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="extra config override")
    ap.add_argument("--cache", default=None, help="tokenizer cache dir (default OUT/cache)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repetitions; median reported")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else out / "cache"
    variants = split_variants(args.variants)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for i in range(args.repeats):
        for v in variants:
            tag = f"-r{i}" if args.repeats > 1 else ""
            runs[v].append(run_variant(v, args.workload, args.sets, out, args.steps, cache, args.gpu, tag))
    results = [median_run(v, rs) for v, rs in runs.items()]
    # the baseline: "bf16", else the first bf16 variant with settings ("bf16+train.cuda_graphs=true")
    base = next((r for r in results if r["variant"] == "bf16" and "error" not in r), None) or next(
        (r for r in results if r["variant"].startswith("bf16+") and "error" not in r), None)
    lines = [
        f"| precision | ms/step | tokens/s | speed-up vs {base['variant'] if base else 'bf16'} | MFU (bf16 peak) | peak GiB | final loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error']} | | | | | |")
            continue
        sp = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        reps = r.get("repeats_tokens_per_s", [])
        rng = f" ({min(reps) / 1e3:.1f}-{max(reps) / 1e3:.1f}K over {len(reps)})" if len(reps) > 1 else ""
        lines.append(
            f"| {r['variant']} | {r['step_ms']:.1f} | {r['tokens_per_s'] / 1e3:.1f}K{rng} | {sp} | {mfu} | "
            f"{r['peak_mem_gib']:.1f} | {r['final_loss']:.3f} |"
        )
    ok = [r for r in results if "error" not in r]
    for r in ok:
        if r["variant"].startswith("adaptive-"):
            best = max(o["tokens_per_s"] for o in ok if not o["variant"].startswith("adaptive-"))
            lines.append(f"\n{r['variant']} / fastest of the others: {r['tokens_per_s'] / best:.3f}")
    meta = next(iter(ok), {})
    header = f"workload: {args.workload}; device: {meta.get('device')}; versions: {meta.get('versions')}; date: {time.strftime('%Y-%m-%d')}"
    table = header + "\n\n" + "\n".join(lines)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(table)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
