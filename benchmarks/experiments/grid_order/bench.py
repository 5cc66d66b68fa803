# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""The expert weights' hinted one-pass cast (``moe.rowwise_weights_triton``) with its programs in two orders:
experts first (grid ``(E, N / BN, K / BK)``: consecutive programs read different experts) and tiles along K first
(grid ``(K / BK, N / BN, E)``: consecutive programs read consecutive pieces of the same rows). Same tiles, same bits
(checked against the two-kernel cast); CUDA-graph timing, the two orders interleaved over ``--repeats`` rounds.

    python benchmarks/experiments/grid_order/bench.py --out /tmp/grid_order.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hinted_weight_cast"))

from bench import SHAPES, weights  # noqa: E402  (hinted_weight_cast/bench.py)
from graph_timing import same_bits, timed  # noqa: E402

from fp8kit.moe import rowwise_quant_triton as rqt  # noqa: E402
from fp8kit.moe import rowwise_weights_triton as rwt  # noqa: E402

TILES = [(64, 128, 4), (64, 128, 8), (128, 128, 8), (32, 128, 4)]


def measure(name: str, shape: tuple[int, int, int], repeats: int) -> dict:
    w = weights(shape, 1)
    ref = rqt.quantize_experts_dual(w)
    hints = (ref[1], ref[3])
    times: dict[str, list[float]] = {}
    for tile in TILES:
        for kf in (False, True):
            *got, fixed = rwt.quantize_experts_dual_hinted(w, *hints, tile=tile, k_fastest=kf)
            assert same_bits(tuple(got), ref) and int(fixed.sum()) == 0, f"{name} {tile} k_fastest={kf}: bits differ"
    for _ in range(repeats):
        for tile in TILES:
            for kf in (False, True):
                times.setdefault(f"{tile} {'K first' if kf else 'E first'}", []).append(
                    timed(lambda: rwt.quantize_experts_dual_hinted(w, *hints, tile=tile, k_fastest=kf)))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{name:16s} {shape}: " + ", ".join(f"{k} {v:.3f} ms ({4 * w.numel() / v / 1e9:.2f} TB/s)"
                                                  for k, v in med.items()), flush=True)
    torch.cuda.empty_cache()
    return {"weight": name, "shape": shape, "ms": med, "runs": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    rows = [measure(name, SHAPES[name], args.repeats) for name in args.shapes.split(",")]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "bytes_per_element": 4}
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
