"""Rowwise FP8 expert GEMMs: the grouped kernel vs a loop of dense GEMMs, per GEMM of the expert layer (H100).

For each model of ``benchmarks/moe_layer.py`` (16384 tokens routed top-k, balanced groups padded to 16 rows)
and each of the six GEMMs of its expert MLP (fprop, dgrad, wgrad of ``gate_up_proj`` and ``down_proj``), times
``torch._scaled_grouped_mm`` against ``fp8kit.moe.rowwise_loop.loop_scaled_grouped_mm`` (one dense
``torch._scaled_mm`` per expert) on the same E4M3 operands (cast from randn, never zeros) and scales, and
checks that the two agree (SQNR of the loop against the grouped output). Timing: ``triton.testing.do_bench``
median, eager (the loop's host launches included, as in training), and for the loop also replayed from a CUDA
graph (the GPU time alone: how far the host is from hiding behind it). TFLOP/s count 2*M*N*K useful work.

    python benchmarks/grouped_gemm_loop.py --out benchmarks/results/grouped_gemm_loop_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe_layer import MODELS, TOKENS  # noqa: E402

from fp8kit.moe.rowwise_loop import loop_scaled_grouped_mm  # noqa: E402

FP8 = torch.float8_e4m3fn


def _fp8(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * 40).clamp(-448, 448).to(FP8)


def _scales(n: int) -> torch.Tensor:
    return torch.rand(n, device="cuda") * 0.01 + 0.001


def _sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.float(), x.float()
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - x).pow(2).mean().clamp_min(1e-30)))


def gemm_cases(name: str, rows: int | None = None, experts: int | None = None) -> list[tuple[str, int, int, int, int]]:
    """``(gemm, experts, rows per expert, K, N)`` of the six GEMMs of ``name``'s expert MLP (rows balanced; by
    default those of 16384 tokens routed top-k over all of the model's experts)."""
    e, topk, h, i = MODELS[name]
    e = experts or e
    rows = rows or -(-TOKENS * topk // e // 16) * 16
    return [("up fprop", e, rows, h, 2 * i), ("up dgrad", e, rows, 2 * i, h), ("up wgrad", e, rows, h, 2 * i),
            ("down fprop", e, rows, i, h), ("down dgrad", e, rows, h, i), ("down wgrad", e, rows, i, h)]


def time_case(gemm: str, e: int, rows: int, k: int, n: int) -> dict:
    import triton.testing as tt

    p = e * rows
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * rows
    bounds = [(j * rows, (j + 1) * rows) for j in range(e)]
    if gemm.endswith("wgrad"):  # dW (E, N, K) = dy^T x, groups along the tokens
        a = _fp8(n, p)  # (N, P) row-major
        b = _fp8(k, p).t()  # (P, K) column-major
        sa, sb = _scales(e * n), _scales(e * k)
    else:  # y (P, N) = x (P, K) @ W[e] (K, N)
        a = _fp8(p, k)
        b = _fp8(e, n, k).transpose(-2, -1)  # each (K, N) column-major
        sa, sb = _scales(p), _scales(e * n).view(e, n)

    def grouped():
        return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True)

    def loop():
        return loop_scaled_grouped_mm(a, b, sa, sb, offs, torch.bfloat16, bounds)

    sqnr = _sqnr(grouped(), loop())
    ms_g = tt.do_bench(grouped, warmup=10, rep=50)
    ms_l = tt.do_bench(loop, warmup=10, rep=50)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        loop()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loop()
    ms_lg = tt.do_bench(graph.replay, warmup=10, rep=50)
    flop = 2.0 * p * k * n
    return {"gemm": gemm, "experts": e, "rows_per_expert": rows, "K": k, "N": n, "grouped_ms": ms_g,
            "loop_ms": ms_l, "loop_graph_ms": ms_lg, "grouped_tflops": flop / ms_g / 1e9,
            "loop_tflops": flop / ms_l / 1e9, "loop_graph_tflops": flop / ms_lg / 1e9,
            "loop_vs_grouped": ms_g / ms_l, "sqnr_loop_vs_grouped_db": sqnr}


def summarize(rows: list[dict]) -> list[dict]:
    """Per (model, experts, rows per expert): the six GEMMs' total time grouped vs loop, and the smallest
    per-expert GEMM's work (GFLOP), the quantity ``moe.grouped_mm.LOOP_MIN_EXPERT_GFLOP`` compares."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["experts"], r["rows_per_expert"])
        s = out.setdefault(key, {"model": key[0], "experts": key[1], "rows_per_expert": key[2], "grouped_ms": 0.0,
                                 "loop_ms": 0.0, "min_expert_gflop": float("inf")})
        s["grouped_ms"] += r["grouped_ms"]
        s["loop_ms"] += r["loop_ms"]
        s["min_expert_gflop"] = min(s["min_expert_gflop"], 2.0 * r["rows_per_expert"] * r["K"] * r["N"] / 1e9)
    for s in out.values():
        s["loop_vs_grouped"] = s["grouped_ms"] / s["loop_ms"]
    return list(out.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b,deepseek-v3-ep32")
    ap.add_argument("--sweep-rows", default="",
                    help="comma list of rows per expert: time each model's six GEMMs at 8 experts and each of these "
                         "row counts instead of the models' own routing (where the loop starts to pay)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    sweep = [int(r) for r in args.sweep_rows.split(",") if r]
    print(f"{'model':<20} {'gemm':<11} {'E':>4} {'rows':>6} {'K':>6} {'N':>6} {'grouped':>9} {'loop':>9} "
          f"{'loop(graph)':>11} {'ratio':>6} {'SQNR':>6}")
    cases = [(name, c) for name in args.models.split(",")
             for c in (gemm_cases(name) if not sweep else [c for r in sweep for c in gemm_cases(name, r, 8)])]
    for name, case in cases:
        r = {"model": name, **time_case(*case)}
        rows.append(r)
        print(f"{name:<20} {r['gemm']:<11} {r['experts']:>4} {r['rows_per_expert']:>6} {r['K']:>6} {r['N']:>6} "
              f"{r['grouped_tflops']:>7.0f}TF {r['loop_tflops']:>7.0f}TF {r['loop_graph_tflops']:>9.0f}TF "
              f"{r['loop_vs_grouped']:>5.2f}x {r['sqnr_loop_vs_grouped_db']:>5.1f}", flush=True)
        torch.cuda.empty_cache()
    summary = summarize(rows)
    print(f"\n{'model':<20} {'E':>4} {'rows':>6} {'min GFLOP/expert GEMM':>22} {'grouped ms':>11} {'loop ms':>8} {'ratio':>6}")
    for s in summary:
        print(f"{s['model']:<20} {s['experts']:>4} {s['rows_per_expert']:>6} {s['min_expert_gflop']:>22.1f} "
              f"{s['grouped_ms']:>11.3f} {s['loop_ms']:>8.3f} {s['loop_vs_grouped']:>5.2f}x")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": TOKENS,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
