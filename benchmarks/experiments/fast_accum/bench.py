# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""``torch._scaled_mm`` with and without ``use_fast_accum`` at the delayed recipe's three GEMMs of the Llama-3-8B
linears (and the LM head), in the layouts ``fp8kit.fp8.delayed`` calls them with:

- fprop ``x8 [M, K] (E4M3) @ w8.T``,
- dgrad ``g8 [M, N] (E5M2) @ w8`` (the weight's column-major copy),
- wgrad ``g8.T @ x8`` (both column-major copies).

Operands are random normal values cast per tensor (never zeros). Timing: CUDA graphs (``graph_timing.timed``), the
two settings interleaved over ``--repeats`` rounds. Accuracy: each output against the fp64 product of the same FP8
operands (SQNR in dB and the largest relative error over elements whose magnitude is above the output's RMS).
Fast accumulation on sm90 adds the tensor cores' partial sums without the periodic promotion to an FP32
accumulator (DeepSeek-V3, arXiv:2412.19437, section 3.3.2); Transformer Engine and torchao use it for fprop only.

    python benchmarks/experiments/fast_accum/bench.py --out /tmp/fast_accum.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_timing import timed  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
#: name -> (K, N) of y = x @ w.T for the Llama-3-8B block's linears and a 32000-word head
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate/up": (4096, 14336), "down": (14336, 4096),
          "head": (4096, 32000)}


def cast(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor cast (amax scaled to the format's max); returns the FP8 tensor and the decoding scale."""
    scale = torch.finfo(dtype).max / t.abs().amax().float()
    return (t.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype), (1 / scale).reshape(())


def col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def accuracy(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> dict:
    ref = (a.double() @ b.double()) * (sa.double() * sb.double())
    err = out.double() - ref
    sqnr = 10 * torch.log10(ref.pow(2).mean() / err.pow(2).mean().clamp_min(1e-300))
    big = ref.abs() > ref.pow(2).mean().sqrt()
    rel = (err.abs()[big] / ref.abs()[big]).max()
    return {"sqnr_db": float(sqnr), "max_rel_err_above_rms": float(rel)}


def measure(name: str, m: int, k: int, n: int, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    x8, ix = cast(x, E4)
    w8, iw = cast(w, E4)
    g8, ig = cast(g, E5)
    x8_cm, w8_cm, g8_cm = col_major(x8), col_major(w8), col_major(g8)
    gemms = {
        "fprop": (x8, w8.t(), ix, iw, m * n * k),
        "dgrad": (g8, w8_cm, ig, iw, m * n * k),
        "wgrad": (g8_cm.t(), x8_cm, ig, ix, m * n * k),
    }
    rows = []
    for gemm, (a, b, sa, sb, macs) in gemms.items():
        acc = {}
        for fast in (False, True):
            out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
            if m * n * k <= 8192 * 4096 * 14336:
                acc[fast] = accuracy(out, a, b, sa, sb)
            del out
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for fast in (False, True):
                times[fast].append(timed(lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb,
                                                                    out_dtype=torch.bfloat16, use_fast_accum=fast)))
        med = {f: statistics.median(v) for f, v in times.items()}
        row = {"linear": name, "gemm": gemm, "M": m, "K": k, "N": n, "split_ms": med[False], "fast_ms": med[True],
               "speedup": med[False] / med[True],
               "split_tflops": 2 * macs / med[False] / 1e9, "fast_tflops": 2 * macs / med[True] / 1e9,
               "accuracy_split": acc.get(False), "accuracy_fast": acc.get(True), "runs": {str(f): v for f, v in times.items()}}
        print(f"{name:8s} {gemm:5s} {m}x{k}x{n}: split {med[False]:.3f} ms ({row['split_tflops']:.0f} TFLOP/s), "
              f"fast {med[True]:.3f} ms ({row['fast_tflops']:.0f}), {row['speedup']:.3f}x; "
              f"SQNR split {acc.get(False, {}).get('sqnr_db', float('nan')):.1f} / fast "
              f"{acc.get(True, {}).get('sqnr_db', float('nan')):.1f} dB; max rel err split "
              f"{acc.get(False, {}).get('max_rel_err_above_rms', float('nan')):.2e} / fast "
              f"{acc.get(True, {}).get('max_rel_err_above_rms', float('nan')):.2e}", flush=True)
        rows.append(row)
    return rows


def blockwise(m: int, k: int, n: int, repeats: int) -> dict:
    """The blockwise recipe's fprop (1x128 x 128x128, cuBLAS via ``F.scaled_mm``) with and without
    ``use_fast_accum``: time, and whether the bits differ."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
    from fp8kit.fp8.blockwise import quantize_act_fprop, quantize_weight

    f = torch.nn.functional
    torch.manual_seed(0)
    q, s_t = quantize_act_fprop(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    wq, ws, _, _ = quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)

    def mm(fast: bool) -> torch.Tensor:
        return f.scaled_mm(q, wq.t(), scale_a=s_t.t(), scale_recipe_a=f.ScalingType.BlockWise1x128,
                           scale_b=ws.t(), scale_recipe_b=f.ScalingType.BlockWise128x128,
                           output_dtype=torch.bfloat16, use_fast_accum=fast)

    row: dict = {"gemm": "blockwise fprop", "M": m, "K": k, "N": n}
    try:
        same = torch.equal(mm(False), mm(True))
    except RuntimeError as e:  # a torch that refuses the flag for blockwise scaling
        row["error"] = str(e).splitlines()[0]
        print(f"blockwise fprop {m}x{k}x{n}: use_fast_accum=True refused: {row['error']}", flush=True)
        return row
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for fast in (False, True):
            times[fast].append(timed(lambda: mm(fast)))
    med = {fl: statistics.median(v) for fl, v in times.items()}
    row |= {"split_ms": med[False], "fast_ms": med[True], "same_bits": same}
    print(f"blockwise fprop {m}x{k}x{n}: split {med[False]:.3f} ms, fast {med[True]:.3f} ms, same bits {same}",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blockwise-only", action="store_true", help="only the blockwise fprop GEMM")
    args = ap.parse_args()
    rows = [] if args.blockwise_only else [
        r for name, (k, n) in SHAPES.items() for r in measure(name, args.tokens, k, n, args.repeats)]
    block = blockwise(args.tokens, 4096, 14336, args.repeats)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows, "blockwise": block}, indent=1))
    if not rows:
        return
    counts = {"gate/up": 2}
    for gemm in ("fprop", "dgrad", "wgrad"):
        split = sum(r["split_ms"] * counts.get(r["linear"], 1) for r in rows if r["gemm"] == gemm and r["linear"] != "head")
        fast = sum(r["fast_ms"] * counts.get(r["linear"], 1) for r in rows if r["gemm"] == gemm and r["linear"] != "head")
        print(f"per 8B block, {gemm}: split {split:.3f} ms, fast {fast:.3f} ms (x8 blocks: {8 * (split - fast):.2f} ms saved)")


if __name__ == "__main__":
    main()
