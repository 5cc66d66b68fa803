"""Experiment: the dispatch's gather + rowwise cast (and the combine backward's weighted one) as a *scatter* over
tokens: each token row read once, cast, and stored at its top-k rows, instead of each of the P rows read through
the gather index (every token read top-k times). Padding rows are zeroed by the same launch's tail programs.

Prints device ms (CUDA graphs, ``graph_timing.timed``) of the current gather kernel and the scatter kernel at
Qwen3-30B-A3B / DeepSeek-V3 / Mixtral token shapes, and whether they give the same bits.

    python benchmarks/experiments/scatter_rows/bench.py [model prefixes, comma-separated]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graph_timing import same_bits, timed  # noqa: E402

from fp8kit.moe import rowwise_quant_triton as K  # noqa: E402
from fp8kit.moe.routing import combine_row_weights, dispatch, row_pairs  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    shapes = {"qwen3-30b-a3b": (16384, 2048, 128, 8), "deepseek-v3": (16384, 7168, 128, 8),
              "mixtral-8x7b": (16384, 4096, 8, 2), "qwen1.5-moe-a2.7b (top-4)": (16384, 2048, 60, 4)}
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    print("| model | op | gather ms | scatter ms | ratio | same bits |")
    print("|---|---|---|---|---|---|")
    for name, (t, h, e, topk) in shapes.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        src = torch.randn(t, h, device="cuda", dtype=torch.bfloat16) * torch.rand(t, 1, device="cuda") * 4
        logits = torch.randn(t, e, device="cuda")
        w, ids = logits.softmax(-1).topk(topk, dim=-1)
        d = dispatch(ids, e)
        pr = d.pair_rows.contiguous()
        for op in ("gather", "gather+rows", "weighted", "weighted+rows"):
            weighted, keep = op.startswith("weighted"), op.endswith("+rows")
            if weighted:
                token, w_row = combine_row_weights(row_pairs(d.pair_rows, d.rows), w)
                old = lambda: K.gather_quantize_rows(src, token, weight=w_row, keep_rows=keep)  # noqa: E731,B023
                wp = w.reshape(-1).contiguous()
                new = lambda: K.scatter_quantize_rows(src, d.gather_idx, pr, weight=wp, keep_rows=keep)  # noqa
            else:
                old = lambda: K.gather_quantize_rows(src, d.gather_idx, keep_rows=keep)  # noqa: E731,B023
                new = lambda: K.scatter_quantize_rows(src, d.gather_idx, pr, keep_rows=keep)  # noqa: E731,B023
            a, b = old(), new()
            ok = same_bits(tuple(x for x in a if x is not None), tuple(x for x in b if x is not None))
            to, tn = timed(old), timed(new)
            print(f"| {name} | {op} | {to:.3f} | {tn:.3f} | {to / tn:.2f}x | {ok} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
