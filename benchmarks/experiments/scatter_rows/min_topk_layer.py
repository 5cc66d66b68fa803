"""The whole Mixtral-8x7B expert layer (``benchmarks/moe_layer.py``'s ``rowwise-fused-auto``, forward + backward) with
the dispatch casts' kernel chosen at top-2 either way: ``rowwise_quant.SCATTER_MIN_TOPK`` 4 (top-2 gathers, the
rule before session 30) and 2 (top-2 scatters), interleaved ``--repeats`` times on one GPU. For each setting: the
layer's ``do_bench`` median and every kernel's device time from ``torch.profiler`` (three steps, per step), so the
dispatch kernels (``_gather_rows_kernel`` / ``_scatter_rows_kernel``) can be compared inside the layer, where the
gather's re-reads are partly served from L2 (session 24):

    python benchmarks/experiments/scatter_rows/min_topk_layer.py --out /tmp/min_topk.json [--model mixtral-8x7b]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
import moe_layer  # noqa: E402

from fp8kit.moe import rowwise_quant as R  # noqa: E402


def kernels(step, steps: int = 3) -> dict:
    """``{kernel name: [device ms per step, calls per step]}`` over ``steps`` profiled steps."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if us and not ev.key.startswith("ProfilerStep"):
            out[ev.key[:100]] = [round(us / steps / 1e3, 4), ev.count // steps]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="mixtral-8x7b")
    ap.add_argument("--settings", default="4,2", help="SCATTER_MIN_TOPK values, in the order of each repeat")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    moe_layer.profile_split = kernels  # measure_model's profile hook: every kernel, not the grouped split
    rows = []
    for rep in range(args.repeats):
        for setting in (int(s) for s in args.settings.split(",")):
            R.SCATTER_MIN_TOPK = setting
            rec = moe_layer.measure_model(args.model, ["rowwise-fused-auto"], torch.device("cuda"), True)
            r = rec["variants"]["rowwise-fused-auto"]
            prof = r.pop("profile", {})
            dispatch = {k: v for k, v in prof.items() if "scatter_rows" in k or "gather_rows" in k}
            rows.append({"scatter_min_topk": setting, "repeat": rep, "ms": r.get("ms"), "error": r.get("error"),
                         "kernel_sum_ms": round(sum(v[0] for v in prof.values()), 3), "dispatch_kernels": dispatch,
                         "kernels": prof})
            print(f"SCATTER_MIN_TOPK={setting} repeat {rep}: layer {r.get('ms')} ms, dispatch kernels {dispatch}",
                  flush=True)
            Path(args.out).write_text(json.dumps({  # after each row: a cut run keeps what it measured
                "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
