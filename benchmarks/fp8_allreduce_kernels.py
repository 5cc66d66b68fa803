"""Block size and warps of the FP8 all-reduce's Triton passes (``fp8kit.comm.allreduce_triton``), one GPU.

    python benchmarks/fp8_allreduce_kernels.py --numel 32M --out DIR

Times ``quantize_stats`` (delayed scaling's pass: reads a bf16 gradient, writes FP8 + statistics partials) and
``gather_mean`` (reads 2 ranks' FP8 rows, writes the bf16 mean) with every ``BLOCK`` x ``num_warps`` of the
grid below (``triton.testing.do_bench`` medians, realistic gradients, never zeros) and reports HBM bandwidth
(bytes read + written / time) against the module's current setting. The GPU's peak is the bound (H200: 4.8
TB/s; H100 SXM: 3.35 TB/s).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from fp8kit.comm import allreduce_triton as K
from fp8kit.comm.autoscale import AutoScaleState, gather_row_bytes
from fp8kit.comm.unify import params_tensor

BLOCKS = (1024, 2048, 4096, 8192, 16384)
WARPS = (4, 8, 16)


def _numel(text: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * mult[text[-1].upper()]) if text[-1].upper() in mult else int(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", default="32M")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n = _numel(args.numel)
    dev = torch.device("cuda")
    g = (torch.randn(n, device=dev) * 1e-3).bfloat16()
    values = torch.tensor([1.0e6, 0, 0, 0, 1, 0], dtype=torch.float64, device=dev)
    params = params_tensor(AutoScaleState(), dev)
    row = gather_row_bytes(n)
    q = torch.empty(row, dtype=torch.uint8, device=dev).view(torch.float8_e5m2)
    vec = torch.empty(4, dtype=torch.float64, device=dev)
    K.quantize_stats(g, values, params, q, vec, 57344.0)
    rows = torch.cat([q.view(torch.uint8), q.view(torch.uint8)]).view(torch.float8_e5m2)
    scale = torch.tensor([1.0e6], device=dev)
    out = torch.empty(n, dtype=torch.bfloat16, device=dev)
    cases = {
        "quantize_stats": (lambda: K.quantize_stats(g, values, params, q, vec, 57344.0), 2 * n + row),
        "gather_mean": (lambda: K.gather_mean(rows, scale, out, 2, row, 0.5), 2 * row + 2 * n),
    }
    default = (K.BLOCK, K.NUM_WARPS)
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
           "numel": n, "default": default, "results": []}
    for name, (fn, nbytes) in cases.items():
        for block in BLOCKS:
            for warps in WARPS:
                K.BLOCK, K.NUM_WARPS = block, warps
                ms = triton.testing.do_bench(fn, warmup=25, rep=100)
                res["results"].append({"kernel": name, "block": block, "warps": warps, "ms": ms,
                                       "tb_s": nbytes / ms / 1e9})
                mark = "  <- current" if (block, warps) == default else ""
                print(f"{name:15s} BLOCK {block:6d} warps {warps:2d}: {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:5.2f} TB/s"
                      f"{mark}", flush=True)
        K.BLOCK, K.NUM_WARPS = default
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_allreduce_kernels.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
