"""One whole MoE expert layer, forward + backward, BF16 vs fp8kit's FP8 expert paths (run on a Hopper GPU).

The layer is what ``fp8kit.moe.Float8GroupedExperts`` runs in training: the routing permutation (tokens
sorted by expert, groups padded to 16 rows), ``gate_up_proj`` grouped GEMM, SwiGLU, ``down_proj`` grouped
GEMM, the un-permutation with the router weights; forward and backward (all three GEMMs of each weight).
All variants share the module code, the routing and the inputs; only the experts' precision changes:

- ``bf16``: ``torch._grouped_mm`` (transformers v5's grouped experts kernel);
- ``rowwise-torchao``: FP8 rowwise grouped GEMM ``torch._scaled_grouped_mm`` with torchao's Triton
  quantization kernels (fp8kit's default for the tensorwise / rowwise / delayed recipes);
- ``rowwise-fused``: the same GEMMs with fp8kit's fused casts, the whole expert MLP one autograd Function
  (``moe/fused_experts.py``: dispatch gather + cast, SwiGLU + cast, wgrad scales without a scatter, both
  weight copies in one pass; ``fp8.grouped_kernel = "fused"``), weights cast on every step (one micro-batch per
  optimizer step);
- ``rowwise-fused-accum``: the same with the expert-weight cache hit (the steady state of gradient accumulation:
  weights cast once per optimizer step, ``GroupedGemmConfig.cache_weights``);
- ``rowwise-fused-gwbf16`` / ``-accum``: the fused path with its weight gradients a bf16 grouped GEMM
  (``fp8.grouped_wgrad = "bf16"``: no per-(expert, column) casts of the wgrad operands); ``rowwise-fused-gwfp8`` /
  ``-accum``: every GEMM in FP8 at any expert width (``fp8.grouped_wgrad = "fp8"``; ``auto`` keeps the wgrad of
  experts narrower than 1024 in bf16);
- ``rowwise-fused-loop`` / ``-accum``: the fused path with its six GEMMs a loop of dense rowwise GEMMs, one per
  expert (``fp8.grouped_gemm = "loop"``, ``moe/rowwise_loop.py``; one device-to-host copy of the group sizes per
  layer, included); ``rowwise-fused-auto``: the defaults (``grouped_gemm`` and ``grouped_wgrad`` ``auto``);
- ``blockwise-loop``: the blockwise recipe (1x128 / 128x128, DeepSeek-V3) as a loop of dense cuBLAS
  blockwise GEMMs over the experts (``moe/grouped_loop.py``; one device-to-host copy of the group sizes per
  layer, included in the time); ``blockwise-loop-wgrad2d``: the same with each expert's wgrad copy of its input in
  128x128 blocks (``fp8.blockwise_wgrad_x = "128x128"``).

Shapes (the issue's): 16384 tokens per GPU routed top-k over E experts, published expert shapes:
Qwen3-30B-A3B (128 experts, top-8, hidden 2048, expert width 768), DeepSeek-V3 (top-8, hidden 7168, width
2048; 128 of its 256 experts, which fit one H100 with their gradients and FP8 copies), Mixtral-8x7B
(8 experts, top-2, 4096 / 14336). ``-ep16`` / ``-ep32``: the same expert shapes as one GPU of an
expert-parallel run sees them (8 local experts, 16384 routed rows each), where the weights are small next to
the activations. Routing: uniform random top-k (distinct experts per token), softmax weights.

Timing: ``triton.testing.do_bench`` median of the eager forward + backward (no CUDA graph: the loop path
needs the group sizes on the host, the same in training), so the host's launch time is included where it
is not hidden behind the GPU's work. ``--profile`` adds a ``torch.profiler`` breakdown of each variant
(GEMM / quantization / other device time).

    python benchmarks/moe_layer.py --out benchmarks/results/moe_layer_h100.json [--profile]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fp8kit.moe.experts import Float8GroupedExperts  # noqa: E402
from fp8kit.moe.grouped_mm import GroupedGemmConfig, resolve_grouped_gemm  # noqa: E402
from fp8kit.moe.routing import padded_rows  # noqa: E402

TOKENS = 16384
# name -> (experts, topk, hidden, expert width)
MODELS = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v3": (128, 8, 7168, 2048),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    # Under expert parallelism a GPU holds E / ep experts and receives about its own tokens x topk pairs for
    # them: 8 local experts with 16384 pairs each (every token routed to all 8 local experts stands in for it).
    "qwen3-30b-a3b-ep16": (8, 8, 2048, 768),
    "deepseek-v3-ep32": (8, 8, 7168, 2048),
}
VARIANTS = {
    "bf16": None,
    "rowwise-torchao": GroupedGemmConfig(kernel="torchao"),
    # weights cast every step (one micro-batch per optimizer step; the timed steps run no optimizer step, so a
    # cached weight would never be re-cast) and the cached steady state of gradient accumulation
    "rowwise-fused": GroupedGemmConfig(kernel="fused", cache_weights=False, gemm="grouped"),
    "rowwise-fused-accum": GroupedGemmConfig(kernel="fused", cache_weights=True, gemm="grouped"),
    # fprop and dgrad in FP8, wgrad a bf16 grouped GEMM (no per-(expert, column) casts; fp8.grouped_wgrad = "bf16")
    "rowwise-fused-gwbf16": GroupedGemmConfig(kernel="fused", cache_weights=False, wgrad="bf16", gemm="grouped"),
    "rowwise-fused-gwbf16-accum": GroupedGemmConfig(kernel="fused", cache_weights=True, wgrad="bf16", gemm="grouped"),
    # every GEMM in FP8 whatever the expert width (fp8.grouped_wgrad = "fp8"; auto keeps narrow experts' wgrad bf16)
    "rowwise-fused-gwfp8": GroupedGemmConfig(kernel="fused", cache_weights=False, wgrad="fp8"),
    "rowwise-fused-gwfp8-accum": GroupedGemmConfig(kernel="fused", cache_weights=True, wgrad="fp8"),
    # the six GEMMs as a loop of dense rowwise GEMMs, one per expert (fp8.grouped_gemm = "loop"; moe/rowwise_loop.py)
    "rowwise-fused-loop": GroupedGemmConfig(kernel="fused", cache_weights=False, gemm="loop"),
    "rowwise-fused-loop-accum": GroupedGemmConfig(kernel="fused", cache_weights=True, gemm="loop"),
    # the default (fp8.grouped_gemm = "auto", fp8.grouped_wgrad = "auto"), weights cast every step
    "rowwise-fused-auto": GroupedGemmConfig(kernel="fused", cache_weights=False),
    "blockwise-loop": GroupedGemmConfig(recipe="blockwise"),
    "blockwise-loop-wgrad2d": GroupedGemmConfig(recipe="blockwise", blockwise_wgrad_x="128x128"),
}


def experts_module(e: int, h: int, i: int, device) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, hidden_act="silu")
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    with torch.no_grad():
        mod.gate_up_proj = torch.nn.Parameter(
            torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16) * h ** -0.5)
        mod.down_proj = torch.nn.Parameter(
            torch.randn(e, h, i, device=device, dtype=torch.bfloat16) * i ** -0.5)
    return mod


def routing(t: int, e: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k].to(device)
    w = torch.softmax(torch.randn(t, k, generator=g), dim=-1).to(device, torch.bfloat16)
    return idx, w


def routing_rows(idx: torch.Tensor, e: int) -> int:
    """``P``: the padded routed rows the layer's dispatch makes for the choices ``idx`` (T, k) over ``e`` experts."""
    return padded_rows(idx.numel(), e)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - x).pow(2).sum().clamp_min(1e-30)))


def profile_split(step) -> dict:
    """Device time of one step by kernel group (ms): GEMMs, quantization / casts, the rest."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    groups = {"gemm": 0.0, "quantize": 0.0, "other": 0.0}
    top = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if not us or ev.key.startswith("ProfilerStep"):
            continue
        name = ev.key.lower()
        if any(s in name for s in ("gemm", "cutlass", "sm90_xmma", "nvjet", "scaled_mm", "grouped_mm")):
            groups["gemm"] += us / 1e3
        elif name.startswith("triton_"):  # Inductor's kernels: compiled routing, SwiGLU backward (not casts)
            groups["other"] += us / 1e3
        elif any(s in name for s in ("quant", "fp8", "float8", "scale", "amax", "gather_rows",
                                       "group_cols", "experts_cast", "swiglu")):
            groups["quantize"] += us / 1e3
        else:
            groups["other"] += us / 1e3
        top.append((us / 1e3, ev.key[:90], ev.count))
    top.sort(reverse=True)
    groups["top"] = [{"ms": round(ms, 3), "kernel": k, "calls": c} for ms, k, c in top[:12]]
    return groups


def bench_ms(step) -> float:
    """Median ms of ``step`` (``triton.testing.do_bench`` over 500 ms: at least 10 steps of the largest layer; with
    50 ms, as before 2026-11-26, Mixtral's 45 ms layer was timed once and moved by 3% between runs)."""
    from triton.testing import do_bench

    return do_bench(step, warmup=5, rep=500)


def measure_model(name: str, variants: list[str], device, profile: bool) -> dict:
    e, k, h, i = MODELS[name]
    # Each model starts from fresh compiled helpers (the routing's gathers and combine, the SwiGLU backward): a
    # second model's shapes would otherwise recompile them with dynamic shapes (torch.compile's automatic dynamic),
    # whose kernels took up to 6x longer here (H100, 2026-11-26), as in no single-model training run.
    torch._dynamo.reset()
    torch.manual_seed(0)
    src = experts_module(e, h, i, device)
    x = torch.randn(TOKENS, h, device=device, dtype=torch.bfloat16)
    idx, rw = routing(TOKENS, e, k, device)
    g = torch.randn(TOKENS, h, device=device, dtype=torch.bfloat16)
    pairs = TOKENS * k
    flop = 6.0 * pairs * (h * 2 * i + i * h)  # fprop + dgrad + wgrad of both weights
    rec = {"model": name, "experts": e, "topk": k, "hidden": h, "expert_width": i, "tokens": TOKENS,
           "pairs_per_expert": pairs / e, "variants": {}}
    ref_out = None
    for v in variants:
        mod = Float8GroupedExperts(src, frozenset() if VARIANTS[v] is None else frozenset(("gate_up_proj", "down_proj")),
                                   VARIANTS[v] or GroupedGemmConfig())
        xr = x.clone().requires_grad_()

        def step(mod=mod, xr=xr):
            xr.grad = None
            mod.gate_up_proj.grad = None
            mod.down_proj.grad = None
            mod(xr, idx, rw).backward(g)

        r = {}
        try:
            out = mod(x, idx, rw).detach()
            if ref_out is None:
                ref_out = out
            r["sqnr_vs_bf16_db"] = None if v == "bf16" else round(sqnr(ref_out, out), 2)
            if mod.runs_fused(device):  # how the fused MLP ran its GEMMs (fp8.grouped_gemm, resolved)
                r["gemm"] = resolve_grouped_gemm(mod.config.gemm, e, routing_rows(idx, e), h, i, True)
            ms = bench_ms(step)
            r.update(ms=ms, tflops=flop / ms / 1e9)
            torch.cuda.reset_peak_memory_stats()
            step()
            r["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if profile:
                r["profile"] = profile_split(step)
        except Exception as exc:  # one failing variant must not lose the others
            r["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:240]}"
        rec["variants"][v] = r
        # hand the weights back to the source module for the next variant
        src.gate_up_proj, src.down_proj = mod.gate_up_proj, mod.down_proj
        del mod
        torch.cuda.empty_cache()
    base = rec["variants"].get("bf16", {}).get("ms")
    for r in rec["variants"].values():
        if base and r.get("ms"):
            r["speedup"] = base / r["ms"]
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/moe_layer.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    from fp8kit.train.setup import versions

    result = {"device": torch.cuda.get_device_name(), "versions": versions(), "date": time.strftime("%Y-%m-%d"),
              "command": "python " + " ".join(sys.argv), "timing": "triton.testing.do_bench median ms, eager fwd+bwd",
              "models": []}
    for name in args.models.split(","):
        rec = measure_model(name, args.variants.split(","), device, args.profile)
        result["models"].append(rec)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))  # after each model: a cut run keeps what it measured
        for v, r in rec["variants"].items():
            brief = {k: (round(x, 3) if isinstance(x, float) else x) for k, x in r.items() if k != "profile"}
            print(name, v, json.dumps(brief), flush=True)
            if "profile" in r:
                p = r["profile"]
                print("   profile ms: gemm {:.3f} quantize {:.3f} other {:.3f}".format(p["gemm"], p["quantize"], p["other"]))
                for t in p["top"][:8]:
                    print("     ", t)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
