"""Forward + backward of one SwiGLU MLP (``down(silu(gate(x)) * up(x))``): BF16 vs the blockwise recipe unfused
(three ``Float8BlockwiseLinear``; the SwiGLU and its backward in Inductor's code, their bf16 outputs cast by the
activation kernel) vs fused (``fp8.blockwise_fused_mlp``: ``fp8kit.fp8.swiglu_mlp``), each compiled, for both
``fp8.blockwise_wgrad_x`` layouts (run on a GPU).

Timed as ``benchmarks/linear_fwd_bwd.py`` times a linear: the compiled step captured in a CUDA graph, its replay
timed with ``triton.testing.do_bench`` (median, L2 flushed), inputs randn with outliers. ``--profile`` adds a
``torch.profiler`` table of one step's kernels per variant at the first shape.

    python benchmarks/swiglu_mlp.py --out benchmarks/results/swiglu_mlp_h100.json
    python benchmarks/swiglu_mlp.py --shapes 8192x4096x14336 --profile --out /tmp/mlp.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from linear_fwd_bwd import time_step  # noqa: E402

from fp8kit.fp8.linear import Float8BlockwiseLinear  # noqa: E402
from fp8kit.fp8.swiglu_mlp import blockwise_swiglu_mlp  # noqa: E402

#: tokens x hidden x intermediate: Llama-3-8B (and Mistral-7B's MLP), Qwen3-8B, Llama-3.2-1B.
SHAPES = ((8192, 4096, 14336), (16384, 4096, 14336), (8192, 4096, 12288), (8192, 2048, 8192))
VARIANTS = ("bf16", "unfused", "fused", "unfused_wgrad2d", "fused_wgrad2d")


def _real(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(*shape, generator=g, device="cuda") * scale
    n = max(1, t.numel() // 1000)
    t.view(-1)[torch.randint(0, t.numel(), (n,), generator=g, device="cuda")] *= 20.0
    return t.to(torch.bfloat16)


def build(variant: str, weights: list[torch.Tensor]):
    """``f(x) -> y`` of ``variant`` on ``weights`` (gate, up, down), compiled, and the weights it differentiates."""
    params = [nn.Parameter(w.clone()) for w in weights]
    wgrad_x = "128x128" if variant.endswith("wgrad2d") else "128x1"
    if variant == "bf16":
        def f(x):
            return F.linear(F.silu(F.linear(x, params[0])) * F.linear(x, params[1]), params[2])
    elif variant.startswith("unfused"):
        lins = [Float8BlockwiseLinear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16,
                                      cache_weight=False, wgrad_x=wgrad_x) for w in weights]
        for lin, p in zip(lins, params, strict=True):
            lin.weight = p

        def f(x):
            return lins[2](F.silu(lins[0](x)) * lins[1](x))
    else:
        def f(x):
            return blockwise_swiglu_mlp(x, *params, cache_weight=False, wgrad_x=wgrad_x)
    return torch.compile(f), params


def profile_step(step, iters: int = 5) -> dict[str, float]:
    """Device ms per step of each kernel (``torch.profiler``), largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", 0.0)
        if us:
            kernels[evt.key[:90]] = kernels.get(evt.key[:90], 0.0) + us / iters / 1e3
    return {k: round(v, 4) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES), help="MxHxI, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", action="store_true", help="profile every variant at the first shape")
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    variants = args.variants.split(",")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "timing": "compiled step, CUDA-graph replay, triton.testing.do_bench median", "rows": [], "profiles": {}}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    for si, shape in enumerate(args.shapes.split(",")):
        m, h, i = (int(d) for d in shape.split("x"))
        weights = [_real(i, h, scale=0.02, seed=1), _real(i, h, scale=0.02, seed=2), _real(h, i, scale=0.02, seed=3)]
        x = _real(m, h, seed=4).requires_grad_()
        dy = _real(m, h, scale=1e-2, seed=5)
        row = {"M": m, "H": h, "I": i, "ms": {}, "speedup": {}}
        for v in variants:
            torch._dynamo.reset()
            f, params = build(v, weights)

            def step(f=f, params=params, x=x, dy=dy):
                return torch.autograd.grad(f(x), (x, *params), dy)

            row["ms"][v], _mode = time_step(step)
            if args.profile and si == 0:
                out["profiles"][v] = profile_step(step)
            del f, params
            torch.cuda.empty_cache()
        for v, ms in row["ms"].items():
            row["speedup"][v] = round(row["ms"]["bf16"] / ms, 3) if "bf16" in row["ms"] else None
        out["rows"].append(row)
        path.write_text(json.dumps(out, indent=1))
        print(f"{m}x{h}x{i}: " + ", ".join(f"{v} {row['ms'][v]:.3f} ms ({row['speedup'][v]}x)" for v in variants),
              flush=True)
    print("\n| M x H x I | " + " | ".join(variants) + " |\n" + "|---" * (len(variants) + 1) + "|")
    for r in out["rows"]:
        print(f"| {r['M']}x{r['H']}x{r['I']} | " + " | ".join(f"{r['ms'][v]:.3f} ({r['speedup'][v]}x)"
                                                         for v in variants) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
