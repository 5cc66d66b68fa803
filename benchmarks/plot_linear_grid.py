"""Plot ``linear_fwd_bwd.py`` results: each variant's speed-up over BF16 at every shape (CPU only).

Reads one or more ``linear_fwd_bwd.py --out FILE`` JSONs (their ``rows``: ``M``, ``K``, ``N`` and ``ms`` per
variant). Each row's speed-ups are taken over the BF16 time **of the same run** (``ms["bf16"]`` in that row), so
files from different calls can share one figure without comparing times across runs. Shapes are sorted by GEMM
size; a bar per variant, a line at 1.0 (BF16). Prints the table it plots, and for each variant the number of shapes
where it is faster than ``--reference`` (default ``ao_tensorwise``, torchao's tensorwise recipe) in the same row.

    python benchmarks/plot_linear_grid.py benchmarks/results/session51/call1/delayed8.json \
        benchmarks/results/session51/call4/grid10.json --png docs/img/linear_grid_delayed_session51.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: legend labels of the variants ``linear_fwd_bwd.py`` names
LABELS = {
    "ao_tensorwise": "torchao tensorwise",
    "ao_rowwise": "torchao rowwise",
    "ao_blockwise": "torchao blockwise (prototype)",
    "fp8kit_delayed": "fp8kit delayed (default casts)",
    "fp8kit_delayed_grad": "fp8kit delayed, delayed_fused_cast=grad_output",
    "fp8kit_delayed_fused": "fp8kit delayed, delayed_fused_cast=all",
    "fp8kit_blockwise": "fp8kit blockwise",
    "fp8kit_tensorwise": "fp8kit tensorwise",
}


def load_rows(paths: list[Path]) -> tuple[list[dict], dict]:
    """The rows of every file (a shape measured twice keeps its last row) and the first file's metadata
    (``device``, ``torch``, ``date``).

    Raises:
        SystemExit: a file without ``rows``, or a row without a BF16 time (no baseline to divide by).
    """
    rows: dict[tuple[int, int, int], dict] = {}
    meta: dict = {}
    for p in paths:
        data = json.loads(p.read_text())
        if "rows" not in data:
            raise SystemExit(f"{p}: not a linear_fwd_bwd.py result (no 'rows')")
        meta = meta or {k: data.get(k) for k in ("device", "torch", "date")}
        for r in data["rows"]:
            if not r.get("ms", {}).get("bf16"):
                raise SystemExit(f"{p}: shape {r.get('M')}x{r.get('K')}x{r.get('N')} has no bf16 time")
            rows[(r["M"], r["K"], r["N"])] = r
    return [rows[k] for k in sorted(rows, key=lambda s: (s[0] * s[1] * s[2], s))], meta


def speedups(rows: list[dict], variants: list[str]) -> dict[str, list[float | None]]:
    """``{variant: [bf16 ms / variant ms per row]}`` (None where the variant has no time in that row)."""
    return {v: [r["ms"]["bf16"] / r["ms"][v] if r["ms"].get(v) else None for r in rows] for v in variants}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="linear_fwd_bwd.py JSON files")
    ap.add_argument("--variants", default="", help="comma-separated (default: every variant but bf16)")
    ap.add_argument("--reference", default="ao_tensorwise", help="the variant each is counted against")
    ap.add_argument("--png", type=Path, default=None)
    args = ap.parse_args()
    rows, meta = load_rows(args.results)
    found = {v for r in rows for v in r["ms"] if v != "bf16"}
    variants = [v for v in args.variants.split(",") if v] or (
        [v for v in LABELS if v in found] + sorted(found - set(LABELS)))
    sp = speedups(rows, variants)
    shapes = [f"{r['M']}x{r['K']}x{r['N']}" for r in rows]
    print("| M x K x N | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))
    for i, s in enumerate(shapes):
        print(f"| {s} | " + " | ".join("-" if sp[v][i] is None else f"{sp[v][i]:.2f}x" for v in variants) + " |")
    if args.reference in sp:
        for v in variants:
            if v == args.reference:
                continue
            pairs = [(a, b) for a, b in zip(sp[v], sp[args.reference], strict=True) if a and b]
            print(f"{v}: faster than {args.reference} at {sum(a > b for a, b in pairs)} of {len(pairs)} shapes")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(max(8.0, 0.75 * len(shapes)), 4.8))
        width = 0.8 / len(variants)
        for j, v in enumerate(variants):
            xs = [i + (j - (len(variants) - 1) / 2) * width for i in range(len(shapes))]
            ax.bar(xs, [s or 0.0 for s in sp[v]], width, label=LABELS.get(v, v))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(shapes)), shapes, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("speed-up over BF16 (same run)")
        lo = min(s for v in variants for s in sp[v] if s)
        ax.set_ylim(min(0.8, lo - 0.05), max(s for v in variants for s in sp[v] if s) + 0.1)
        ax.set_title(f"one linear, forward + backward (M x K x N, M tokens): {meta.get('device')}, "
                     f"torch {meta.get('torch')}, {meta.get('date')}", fontsize=9)
        ax.legend(fontsize=8, ncol=2, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        args.png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
