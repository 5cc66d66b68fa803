# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""The fused experts' row casts (``moe/rowwise_quant_triton.py``: ``_gather_rows_kernel``, the dispatch gather and the
output gradients' dgrad casts; ``_swiglu_rows_kernel``, SwiGLU + the down projection's input cast) timed alone at the
DeepSeek-V3 and Mixtral-8x7B expert shapes of ``benchmarks/moe_layer.py`` for rows per program, chunk width and warps
around the committed choice (``_row_blocks``), each checked bit for bit against the committed launch. CUDA graph of
10 launches, replayed, median of 7 (``benchmarks/experiments/graph_timing.py``).

    python benchmarks/experiments/row_casts/bench.py --out /tmp/row_casts.json
    python benchmarks/experiments/row_casts/bench.py --out /tmp/q.json --models qwen3-30b-a3b --warps 1,2,4,8 --narrow
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_timing import same_bits as same  # noqa: E402
from graph_timing import timed  # noqa: E402

from fp8kit.moe import rowwise_quant_triton as rq  # noqa: E402
from fp8kit.moe.routing import dispatch  # noqa: E402

TOKENS = 16384
FP8 = torch.float8_e4m3fn


def gather(src, index, rows, block, warps):
    t, k = src.shape
    p = index.shape[0]
    q, inv = torch.empty(p, k, dtype=FP8, device=src.device), torch.empty(p, dtype=torch.float32, device=src.device)
    rq._gather_rows_kernel[(triton.cdiv(p, rows),)](src, index, q, inv, t, p, k, src.stride(0), q.stride(0),
                                                     inv.stride(0), inv, q, ROWS=rows, BLOCK_K=block,
                                                     CHUNKS=triton.cdiv(k, block), HAS_W=False, STORE_ROWS=False,
                                                     num_warps=warps, **rq._KW)
    return q, inv


def swiglu(h, rows, block, warps):
    p, i = h.shape[0], h.shape[1] // 2
    a = torch.empty(p, i, dtype=h.dtype, device=h.device)
    q, inv = torch.empty(p, i, dtype=FP8, device=h.device), torch.empty(p, dtype=torch.float32, device=h.device)
    rq._swiglu_rows_kernel[(triton.cdiv(p, rows),)](h, a, q, inv, p, i, h.stride(0), INTERLEAVED=False, ROWS=rows,
                                                     BLOCK_K=block, CHUNKS=triton.cdiv(i, block), num_warps=warps,
                                                     enable_fp_fusion=False, **rq._KW)
    return a, q, inv


def configs(k: int, max_block: int, warps: tuple[int, ...] = (4, 8, 16), narrow: bool = False):
    rows0, block0, _, warps0 = rq._row_blocks(k, max_block)
    blocks = sorted({b for b in (block0 // 2, block0, block0 * 2) if 1024 <= b <= max_block and b // 2 < max(k, 1024)})
    if narrow:
        blocks = [block0]
    out = [(rows0, block0, warps0)]
    for r, b, w in itertools.product((1, 2, 4), blocks, warps):
        if r * b <= 32768 and (r, b, w) not in out:
            out.append((r, b, w))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="deepseek-v3,mixtral-8x7b")
    ap.add_argument("--warps", default="4,8,16", help="warps tried at each rows / chunk width")
    ap.add_argument("--narrow", action="store_true", help="only the committed chunk width")
    args = ap.parse_args()
    warps = tuple(int(w) for w in args.warps.split(","))
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "configs": "ROWS, BLOCK_K, num_warps; the first is the committed _row_blocks choice", "rows": []}
    shapes = {"deepseek-v3": (128, 8, 7168, 2048), "mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768)}
    for name in args.models.split(","):
        e, topk, hdim, inter = shapes[name]
        gen = torch.Generator(device="cpu").manual_seed(0)
        idx = torch.rand(TOKENS, e, generator=gen).argsort(dim=1)[:, :topk].cuda()
        d = dispatch(idx, e)
        p = d.rows
        hidden = torch.randn(TOKENS, hdim, device="cuda", dtype=torch.bfloat16)
        dh = torch.randn(p, 2 * inter, device="cuda", dtype=torch.bfloat16)
        ident = torch.arange(p, device="cuda")
        cases = [("gather x", lambda r, b, w: gather(hidden, d.gather_idx, r, b, w), hdim, rq._MAX_BLOCK_K,
                  p * hdim * 3),
                 ("rows dh", lambda r, b, w: gather(dh, ident, r, b, w), 2 * inter, rq._MAX_BLOCK_K, p * 2 * inter * 3),
                 ("swiglu h", lambda r, b, w: swiglu(dh, r, b, w), inter, rq._MAX_SWIGLU_BLOCK, p * inter * 7)]
        for label, fn, k, max_block, nbytes in cases:
            cfgs = configs(k, max_block, warps, args.narrow)
            ref = fn(*cfgs[0])
            row = {"model": name, "case": label, "P": p, "K": k, "min_bytes": nbytes, "results": []}
            for cfg in cfgs:
                try:
                    ok = same(fn(*cfg), ref)
                    ms = timed(lambda: fn(*cfg), reps=10)
                    r = {"cfg": list(cfg), "ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 3), "bit_equal": ok}
                except Exception as exc:  # noqa: BLE001 - record and go on
                    r = {"cfg": list(cfg), "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
                row["results"].append(r)
            best = min((r for r in row["results"] if "ms" in r), key=lambda r: r["ms"])
            print(name, label, "committed", row["results"][0], "best", best, flush=True)
            rec["rows"].append(row)
            Path(args.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
