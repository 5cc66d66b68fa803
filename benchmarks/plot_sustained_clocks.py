"""Plot and summarize a ``sustained_clocks.py`` run: ms per replay, SM clock and power over time (CPU only).

``sustained_clocks.py --out DIR`` leaves ``DIR/sustained_clocks.json`` (ms per batch of replays, per variant) and
``DIR/nvidia_smi.csv`` (SM clock, power, temperature and throttle reasons every 20 ms). This script reads both,
prints each variant's median ms and speed-up over the first variant in two windows, a burst (the first
``--burst`` seconds, what ``triton.testing.do_bench``'s ~150 ms sees) and the steady state (``--steady`` seconds,
default 1-5 s, the clock a training run holds under the power cap), and draws the figure of
``docs/benchmarks.md``:

    python benchmarks/plot_sustained_clocks.py benchmarks/results/session46/call4/sustained \
        --png docs/img/sustained_clocks_h200.png
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path


def smi_rows(path: Path) -> list[dict]:
    """Rows of an ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,
    clocks_event_reasons.active --format=csv,noheader`` log: ``{"t": unix s, "mhz", "w", "temp", "reasons"}``.
    Lines that are not samples (a header, a cut last line) are skipped."""
    rows = []
    with path.open() as f:
        for r in csv.reader(f):
            if len(r) < 5 or not r[1].strip()[:1].isdigit():
                continue
            stamp = r[0].strip()
            t = time.mktime(time.strptime(stamp.split(".")[0], "%Y/%m/%d %H:%M:%S"))
            t += float("0." + stamp.split(".")[1]) if "." in stamp else 0.0
            rows.append({"t": t, "mhz": float(r[1].split()[0]), "w": float(r[2].split()[0]),
                         "temp": float(r[3]), "reasons": r[4].strip()})
    return rows


def window_ms(samples: list[list[float]], t0: float, t1: float) -> float | None:
    """Median ms per replay of the batches that ended in ``[t0, t1]`` seconds after the variant's first batch."""
    ms = [m for t, m in samples if t0 <= t <= t1]
    return statistics.median(ms) if ms else None


def summary(result: dict, burst: float, steady: tuple[float, float]) -> list[dict]:
    """Per variant: burst and steady medians (ms) and speed-ups over the first variant in the same window."""
    rows = []
    for v, r in result["variants"].items():
        rows.append({"variant": v, "burst_ms": window_ms(r["samples"], 0.0, burst),
                     "steady_ms": window_ms(r["samples"], *steady)})
    base = rows[0]
    for r in rows:
        for key in ("burst", "steady"):
            a, b = base[f"{key}_ms"], r[f"{key}_ms"]
            r[f"{key}_speedup"] = round(a / b, 3) if a and b else None
    return rows


def plot(result: dict, smi: list[dict], rows: list[dict], png: Path, steady: tuple[float, float]) -> None:
    """Two panels: ms per replay against seconds since each variant's first batch (legend: steady speed-up),
    and the SM clock and power draw over the whole script."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, k, n = result["shape"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.2))
    by_name = {r["variant"]: r for r in rows}
    for v, r in result["variants"].items():
        t, ms = zip(*r["samples"], strict=True)
        s = by_name[v]
        top.plot(t, ms, label=f"{v}: {s['steady_ms']:.3f} ms, {s['steady_speedup']:.3f}x (steady)")
    top.axvspan(*steady, color="0.93", zorder=0)
    top.set_xlabel(f"seconds since the variant's first batch (shaded: the steady window {steady[0]:g}-{steady[1]:g} s)")
    top.set_ylabel("ms per forward + backward")
    top.set_title(f"{result['device']}, {m}x{k}x{n} linear, CUDA-graph replays back to back ({result['date'][:10]})")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    if smi:
        t0 = smi[0]["t"]
        ts = [r["t"] - t0 for r in smi]
        bottom.plot(ts, [r["mhz"] for r in smi], color="tab:blue", lw=1, label="SM clock (MHz)")
        bottom.set_ylabel("SM clock, MHz")
        power = bottom.twinx()
        power.plot(ts, [r["w"] for r in smi], color="tab:red", lw=1, label="power (W)")
        limit = result.get("power_limit_and_max_sm_clock", "").split(",")[0].strip()
        power.set_ylabel(f"power draw, W (limit {limit})")
        bottom.legend(loc="upper left", fontsize=8)
        power.legend(loc="upper right", fontsize=8)
    bottom.set_xlabel("seconds (whole script: compile, rest, load, per variant)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a sustained_clocks.py --out folder")
    ap.add_argument("--png", type=Path, help="write the figure here")
    ap.add_argument("--burst", type=float, default=0.2, help="seconds of the burst window (default 0.2)")
    ap.add_argument("--steady", default="1,5", help="start,end seconds of the steady window (default 1,5)")
    args = ap.parse_args()
    path = args.folder / "sustained_clocks.json"
    if not path.is_file():
        raise SystemExit(f"plot_sustained_clocks: no {path} (run benchmarks/sustained_clocks.py --out {args.folder})")
    result = json.loads(path.read_text())
    steady = tuple(float(v) for v in args.steady.split(","))
    if len(steady) != 2 or steady[0] >= steady[1]:
        raise SystemExit(f"plot_sustained_clocks: --steady {args.steady!r} is not 'start,end' with start < end")
    rows = summary(result, args.burst, steady)
    print(f"{result['device']} ({result.get('power_limit_and_max_sm_clock', '')}), shape {result['shape']}, "
          f"{result['date']}")
    print(f"| variant | burst (first {args.burst:g} s) ms | vs {rows[0]['variant']} | steady ({steady[0]:g}-{steady[1]:g} s) "
          f"median ms | vs {rows[0]['variant']} |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['burst_ms']:.4f} | {r['burst_speedup']:.3f}x | {r['steady_ms']:.4f} | "
              f"{r['steady_speedup']:.3f}x |")
    if args.png:
        smi_path = args.folder / "nvidia_smi.csv"
        plot(result, smi_rows(smi_path) if smi_path.is_file() else [], rows, args.png, steady)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
