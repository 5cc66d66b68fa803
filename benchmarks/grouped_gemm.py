"""FP8 vs BF16 grouped GEMM for MoE experts (run on a Hopper GPU): the table of the MoE issue.

For every (expert shape, experts, tokens per expert) cell it measures, with ``triton.testing.do_bench``
(median ms, same process, same inputs):

- GEMM only (operands already quantized, as in ``shared/anchors.md``): ``torch._grouped_mm`` BF16 vs
  ``torch._scaled_grouped_mm`` rowwise FP8, in TFLOP/s;
- the full training path, forward + backward (3 GEMMs, every amax / scale / cast included):
  BF16 ``torch._grouped_mm`` (what transformers runs) vs fp8kit's ``fp8_grouped_mm`` with the
  ``scaled_grouped_mm`` backend (compiled quantization) vs the ``torchao`` backend (torchao's Triton
  quantization kernels), in TFLOP/s of useful work (6 x M x K x N) and as a speed-up over BF16.

Before timing, a correctness check per shape family: the CUDA FP8 path against an FP32 reference
(SQNR of output, input gradient and weight gradient) and against the CPU-testable emulation.

    python benchmarks/grouped_gemm.py --out benchmarks/results/grouped_gemm_h100.json
    python benchmarks/grouped_gemm.py --quick   # a few cells

Cells whose routed rows exceed ``--max-rows`` or whose weights exceed ``--max-weight-gib`` are skipped
(and listed), to keep one run within minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fp8kit.moe import quantize as q  # noqa: E402
from fp8kit.moe.grouped_mm import fp8_grouped_mm  # noqa: E402

# name -> (K, N) of the expert GEMMs: up = gate_up_proj (K = hidden, N = 2 x moe_intermediate),
# down = down_proj (K = moe_intermediate, N = hidden). Published config.json shapes.
SHAPES = {
    "qwen3-30b-a3b up": (2048, 1536),
    "qwen3-30b-a3b down": (768, 2048),
    "deepseek-v3 up": (7168, 4096),
    "deepseek-v3 down": (2048, 7168),
    "mixtral-8x7b up": (4096, 28672),
    "mixtral-8x7b down": (14336, 4096),
}
EXPERTS = (8, 64, 128)
TOKENS_PER_EXPERT = (128, 512, 2048, 8192)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return float(10 * math.log10(ref.pow(2).sum() / (ref - x).pow(2).sum().clamp_min(1e-300)))


def offsets(experts: int, per_expert: int, device) -> torch.Tensor:
    return (torch.arange(1, experts + 1, device=device) * per_expert).to(torch.int32)


def bench(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def check_correctness(device) -> list[dict]:
    """CUDA FP8 path vs FP32 reference and vs the emulation, on unbalanced routing with empty experts."""
    out = []
    torch.manual_seed(0)
    for name, (k, n) in (("qwen3-30b-a3b up", SHAPES["qwen3-30b-a3b up"]), ("deepseek-v3 down", SHAPES["deepseek-v3 down"])):
        e = 8
        sizes = torch.tensor([0, 16, 512, 48, 0, 1024, 32, 160])
        offs = sizes.cumsum(0).to(torch.int32).to(device)
        rows = int(sizes.sum())
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        w = (torch.randn(e, n, k, device=device) * k ** -0.5).to(torch.bfloat16)
        g = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
        res = {}
        for backend in ("scaled_grouped_mm", "torchao", "emulated", "fp32"):
            xx = (x.float() if backend == "fp32" else x).clone().requires_grad_()
            ww = (w.float() if backend == "fp32" else w).clone().requires_grad_()
            if backend == "fp32":
                ends = offs.tolist()
                y = torch.cat([xx[s:t] @ ww[i].t() for i, (s, t) in enumerate(zip([0, *ends[:-1]], ends, strict=True))])
            else:
                y = fp8_grouped_mm(xx, ww, offs, backend)
            y.backward(g.to(y.dtype))
            res[backend] = (y.detach().float(), xx.grad.float(), ww.grad.float())
        for backend in ("scaled_grouped_mm", "torchao", "emulated"):
            ref = res["fp32"]
            row = {"shape": name, "backend": backend,
                   "sqnr_out_db": sqnr(ref[0], res[backend][0]), "sqnr_dx_db": sqnr(ref[1], res[backend][1]),
                   "sqnr_dw_db": sqnr(ref[2], res[backend][2])}
            if backend != "emulated":
                row["sqnr_vs_emulated_out_db"] = sqnr(res["emulated"][0], res[backend][0])
                row["sqnr_vs_emulated_dw_db"] = sqnr(res["emulated"][2], res[backend][2])
            out.append(row)
            print("correctness", json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return out


def measure_cell(name: str, k: int, n: int, e: int, t: int, device) -> dict:
    m = e * t
    offs = offsets(e, t, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = (torch.randn(e, n, k, device=device) * k ** -0.5).to(torch.bfloat16)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    flop = 2.0 * m * k * n
    rec = {"shape": name, "K": k, "N": n, "experts": e, "tokens_per_expert": t, "rows": m}
    # GEMM only
    xq, xs = q.quantize_rows(x)
    wq, ws = q.quantize_experts(w, -1)
    ms_bf16 = bench(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    ms_fp8 = bench(lambda: torch._scaled_grouped_mm(xq, wq, xs, ws, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=True))
    rec.update(gemm_bf16_tflops=flop / ms_bf16 / 1e9, gemm_fp8_tflops=flop / ms_fp8 / 1e9, gemm_speedup=ms_bf16 / ms_fp8)
    # full forward + backward
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()

    def step(fn):
        def run():
            xr.grad = None
            wr.grad = None
            fn().backward(g)
        return run

    t_bf16 = bench(step(lambda: torch._grouped_mm(xr, wr.transpose(-2, -1), offs=offs)))
    rec["train_bf16_ms"] = t_bf16
    rec["train_bf16_tflops"] = 3 * flop / t_bf16 / 1e9
    for backend in ("scaled_grouped_mm", "torchao"):
        try:
            ms = bench(step(lambda backend=backend: fp8_grouped_mm(xr, wr, offs, backend)))
            rec[f"train_{backend}_ms"] = ms
            rec[f"train_{backend}_tflops"] = 3 * flop / ms / 1e9
            rec[f"train_{backend}_speedup"] = t_bf16 / ms
        except Exception as exc:  # record and go on: one failing backend must not lose the table
            rec[f"train_{backend}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/grouped_gemm.json")
    ap.add_argument("--quick", action="store_true", help="three cells only")
    ap.add_argument("--max-rows", type=int, default=65536, help="skip cells with more routed rows")
    ap.add_argument("--max-weight-gib", type=float, default=8.0, help="skip cells with larger BF16 expert weights")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    from fp8kit.train.setup import versions

    result = {"device": torch.cuda.get_device_name(), "versions": versions(), "date": time.strftime("%Y-%m-%d"),
              "command": "python " + " ".join(sys.argv), "timing": "triton.testing.do_bench median ms",
              "correctness": check_correctness(device), "cells": [], "skipped": []}
    cells = [(s, e, t) for s in SHAPES for e in EXPERTS for t in TOKENS_PER_EXPERT]
    if args.quick:
        cells = [("deepseek-v3 up", 8, 2048), ("qwen3-30b-a3b up", 128, 512), ("mixtral-8x7b up", 8, 4096)]
    for name, e, t in cells:
        k, n = SHAPES[name]
        wgib = e * n * k * 2 / 2**30
        if e * t > args.max_rows or wgib > args.max_weight_gib:
            result["skipped"].append({"shape": name, "experts": e, "tokens_per_expert": t,
                                      "why": f"rows {e * t} > {args.max_rows}" if e * t > args.max_rows
                                      else f"weights {wgib:.1f} GiB > {args.max_weight_gib}"})
            continue
        rec = measure_cell(name, k, n, e, t, device)
        result["cells"].append(rec)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()}), flush=True)
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
