"""Tile sweep of the expert-weight amax kernel (``moe/rowwise_quant_triton._experts_amax_kernel``), H100.

The fused MoE experts cast each expert weight ``(E, N, K)`` into two rowwise E4M3 copies (fprop: per-row scales,
dgrad: per-column scales) with two kernels: an amax pass (row amax, column amax by atomic max) and a cast pass.
This times the amax pass alone at the Qwen3-30B-A3B, DeepSeek-V3 (128 experts) and Mixtral-8x7B expert shapes for
tiles ``BN x BK`` and warp counts, checks every setting gives the same bits as the shipped one, and reports the
read bandwidth (bf16 weights, randn). ``triton.testing.do_bench`` medians.

    python benchmarks/expert_amax_tiles.py --out benchmarks/results/expert_amax_tiles_h100.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import fp8kit.moe.rowwise_quant_triton as k  # noqa: E402

SHAPES = {"qwen3-30b-a3b up": (128, 1536, 2048), "qwen3-30b-a3b down": (128, 2048, 768),
          "deepseek-v3 up": (128, 4096, 7168), "deepseek-v3 down": (128, 7168, 2048),
          "mixtral-8x7b up": (8, 28672, 4096), "mixtral-8x7b down": (8, 4096, 14336)}


def amax(w: torch.Tensor, bn: int, bk: int, warps: int) -> tuple[torch.Tensor, ...]:
    import triton

    e, n, kk = w.shape
    row, col, inv = (torch.empty(e, n, device="cuda"), torch.zeros(e, kk, device="cuda"),
                     torch.empty(e, n, device="cuda"))
    k._experts_amax_kernel[(e, triton.cdiv(n, bn))](w, row, col, inv, n, kk, w.stride(0), w.stride(1), BN=bn, BK=bk,
                                                     num_warps=warps, **k._KW)
    return row, col, inv


def main() -> None:
    import triton.testing as tt

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    shipped = (k._AMAX_BN, k._AMAX_BK, k._AMAX_WARPS)
    weights = {name: torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for name, shape in SHAPES.items()}
    refs = {name: amax(w, *shipped) for name, w in weights.items()}
    rows = []
    for bn, bk, warps in itertools.product((32, 64, 128, 256, 512), (32, 64, 128, 256), (4, 8)):
        if bn * bk > 32768:
            continue
        line = f"BN {bn:>3} BK {bk:>3} warps {warps}:"
        for name, w in weights.items():
            same = all(torch.equal(a, b) for a, b in zip(amax(w, bn, bk, warps), refs[name], strict=True))
            ms = tt.do_bench(lambda w=w, bn=bn, bk=bk, warps=warps: amax(w, bn, bk, warps), warmup=5, rep=100)
            rows.append({"BN": bn, "BK": bk, "warps": warps, "shape": name, "ms": ms,
                         "tb_per_s": w.numel() * w.element_size() / ms / 1e9, "same_bits": same})
            line += f"  {name} {ms:.3f} ms ({rows[-1]['tb_per_s']:.2f} TB/s){'' if same else ' DIFFERENT BITS'}"
        print(line, flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shipped": shipped,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
