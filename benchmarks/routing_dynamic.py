"""The MoE routing helpers compiled for static shapes vs after a recompile with a dynamic row count (run on a GPU).

Under expert parallelism the rows a rank receives change every step, so the helpers of ``moe/routing.py`` and
``moe/fused_experts.py`` that ``base.cuda_compile.compiled_on_cuda`` compiles see a new row count each step:
Dynamo compiles them for the first shape, then once more with that dimension symbolic ("automatic dynamic")
and keeps that graph. Session 16 saw some of these kernels run up to 6x slower after a recompile, but there every
dimension had changed (one process ran three models), which also made the hidden size symbolic. This script
measures the case a real EP run meets, each helper at one shape in three compiles:

- ``static``: compiled for this shape only;
- ``rows-dynamic``: first called with other row counts (same hidden size), so the row dimension became dynamic;
- ``all-dynamic``: ``torch.compile(dynamic=True)``: every dimension symbolic (the session-16 benchmark artifact).

Timing: ``triton.testing.do_bench`` median over 200 ms, inputs from ``randn`` / random routing.

    python benchmarks/routing_dynamic.py --out benchmarks/results/routing_dynamic_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fp8kit.moe import routing  # noqa: E402
from fp8kit.moe.fused_experts import swiglu_backward  # noqa: E402

# name -> (hidden, topk, expert width)
MODELS = {"qwen3-30b-a3b": (2048, 8, 768), "deepseek-v3": (7168, 8, 2048)}
TOKENS = 16384


def _inputs(tokens: int, hidden: int, topk: int, width: int, dev: str) -> dict[str, tuple]:
    """Each helper's arguments at ``tokens`` (pairs = tokens x topk; rows = pairs: no padding needed here)."""
    s = tokens * topk
    perm = torch.randperm(s, device=dev)
    x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
    rows = torch.randn(s, hidden, device=dev, dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(tokens, topk, device=dev), -1).to(torch.bfloat16)
    gather_idx = torch.div(perm, topk, rounding_mode="floor")
    h = torch.randn(s, 2 * width, device=dev, dtype=torch.bfloat16)
    da = torch.randn(s, width, device=dev, dtype=torch.bfloat16)
    return {
        "gather_rows": (x, gather_idx),
        "sum_token_rows": (rows, perm, topk, torch.bfloat16),  # topk as routing.sum_token_rows passes it
        "combine_rows": (rows, perm, w, torch.bfloat16),
        "combine_rows_grad": (x, w, routing.row_pairs(perm, s), torch.bfloat16),
        "combine_weights_grad": (rows, perm, x, topk, torch.bfloat16),
        "swiglu_backward": (h, da),
    }


HELPERS = {
    "gather_rows": routing.gather_rows.eager,
    "sum_token_rows": routing._sum_topk_rows.eager,  # the compiled part of routing.sum_token_rows
    "combine_rows": routing.combine_rows.eager,
    "combine_rows_grad": routing.combine_rows_grad.eager,
    "combine_weights_grad": routing.combine_weights_grad.eager,
    "swiglu_backward": swiglu_backward.eager,
}


def _bench(fn, args) -> float:
    from triton.testing import do_bench

    return float(do_bench(lambda: fn(*args), warmup=50, rep=200, return_mode="median"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default=",".join(MODELS))
    a = ap.parse_args()
    dev = "cuda"
    rec = {"device": torch.cuda.get_device_name(), "versions": {"torch": torch.__version__},
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "tokens": TOKENS, "rows": []}
    try:
        import triton
        rec["versions"]["triton"] = triton.__version__
    except ImportError:
        pass
    for model in a.models.split(","):
        hidden, topk, width = MODELS[model]
        args = _inputs(TOKENS, hidden, topk, width, dev)
        other = [_inputs(t, hidden, topk, width, dev) for t in (TOKENS - 512, TOKENS - 1024)]
        for name, fn in HELPERS.items():
            row = {"model": model, "helper": name}
            torch._dynamo.reset()
            static = torch.compile(fn)
            ref = static(*args[name])
            row["static_ms"] = _bench(static, args[name])
            torch._dynamo.reset()
            dyn = torch.compile(fn)
            for o in other:  # the second distinct row count makes Dynamo recompile with a symbolic row count
                dyn(*o[name])
            out = dyn(*args[name])
            row["rows_dynamic_ms"] = _bench(dyn, args[name])
            torch._dynamo.reset()
            alld = torch.compile(fn, dynamic=True)
            alld(*args[name])
            row["all_dynamic_ms"] = _bench(alld, args[name])
            row["rows_dynamic_equal_static"] = bool(torch.equal(ref, out))
            row["rows_dynamic_vs_static"] = row["rows_dynamic_ms"] / row["static_ms"]
            row["all_dynamic_vs_static"] = row["all_dynamic_ms"] / row["static_ms"]
            print(f"{model:14s} {name:22s} static {row['static_ms']:.3f} ms  rows-dynamic "
                  f"{row['rows_dynamic_ms']:.3f} ({row['rows_dynamic_vs_static']:.2f}x)  all-dynamic "
                  f"{row['all_dynamic_ms']:.3f} ({row['all_dynamic_vs_static']:.2f}x)  equal={row['rows_dynamic_equal_static']}",
                  flush=True)
            rec["rows"].append(row)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
