"""Command-line parts of adaptive FP8: ``plan``, ``bench-layers``, ``merge-policy``.

``bench-layers`` also reads the adaptive-FP8 seed's environment variables (``TE_LAYER_PERF_*``,
seed 000 section 2.1.4) at call time; a command-line flag wins over its variable.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from fp8kit.errors import ConfigError, PolicyError

ENV_PREFIX = "TE_LAYER_PERF_"
# flag dest -> (variable suffix, type)
ENV_FLAGS = {
    "config": ("OMNI_CONFIG_PATH", str),
    "tp": ("TP_SIZE", int),
    "ep": ("EP_SIZE", int),
    "etp": ("ETP_SIZE", int),
    "precisions": ("PRECISIONS", str),
    "recipe": ("FP8_RECIPE", str),
    "warmup": ("WARMUP", int),
    "iters": ("ITERS", int),
    "report": ("REPORT_PATH", str),
    "policy": ("FP8_POLICY_PATH", str),
    "speedup_threshold": ("SPEEDUP_THRESHOLD", float),
    "shape_sweep": ("SHAPE_SWEEP", str),
}
BENCH_DEFAULTS = {"tp": 1, "ep": 1, "etp": 1, "precisions": "bf16,fp8", "recipe": "tensorwise", "warmup": 5,
                  "iters": 10, "speedup_threshold": 1.0}


def add_parsers(sub) -> None:
    p = sub.add_parser("plan", help="print the FP8/BF16 decision of every module, without training or a GPU")
    p.add_argument("config", nargs="?", help="run config file; default: the embedded default")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print a JSON list of decisions instead of a table")
    p.add_argument("--list-policies", action="store_true", help="list the policies shipped with fp8kit")

    p = sub.add_parser("bench-layers", help="time each linear site of one layer in bf16 and fp8 (adaptive FP8, step 1)")
    p.add_argument("config", nargs="?", help="run config file (its [model] section); or $TE_LAYER_PERF_OMNI_CONFIG_PATH")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--tp", type=int)
    p.add_argument("--ep", type=int)
    p.add_argument("--etp", type=int)
    p.add_argument("--precisions", help="comma-separated, default bf16,fp8")
    p.add_argument("--recipe", help="FP8 recipe, default tensorwise")
    p.add_argument("--warmup", type=int, help="warm-up iterations, default 5")
    p.add_argument("--iters", type=int, help="timed iterations (median), default 10")
    p.add_argument("--shape-sweep", dest="shape_sweep", help='"SEQxMBS,..." e.g. "1024x1,4096x2"; default powers of two')
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=32768, help="top of the automatic sweep")
    p.add_argument("--report", help="where to write the report JSON")
    p.add_argument("--policy", help="also merge this report into a policy JSON here")
    p.add_argument("--speedup-threshold", dest="speedup_threshold", type=float)
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--simulate-tp", dest="simulate_tp", action="store_true",
                   help="time the per-rank shapes of --tp N on one device (no communication)")
    p.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                   help="time eager modules (default: compiled on CUDA, eager on CPU)")
    p.add_argument("--compile", dest="compile", action="store_true", help="compile also on CPU")

    p = sub.add_parser("merge-policy", help="merge bench-layers reports into a policy JSON (adaptive FP8, step 2)")
    p.add_argument("--reports", nargs="+", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--speedup-threshold", dest="speedup_threshold", type=float, default=1.0)
    p.add_argument("--component", default=None, help="only this component's sites (llm, vision); default all")
    p.add_argument("--force", action="store_true", help="merge reports of different devices or recipes anyway")


def _env(args: argparse.Namespace) -> None:
    """Fill unset flags from the seed's environment variables, then from the defaults."""
    for dest, (suffix, cast) in ENV_FLAGS.items():
        if getattr(args, dest, None) is not None:
            continue
        raw = os.environ.get(ENV_PREFIX + suffix)
        if raw is not None and raw.strip():
            try:
                setattr(args, dest, cast(raw))
            except ValueError:
                raise ConfigError(f"${ENV_PREFIX}{suffix}={raw!r}: expected {cast.__name__}") from None
        elif dest in BENCH_DEFAULTS:
            setattr(args, dest, BENCH_DEFAULTS[dest])


def load_report(path: str) -> dict:
    """Read a bench-layers report.

    Raises:
        PolicyError: missing, invalid JSON, or not a layer report.
    """
    p = Path(path)
    if not p.is_file():
        raise PolicyError(f"report {path!r} does not exist")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PolicyError(f"report {path!r}: invalid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(data, dict) or not isinstance(data.get("measurements"), list):
        raise PolicyError(f"report {path!r}: not a bench-layers report (no 'measurements' list)")
    return data


def run(args: argparse.Namespace) -> int:
    from fp8kit.config import load_config
    from fp8kit.console import make_console

    console = make_console()
    if args.command == "plan":
        if args.list_policies:
            from fp8kit.fp8.policy import list_builtin_policies

            for name in list_builtin_policies():
                print(f"builtin:{name}")
            return 0
        return _plan(load_config(args.config, args.overrides), args.json, console)
    if args.command == "merge-policy":
        from fp8kit.fp8.policy import merge_reports

        reports = [(r, load_report(r)) for r in args.reports]
        policy = merge_reports(reports, args.speedup_threshold, force=args.force, component=args.component)
        policy.save(args.output)
        _print_policy(policy, console)
        console.print(f"policy written to {args.output}")
        return 0
    if args.command == "bench-layers":
        return _bench(args, console)
    raise AssertionError(args.command)


def _plan(cfg, as_json: bool, console) -> int:
    from fp8kit.fp8.decide import decide
    from fp8kit.fp8.options import options_from_config
    from fp8kit.fp8.report import print_report
    from fp8kit.fp8.sites import find_sites
    from fp8kit.models.build import build_hf_config, build_model

    hf_cfg = build_hf_config(cfg.model, cfg.data.vocab_size)
    model = build_model(cfg.model, cfg.data.vocab_size, device="meta")
    options = options_from_config(cfg, hf_cfg)
    decisions = decide(find_sites(model), options)
    if as_json:
        print(json.dumps([d.to_dict() for d in decisions], indent=1))
        return 0
    for w in options.warnings:
        console.print(f"[bold yellow]warning:[/] {w}")
    d = cfg.distributed
    console.print(
        f"plan: {cfg.model.hf_config or cfg.model.preset}, {cfg.train.mixed_precision} {cfg.fp8.recipe}, "
        f"tp={d.tp} ep={d.ep} etp={d.etp}, num_tokens={options.num_tokens}"
        + (f", policy {cfg.fp8.fp8_dynamic_policy_path}" if cfg.fp8.selective_fp8 else "")
    )
    print_report(decisions, console, title="FP8 plan", detail=True)
    return 0


def _bench(args: argparse.Namespace, console) -> int:
    from fp8kit.bench.layers import BenchLayersArgs, auto_sweep, parse_shape_sweep, run_bench_layers
    from fp8kit.config import load_config
    from fp8kit.fp8.policy import merge_reports

    _env(args)
    cfg = load_config(args.config, args.overrides)
    for key in ("report", "policy"):
        path = getattr(args, key)
        if path:
            parent = Path(path).resolve().parent
            probe = parent
            while not probe.exists():
                probe = probe.parent
            if not probe.is_dir() or not os.access(probe, os.W_OK):
                raise ConfigError(f"--{key} {path!r} cannot be written")
    bench_args = BenchLayersArgs(
        config=cfg, tp=args.tp, ep=args.ep, etp=args.etp,
        precisions=tuple(p.strip() for p in args.precisions.split(",") if p.strip()),
        recipe=args.recipe, warmup=args.warmup, iters=args.iters,
        shape_sweep=parse_shape_sweep(args.shape_sweep) if args.shape_sweep else auto_sweep(args.max_tokens),
        device=args.device, simulate_tp=args.simulate_tp, compile=args.compile,
    )
    report = run_bench_layers(bench_args, console)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    _print_speedups(report, console)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        console.print(f"report written to {args.report}")
    if args.policy:
        policy = merge_reports([(args.report or "<this run>", report)], args.speedup_threshold)
        policy.save(args.policy)
        _print_policy(policy, console)
        console.print(f"policy written to {args.policy}")
    if report.get("note"):
        console.print(f"[bold yellow]note:[/] {report['note']}")
    return 0


def _print_speedups(report: dict, console) -> None:
    from rich.table import Table

    from fp8kit.bench.layers import speedup_table

    t = Table(title=f"bench-layers: {report['model']} tp={report['tp']}"
              + (" (simulated)" if report["simulated_tp"] else "") + f", {report['recipe']}, {report['device']}",
              header_style="bold")
    for c in ("site", "tokens", "bf16 ms", "fp8 ms", "fp8 speed-up"):
        t.add_column(c)
    for site, tokens, b, f, sp in speedup_table(report):
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        t.add_row(site, str(tokens), fmt(b), fmt(f), "-" if sp is None else f"{sp:.2f}x",
                  style="green" if sp and sp > 1 else None)
    console.print(t)
    for n in report["notes"]:
        console.print(f"note: {n}")


def _print_policy(policy, console) -> None:
    from rich.table import Table

    t = Table(title=f"policy (speedup threshold {policy.speedup_threshold})", header_style="bold")
    for c in ("module_kind", "ub_name", "tp / etp,num_gemms", "min_tokens", "measured_speedup"):
        t.add_column(c)
    for kind, ubs in policy.dense.items():
        for ub, rules in ubs.items():
            for r in rules:
                t.add_row(kind, ub, f"tp={r.tp}", str(r.min_tokens), f"{r.measured_speedup:.3f}")
    for kind, rules in policy.grouped.items():
        for r in rules:
            t.add_row(kind, "", f"etp={r.etp},num_gemms={r.num_gemms}", str(r.min_tokens), f"{r.measured_speedup:.3f}")
    console.print(t)
