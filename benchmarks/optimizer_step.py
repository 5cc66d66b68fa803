"""Optimizer step time and training-state bytes: torch AdamW(fused) vs fp8kit FP8AdamW (run on a GPU).

For each parameter set (the real parameter shapes of a preset, bf16 on the GPU, gradients
``randn * 1e-3``) it times, with CUDA events over back-to-back steps after warm-up (host overhead
included, since a step's Python work is part of its cost):

- ``adamw-bf16``: ``torch.optim.AdamW(fused=True)`` on bf16 parameters (fp8kit's default training)
  with clipping folded into the kernel (``train/clip.py``);
- ``adamw-fp32``: the same on fp32 parameters (FP32 master weights, the 16 bytes/param layout);
- ``fp8adamw`` variants: ``clip_grad_norm_`` + ``step`` (compiled), and separately the backward hooks'
  gradient quantization, which runs inside backward.

It also checks that the compiled FP8AdamW step equals the eager one (same inputs) and prints a table.

    python benchmarks/optimizer_step.py --presets llama-125m,llama3-8b --layers 0,8 --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def make_params(preset: str, layers: int | None, dtype: torch.dtype, vocab: int) -> list[torch.nn.Parameter]:
    from fp8kit.config import load_config
    from fp8kit.models.build import build_model

    sets = [f"model.preset={preset}"] + ([f"model.num_layers={layers}"] if layers else [])
    cfg = load_config(None, sets)
    model = build_model(cfg.model, vocab, device=torch.device("cuda"), dtype=dtype, seed=0)
    return [p for p in model.parameters() if p.requires_grad]


def groups_of(params):
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def time_it(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def bench_torch(params, grads, iters, warmup):
    from fp8kit.train.clip import clip_grad_norm

    opt = torch.optim.AdamW(groups_of(params), lr=1e-4, betas=(0.9, 0.95), fused=True)

    def step():
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        clip_grad_norm(params, 1.0, opt)
        opt.step()

    return time_it(step, iters, warmup), opt


def bench_fp8(params, grads, precision, iters, warmup):
    from fp8kit.optim import FP8AdamW

    opt = FP8AdamW(groups_of(params), lr=1e-4, betas=(0.9, 0.95), precision=precision)

    def hooks():
        for p, g in zip(params, grads, strict=True):
            p.grad = g
            opt._grad_hook(p)

    def step():
        opt.clip_grad_norm_(1.0)
        opt.step()

    def both():
        hooks()
        step()

    t_hooks = time_it(hooks, iters, warmup)
    time_it(both, 2, 1)
    def step_again():  # keep the quantized gradients "present" so each timed step does the same work
        step()
        for fg in opt._flat:
            fg.has_grad = [True] * len(fg.has_grad)

    t_step = time_it(step_again, iters, warmup)
    return t_step, t_hooks, opt


def check_against_eager(params, grads, precision, steps: int = 3, lr: float = 1e-3) -> dict:
    """The GPU step (Triton or torch.compile) against the eager reference math on the same inputs.

    Adam's update is ~lr in magnitude whatever the gradient's size, so an element whose FP8 gradient
    rounds to zero on one path and not on the other differs by up to ~lr per step; a wrong kernel differs
    almost everywhere. Returns the fraction of elements differing by more than 1% of ``steps * lr`` and
    the largest difference in units of ``steps * lr``.
    """
    from fp8kit.optim import FP8AdamW

    outs, backend = [], None
    for compile_ in (True, False):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params[:8]]
        opt = FP8AdamW(groups_of(ps), lr=lr, precision=precision, compile=compile_)
        backend = backend or opt._flat[0].step_impl
        for _ in range(steps):
            for p, g in zip(ps, grads[:8], strict=True):
                p.grad = g.clone()
                opt._grad_hook(p)
            opt.clip_grad_norm_(1.0)
            opt.step()
        outs.append(torch.cat([p.detach().float().reshape(-1) for p in ps]))
    d = (outs[0] - outs[1]).abs() / (steps * lr)
    return {"backend": backend, "frac_differing": float((d > 0.01).float().mean()), "max_diff_lr": float(d.max())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="llama-125m,llama3-8b")
    ap.add_argument("--layers", default="0,8", help="model.num_layers per preset (0: the preset's own)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="runs/optimizer-step")
    args = ap.parse_args()
    from fp8kit.optim import FP8AdamWPrecision, training_state_bytes
    from fp8kit.train.setup import versions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = {
        "fp8adamw (paper: fp16 master, e5m2 grad, e4m3 m, fp16 v; per tensor)": FP8AdamWPrecision(),
        "fp8adamw per block 128": FP8AdamWPrecision(granularity="block"),
        "fp8adamw bf16_sr master": FP8AdamWPrecision(master="bf16_sr"),
        "fp8adamw fp8 v": FP8AdamWPrecision(v="e4m3"),
    }
    rows = []
    for preset, layers in zip(args.presets.split(","), [int(x) for x in args.layers.split(",")], strict=True):
        for dtype, name in ((torch.bfloat16, "adamw-bf16 (fused)"), (torch.float32, "adamw-fp32 (fused)")):
            params = make_params(preset, layers or None, dtype, args.vocab)
            grads = [torch.randn_like(p) * 1e-3 for p in params]
            t, opt = bench_torch(params, grads, args.iters, args.warmup)
            b = training_state_bytes(params, opt)
            n = sum(p.numel() for p in params)
            rows.append({"preset": preset, "layers": layers, "params_m": n / 1e6, "variant": name, "step_ms": t,
                         "hooks_ms": 0.0, "bytes": b})
            (out / "optimizer_step.partial.json").write_text(json.dumps(rows, default=str))
            print(rows[-1], flush=True)
            del params, grads, opt
            torch.cuda.empty_cache()
        base = rows[-2]["step_ms"]  # adamw-bf16 of this preset
        for name, prec in variants.items():
            params = make_params(preset, layers or None, torch.bfloat16, args.vocab)
            grads = [torch.randn_like(p) * 1e-3 for p in params]
            t0 = time.time()
            t, th, opt = bench_fp8(params, grads, prec, args.iters, args.warmup)
            b = training_state_bytes(params, opt)
            err = check_against_eager(params, grads, prec)
            rows.append({"preset": preset, "layers": layers, "params_m": sum(p.numel() for p in params) / 1e6,
                         "variant": name, "step_ms": t, "hooks_ms": th, "bytes": b, "vs_adamw_bf16": t / base,
                         "vs_eager": err, "bench_s": time.time() - t0})
            print(rows[-1], flush=True)
            del params, grads, opt
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "versions": versions(), "date": time.strftime("%Y-%m-%d"),
            "iters": args.iters}
    lines = [f"device {meta['device']}; torch {torch.__version__}; {meta['date']}", "",
             "| model | params | optimizer | kernel | step ms | vs AdamW bf16 | grad hooks ms | B/param master+grad+m+v | B/param total | vs eager: elements differing / max (x lr) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base_ms = {}
    for r in rows:
        if r["variant"].startswith("adamw-bf16"):
            base_ms[r["preset"] + (f" x{r['layers']}" if r["layers"] else "")] = r["step_ms"]
    for r in rows:
        label = r["preset"] + (f" x{r['layers']}" if r["layers"] else "")
        lines.append(
            f"| {label} | {r['params_m']:.0f}M | {r['variant']} | {r.get('vs_eager', {}).get('backend', 'torch fused')} | "
            f"{r['step_ms']:.2f} | {r['step_ms'] / base_ms[label]:.2f}x | "
            f"{r['hooks_ms']:.2f} | {r['bytes']['state']:.2f} | {r['bytes']['total']:.2f} | "
            + (f"{100 * r['vs_eager']['frac_differing']:.3f}% / {r['vs_eager']['max_diff_lr']:.2f} |" if "vs_eager" in r else "- |")
        )
    table = "\n".join(lines)
    (out / "optimizer_step.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    (out / "optimizer_step.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
