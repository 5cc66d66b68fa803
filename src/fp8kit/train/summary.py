"""The final summary of a run: one table printed, and ``summary.md`` / ``summary.json`` saved.

Throughput figures are medians over the steps after the first few (which include compilation and
allocator warm-up): ``warm = min(5, steps // 4)`` steps are skipped, and steps that follow a precision
switch (recompilation) are skipped too. A resumed run's throughput comes from the steps of the session that
resumed it (its own warm-up skipped the same way): an earlier session may have run on another layout (2 ranks
before, 1 now) and compiled at its own start; losses come from the whole run.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fp8kit.train.health import health_markdown, worst_layers


def _steady(records: list[dict], switches: list[int]) -> list[dict]:
    if not records:
        return []
    warm = min(5, len(records) // 4)
    skip = {s + 1 for s in switches} | {s + 2 for s in switches}
    steady = [r for r in records[warm:] if r["step"] not in skip]
    return steady or records[-1:]


def summarize_run(records: list[dict], *, switches: list[int], info: dict, setup_desc: dict,
                  session_from: int = 0) -> dict:
    """Numbers of the summary (see the module docstring for the medians). ``session_from``: the step this
    session started from (a resume's checkpoint step; 0 for a fresh run): throughput from the later steps only
    (None when this session ran none)."""
    session = [r for r in records if r["step"] > session_from]  # a resume stopped before its first step: none
    steady = _steady(session, switches)
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    last = records[-max(1, len(records) // 10):] if records else []
    med = lambda key: statistics.median(r[key] for r in steady) if steady and steady[0].get(key) is not None else None  # noqa: E731
    return {
        **setup_desc,
        "steps_done": records[-1]["step"] if records else 0,
        "final_loss": records[-1]["loss"] if records else None,
        # a diverged run's last loss is null (NaN / inf): average the finite ones
        "final_loss_avg_last10pct": statistics.fmean(finite) if (finite := [
            r["loss"] for r in last if r["loss"] is not None]) else None,
        "final_val_loss": vals[-1] if vals else None,
        "tokens_per_s": med("tokens_per_s"),
        "tokens_per_s_per_gpu": med("tokens_per_s_per_gpu"),
        "step_ms": med("step_ms"),
        "mfu": med("mfu"),
        "peak_mem_gib": max((r["peak_mem_gib"] for r in records), default=None),
        "device": info.get("device"),
        "versions": info.get("versions"),
        "fp8_health_worst": worst_layers(records),  # fp8.stats_every: each layer's worst operand, worst first
        "chat": info.get("chat"),  # data.format = "chat": record counts (skipped, truncated), packing
        "supervised_tokens": sum(r.get("supervised_tokens") or 0 for r in records),
        "cuda_graphs": info.get("cuda_graphs"),  # train.cuda_graphs: how many compiled graphs Inductor ran without
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
        *([("status", f"interrupted by {s.get('signal')} after step {s.get('interrupted_at_step')}")]
          if s.get("status") == "interrupted" else []),
        ("final train loss", _fmt(s["final_loss"])),
        ("final val loss", _fmt(s["final_val_loss"])),
        *([("chat records", _chat_row(s["chat"]))] if s.get("chat") else []),
        ("parallel", s.get("parallel", "single process")),
        *([("CUDA graphs", _cuda_graphs_row(s["cuda_graphs"]))] if s.get("cuda_graphs") else []),
        # summaries written before parallel_facts existed kept facts among the notes: their old label
        *[("parallel warning" if "parallel_facts" in s else "parallel note", n) for n in s.get("parallel_notes", [])],
        *[("parallel note", n) for n in s.get("parallel_facts", [])],
        ("tokens/s (median)", _fmt(s["tokens_per_s"], ",.0f")),
        ("tokens/s per GPU (median)", _fmt(s.get("tokens_per_s_per_gpu"), ",.0f")),
        ("step time ms (median)", _fmt(s["step_ms"], ".1f")),
        ("MFU vs BF16 peak", _fmt(s["mfu"], ".1%") if s["mfu"] is not None else "- (CPU or unknown GPU)"),
        ("peak memory GiB", _fmt(s["peak_mem_gib"], ".2f")),
        ("device", s["device"]),
        ("wall time s", _fmt(s["wall_s"], ".1f")),
        *([("FP8 health, worst layer", _worst_row(s["fp8_health_worst"][0]))] if s.get("fp8_health_worst") else []),
        *([("divergence events", _events_row(s["recoveries"]))] if s.get("recoveries") else []),
    ]


def _cuda_graphs_row(w: dict) -> str:
    """``train.cuda_graphs``: what ran without graphs (``fp8kit.train.cuda_graphs`` counts it)."""
    n, b = w["graphs_skipped"], w["graph_breaks"]
    if n == 0 and b == 0:
        return "on; no graph skipped by Inductor, no graph break"
    return f"on; {n} compiled graph(s) ran without them, {b} graph break(s) (see the warnings)"


def _chat_row(c: dict) -> str:
    return (f"{c['samples']} trained of {c['records']}: {c['no_assistant']} skipped (no assistant turn), "
            f"{c['truncated_away']} dropped by truncation; {'packed' if c['pack'] else 'one per row'} "
            f"({c['fill']:.0%} filled)")


def _worst_row(r: dict) -> str:
    return (f"{r['layer']} {r['operand']} at step {r['step']}: underflow {_fmt(r['underflow'], '.2%')}, "
            f"saturation {_fmt(r['saturation'], '.2%')}")


def _events_row(events: list[dict]) -> str:
    rec = [e for e in events if e["event"] == "recovery"]
    stopped = [e for e in events if e["event"] != "recovery"]
    return (f"{len(rec)} recoveries (steps {', '.join(str(e['step']) for e in rec) or '-'})"
            + (f"; stopped at step {stopped[-1]['step']}" if stopped else ""))


def _events_markdown(events: list[dict]) -> list[str]:
    """The divergence guard's events (``train.on_divergence = "recover"``) as a table."""
    if not events:
        return []
    lines = ["", "## Divergence events", "", "| step | event | cause | rolled back to | micro-batches skipped "
             "| layers moved to BF16 | BF16 until step |", "|---|---|---|---|---|---|---|"]
    for e in events:
        layers = e.get("layers_to_bf16") or []
        lines.append(f"| {e['step']} | {e['event']} | {e['cause']} | {e.get('rolled_back_to', '-')} | "
                     f"{e.get('skipped_micro_batches', '-')} | {len(layers)}: {', '.join(layers) or '-'} | "
                     f"{e.get('bf16_until_step') or '-'} |" if e["event"] == "recovery" else
                     f"| {e['step']} | {e['event']} | {e['cause']} | {e.get('note', '')} | | | |")
    return lines


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
    lines += health_markdown(s.get("fp8_health_worst") or [], s.get("fp8_stats_every"))
    lines += _events_markdown(s.get("recoveries") or [])
    (out_dir / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
