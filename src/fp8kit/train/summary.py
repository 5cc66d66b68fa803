"""The final summary of a run: one table printed, and ``summary.md`` / ``summary.json`` saved.

Throughput figures are medians over the steps after the first few (which include compilation and
allocator warm-up): ``warm = min(5, steps // 4)`` steps are skipped, and steps that follow a precision
switch (recompilation) are skipped too.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _steady(records: list[dict], switches: list[int]) -> list[dict]:
    if not records:
        return []
    warm = min(5, len(records) // 4)
    skip = {s + 1 for s in switches} | {s + 2 for s in switches}
    steady = [r for r in records[warm:] if r["step"] not in skip]
    return steady or records[-1:]


def summarize_run(records: list[dict], *, switches: list[int], info: dict, setup_desc: dict) -> dict:
    """Numbers of the summary (see the module docstring for the medians)."""
    steady = _steady(records, switches)
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    last = records[-max(1, len(records) // 10):] if records else []
    med = lambda key: statistics.median(r[key] for r in steady) if steady and steady[0].get(key) is not None else None  # noqa: E731
    return {
        **setup_desc,
        "steps_done": records[-1]["step"] if records else 0,
        "final_loss": records[-1]["loss"] if records else None,
        "final_loss_avg_last10pct": statistics.fmean(r["loss"] for r in last) if last else None,
        "final_val_loss": vals[-1] if vals else None,
        "tokens_per_s": med("tokens_per_s"),
        "tokens_per_s_per_gpu": med("tokens_per_s_per_gpu"),
        "step_ms": med("step_ms"),
        "mfu": med("mfu"),
        "peak_mem_gib": max((r["peak_mem_gib"] for r in records), default=None),
        "device": info.get("device"),
        "versions": info.get("versions"),
    }


def _fmt(v, spec: str = ".4f") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, float) else str(v)


def summary_rows(s: dict) -> list[tuple[str, str]]:
    return [
        ("model", f"{s['model']} ({s['params_m']:.1f}M parameters)"),
        ("precision", s["precision"]),
        ("FP8 sites", s["fp8_sites"]),
        ("steps", _fmt(s["steps_done"])),
        ("final train loss", _fmt(s["final_loss"])),
        ("final val loss", _fmt(s["final_val_loss"])),
        ("parallel", s.get("parallel", "single process")),
        *[("parallel note", n) for n in s.get("parallel_notes", [])],
        ("tokens/s (median)", _fmt(s["tokens_per_s"], ",.0f")),
        ("tokens/s per GPU (median)", _fmt(s.get("tokens_per_s_per_gpu"), ",.0f")),
        ("step time ms (median)", _fmt(s["step_ms"], ".1f")),
        ("MFU vs BF16 peak", _fmt(s["mfu"], ".1%") if s["mfu"] is not None else "- (CPU or unknown GPU)"),
        ("peak memory GiB", _fmt(s["peak_mem_gib"], ".2f")),
        ("device", s["device"]),
        ("wall time s", _fmt(s["wall_s"], ".1f")),
    ]


def print_summary(s: dict, console: Console) -> None:
    table = Table(title="Run summary", header_style="bold")
    table.add_column("metric")
    table.add_column("value")
    for k, v in summary_rows(s):
        table.add_row(k, str(v))
    console.print(table)


def save_summary(s: dict, out_dir: Path) -> None:
    out_dir = Path(out_dir)
    (out_dir / "summary.json").write_text(json.dumps(s, indent=1) + "\n", encoding="utf-8")
    lines = ["# Run summary", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in summary_rows(s)]
    if s.get("versions"):
        lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in s["versions"].items())]
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
