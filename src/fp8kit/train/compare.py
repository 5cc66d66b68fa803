"""``fp8kit compare``: the same config in bf16 and in fp8 (same seed, same data order), one PNG.

Writes ``OUT/bf16/`` and ``OUT/fp8/`` (two ordinary run directories), ``OUT/compare.png`` (train and
validation loss curves of both, and the table below drawn under them), ``OUT/compare.md`` and
``OUT/compare.json``.

Table: final train loss (mean of the last 10% of steps), final validation loss, loss gap in % of
bf16 ``100 * (fp8 - bf16) / bf16`` (on validation loss), median tokens/s of each and their ratio, and
peak memory of each.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fp8kit.base.console import make_console
from fp8kit.base.errors import Fp8kitError
from fp8kit.config import RunConfig
from fp8kit.train.rundir import RUN_MARKER, check_writable
from fp8kit.train.trainer import TrainResult, train


def compare_table(bf16: dict, fp8: dict) -> dict:
    """The comparison numbers from two run summaries."""

    def gap(a, b):
        return None if a is None or b is None else 100.0 * (b - a) / a

    def ratio(a, b):
        return None if not a or b is None else b / a

    return {
        "bf16_final_loss": bf16["final_loss_avg_last10pct"],
        "fp8_final_loss": fp8["final_loss_avg_last10pct"],
        "bf16_final_val_loss": bf16["final_val_loss"],
        "fp8_final_val_loss": fp8["final_val_loss"],
        "val_loss_gap_pct": gap(bf16["final_val_loss"], fp8["final_val_loss"]),
        "train_loss_gap_pct": gap(bf16["final_loss_avg_last10pct"], fp8["final_loss_avg_last10pct"]),
        "bf16_tokens_per_s": bf16["tokens_per_s"],
        "fp8_tokens_per_s": fp8["tokens_per_s"],
        "tokens_per_s_ratio": ratio(bf16["tokens_per_s"], fp8["tokens_per_s"]),
        "bf16_peak_mem_gib": bf16["peak_mem_gib"],
        "fp8_peak_mem_gib": fp8["peak_mem_gib"],
        "device": fp8["device"],
        "fp8_precision": fp8["precision"],
    }


def _rows(t: dict) -> list[tuple[str, str, str, str]]:
    f = lambda v, spec=".4f": "-" if v is None else format(v, spec)  # noqa: E731
    return [
        ("train loss, mean of the last 10% of steps", f(t["bf16_final_loss"]), f(t["fp8_final_loss"]), f(t["train_loss_gap_pct"], "+.2f") + " %"),
        ("final val loss", f(t["bf16_final_val_loss"]), f(t["fp8_final_val_loss"]), f(t["val_loss_gap_pct"], "+.2f") + " %"),
        ("tokens/s", f(t["bf16_tokens_per_s"], ",.0f"), f(t["fp8_tokens_per_s"], ",.0f"), f(t["tokens_per_s_ratio"], ".3f") + "x"),
        ("peak memory GiB", f(t["bf16_peak_mem_gib"], ".2f"), f(t["fp8_peak_mem_gib"], ".2f"), ""),
    ]


def plot_compare(bf16: TrainResult, fp8: TrainResult, table: dict, path: Path, title: str) -> None:
    """Loss curves (train, smoothed; validation as markers) of both runs, the table beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_t) = plt.subplots(2, 1, figsize=(9, 7.5), gridspec_kw={"height_ratios": [3, 1.2]})
    for res, name, color in ((bf16, "bf16", "tab:blue"), (fp8, "fp8", "tab:red")):
        steps = [r["step"] for r in res.metrics]
        loss = [r["loss"] for r in res.metrics]
        ax.plot(steps, loss, color=color, alpha=0.25, linewidth=0.8)
        k = max(1, len(loss) // 25)
        smooth = [sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
        ax.plot(steps, smooth, color=color, linewidth=1.8, label=f"{name} train (mean of {k})")
        vs = [(r["step"], r["val_loss"]) for r in res.metrics if r.get("val_loss") is not None]
        if vs:
            ax.plot(*zip(*vs, strict=True), "o--", color=color, markersize=5, label=f"{name} validation")
    switches = [s for s, _ in fp8.loop.switches]
    for s in switches:
        ax.axvline(s, color="gray", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    ax_t.axis("off")
    cells = [list(r) for r in _rows(table)]
    tbl = ax_t.table(cellText=cells, colLabels=["", "bf16", table["fp8_precision"], "fp8 vs bf16"], loc="center")
    tbl.auto_set_font_size(False)
    tbl.set_fontsize(9)
    tbl.auto_set_column_width(col=list(range(4)))  # equal widths clip the row labels
    tbl.scale(1, 1.4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(cfg: RunConfig, out_dir: str | Path | None = None, *, console: Console | None = None) -> dict:
    """Run ``cfg`` in bf16 and in fp8 and write the comparison (see the module docstring).

    Raises:
        Fp8kitError: bad input (checked by the first run before it writes), or a run diverged.
    """
    import time

    console = console or make_console()
    out = Path(out_dir) if out_dir is not None else Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-compare"
    check_writable(out)
    held = [sub for sub in ("bf16", "fp8") if (out / sub / RUN_MARKER).exists()]
    if held:  # check_writable would suggest --resume, which compare does not take
        raise Fp8kitError(f"--out {str(out)!r} already holds a comparison ({' and '.join(held)} hold runs); "
                          f"choose another --out")
    for sub in ("bf16", "fp8"):
        check_writable(out / sub)
    results = {}
    for precision in ("bf16", "fp8"):
        run_cfg = copy.deepcopy(cfg)
        run_cfg.train.mixed_precision = precision
        console.rule(f"compare: {precision}")
        results[precision] = train(run_cfg, out / precision, console=console)
    table = compare_table(results["bf16"].summary, results["fp8"].summary)
    title = f"{results['fp8'].summary['model']}: bf16 vs {table['fp8_precision']} on {table['device']}"
    plot_compare(results["bf16"], results["fp8"], table, out / "compare.png", title)
    (out / "compare.json").write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    md = ["# bf16 vs fp8", "", title, "", "| | bf16 | fp8 | fp8 vs bf16 |", "|---|---|---|---|"]
    md += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in _rows(table)]
    (out / "compare.md").write_text("\n".join(md) + "\n\n![loss curves](compare.png)\n", encoding="utf-8")
    rt = Table(title="bf16 vs fp8", header_style="bold")
    for col in ("", "bf16", table["fp8_precision"], "fp8 vs bf16"):
        rt.add_column(col)
    for row in _rows(table):
        rt.add_row(*row)
    console.print(rt)
    console.print(f"plot: {out / 'compare.png'}")
    return table
