"""Convergence of FP8AdamW against AdamW with FP32 master weights (FP8-LM's optimizer ablation; GPU).

Three ``fp8kit train`` runs of the ``llama-125m`` preset on the embedded corpus, identical except the
optimizer (all with FP8 tensorwise matmuls, same seed and data order):

- ``adamw-fp32``: ``torch.optim.AdamW`` on FP32 master weights (``train.param_dtype=fp32``, the forward
  in bf16 through autocast): 16 bytes/param of training state;
- ``fp8adamw``: FP8AdamW with the paper's defaults (fp16 master, e5m2 grad, e4m3 m, fp16 v);
- ``fp8adamw-v-e4m3``: the same with the second moment in FP8 (the paper's negative ablation).

Writes one PNG with the train (EMA-smoothed) and validation loss curves, and a table (final losses,
gap to adamw-fp32, step time, bytes/param). ``--parallel`` runs the three at once on one GPU (the
losses do not depend on it; step times then do, so take those from ``optimizer_step.py``).

    python benchmarks/fp8_adamw_convergence.py --out DIR --steps 2000 --parallel
    python benchmarks/fp8_adamw_convergence.py --out DIR --plot-only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "adamw-fp32": ["optim.name=adamw", "train.param_dtype=fp32"],
    "fp8adamw": ["optim.name=fp8_adamw"],
    "fp8adamw-v-e4m3": ["optim.name=fp8_adamw", "optim.v=e4m3"],
}


def common(args) -> list[str]:
    return [
        "model.preset=llama-125m", "data.vocab_size=32000", f"data.seq_length={args.seq}",
        f"train.micro_batch_size={args.mbs}", f"train.steps={args.steps}", f"train.lr={args.lr}",
        "train.warmup_steps=100", "train.weight_decay=0.1", "train.mixed_precision=fp8", "fp8.recipe=tensorwise",
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


def report(out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {n: read(out, n) for n in VARIANTS}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, recs in runs.items():
        if not recs:
            continue
        finite = [r for r in recs if r["loss"] == r["loss"] and r["loss"] < 1e4]
        ax1.plot([r["step"] for r in finite], ema([r["loss"] for r in finite]), label=name)
        vals = [(r["step"], r["val_loss"]) for r in recs if r.get("val_loss") is not None]
        if vals:
            ax2.plot(*zip(*vals, strict=True), marker="o", label=name)
    for ax, title in ((ax1, "train loss (EMA 0.98)"), (ax2, "validation loss")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylim(top=min(8.0, ax1.get_ylim()[1]))
    fig.suptitle("llama-125m on the stdlib corpus, FP8 matmuls: optimizer precision")
    fig.tight_layout()
    fig.savefig(out / "fp8_adamw_convergence.png", dpi=120)
    base = runs.get("adamw-fp32") or []
    base_loss = statistics.fmean(r["loss"] for r in base[-len(base) // 10:]) if base else None
    lines = ["| optimizer | steps | final train loss (mean last 10%) | gap vs adamw-fp32 | final val loss | "
             "median step ms | state B/param (total) |", "|---|---|---|---|---|---|---|"]
    for name, recs in runs.items():
        if not recs:
            lines.append(f"| {name} | no run | | | | | |")
            continue
        last = recs[-max(1, len(recs) // 10):]
        loss = statistics.fmean(r["loss"] for r in last)
        gap = f"{100 * (loss - base_loss) / base_loss:+.2f}%" if base_loss else "-"
        val = next((r["val_loss"] for r in reversed(recs) if r.get("val_loss") is not None), None)
        ms = statistics.median(r["step_ms"] for r in recs[10:]) if len(recs) > 10 else float("nan")
        lines.append(f"| {name} | {recs[-1]['step']} | {loss:.4f} | {gap} | {val if val is None else round(val, 4)} | "
                     f"{ms:.1f} | {recs[-1].get('state_bytes_per_param', float('nan')):.2f} |")
    table = "\n".join(lines)
    (out / "fp8_adamw_convergence.md").write_text(table + "\n")
    return table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/fp8-adamw-convergence")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--parallel", action="store_true", help="run the variants at the same time on one GPU")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.plot_only:
        t0 = time.time()
        names = args.variants.split(",")
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
    table = report(out)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
