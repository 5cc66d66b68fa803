"""Forward + backward of one linear layer: BF16 vs torchao FP8 (tensorwise, rowwise, blockwise prototype) vs
fp8kit's blockwise FP8 engine (run on a Hopper GPU).

For every (M tokens, K in_features, N out_features) it times ``dx, dw = autograd.grad(layer(x), (x, w), dy)``:

- ``bf16``: ``torch.compile``d ``nn.Linear`` (3 cuBLAS BF16 GEMMs);
- ``ao_tensorwise`` / ``ao_rowwise``: torchao ``Float8Linear`` (``convert_to_float8_training``), compiled;
- ``ao_blockwise``: torchao 0.18's ``prototype.blockwise_fp8_training.Float8BlockwiseLinear`` (Triton
  casts, cuBLAS blockwise GEMMs), eager as shipped;
- ``fp8kit``: :class:`fp8kit.fp8.linear.Float8BlockwiseLinear`, weight quantized on every call
  (``cache_weight=False``: the same work per call as every other column);
- ``fp8kit_cached``: the same with the weight cache (the steady state of gradient accumulation: the
  weight is quantized once per optimizer step, not per micro-batch);
- ``fp8kit_delayed``: :class:`fp8kit.fp8.delayed.Float8DelayedLinear` (per-tensor E4M3 / E5M2 scales from the amax
  history, this step's amax recorded in the cast), ``torch.compile(dynamic=False)`` as ``fp8kit train`` runs it,
  every cast through fp8kit's Triton cast-transpose kernel (``fp8.delayed_fused_cast = "all"``: one read per
  operand writes both FP8 layouts and the amax);
- ``fp8kit_delayed_none``: the same with every cast left to torch.compile (``delayed_fused_cast = "none"``).

Host overhead is removed: each variant is captured in a CUDA graph after warm-up and the graph's replay
is timed with ``triton.testing.do_bench`` (median, L2 flushed between replays); a variant that cannot be
captured is timed directly (marked in the JSON). Inputs are randn (weights x 0.02), never zeros. The
compiled modules use dynamic shapes after the first shape (one recompile per recipe, not one per shape).

Also measured: the achieved bandwidth of fp8kit's quantization kernels (bytes read + written / time,
against the H100's ~3.35 TB/s) next to torchao's two separate activation casts, and a ``torch.profiler``
breakdown of one fp8kit forward + backward at 8192x4096x4096 (GEMMs vs quantization vs other kernels).

    python benchmarks/linear_fwd_bwd.py --out benchmarks/results/linear_fwd_bwd_h100.json
    python benchmarks/linear_fwd_bwd.py --quick --out /tmp/q.json   # the two target shapes only
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fp8kit.base.torchao_lib import torchao_float8  # noqa: E402
from fp8kit.fp8.blockwise import padded_rows  # noqa: E402
from fp8kit.fp8.delayed import Float8DelayedLinear  # noqa: E402
from fp8kit.fp8.delayed_state import DelayedScaling, DelayedScalingState  # noqa: E402
from fp8kit.fp8.kernels import ops  # noqa: E402
from fp8kit.fp8.kernels.cast_ops import cast_transpose  # noqa: E402
from fp8kit.fp8.linear import Float8BlockwiseLinear  # noqa: E402

MS = (4096, 8192, 16384)
KN = ((4096, 6144), (4096, 4096), (4096, 14336), (14336, 4096), (2048, 2048), (2048, 8192))
TARGETS = {(16384, 4096, 14336): 1.50, (8192, 4096, 4096): 1.25}
HBM_TBPS = 3.35
VARIANTS = ("bf16", "ao_tensorwise", "ao_rowwise", "ao_blockwise", "fp8kit", "fp8kit_cached", "fp8kit_delayed",
            "fp8kit_delayed_none")


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(10 * math.log10(ref.pow(2).sum() / (ref - x).pow(2).sum().clamp_min(1e-300)))


def build(variant: str, base: nn.Linear) -> nn.Module:
    lin = copy.deepcopy(base)
    if variant == "bf16":
        return torch.compile(lin)
    if variant in ("ao_tensorwise", "ao_rowwise"):
        f8 = torchao_float8()
        cfg = f8.Float8LinearConfig.from_recipe_name(variant.removeprefix("ao_"))
        return torch.compile(f8.convert_to_float8_training(nn.Sequential(lin), config=cfg))
    if variant == "ao_blockwise":
        from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear as AOBlockwise

        return AOBlockwise.from_float(lin)
    if variant.startswith("fp8kit_delayed"):  # per-tensor scales from the amax history; static shapes
        fused = "none" if variant == "fp8kit_delayed_none" else "all"
        state = DelayedScalingState(DelayedScaling(fused_cast=fused))
        return torch.compile(Float8DelayedLinear.from_linear(lin, state, "linear"), dynamic=False)
    return Float8BlockwiseLinear.from_linear(lin, cache_weight=variant == "fp8kit_cached")


def weight_of(mod: nn.Module) -> nn.Parameter:
    return next(p for p in mod.parameters() if p.dim() == 2)


def time_step(step) -> tuple[float, str]:
    """Median ms of ``step()``: CUDA-graph replay when capturable, else direct."""
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        ms = do_bench(graph.replay, warmup=25, rep=150, return_mode="median")
        del graph
        return ms, "cuda_graph"
    except Exception as e:  # noqa: BLE001 - fall back to direct timing, recorded in the JSON
        torch.cuda.synchronize()
        return do_bench(step, warmup=25, rep=150, return_mode="median"), f"direct ({type(e).__name__})"


def bench_shape(m: int, k: int, n: int, variants) -> dict:
    dev = torch.device("cuda")
    torch.manual_seed(m + k + n)
    base = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        base.weight.copy_(torch.randn(n, k, device=dev) * 0.02)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    row = {"M": m, "K": k, "N": n, "ms": {}, "mode": {}, "speedup": {}, "sqnr_db": {}}
    ref_y = None
    for v in variants:
        try:
            mod = build(v, base)
            w = weight_of(mod)
            y = mod(x)
            if v == "bf16":
                ref_y = y.detach().float()
            elif ref_y is not None:
                row["sqnr_db"][v] = round(sqnr(ref_y, y.detach().float()), 1)
            del y

            def step(mod=mod, w=w):
                return torch.autograd.grad(mod(x), (x, w), dy)

            ms, mode = time_step(step)
            row["ms"][v], row["mode"][v] = round(ms, 4), mode
        except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
            row["ms"][v], row["mode"][v] = None, f"error: {type(e).__name__}: {str(e)[:200]}"
        del mod
        torch.cuda.empty_cache()
    b = row["ms"].get("bf16")
    for v, ms in row["ms"].items():
        if b and ms:
            row["speedup"][v] = round(b / ms, 3)
    flops = 6 * m * k * n
    row["tflops"] = {v: round(flops / (ms * 1e9), 1) for v, ms in row["ms"].items() if ms}
    return row


def graph_ms(fn, calls: int = 20) -> float:
    """Device ms per call of ``fn``: ``calls`` calls captured in one CUDA graph, replay timed (median)."""
    from triton.testing import do_bench

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = do_bench(graph.replay, warmup=10, rep=100, return_mode="median") / calls
    del graph
    return ms


def quant_bandwidth(m: int, k: int) -> dict:
    """fp8kit's fused activation cast vs torchao's two activation casts, and the weight cast (device time)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    mp = padded_rows(m)
    act_bytes = 2 * m * k + 2 * mp * k + 4 * (mp * k // 128) * 2
    t_act = graph_ms(lambda: ops.quantize_act(x))
    out = {"M": m, "K": k, "act_ms": round(t_act, 4), "act_TBps": round(act_bytes / t_act / 1e9, 3)}
    try:
        from torchao.prototype.blockwise_fp8_training import kernels as ak

        def ao_two():
            ak.triton_fp8_blockwise_act_quant_lhs(x, 128)
            ak.triton_fp8_blockwise_act_quant_rhs(x, 128)

        out["ao_lhs_plus_rhs_ms"] = round(graph_ms(ao_two), 4)
    except Exception as e:  # noqa: BLE001
        out["ao_lhs_plus_rhs_ms"] = f"error: {type(e).__name__}"
    w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 0.02  # an [N=m, K] weight
    w_bytes = 2 * m * k + 2 * m * k + 4 * (m // 128) * (k // 128) * 2
    t_w = graph_ms(lambda: ops.quantize_weight(w, cache=False))
    out.update(weight_ms=round(t_w, 4), weight_TBps=round(w_bytes / t_w / 1e9, 3), hbm_TBps=HBM_TBPS)
    # the delayed recipe's per-tensor cast at a known scale: 2 bytes read + 2 written per element
    scale = torch.tensor(3.0, device="cuda")
    t_ct = graph_ms(lambda: cast_transpose(x, scale, torch.float8_e5m2))
    out.update(cast_transpose_ms=round(t_ct, 4), cast_transpose_TBps=round(4 * m * k / t_ct / 1e9, 3))
    return out


def profile_breakdown(variant: str, m: int, k: int, n: int, iters: int = 5) -> dict:
    """Device time per kernel category of one forward + backward (eager; fp8kit quantizes its weight)."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    base = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        base.weight.copy_(torch.randn(n, k, device=dev) * 0.02)
    mod = build(variant, base)
    w = weight_of(mod)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        torch.autograd.grad(mod(x), (x, w), dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            torch.autograd.grad(mod(x), (x, w), dy)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if us:
            kernels[evt.key] = kernels.get(evt.key, 0.0) + us / iters / 1e3

    def category(name: str) -> str:
        low = name.lower()
        if "quant" in low and "triton" in low or "quant_kernel" in low or "cast_transpose" in low:
            return "quantization (Triton)"
        if any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90", "cublas")):
            return "GEMM (cuBLAS)"
        return "other"

    cats: dict[str, float] = {}
    for name, ms in kernels.items():
        cats[category(name)] = cats.get(category(name), 0.0) + ms
    return {
        "variant": variant, "shape": [m, k, n], "gemm_tflops_equiv": round(6 * m * k * n / 1e9 / max(
            cats.get("GEMM (cuBLAS)", 0.0), 1e-9), 1),
        "per_iter_ms": {c: round(v, 4) for c, v in sorted(cats.items())}, "total_ms": round(sum(cats.values()), 4),
        "kernels_ms": {nm: round(v, 4) for nm, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:20]},
    }


def _cast_transpose_kernel():
    from fp8kit.fp8.kernels import cast_transpose_triton

    return cast_transpose_triton._cast_transpose_kernel


def autotuned_configs() -> dict:
    """The configuration Triton's autotuner chose for fp8kit's kernels, per key."""
    try:
        from fp8kit.fp8.kernels import blockwise_triton as bt
    except ImportError:
        return {}
    return {name: {str(key): str(cfg) for key, cfg in getattr(kernel, "cache", {}).items()}
            for name, kernel in (("act", bt._act_quant_kernel), ("weight", bt._weight_quant_kernel),
                                 ("cast_transpose", _cast_transpose_kernel()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="only the two target shapes")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", default="", help="comma-separated MxKxN to run instead of the grid")
    ap.add_argument("--profile", default="fp8kit:8192x4096x4096",
                    help="comma-separated variant:MxKxN to profile with torch.profiler")
    ap.add_argument("--time-budget", type=float, default=0.0,
                    help="seconds after which the remaining shapes are skipped (0: none)")
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096
    variants = [v for v in args.variants.split(",") if v]
    shapes = [(16384, 4096, 14336), (8192, 4096, 4096)]
    if not args.quick:
        shapes += [(m, k, n) for m in MS for k, n in KN if (m, k, n) not in shapes]
    if args.shapes:
        shapes = [tuple(int(d) for d in sh.split("x")) for sh in args.shapes.split(",")]
    out = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"), "timing": "CUDA-graph replay, triton.testing.do_bench median",
        "blockwise_gemm": ops.blockwise_gemm_support("cuda")[1], "rows": [], "quant_bandwidth": [],
    }
    try:
        import torchao

        out["torchao"] = torchao.__version__
    except ImportError:
        out["torchao"] = None
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        path.write_text(json.dumps(out, indent=1))

    t0 = time.time()
    for m, k in ((16384, 4096), (8192, 4096), (16384, 14336), (4096, 14336)):
        out["quant_bandwidth"].append(quant_bandwidth(m, k))
        save()
    out["profiles"] = []
    for item in filter(None, args.profile.split(",")):
        variant, shape = item.split(":")
        out["profiles"].append(profile_breakdown(variant, *(int(d) for d in shape.split("x"))))
        save()
    out["autotuned"] = autotuned_configs()
    save()
    out["skipped_shapes"] = []
    for m, k, n in shapes:
        if args.time_budget and time.time() - t0 > args.time_budget:
            out["skipped_shapes"].append([m, k, n])
            continue
        row = bench_shape(m, k, n, variants)
        out["rows"].append(row)
        save()
        print(f"[{time.time() - t0:6.1f}s] {m}x{k}x{n}: " + ", ".join(
            f"{v} {row['ms'][v]}" for v in variants), flush=True)
    out["autotuned"] = autotuned_configs()
    save()

    cols = variants
    print("\nfwd+bwd of one linear, ms (speedup vs bf16); " + out["device"] + ", torch " + out["torch"])
    print(f"{'M x K x N':>20} | " + " | ".join(f"{c:>16}" for c in cols))
    for r in out["rows"]:
        cells = []
        for c in cols:
            ms = r["ms"].get(c)
            cells.append(f"{ms:7.3f} ({r['speedup'].get(c, 0):4.2f}x)" if ms else f"{'n/a':>16}")
        print(f"{r['M']:>6}x{r['K']}x{r['N']:<6} | " + " | ".join(f"{c:>16}" for c in cells))
    print("\ntargets:")
    for r in out["rows"]:
        key = (r["M"], r["K"], r["N"])
        if key in TARGETS:
            print(f"  {key}: fp8kit {r['speedup'].get('fp8kit')}x (cached {r['speedup'].get('fp8kit_cached')}x, "
                  f"delayed {r['speedup'].get('fp8kit_delayed')}x, delayed_none {r['speedup'].get('fp8kit_delayed_none')}x) "
                  f"vs target {TARGETS[key]}x; ao_blockwise {r['speedup'].get('ao_blockwise')}x")
    below = [(r["M"], r["K"], r["N"]) for r in out["rows"]
             if r["ms"].get("fp8kit") and r["ms"].get("ao_blockwise") and r["ms"]["fp8kit"] > r["ms"]["ao_blockwise"]]
    print(f"  shapes where fp8kit is slower than ao_blockwise: {below or 'none'}")
    if out["skipped_shapes"]:
        print(f"  skipped (time budget): {out['skipped_shapes']}")
    print(f"  autotuned: {out['autotuned']}")
    print("\nquantization bandwidth (TB/s, H100 HBM ~3.35):")
    for q in out["quant_bandwidth"]:
        print(f"  {q['M']}x{q['K']}: act fused {q['act_ms']} ms = {q['act_TBps']} TB/s "
              f"(torchao lhs+rhs {q['ao_lhs_plus_rhs_ms']} ms); weight {q['weight_ms']} ms = {q['weight_TBps']} TB/s; "
              f"delayed cast-transpose {q['cast_transpose_ms']} ms = {q['cast_transpose_TBps']} TB/s")
    for p in out["profiles"]:
        print(f"\nprofile {p['variant']} fwd+bwd {p['shape']}: {p['per_iter_ms']} total {p['total_ms']} ms "
              f"(GEMMs at {p['gemm_tflops_equiv']} TFLOP/s)")
        for name, ms in list(p["kernels_ms"].items())[:8]:
            print(f"  {ms:8.4f} ms  {name[:110]}")


if __name__ == "__main__":
    main()
