"""The MoE routing's gather-reduce kernels (``moe/routing.py``) as Inductor compiles them, written two ways:

- ``reduce``: the committed form, ``rows[pair_rows].view(T, topk, H)`` reduced over ``topk`` (Inductor emits a
  persistent reduction whose reduction axis, topk, is the fastest-varying one of its tile);
- ``loop``: the same sum as a Python loop over the ``topk`` columns of ``pair_rows`` (``topk`` is a host constant),
  which Inductor emits as one pointwise kernel reading ``topk`` gathered rows, each load contiguous along ``H``.

Timed with ``triton.testing.do_bench`` (median; each function compiled once per shape, ``torch._dynamo.reset()``
between shapes) at the token / expert shapes of ``benchmarks/moe_layer.py``; each ``loop`` result compared with
``reduce`` (float32 sums in another order: equal up to the last bf16 bit).

    python benchmarks/experiments/routing_loops/bench.py --out /tmp/routing_loops.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))

from fp8kit.moe.routing import dispatch  # noqa: E402

MODELS = {"qwen3-30b-a3b": (128, 8, 2048), "deepseek-v3": (128, 8, 7168), "mixtral-8x7b": (8, 2, 4096)}
TOKENS = 16384


def combine_reduce(rows, pair_rows, w):
    t, k = w.shape
    picked = rows[pair_rows].view(t, k, rows.shape[1])
    return (picked.float() * w.float()[..., None]).sum(dim=1).to(rows.dtype)


def combine_loop(rows, pair_rows, w):
    t, k = w.shape
    pr = pair_rows.view(t, k)
    acc = rows[pr[:, 0]].float() * w[:, 0, None].float()
    for j in range(1, k):
        acc = acc + rows[pr[:, j]].float() * w[:, j, None].float()
    return acc.to(rows.dtype)


def sum_reduce(rows, pair_rows, k):
    return rows[pair_rows].view(-1, k, rows.shape[1]).sum(dim=1, dtype=torch.float32).to(rows.dtype)


def sum_loop(rows, pair_rows, k):
    pr = pair_rows.view(-1, k)
    acc = rows[pr[:, 0]].float()
    for j in range(1, k):
        acc = acc + rows[pr[:, j]].float()
    return acc.to(rows.dtype)


def wgrad_reduce(rows, pair_rows, grad, k):
    picked = rows[pair_rows].view(-1, k, rows.shape[1])
    return (picked.float() * grad.float()[:, None, :]).sum(dim=-1).to(rows.dtype)


def wgrad_loop(rows, pair_rows, grad, k):
    pr = pair_rows.view(-1, k)
    g = grad.float()
    return torch.stack([(rows[pr[:, j]].float() * g).sum(dim=-1) for j in range(k)], dim=1).to(rows.dtype)


def main() -> None:
    from triton.testing import do_bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": TOKENS, "rows": []}
    for name, (e, k, h) in MODELS.items():
        torch._dynamo.reset()
        gen = torch.Generator(device="cpu").manual_seed(0)
        idx = torch.rand(TOKENS, e, generator=gen).argsort(dim=1)[:, :k].cuda()
        d = dispatch(idx, e)
        rows = torch.randn(d.rows, h, device="cuda", dtype=torch.bfloat16)
        w = torch.softmax(torch.randn(TOKENS, k, device="cuda"), -1).to(torch.bfloat16)
        grad = torch.randn(TOKENS, h, device="cuda", dtype=torch.bfloat16)
        gather_bytes = TOKENS * k * h * 2
        cases = {
            "combine": (combine_reduce, combine_loop, (rows, d.pair_rows, w), gather_bytes + TOKENS * h * 2),
            "sum_token_rows": (sum_reduce, sum_loop, (rows, d.pair_rows, k), gather_bytes + TOKENS * h * 2),
            "combine_weights_grad": (wgrad_reduce, wgrad_loop, (rows, d.pair_rows, grad, k),
                                     gather_bytes + TOKENS * h * 2),
        }
        for case, (ref_fn, loop_fn, fn_args, nbytes) in cases.items():
            row = {"model": name, "case": case, "min_bytes": nbytes}
            outs = {}
            for label, fn in (("reduce", ref_fn), ("loop", loop_fn)):
                c = torch.compile(fn)
                outs[label] = c(*fn_args)
                ms = do_bench(lambda c=c, a=fn_args: c(*a), warmup=25, rep=200, return_mode="median")
                row[label] = {"ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 3)}
            diff = (outs["loop"].float() - outs["reduce"].float()).abs()
            row["max_abs_diff"] = float(diff.max())
            row["frac_differing"] = float((diff > 0).float().mean())
            print(row, flush=True)
            rec["rows"].append(row)
        Path(args.out).write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
