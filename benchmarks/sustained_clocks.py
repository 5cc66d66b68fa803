"""Does a linear's FP8 forward + backward lose its clock under sustained load? (run on a Hopper GPU)

``linear_fwd_bwd.py`` times a CUDA-graph replay for about 150 ms (``do_bench``), while ``torch.profiler`` sums a
few eager iterations: at 16384x4096x14336 the two disagree (blockwise: 5.73 ms timed, 5.07 ms of kernels;
``docs/benchmarks.md`` section 6, session 17). This script replays one variant's captured forward + backward
back to back for ``--seconds``, records the time of every ``--batch`` replays with CUDA events, and samples the
GPU's SM clock, power draw and throttle reasons with ``nvidia-smi`` (every 20 ms) over the same interval. It
prints, per variant, the ms per replay in the first and last windows and the clock and power there, so the
GPU's sustained clock (power / thermal limit) can be told from a software cost.

    python benchmarks/sustained_clocks.py --out DIR --shape 16384x4096x14336 --variants bf16,ao_tensorwise,fp8kit_wgrad2d
    python benchmarks/plot_sustained_clocks.py DIR --png PNG   # burst / steady medians and the figure
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from linear_fwd_bwd import build, warm_up, weight_of  # noqa: E402
from plot_sustained_clocks import smi_rows  # noqa: E402

QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def sustained(step, seconds: float, batch: int) -> list[tuple[float, float]]:
    """``(wall time at the batch's end, ms per replay)`` for each batch of ``batch`` graph replays."""
    warm_up(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    out = []
    end = time.time() + seconds
    while time.time() < end:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            graph.replay()
        b.record()
        b.synchronize()
        out.append((time.time(), a.elapsed_time(b) / batch))
    del graph
    return out


def window(samples, rows, t0: float, t1: float) -> dict:
    ms = [m for t, m in samples if t0 <= t < t1]
    sm = [r for r in rows if t0 <= r["t"] < t1]
    return {"ms": round(statistics.median(ms), 4) if ms else None,
            "mhz": round(statistics.median(r["mhz"] for r in sm)) if sm else None,
            "watts": round(statistics.median(r["w"] for r in sm)) if sm else None,
            "temp_c": max(r["temp"] for r in sm) if sm else None,
            "reasons": sorted({r["reasons"] for r in sm}) if sm else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for sustained_clocks.json and the nvidia-smi log")
    ap.add_argument("--shape", default="16384x4096x14336", help="MxKxN")
    ap.add_argument("--variants", default="bf16,ao_tensorwise,fp8kit_wgrad2d")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=5, help="replays per timed batch")
    ap.add_argument("--rest", type=float, default=3.0, help="idle seconds between variants (clocks recover)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    m, k, n = (int(v) for v in args.shape.split("x"))
    gpu = torch.cuda.current_device()
    log = out / "nvidia_smi.csv"
    smi = subprocess.Popen(["nvidia-smi", f"--id={gpu}", f"--query-gpu={QUERY}", "--format=csv,noheader",
                            "-lms", "20"], stdout=log.open("w"))
    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        base.weight.copy_(torch.randn(n, k, device=dev) * 0.02)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    runs = {}
    try:
        for v in args.variants.split(","):
            mod = build(v, base)
            w = weight_of(mod)

            def step(mod=mod, w=w):
                return torch.autograd.grad(mod(x), (x, w), dy)

            step()
            torch.cuda.synchronize()
            time.sleep(args.rest)
            runs[v] = sustained(step, args.seconds, args.batch)
            del mod
            torch.cuda.empty_cache()
    finally:
        time.sleep(0.3)
        smi.terminate()
        smi.wait()
    rows = smi_rows(log)
    limits = subprocess.run(["nvidia-smi", f"--id={gpu}", "--query-gpu=power.limit,clocks.max.sm",
                             "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [m, k, n],
              "power_limit_and_max_sm_clock": limits,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "variants": {}}
    flops = 6 * m * k * n
    print(f"{result['device']} ({limits})  {args.shape}  fwd+bwd, CUDA-graph replays back to back")
    print("| variant | first 0.2 s ms | MHz | W | last 1 s ms | MHz | W | TFLOP/s (last) | reasons (last) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v, samples in runs.items():
        t_start, t_end = samples[0][0], samples[-1][0]
        first = window(samples, rows, t_start - 0.05, t_start + 0.2)
        last = window(samples, rows, t_end - 1.0, t_end + 0.01)
        result["variants"][v] = {"first": first, "last": last, "t_start_unix": round(t_start, 3),
                                 "samples": [[round(t - t_start, 4), round(ms, 4)] for t, ms in samples]}
        tf = round(flops / (last["ms"] * 1e9)) if last["ms"] else None
        print(f"| {v} | {first['ms']} | {first['mhz']} | {first['watts']} | {last['ms']} | {last['mhz']} | "
              f"{last['watts']} | {tf} | {' '.join(last['reasons'])} |")
    (out / "sustained_clocks.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
