"""Command-line parts of selective FP8: ``plan``, ``bench-layers``, ``merge-policy``.

The bench-layers -> merge-policy workflow and the policy format are those of LoongForge's adaptive FP8.
``bench-layers`` measures the run config's FP8 recipe (``fp8.recipe``) at its ``[distributed]`` sizes
(``tp``, ``ep``) unless ``--recipe`` / ``--tp`` / ``--ep`` override them. It also reads
LoongForge's ``TE_LAYER_PERF_*`` environment variables at call time; a variable counts as its flag, and
the flag wins over it. Experts are whole on every rank (no expert tensor parallelism): grouped sites are
measured and written at LoongForge's ``etp = 1``, and ``$TE_LAYER_PERF_ETP_SIZE`` other than 1 is refused.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from fp8kit.base.errors import ConfigError, PolicyError
from fp8kit.base.runtime import launched_rank
from fp8kit.cli.config_load import load_cli_config
from fp8kit.fp8.recipes import RECIPE_NAMES, recipe_info

ENV_PREFIX = "TE_LAYER_PERF_"
# flag dest -> (variable suffix, type)
ENV_FLAGS = {
    "config": ("OMNI_CONFIG_PATH", str),
    "tp": ("TP_SIZE", int),
    "ep": ("EP_SIZE", int),
    "precisions": ("PRECISIONS", str),
    "recipe": ("FP8_RECIPE", str),
    "warmup": ("WARMUP", int),
    "iters": ("ITERS", int),
    "report": ("REPORT_PATH", str),
    "policy": ("FP8_POLICY_PATH", str),
    "speedup_threshold": ("SPEEDUP_THRESHOLD", float),
    "shape_sweep": ("SHAPE_SWEEP", str),
}
# flags without a config key behind them; recipe / tp / ep default to the run config
BENCH_DEFAULTS = {"precisions": "bf16,fp8", "warmup": 5, "iters": 10, "speedup_threshold": 1.0}
# flag dest -> the config key it overrides
CONFIG_KEYS = {
    "recipe": "fp8.recipe", "tp": "distributed.tp", "ep": "distributed.ep",
}


def add_parsers(sub) -> None:
    p = sub.add_parser("plan", help="print the FP8/BF16 decision of every module, without training or a GPU")
    p.add_argument("config", nargs="?", help="run config file; default: the embedded default")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. model.preset=llama3-8b")
    p.add_argument("--json", action="store_true", help="print a JSON list of decisions instead of a table")
    p.add_argument("--list-policies", action="store_true", help="list the policies shipped with fp8kit")

    p = sub.add_parser("bench-layers",
                       help="time each linear site of one layer in bf16 and fp8 (selective FP8, step 1)")
    p.add_argument("config", nargs="?", help="run config file (its [model], fp8.recipe and [distributed]); "
                   "or $TE_LAYER_PERF_OMNI_CONFIG_PATH")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value (repeatable), e.g. model.preset=llama3-8b")
    p.add_argument("--tp", type=int, help="tensor-parallel size; default the config's distributed.tp")
    p.add_argument("--ep", type=int, help="expert-parallel size; default the config's distributed.ep")
    p.add_argument("--precisions", help="comma-separated, default bf16,fp8")
    p.add_argument("--recipe", help=f"FP8 recipe ({', '.join(RECIPE_NAMES)}); default the config's fp8.recipe")
    p.add_argument("--warmup", type=int, help="warm-up iterations, default 5")
    p.add_argument("--iters", type=int, help="timed iterations (median), default 10")
    p.add_argument("--retime", type=int, default=2,
                   help="time a point that looks like a spike (slower than the next larger token count, or "
                   "grown faster than its tokens) again up to N times, keeping the fastest; 0: off (default 2)")
    p.add_argument("--shape-sweep", dest="shape_sweep",
                   help='"SEQxMBS,..." e.g. "1024x1,4096x2"; default powers of two')
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=32768,
                   help="top of the automatic sweep")
    p.add_argument("--report", help="where to write the report JSON")
    p.add_argument("--policy", help="also merge this report into a policy JSON here")
    p.add_argument("--speedup-threshold", dest="speedup_threshold", type=float,
                   help="with --policy: FP8 wherever it is at least this many times faster than bf16 (default 1.0)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--simulate-tp", dest="simulate_tp", action="store_true",
                   help="time the per-rank shapes of --tp N on one device (no communication)")
    p.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                   help="time eager modules (default: compiled on CUDA, eager on CPU)")
    p.add_argument("--compile", dest="compile", action="store_true", help="compile also on CPU")
    p.add_argument("--dynamic", action="store_true",
                   help="one compilation with the token dimension dynamic for the whole sweep (faster to run; "
                   "FP8's casts then run slower than in training, so the policy under-uses FP8). Default: each "
                   "token count compiled for its static shape, as training compiles")

    p = sub.add_parser("merge-policy",
                       help="merge bench-layers reports into a policy JSON (selective FP8, step 2)")
    p.add_argument("--reports", nargs="+", required=True, help="bench-layers report JSON files (one per TP / EP size)")
    p.add_argument("--output", required=True, help="where to write the policy JSON")
    p.add_argument("--speedup-threshold", dest="speedup_threshold", type=float, default=1.0,
                   help="FP8 wherever it is at least this many times faster than bf16 (default 1.0)")
    p.add_argument("--component", default=None, help="only this component's sites (llm, vision); default all")
    p.add_argument("--force", action="store_true",
                   help="merge reports of different devices, recipes or fast accumulation anyway (the "
                        "policy's metadata then records each report's fast_accum, its own as \"mixed\")")


def _env(args: argparse.Namespace) -> dict[str, str]:
    """Fill unset flags from LoongForge's ``TE_LAYER_PERF_*`` variables, then from :data:`BENCH_DEFAULTS`.

    Returns ``{dest: "--flag" or "$VARIABLE"}`` for every flag that is set now by either.

    Raises:
        ConfigError: a variable's value is not of the flag's type, or ``$TE_LAYER_PERF_ETP_SIZE`` is not 1.
    """
    etp = os.environ.get(ENV_PREFIX + "ETP_SIZE", "").strip()
    if etp not in ("", "1"):
        raise ConfigError(f"${ENV_PREFIX}ETP_SIZE={etp!r}: expert tensor parallelism is not supported, every rank "
                          f"holds whole experts (docs/distributed.md); unset it or set 1")
    given = {}
    for dest, (suffix, cast) in ENV_FLAGS.items():
        if getattr(args, dest, None) is not None:
            given[dest] = "--" + dest.replace("_", "-")
            continue
        raw = os.environ.get(ENV_PREFIX + suffix)
        if raw is not None and raw.strip():
            try:
                setattr(args, dest, cast(raw))
            except ValueError:
                raise ConfigError(f"${ENV_PREFIX}{suffix}={raw!r}: expected {cast.__name__}") from None
            given[dest] = f"${ENV_PREFIX}{suffix}"
        elif dest in BENCH_DEFAULTS:
            setattr(args, dest, BENCH_DEFAULTS[dest])
    return given


def _config_origin(path: str | None, data: dict, overrides: list[str], key: str) -> str:
    """Where the run config's ``key`` (``"section.name"``) came from: the last ``--set`` of it, else the
    config file when it has the key (``data``: the file's parsed sections), else ``"default"``."""
    for text in reversed(overrides):
        if text.split("=", 1)[0].strip() == key:
            return f"--set {text}"
    section, name = key.split(".")
    body = data.get(section)
    if path is not None and isinstance(body, dict) and name in body:
        return f"config file {path}"
    return "default"


def resolve_bench_values(args: argparse.Namespace, given: dict[str, str], cfg) -> tuple[dict, dict[str, str]]:
    """The recipe and tp / ep that ``bench-layers`` measures, and where each came from.

    A flag (or its ``TE_LAYER_PERF_*`` variable, ``given`` by :func:`_env`) wins; otherwise the run
    config's ``fp8.recipe`` / ``distributed.tp|ep`` (from the config file, a ``--set`` or the
    config default). Returns ``({"recipe": str, "tp": int, "ep": int}, {same keys: source})``.

    Raises:
        ConfigError: the config file cannot be read (``fp8kit.config.read_config_file``).
    """
    from fp8kit.config import read_config_file

    data = read_config_file(args.config) if args.config is not None else {}
    values, sources = {}, {}
    for dest, key in CONFIG_KEYS.items():
        if getattr(args, dest) is not None:
            values[dest], sources[dest] = getattr(args, dest), given[dest]
        else:
            section, name = key.split(".")
            values[dest] = getattr(getattr(cfg, section), name)
            sources[dest] = _config_origin(args.config, data, args.overrides, key)
    return values, sources


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
    from fp8kit.base.console import make_console

    console = make_console()
    if args.command == "plan":
        if args.list_policies:
            from fp8kit.selective.policy import list_builtin_policies, load_policy

            for name in list_builtin_policies():
                note = load_policy(f"builtin:{name}").metadata.get("note")
                print(f"builtin:{name}" + (f"  (note: {note})" if note else ""))
            return 0
        return _plan(load_cli_config(args), args.json, console)
    if args.command == "merge-policy":
        from fp8kit.selective.policy import merge_reports

        out = Path(args.output).resolve()
        same = [r for r in args.reports if Path(r).resolve() == out]
        if same:
            raise PolicyError(f"merge-policy: --output {args.output!r} is one of the --reports (it would be "
                              f"overwritten by the policy); give the policy another file name")
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
    from fp8kit.config.options import options_from_config
    from fp8kit.models.build import build_hf_config, build_model
    from fp8kit.selective.decide import decide, decision_notes
    from fp8kit.selective.report import print_report
    from fp8kit.selective.sites import find_sites

    hf_cfg = build_hf_config(cfg.model, cfg.data.vocab_size)
    model = build_model(cfg.model, cfg.data.vocab_size, device="meta")
    options = options_from_config(cfg, hf_cfg)
    sites = find_sites(model)
    decisions = decide(sites, options)
    auto_note = _plan_auto(cfg, sites, decisions, options) if options.auto is not None else None
    if auto_note is not None:
        decisions, auto_note = auto_note
    if cfg.distributed.tp > 1:  # what a GPU run would refuse: an FP8 linear whose tp shard its recipe cannot run
        from fp8kit.parallel.parallelize import check_tp_shards

        check_tp_shards(model, decisions, cfg.distributed.tp)
    if as_json:
        print(json.dumps([d.to_dict() for d in decisions], indent=1))
        return 0
    for w in [*options.warnings, *decision_notes(decisions, options)]:
        console.print(f"[bold yellow]warning:[/] {w}")
    d = cfg.distributed
    console.print(
        f"plan: {cfg.model.describe()}, {cfg.train.mixed_precision} {cfg.fp8.recipe}, "
        f"tp={d.tp} ep={d.ep}, num_tokens={options.num_tokens}"
        + (f", policy {cfg.selective.fp8_dynamic_policy_path}" if cfg.selective.selective_fp8 == "policy" else "")
        + (", selective_fp8 = auto" if cfg.selective.selective_fp8 == "auto" else "")
    )
    if auto_note:
        console.print(f"[bold yellow]note:[/] {auto_note}")
    print_report(decisions, console, title="FP8 plan", detail=True)
    return 0


def _plan_auto(cfg, sites, decisions, options):
    """``selective_fp8 = "auto"`` in ``plan``: nothing is measured; on a machine with a GPU the cached timings of
    that GPU decide the shapes they cover. Returns ``(decisions, note)``, or None when there is nothing to say."""
    from dataclasses import replace

    import torch

    if cfg.train.mixed_precision != "fp8" or not any(d.is_fp8 for d in decisions):
        return None
    if not torch.cuda.is_available():
        return decisions, ('selective_fp8 = "auto": plan measures nothing and this machine has no GPU, so the static '
                           "rules are shown; `fp8kit train` on CUDA times the FP8 candidates at start-up (cached)")
    from fp8kit.base.runtime import device_name
    from fp8kit.bench.auto import lookup_cached, run_auto_options, run_units
    from fp8kit.config.prepare_options import weight_cache_requested
    from fp8kit.data.tokenizer import resolve_cache_dir
    from fp8kit.selective.auto import distinct_shapes
    from fp8kit.selective.auto_cache import AutoCache
    from fp8kit.selective.decide import decide

    device = torch.device("cuda")
    auto = run_auto_options(options.auto, cfg, device)
    units = run_units(decisions, cfg, auto)
    # no mesh: FSDP2 or not from the config's dp sizes
    timings = lookup_cached(units, cfg, device, AutoCache(resolve_cache_dir(cfg.data.cache_dir)))
    total = len(distinct_shapes(units))
    note = (f'selective_fp8 = "auto": {len(timings)} of {total} shapes cached for {device_name(device)}'
            + ("" if len(timings) == total else "; the others keep their static rule here and are timed by "
               "`fp8kit train` at start-up"))
    if weight_cache_requested(cfg) and cfg.distributed.dp_shard == -1 and cfg.distributed.dp_replicate == 1:
        # train's mesh decides; plan sees no launch: dp_shard = -1 under torchrun fills the mesh with FSDP2, which
        # turns the weight cache off, so that run's timings are keyed without train.grad_accum's accumulation
        note += ("; looked up as one process (distributed.dp_shard = -1): for a torchrun launch with FSDP2 set "
                 "distributed.dp_shard to its size to see the timings that run caches")
    return decide(sites, replace(options, auto=replace(auto, timings=timings))), note


def _bench(args: argparse.Namespace, console) -> int:
    from fp8kit.bench.layers import BenchLayersArgs, auto_sweep, parse_shape_sweep, run_bench_layers
    from fp8kit.config.options import grouped_for_fp8, requested_fast_accum
    from fp8kit.selective.policy import merge_reports

    given = _env(args)
    cfg = load_cli_config(args)
    values, sources = resolve_bench_values(args, given, cfg)
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
        model=cfg.model, vocab_size=cfg.data.vocab_size, **values, sources=sources,
        precisions=tuple(p.strip() for p in args.precisions.split(",") if p.strip()),
        warmup=args.warmup, iters=args.iters, retime=args.retime,
        shape_sweep=parse_shape_sweep(args.shape_sweep) if args.shape_sweep else auto_sweep(args.max_tokens),
        device=args.device, simulate_tp=args.simulate_tp, compile=args.compile, dynamic=args.dynamic,
        blockwise_wgrad_x=cfg.fp8.blockwise_wgrad_x, fast_accum=requested_fast_accum(cfg.fp8),
        delayed_fused_cast=cfg.fp8.delayed_fused_cast,
        grouped=grouped_for_fp8(cfg.fp8.model_copy(update={"recipe": values["recipe"]})),
    )
    recipe_info(values["recipe"], sources["recipe"])  # an unknown recipe: its error before anything is printed
    main_rank = launched_rank() == 0
    if main_rank:
        simulated = "; simulated on one device" if args.simulate_tp and values["tp"] > 1 else ""
        console.print("bench-layers measures " + ", ".join(
            f"{k} {values[k]} ({sources[k]}{simulated if k == 'tp' else ''})" for k in CONFIG_KEYS),
            soft_wrap=True, markup=False, highlight=False)
    report = run_bench_layers(bench_args, console)
    if not main_rank:
        return 0
    _print_speedups(report, console)
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        console.print(f"report written to {args.report}")
    elif not args.policy:
        console.print("note: the timings were not saved (--report R.json keeps them for merge-policy)")
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
              + (" (simulated)" if report["simulated_tp"] else "")
              + f", {report['recipe']}, {report['device']}",
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
            t.add_row(kind, "", f"etp={r.etp},num_gemms={r.num_gemms}", str(r.min_tokens),
                      f"{r.measured_speedup:.3f}")
    console.print(t)
    if not t.row_count:
        console.print(f"[bold yellow]note:[/] no measured site reached the speed-up threshold "
                      f"{policy.speedup_threshold}: with this policy every site stays BF16")
    if policy.metadata.get("note"):
        console.print(f"[bold yellow]note:[/] {policy.metadata['note']}")
