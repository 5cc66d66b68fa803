"""The whole expert layer (``benchmarks/moe_layer.py``: BF16 vs ``rowwise-fused-auto``, forward + backward) with the
scatter dispatch kernel at several tiles (``rowwise_quant_triton._SCATTER_TILE``; ``rowblocks``: ``_row_blocks``'s
one row on 4-8 warps, the tile before session 27; ``shipped``: ``_scatter_tile``'s). Each tile is measured as a
BF16 / FP8 pair of its own, the tiles interleaved ``--repeats`` times, so each ratio comes from neighbouring timings
on one GPU:

    python benchmarks/experiments/scatter_rows/layer.py --out /tmp/scatter_layer.json \\
        [--models qwen3-30b-a3b,deepseek-v3] [--tiles rowblocks,shipped,1x2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
import moe_layer  # noqa: E402

from fp8kit.moe import rowwise_quant_triton as K  # noqa: E402


def parse_tile(s: str) -> tuple[int, int] | None:
    """``rowblocks`` -> (0, 0); ``shipped`` -> None; ``RxW`` -> (R, W)."""
    if s in ("rowblocks", "shipped"):
        return (0, 0) if s == "rowblocks" else None
    r, w = s.split("x")
    return int(r), int(w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
    ap.add_argument("--tiles", default="rowblocks,shipped")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    shipped = K._SCATTER_TILE
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for name in args.models.split(","):
        runs: dict[str, list[float]] = {t: [] for t in args.tiles.split(",")}
        for _ in range(args.repeats):
            for t in runs:
                K._SCATTER_TILE = parse_tile(t)
                r = moe_layer.measure_model(name, ["bf16", "rowwise-fused-auto"], torch.device("cuda"), False)
                v = r["variants"]
                runs[t].append(v["bf16"]["ms"] / v["rowwise-fused-auto"]["ms"])
                rec["rows"].append({"model": name, "tile": t, "bf16_ms": v["bf16"]["ms"],
                                    "fp8_ms": v["rowwise-fused-auto"]["ms"], "speedup": runs[t][-1]})
                print(name, t, json.dumps(rec["rows"][-1]), flush=True)
                Path(args.out).write_text(json.dumps(rec, indent=1))
        for t, xs in runs.items():
            print(f"{name} tile {t}: speed-up median {statistics.median(xs):.3f} ({', '.join(f'{x:.3f}' for x in xs)})")
    K._SCATTER_TILE = shipped
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
