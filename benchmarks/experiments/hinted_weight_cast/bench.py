# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""The expert weights' two FP8 copies with the previous step's scales as hints (``moe.rowwise_weights_triton``)
against the two-kernel cast (``moe.rowwise_quant_triton.quantize_experts_dual``), at the expert shapes of Qwen3-30B-A3B,
DeepSeek-V3 (64 of its experts) and Mixtral-8x7B.

For each weight: ``w`` (bf16, std 0.02 with a few larger elements) is cast once for the hints; then one optimizer-like
update ``w + lr * sign(noise)`` (``--lr``, AdamW's step size at the start of training) is cast with those hints, and
checked bit for bit against the two-kernel cast of the same weights. Prints the rows and columns whose scale moved
(those the fix kernel recasts), and the device ms of: the two-kernel cast, the hinted cast with exact hints (the
benchmark loop of ``moe_layer.py``: weights that never change) for each tile of the one-pass kernel, and the hinted
cast after the update. CUDA-graph timing (``graph_timing.timed``).

    python benchmarks/experiments/hinted_weight_cast/bench.py --out /tmp/hinted.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_timing import same_bits, timed  # noqa: E402

from fp8kit.moe import rowwise_quant_triton as rqt  # noqa: E402
from fp8kit.moe import rowwise_weights_triton as rwt  # noqa: E402

SHAPES = {
    "qwen3 gate_up": (128, 1536, 2048), "qwen3 down": (128, 2048, 768),
    "dsv3 gate_up": (64, 4096, 7168), "dsv3 down": (64, 7168, 2048),
    "mixtral gate_up": (8, 28672, 4096), "mixtral down": (8, 4096, 14336),
}
TILES = [(64, 128, 8), (64, 128, 4), (128, 128, 8), (64, 64, 4), (128, 64, 4), (32, 128, 4), (128, 64, 8),
         (64, 256, 8), (32, 256, 4)]


def weights(shape, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(*shape, generator=g, device="cuda") * 0.02
    idx = torch.randint(0, w.numel(), (w.numel() // 1000,), generator=g, device="cuda")
    w.view(-1)[idx] *= 4.0
    return w.to(torch.bfloat16)


def measure(name: str, shape: tuple[int, int, int], lr: float) -> dict:
    w0 = weights(shape, 1)
    _, h_rows, _, h_cols = rqt.quantize_experts_dual(w0)
    g = torch.Generator(device="cuda").manual_seed(2)
    w = (w0.float() + lr * torch.randn(shape, generator=g, device="cuda").sign()).to(torch.bfloat16)
    del w0
    ref = rqt.quantize_experts_dual(w)
    *got, fixed = rwt.quantize_experts_dual_hinted(w, h_rows, h_cols)
    assert same_bits(tuple(got), ref), f"{name}: hinted cast after the update differs from the two-kernel cast"
    exact = (ref[1], ref[3])
    r = {"weight": name, "shape": shape, "rows_moved": int(fixed[0]), "cols_moved": int(fixed[1]),
         "rows": shape[0] * shape[1], "cols": shape[0] * shape[2]}
    r["two_kernel_ms"] = timed(lambda: rqt.quantize_experts_dual(w))
    r["tiles"] = {}
    for tile in TILES:
        *got, fixed = rwt.quantize_experts_dual_hinted(w, *exact, tile=tile)
        assert same_bits(tuple(got), ref) and fixed.sum() == 0, f"{name} tile {tile}"
        r["tiles"][str(tile)] = timed(lambda: rwt.quantize_experts_dual_hinted(w, *exact, tile=tile))
    best = min(r["tiles"], key=r["tiles"].get)
    r["hinted_exact_ms"] = r["tiles"][str((rwt._BN, rwt._BK, rwt._WARPS))]
    r["hinted_after_update_ms"] = timed(lambda: rwt.quantize_experts_dual_hinted(w, h_rows, h_cols))
    r["best_tile"] = best
    r["tb_s"] = {"two_kernel": 6 * w.numel() / r["two_kernel_ms"] / 1e9,
                 "hinted_exact": 4 * w.numel() / r["hinted_exact_ms"] / 1e9}
    print(f"{name:16s} {shape}: scales moved in {r['rows_moved']}/{r['rows']} rows, {r['cols_moved']}/{r['cols']} "
          f"cols (lr {lr}); two-kernel {r['two_kernel_ms']:.3f} ms ({r['tb_s']['two_kernel']:.2f} TB/s), hinted "
          f"exact {r['hinted_exact_ms']:.3f} ms ({r['tb_s']['hinted_exact']:.2f} TB/s), after the update "
          f"{r['hinted_after_update_ms']:.3f} ms; best tile {best} {r['tiles'][best]:.3f} ms", flush=True)
    print("   tiles: " + ", ".join(f"{k} {v:.3f}" for k, v in r["tiles"].items()), flush=True)
    torch.cuda.empty_cache()
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    rows = [measure(name, SHAPES[name], args.lr) for name in args.shapes.split(",")]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "lr": args.lr}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
