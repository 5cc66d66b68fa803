"""The conversion report: every site with its shape, module kind, precision and reason.

Saved with each run as ``conversion_report.json`` (one object per site, machine-readable) and
``conversion_report.md`` (a table per site), and printed at start as a compact table in which the
same module of every transformer layer is one row (``model.layers.*.mlp.down_proj``, layers 0-31).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fp8kit.base.console import make_console
from fp8kit.selective.decide import Decision, summarize


def _ranges(values: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8'."""
    values = sorted(set(values))
    out, start, prev = [], None, None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(out)


def grouped_rows(decisions: list[Decision]) -> list[dict]:
    """Rows with the layer index replaced by ``*`` and identical rows merged (layers as ranges)."""
    groups: OrderedDict[tuple, dict] = OrderedDict()
    for d in decisions:
        s = d.site
        name = s.fqn
        if s.layer is not None:
            name = re.sub(rf"(^|\.)({s.layer})(\.|$)", r"\1*\3", name, count=1)
        key = (name, s.weight_shape, s.module_kind, s.ub_name, d.precision, d.reason)
        row = groups.setdefault(
            key,
            {
                "fqn": name,
                "shape": "x".join(map(str, s.weight_shape)),
                "module_kind": s.module_kind,
                "ub_name": s.ub_name or "",
                "precision": d.precision,
                "reason": d.reason,
                "tp": d.tp,
                "etp": d.etp,
                "num_gemms": d.num_gemms,
                "num_tokens": d.num_tokens,
                "layers": [],
            },
        )
        if s.layer is not None:
            row["layers"].append(s.layer)
    rows = list(groups.values())
    for r in rows:
        r["layers"] = _ranges(r["layers"])
    return rows


def print_report(
    decisions: list[Decision], console: Console | None = None, title: str = "FP8 conversion", detail: bool = False
) -> None:
    """Print the compact conversion table and a one-line summary.

    ``detail`` adds the columns of the policy lookup (tp, etp, num_gemms, num_tokens).
    """
    console = console or make_console()
    table = Table(title=title, show_lines=False, header_style="bold")
    cols = ["module", "layers", "shape", "module_kind", "ub_name"]
    if detail:
        cols += ["tp", "etp", "num_gemms", "num_tokens"]
    cols += ["precision", "reason"]
    for col in cols:
        table.add_column(col, overflow="fold")
    for r in grouped_rows(decisions):
        style = "green" if r["precision"] == "fp8" else None
        cells = [r["fqn"], r["layers"], r["shape"], r["module_kind"], r["ub_name"]]
        if detail:
            cells += [str(r["tp"]), str(r["etp"]), "" if r["num_gemms"] is None else str(r["num_gemms"]),
                      "" if r["num_tokens"] is None else str(r["num_tokens"])]
        table.add_row(*cells, r["precision"], r["reason"], style=style)
    console.print(table)
    s = summarize(decisions)
    console.print(
        f"{s['fp8_sites']} of {s['sites']} sites in FP8; "
        f"{100 * s['fp8_param_fraction']:.1f}% of linear-layer weights run FP8 matmuls"
    )


def print_auto_table(info: dict, console: Console | None = None) -> None:
    """Print the ``selective_fp8 = "auto"`` table (one row per distinct timed shape) and how it was obtained.

    ``info`` is ``fp8kit.bench.auto.AutoOutcome.info`` (saved as ``selective_auto`` in ``run_info.json``);
    nothing is printed unless the table was applied (``info["applied"]``).
    """
    if not info.get("applied"):
        return
    console = console or make_console()
    table = Table(title=f"selective_fp8 = auto: {info['recipe']} vs BF16 on {info['device']} "
                  f"(FP8 where speed-up >= {info['min_speedup']:g})", header_style="bold")
    for col in ("units", "sites", "M x K x N", "bf16 ms", "fp8 ms", "speed-up", "precision", "source"):
        table.add_column(col, overflow="fold")
    for r in info["rows"]:
        ms = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        table.add_row(r["units"], str(r["sites"]), r["shape"], ms(r["bf16_ms"]), ms(r["fp8_ms"]), sp,
                      r["precision"] or "-", (r["source"] or "-") + (f" ({r['error']})" if r["error"] else ""),
                      style="green" if r["precision"] == "fp8" else None)
    console.print(table)
    console.print(
        f"selective_fp8 = auto: {info['shapes']} shapes, {info['measured']} measured, {info['cached']} from the "
        f"cache ({info['cache_dir']}), {info['seconds']:.1f} s"
    )


def auto_summary(info: dict) -> str:
    """One line for the run summary: the ``auto`` choices and measured speed-ups (BF16 time / FP8 time), or why
    nothing was measured; ``""`` when ``selective_fp8`` is not ``auto``."""
    if info.get("mode") != "auto":
        return ""
    if not info.get("applied"):
        return "selective_fp8 = auto: not measured, static rules" + (" (CPU / emulated FP8)" if "emulated" in
                                                                      info.get("note", "") else "")
    parts = [f"{r['units']} " + ("-" if r["speedup"] is None else f"{r['speedup']:.2f}x") + f" -> {r['precision']}"
             for r in info["rows"]]
    return (f"selective_fp8 = auto on {info['device']}: {', '.join(parts)} ({info['measured']} measured, "
            f"{info['cached']} cached, {info['seconds']:.1f} s)")


def report_markdown(decisions: list[Decision], header: dict | None = None) -> str:
    """The full per-site report as Markdown."""
    s = summarize(decisions)
    lines = ["# FP8 conversion report", ""]
    for k, v in (header or {}).items():
        lines.append(f"- {k}: {v}")
    lines += [
        f"- FP8 sites: {s['fp8_sites']} of {s['sites']}",
        f"- linear-layer weights in FP8: {100 * s['fp8_param_fraction']:.1f}%",
        "",
        "| fqn | shape | module_kind | ub_name | precision | reason |",
        "|---|---|---|---|---|---|",
    ]
    for d in decisions:
        st = d.site
        lines.append(
            f"| `{st.fqn}` | {'x'.join(map(str, st.weight_shape))} | {st.module_kind} | {st.ub_name or ''} "
            f"| {d.precision} | {d.reason} |"
        )
    return "\n".join(lines) + "\n"


def save_report(decisions: list[Decision], out_dir: Path, header: dict | None = None) -> None:
    """Write ``conversion_report.json`` and ``conversion_report.md`` into ``out_dir``."""
    out_dir = Path(out_dir)
    payload = {"header": header or {}, "summary": summarize(decisions), "sites": [d.to_dict() for d in decisions]}
    (out_dir / "conversion_report.json").write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    (out_dir / "conversion_report.md").write_text(report_markdown(decisions, header), encoding="utf-8")
