"""Plot ``step_profile.py`` results: each variant's GPU busy time and idle time per step, side by side for several runs.

Reads the results table ``step_profile.py`` prints (and writes as ``OUT/results.md``): the rows ``| variant | wall ms |
vs bf16 | GPU busy ms | idle ms | ...``, from each file given as ``LABEL=PATH`` (a log holding the table works too).
One stacked bar per (variant, run): busy below, idle above, so a bar's height is the profiled step (busy + idle);
a host-bound step shows as a tall idle part over a short busy one. Prints the table it plots. CPU only.

    python benchmarks/plot_step_profile.py \
        before=benchmarks/results/session52/call3/step_profile_1b.log \
        after=benchmarks/results/session52/call6/step_profile_1b_after.log \
        --title "llama3-1b step, H200" --png docs/img/step_profile_1b_session52.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: the columns read from a results row
COLUMNS = ("variant", "wall ms", "vs bf16", "GPU busy ms", "idle ms")


def read_table(path: Path) -> dict[str, dict[str, str]]:
    """``{variant: {column: cell}}`` from the first ``| variant | wall ms | ...`` table in ``path``.

    Raises:
        SystemExit: no such table in the file.
    """
    header: list[str] | None = None
    rows: dict[str, dict[str, str]] = {}
    for line in path.read_text().splitlines():
        if not line.startswith("|"):
            if header is not None and rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            if cells[: len(COLUMNS)] == list(COLUMNS):
                header = cells
            continue
        if set(cells[0]) <= {"-"}:
            continue
        rows[cells[0]] = dict(zip(header, cells, strict=False))
    if not rows:
        raise SystemExit(f"{path}: no step_profile results table (a row starting '| variant | wall ms |')")
    return rows


def short(variant: str) -> str:
    """A variant's label: ``delayed+fp8.delayed_fused_cast=all`` -> ``delayed, all``."""
    base, *extra = variant.split("+")
    return ", ".join([base, *(e.split("=", 1)[-1] for e in extra)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=PATH of a step_profile.py results table (or a log holding it)")
    ap.add_argument("--title", default="training step: GPU busy and idle time")
    ap.add_argument("--png", required=True)
    args = ap.parse_args()
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"{spec!r}: give LABEL=PATH")
        runs.append((label, read_table(Path(path))))
    variants = list(dict.fromkeys(v for _, table in runs for v in table))
    print("| variant | " + " | ".join(f"{label} busy / idle / wall ms" for label, _ in runs) + " |")
    for v in variants:
        cells = [f"{t[v]['GPU busy ms']} / {t[v]['idle ms']} / {t[v]['wall ms']}" if v in t else "-" for _, t in runs]
        print(f"| {v} | " + " | ".join(cells) + " |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(2.2 + 1.9 * len(variants), 4.6))
    colors = plt.get_cmap("tab10")
    for j, (label, table) in enumerate(runs):
        xs = [i + (j - (len(runs) - 1) / 2) * width for i, v in enumerate(variants) if v in table]
        busy = [float(table[v]["GPU busy ms"]) for v in variants if v in table]
        idle = [float(table[v]["idle ms"]) for v in variants if v in table]
        ax.bar(xs, busy, width * 0.95, color=colors(j), label=f"{label}: GPU busy")
        ax.bar(xs, idle, width * 0.95, bottom=busy, color=colors(j), alpha=0.35, hatch="//",
               label=f"{label}: GPU idle (waiting for the host)")
        for x, b, i in zip(xs, busy, idle, strict=True):
            ax.text(x, b + i + 1, f"{b + i:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(variants)), [short(v) for v in variants])
    ax.set_ylabel("ms per profiled step")
    ax.set_title(args.title)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    Path(args.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
