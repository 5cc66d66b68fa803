# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""The scatter dispatch kernel (``moe/rowwise_quant_triton._scatter_rows_kernel``) at several tiles: token rows per
program x warps (``_scatter_tile``, the shipped tile; before session 27 ``_row_blocks``'s one row on 4 warps at
Qwen3's hidden size, 8 at DeepSeek-V3's). At Qwen3-30B-A3B shapes the layer spent 0.85 ms in this kernel's three
calls (session 24's profile, docs/benchmarks.md section 4): the forward dispatch cast, the combine backward's weighted
cast with its bf16 rows, and the bf16 rows alone for the wgrad. For the casts the gather kernel (the dispatch's path
below ``SCATTER_MIN_TOPK``; its per-row weights computed outside the timing) is timed too. Every tile and the gather
are checked bit for bit against tile (1, 1). Device ms, CUDA graphs (``graph_timing.timed``), random top-k routing,
16384 tokens:

    python benchmarks/experiments/scatter_rows/tiles.py --out /tmp/scatter_tiles.json [--models qwen3,deepseek,mixtral]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graph_timing import same_bits, timed  # noqa: E402

from fp8kit.moe import rowwise_quant_triton as K  # noqa: E402
from fp8kit.moe.routing import dispatch  # noqa: E402
from fp8kit.moe.rowwise_quant import _row_weights  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (16384, 2048, 128, 8), "deepseek-v3": (16384, 7168, 128, 8),
          "mixtral-8x7b": (16384, 4096, 8, 2)}
TILES = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (4, 2), (4, 4)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3,deepseek,mixtral")
    ap.add_argument("--reps", type=int, default=10, help="calls per CUDA graph")
    args = ap.parse_args()
    torch.manual_seed(0)
    out = []
    for name, (t, h, e, topk) in SHAPES.items():
        if not any(name.startswith(m) for m in args.models.split(",")):
            continue
        src = torch.randn(t, h, device="cuda", dtype=torch.bfloat16) * torch.rand(t, 1, device="cuda") * 4
        w, ids = torch.randn(t, e, device="cuda").softmax(-1).topk(topk, dim=-1)
        d = dispatch(ids, e)
        pr, wp = d.pair_rows.contiguous(), w.reshape(-1).contiguous()
        ops = {"cast": dict(), "weighted cast + rows": dict(weight=wp, keep_rows=True), "rows": dict(cast=False)}
        for op, kw in ops.items():
            cast = kw.get("cast", True)
            ref = [x for x in K.scatter_quantize_rows(src, d.gather_idx, pr, tile=TILES[0], **kw) if x is not None]
            row = {"model": name, "op": op, "row_blocks": str(K._row_blocks(h)[::3]),
                   "shipped": str(K._scatter_tile(K._row_blocks(h)[1])), "ms": {}, "same_bits": {}}
            if cast:  # the gather kernel (the dispatch's choice below SCATTER_MIN_TOPK), the same bits
                w_row = None if "weight" not in kw else _row_weights(wp, pr, d.gather_idx.shape[0])
                def g():
                    return K.gather_quantize_rows(src, d.gather_idx, weight=w_row, keep_rows=kw.get("keep_rows", False))
                row["same_bits"]["gather"] = same_bits(tuple(g()), tuple(ref))
                row["ms"]["gather"] = timed(g, reps=args.reps)
            for tile in TILES:
                got = [x for x in K.scatter_quantize_rows(src, d.gather_idx, pr, tile=tile, **kw) if x is not None]
                row["same_bits"][str(tile)] = same_bits(tuple(got), tuple(ref))
                row["ms"][str(tile)] = timed(lambda: K.scatter_quantize_rows(src, d.gather_idx, pr, tile=tile, **kw),
                                             reps=args.reps)
            out.append(row)
            print(f"{name} {op} (shipped {row['shipped']}, _row_blocks {row['row_blocks']}): "
                  + ", ".join(f"{k} {v:.3f}{'' if row['same_bits'][k] else ' BITS DIFFER'}"
                              for k, v in row["ms"].items()), flush=True)
            Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                                  "rows": out}, indent=1))  # after each row: a cut run keeps it
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
