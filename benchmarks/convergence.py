"""Convergence of fp8kit's FP8 recipes and optimizers against their high-precision baselines (GPU).

``fp8kit train`` runs of the ``llama-125m`` preset on the embedded stdlib corpus, identical except for what
the study varies (same seed, data order, lr schedule; seq 1024 x micro-batch 16, lr 1e-3, 1200 steps by
default, as in the FP8 engine and FP8-LM issues):

- ``--study recipes``: the matmul precision: ``bf16`` (baseline) vs FP8 ``tensorwise`` (torchao),
  ``blockwise`` and ``delayed`` (fp8kit), all with FP32 master weights and torch AdamW;
- ``--study moe-tiny`` / ``moe-qwen3``: MoE experts in FP8 vs BF16 (the MoE issue): the ``tiny-moe`` preset (8
  experts of width 128, top-2) and a Qwen3-MoE-shaped model with real expert shapes
  (``benchmarks/configs/qwen3-moe-small.json``: hidden 2048, 16 experts of width 768, top-4, 2 layers):
  ``bf16`` vs every linear and both expert weights in FP8 with the ``blockwise`` recipe (1x128 / 128x128,
  DeepSeek-V3's) and with ``tensorwise`` (torchao dense, fp8kit's fused rowwise experts); same optimizer
  (FP32 master + AdamW);
- ``--study optimizers``: the optimizer state precision under FP8 tensorwise matmuls: ``adamw-fp32``
  (baseline: torch AdamW on FP32 master weights, 16 bytes/param) vs ``fp8adamw`` (fp8kit's default
  FP8AdamW), ``fp8adamw-paper`` (FP8-LM's layout without the first-moment range expansion) and
  ``fp8adamw-v-e4m3`` (the paper's negative ablation: FP8 second moment);
- ``--study llama3-8b``: the 8B throughput workload (Llama-3-8B, 8 layers, seq 4096 x micro-batch 2, lr 3e-4,
  400 steps by default: :data:`STUDY_DEFAULTS`) with its optimizer (FP8AdamW, bf16 working weights): ``bf16`` vs the delayed recipe with the FP8
  LM head, with the default accumulation (fast fprop and wgrad since session 42), with fast fprop only
  (Transformer Engine's), and with ``fp8.fast_accum = "all"``: the long reductions
  of real 8B shapes (K up to 14336, wgrad over 8192 tokens), which llama-125m does not have;
- ``--study weight-cache``: llama-125m with 2 micro-batches of 8 per optimizer step (the same tokens per step):
  ``bf16`` vs the ``delayed`` and ``blockwise`` recipes with their FP8 weights cast once per step
  (``fp8.weight_cache``, the default) and at every micro-batch (``*-weight-cache-off``).

Writes ``<study>.png`` (train loss, EMA-smoothed; validation loss; both as gaps to the baseline in percent,
the train loss's as window means, :func:`train_gap_windows`) and ``<study>.md`` (final losses, gap of the final
validation loss to the baseline, median step time, state bytes/param). ``--parallel`` runs
the variants at once on one GPU: the losses do not depend on it, the step times do (take those from
``train_throughput.py`` / ``optimizer_step.py``).

    python benchmarks/convergence.py --study recipes --out DIR --parallel
    python benchmarks/convergence.py --study optimizers --out DIR --parallel
    python benchmarks/convergence.py --study recipes --out DIR --plot-only
    python benchmarks/convergence.py --study llama3-8b --out DIR --parallel
    python benchmarks/convergence.py --study weight-cache --out DIR --parallel
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

FP32_MASTER = ["optim.name=adamw", "train.param_dtype=fp32"]
FULL_FP8 = ["train.mixed_precision=fp8", "selective.selective_fp8=false"]  # every eligible layer, no auto
VARIANTS = {
    # study "recipes": matmul precision, FP32 master weights + torch AdamW everywhere
    "bf16": ["train.mixed_precision=bf16", *FP32_MASTER],
    "tensorwise": [*FULL_FP8, "fp8.recipe=tensorwise", *FP32_MASTER],
    "blockwise": [*FULL_FP8, "fp8.recipe=blockwise", *FP32_MASTER],
    "delayed": [*FULL_FP8, "fp8.recipe=delayed", *FP32_MASTER],
    # the compiled blocks replayed as CUDA graphs (train.cuda_graphs): same kernels, no launch overhead
    "bf16-cuda-graphs": ["train.mixed_precision=bf16", "train.cuda_graphs=true", *FP32_MASTER],
    "delayed-cuda-graphs": [*FULL_FP8, "fp8.recipe=delayed", "train.cuda_graphs=true", *FP32_MASTER],
    # the output head (lm_head) in FP8 too (fp8.output_head; BF16 in every other variant)
    "delayed-output-head": [*FULL_FP8, "fp8.recipe=delayed", "fp8.output_head=true", *FP32_MASTER],
    "tensorwise-output-head": [*FULL_FP8, "fp8.recipe=tensorwise", "fp8.output_head=true", *FP32_MASTER],
    # delayed with fast accumulation in every GEMM (fp8.fast_accum; the default: fprop + wgrad since session 42), and
    # in none
    "delayed-fast-accum-all": [*FULL_FP8, "fp8.recipe=delayed", "fp8.fast_accum=all", *FP32_MASTER],
    "delayed-split-accum": [*FULL_FP8, "fp8.recipe=delayed", "fp8.fast_accum=[]", *FP32_MASTER],
    # delayed with the three MLP linears run separately (the fused SwiGLU MLP off)
    "delayed-unfused": [*FULL_FP8, "fp8.recipe=delayed", "fp8.delayed_fused_mlp=false", *FP32_MASTER],
    # blockwise keeping no FP8 copy from forward to backward (the per-tensor recipes' peak memory)
    "blockwise-recompute": [*FULL_FP8, "fp8.recipe=blockwise", "fp8.blockwise_recompute=true", *FP32_MASTER],
    # blockwise with the wgrad GEMM's x^T copy in 128x128 blocks (cuBLAS's faster kernel)
    "blockwise-wgrad2d": [*FULL_FP8, "fp8.recipe=blockwise", "fp8.blockwise_wgrad_x=128x128", *FP32_MASTER],
    # study "weight-cache" (run with --grad-accum 2): the FP8 weights cast at every micro-batch instead of once per
    # optimizer step (fp8.weight_cache, on by default; the delayed recipe then holds each weight's scale for the step)
    "delayed-weight-cache-off": [*FULL_FP8, "fp8.recipe=delayed", "fp8.weight_cache=false", *FP32_MASTER],
    "blockwise-weight-cache-off": [*FULL_FP8, "fp8.recipe=blockwise", "fp8.weight_cache=false", *FP32_MASTER],
    # study "moe-qwen3": the experts' wgrad GEMMs in FP8 (the default "auto" picks bf16 for 768-wide experts)
    "tensorwise-gwfp8": [*FULL_FP8, "fp8.recipe=tensorwise", "fp8.grouped_wgrad=fp8", *FP32_MASTER],
    # study "optimizers": optimizer state precision, FP8 tensorwise matmuls everywhere
    "adamw-fp32": [*FULL_FP8, "fp8.recipe=tensorwise", *FP32_MASTER],
    "fp8adamw": [*FULL_FP8, "fp8.recipe=tensorwise", "optim.name=fp8_adamw"],
    "fp8adamw-paper": [*FULL_FP8, "fp8.recipe=tensorwise", "optim.name=fp8_adamw",
                       "optim.m_rounding=nearest"],
    "fp8adamw-v-e4m3": [*FULL_FP8, "fp8.recipe=tensorwise", "optim.name=fp8_adamw",
                        "optim.v=e4m3"],
    "fp8adamw-block": [*FULL_FP8, "fp8.recipe=tensorwise", "optim.name=fp8_adamw", "optim.granularity=block"],
    # fp8kit's default optimizer (FP8AdamW, bf16 working weights): bf16 tokens reach the experts, whose fused MLP then
    # takes the combine in (moe/fused_experts.py); with an FP32 master (above) they arrive in float32 and it does not
    "bf16-default-optim": ["train.mixed_precision=bf16"],
    "tensorwise-default-optim": [*FULL_FP8, "fp8.recipe=tensorwise"],
    # the delayed recipe on bf16 working weights (FP8AdamW): bf16 activations, so the fused SwiGLU MLP runs its
    # Triton kernel (with FP32 master weights the activations are float32 and the MLPs run as three linears)
    "delayed-default-optim": [*FULL_FP8, "fp8.recipe=delayed"],
    "delayed-unfused-default-optim": [*FULL_FP8, "fp8.recipe=delayed", "fp8.delayed_fused_mlp=false"],
    # study "llama3-8b": the 8B throughput workload's recipes (train_throughput.py's variants), FP8AdamW as there
    # (the default accumulation: fprop only in the results of sessions 41-42, fprop + wgrad from session 42's change)
    "delayed-head-default-optim": [*FULL_FP8, "fp8.recipe=delayed", "fp8.output_head=true"],
    "delayed-head-all-default-optim": [*FULL_FP8, "fp8.recipe=delayed", "fp8.output_head=true", "fp8.fast_accum=all"],
    # fast accumulation in fprop and dgrad, the wgrad GEMM (the reduction over tokens) split
    "delayed-head-fd-default-optim": [*FULL_FP8, "fp8.recipe=delayed", "fp8.output_head=true",
                                      "fp8.fast_accum=fprop,dgrad"],
    # fast accumulation in fprop and wgrad (the reduction over tokens), dgrad split: the delayed default since
    # session 42 (spelled out, as session 42 ran it before it was the default)
    "delayed-head-fw-default-optim": [*FULL_FP8, "fp8.recipe=delayed", "fp8.output_head=true",
                                      "fp8.fast_accum=fprop,wgrad"],
    # fast accumulation in fprop only (Transformer Engine's and torchao's; the delayed default until session 41)
    "delayed-head-fprop-default-optim": [*FULL_FP8, "fp8.recipe=delayed", "fp8.output_head=true",
                                         "fp8.fast_accum=fprop"],
}
STUDIES = {
    "recipes": ["bf16", "tensorwise", "blockwise", "delayed"],
    "moe-tiny": ["bf16", "blockwise", "tensorwise"],
    "weight-cache": ["bf16", "delayed", "delayed-weight-cache-off", "blockwise", "blockwise-weight-cache-off"],
    "moe-qwen3": ["bf16", "blockwise", "tensorwise", "tensorwise-gwfp8"],
    "optimizers": ["adamw-fp32", "fp8adamw", "fp8adamw-paper", "fp8adamw-v-e4m3", "fp8adamw-block"],
    "llama3-8b": ["bf16-default-optim", "delayed-head-default-optim", "delayed-head-fprop-default-optim",
                  "delayed-head-all-default-optim"],
}
#: The model of each study (``--set`` overrides); the others train ``llama-125m``.
MODELS = {
    "moe-tiny": ["model.preset=tiny-moe"],
    "llama3-8b": ["model.preset=llama3-8b", "model.num_layers=8"],
    "moe-qwen3": [f"model.hf_config={Path(__file__).resolve().parent / 'configs' / 'qwen3-moe-small.json'}"],
}
#: The run's length and shape unless given (``--steps`` etc.): llama-125m's; a study with its own model has its own.
DEFAULTS = {"steps": 1200, "seq": 1024, "mbs": 16, "grad_accum": 1, "lr": 1e-3, "eval_every": 200}
STUDY_DEFAULTS = {"llama3-8b": {"steps": 400, "seq": 4096, "mbs": 2, "lr": 3e-4, "eval_every": 100},
                  # the same 16 x 1024 tokens per optimizer step, as 2 micro-batches (the weight cache needs > 1)
                  "weight-cache": {"mbs": 8, "grad_accum": 2}}
TITLES = {
    "recipes": "llama-125m on the stdlib corpus: FP8 recipes vs BF16 (AdamW, FP32 master; *-default-optim: FP8AdamW)",
    "weight-cache": "llama-125m, 2 micro-batches per step: FP8 weights cast once per step (default) or per micro-batch",
    "moe-tiny": "tiny-moe (8 experts x 128, top-2) on the stdlib corpus: FP8 experts vs BF16",
    "moe-qwen3": "Qwen3-MoE-shaped (16 experts x 768, hidden 2048, top-4) on the stdlib corpus: FP8 experts vs BF16",
    "optimizers": "llama-125m on the stdlib corpus, FP8 matmuls: optimizer state precision",
    "llama3-8b": "Llama-3-8B layers x 8 on the stdlib corpus: the throughput workload's FP8 recipes vs BF16 (FP8AdamW)",
}


def common(args) -> list[str]:
    return [
        *MODELS.get(args.study, ["model.preset=llama-125m"]), "data.vocab_size=32000", f"data.seq_length={args.seq}",
        f"train.micro_batch_size={args.mbs}", f"train.grad_accum={args.grad_accum}", f"train.steps={args.steps}", f"train.lr={args.lr}",
        "train.warmup_steps=100", "train.weight_decay=0.1",
        f"train.compile={str(args.compile).lower()}", f"train.eval_every={args.eval_every}", "train.eval_batches=16",
        "train.checkpoint_every=0", "train.final_checkpoint=false", "train.log_every=100",
        f"data.cache_dir={Path(args.out) / 'cache'}",
    ]


def launch(name: str, args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fp8kit", "train", "--out", str(Path(args.out) / name)]
    for s in [*common(args), *VARIANTS[name]]:
        cmd += ["--set", s]
    print("+", " ".join(cmd), flush=True)
    log = open(Path(args.out) / f"{name}.log", "w")  # noqa: SIM115 - closed when the process ends
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)


def read(out: Path, name: str) -> list[dict]:
    path = out / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def ema(xs: list[float], a: float = 0.98) -> list[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None else a * m + (1 - a) * x
        out.append(m)
    return out


#: How many windows :func:`train_gap_windows` cuts a run into.
WINDOWS = 20


def finite_losses(recs: list[dict]) -> list[dict]:
    """The records whose train loss is a number below 1e4 (a diverged run's NaN / inf steps left out)."""
    return [r for r in recs if r["loss"] == r["loss"] and r["loss"] < 1e4]


def train_gap_windows(recs: list[dict], base_loss: dict[int, float]) -> list[tuple[float, float]]:
    """The train loss's gap to the baseline's, in percent, over :data:`WINDOWS` windows of equal step count.

    Each window compares the mean loss of the steps both runs logged in it (same seed and data order, so the
    same batches): ``100 * (mean(loss) / mean(baseline loss) - 1)``, placed at the window's last step. Per-step
    losses swing with the batch far more than the precisions differ; the validation loss is evaluated only a few
    times. Returns ``[]`` when the runs share fewer than ``WINDOWS`` steps.
    """
    steps = [r["step"] for r in recs if r["step"] in base_loss]
    if len(steps) < WINDOWS:
        return []
    own = {r["step"]: r["loss"] for r in recs}
    size = len(steps) // WINDOWS
    out = []
    for i in range(WINDOWS):
        win = steps[i * size:(i + 1) * size] if i < WINDOWS - 1 else steps[i * size:]
        out.append((win[-1], 100.0 * (statistics.fmean(own[s] for s in win)
                                      / statistics.fmean(base_loss[s] for s in win) - 1.0)))
    return out


def report(out: Path, study: str, requested: list[str] | None = None) -> str:
    """The study's plot (``out/<study>.png``) and its markdown table, from the runs' ``metrics.jsonl`` under ``out``.

    Rows: ``requested`` (``--variants``; the study's variants when None), then any other variant run into the same
    folder; a listed variant without a run reads "no run".
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    listed = list(requested or STUDIES[study])
    extra = [n for n in VARIANTS if n not in listed and (out / n / "metrics.jsonl").exists()]
    runs = {n: read(out, n) for n in [*listed, *extra]}
    # the first listed variant that ran (the study's baseline unless --variants leaves it out)
    baseline = next((n for n, recs in runs.items() if recs), listed[0])
    fig, (ax1, ax2, ax3, ax4) = plt.subplots(1, 4, figsize=(22, 4.5))
    base_recs = runs.get(baseline) or []
    base_loss = {r["step"]: r["loss"] for r in finite_losses(base_recs)}
    ref_val = next((r["val_loss"] for r in reversed(base_recs) if r.get("val_loss") is not None), None)
    base_by_step = {r["step"]: r["val_loss"] for r in base_recs if r.get("val_loss") is not None}
    kept: list[float] = []  # the losses of the runs that did not diverge set the axes
    for name, recs in runs.items():
        if not recs:
            continue
        finite = finite_losses(recs)
        vals = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        diverged = bool(ref_val and vals and not vals[-1][1] < 1.5 * ref_val)
        label = f"{name} (diverged: final val {vals[-1][1]:.3g}, off the axes)" if diverged else name
        curve = ema([r["loss"] for r in finite])
        ax1.plot([r["step"] for r in finite], curve, label=label)
        if vals:
            ax2.plot(*zip(*vals, strict=True), marker="o", label=label)
        # the validation gap to the baseline at each evaluated step, in percent: what the curves above can't show
        gaps = [(st, 100.0 * (v / base_by_step[st] - 1.0)) for st, v in vals if base_by_step.get(st)]
        if gaps and not diverged:
            ax3.plot(*zip(*gaps, strict=True), marker="o", label=label)
        windows = train_gap_windows(finite, base_loss)
        if windows and not diverged:
            ax4.plot(*zip(*windows, strict=True), marker=".", label=label)
        if not diverged:
            kept += curve[len(curve) // 20:] + [v for _, v in vals]
    ax3.axhspan(-1.0, 1.0, color="green", alpha=0.08, label="within 1% of the baseline")
    ax3.axhline(0.0, color="gray", lw=0.8)
    ax4.axhspan(-1.0, 1.0, color="green", alpha=0.08)
    ax4.axhline(0.0, color="gray", lw=0.8)
    for ax, title in ((ax1, "train loss (EMA 0.98)"), (ax2, "validation loss"),
                      (ax3, f"validation loss vs {baseline}, %"),
                      (ax4, f"train loss vs {baseline}, %, window means")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if kept:
        lo, hi = min(kept), min(8.0, max(kept))
        for ax in (ax1, ax2):
            ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
    else:
        ax1.set_ylim(top=min(8.0, ax1.get_ylim()[1]))
    fig.suptitle(TITLES[study])
    fig.tight_layout()
    fig.savefig(out / f"{study}.png", dpi=120)
    base = runs.get(baseline) or []
    base_val = next((r["val_loss"] for r in reversed(base) if r.get("val_loss") is not None), None)
    lines = [f"| variant | steps | final train loss (mean last 10%) | final val loss | val gap vs {baseline} | "
             "median step ms | state B/param (total) |", "|---|---|---|---|---|---|---|"]
    for name, recs in runs.items():
        if not recs:
            lines.append(f"| {name} | no run | | | | | |")
            continue
        last = recs[-max(1, len(recs) // 10):]
        loss = statistics.fmean(r["loss"] for r in last)
        val = next((r["val_loss"] for r in reversed(recs) if r.get("val_loss") is not None), None)
        gap = f"{100 * (val - base_val) / base_val:+.2f}%" if base_val and val is not None else "-"
        ms = statistics.median(r["step_ms"] for r in recs[10:]) if len(recs) > 10 else float("nan")
        lines.append(f"| {name} | {recs[-1]['step']} | {loss:.4f} | {val if val is None else round(val, 4)} | {gap} | "
                     f"{ms:.1f} | {recs[-1].get('state_bytes_per_param', float('nan')):.2f} |")
    table = "\n".join(lines)
    (out / f"{study}.md").write_text(table + "\n")
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--study", choices=sorted(STUDIES), required=True)
    ap.add_argument("--out", default="runs/convergence")
    for flag, kind in (("--steps", int), ("--seq", int), ("--mbs", int), ("--grad-accum", int), ("--lr", float), ("--eval-every", int)):
        dest = flag[2:].replace("-", "_")
        ap.add_argument(flag, type=kind, default=None,
                        help=f"default {DEFAULTS[dest]}" + "".join(f"; {k}: {v[dest]}" for k, v in STUDY_DEFAULTS.items()
                                                                 if dest in v))
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--variants", default=None, help="comma-separated subset of the study's variants")
    ap.add_argument("--parallel", action="store_true", help="run the variants at the same time on one GPU")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    for key, value in {**DEFAULTS, **STUDY_DEFAULTS.get(args.study, {})}.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        t0 = time.time()
        names = args.variants.split(",") if args.variants else STUDIES[args.study]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            ap.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
        if args.parallel:
            # the first run trains and caches the tokenizer; start the others once it is training
            procs = {names[0]: launch(names[0], args)}
            while procs[names[0]].poll() is None and not (out / names[0] / "metrics.jsonl").exists():
                time.sleep(2)
            procs.update({n: launch(n, args) for n in names[1:]})
            codes = {n: p.wait() for n, p in procs.items()}
        else:
            codes = {n: launch(n, args).wait() for n in names}
        print(f"exit codes {codes}; {time.time() - t0:.0f} s", flush=True)
    table = report(out, args.study, args.variants.split(",") if args.variants else None)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
