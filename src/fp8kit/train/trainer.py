"""``fp8kit train``: set up (checked, nothing written) -> run directory -> loop -> summary.

Under torchrun every rank runs this function; only global rank 0 writes the run directory (config,
reports, metrics, summary) and prints. Distributed checkpoints are written by all ranks (DCP).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console

from fp8kit.base.console import make_console, stage_status
from fp8kit.base.runtime import barrier, is_main, launched_rank, launched_world_size
from fp8kit.config import RunConfig, save_config
from fp8kit.moe.expert_parallel import dispatch_format
from fp8kit.optim.memory import format_state_bytes
from fp8kit.selective.decide import summarize
from fp8kit.selective.report import auto_summary, print_auto_table, print_report, save_report
from fp8kit.train.export import save_run_files
from fp8kit.train.guard import LrSpike, run_training
from fp8kit.train.loggers import RunLoggers, check_loggers
from fp8kit.train.loop import LoopResult, TrainingDiverged, run_loop
from fp8kit.train.metrics import read_metrics
from fp8kit.train.preempt import StopSignals, signal_name
from fp8kit.train.rundir import check_writable, create_run_dir, default_run_dir, plan_resume
from fp8kit.train.setup import Setup, build_setup, restore
from fp8kit.train.summary import print_summary, save_summary, summarize_run


@dataclass
class TrainResult:
    """What a finished run returns: its directory, summary numbers and all metric records."""

    out_dir: Path
    summary: dict
    metrics: list[dict]
    loop: LoopResult

    @property
    def interrupted(self) -> int:
        """The signal number the run stopped for (preemption; 0: it ran to its end)."""
        return self.loop.interrupted


def train(
    cfg: RunConfig,
    out_dir: str | Path | None = None,
    *,
    resume: str | Path | None = None,
    console: Console | None = None,
    fault: LrSpike | list[LrSpike] | None = None,
) -> TrainResult:
    """Train ``cfg`` into ``out_dir`` (default ``runs/<time>-<preset>-<precision>``).

    With ``resume`` (a run directory or a checkpoint directory; default ``train.resume``) training
    continues from that checkpoint exactly: model, optimizer, LR schedule, data position, RNG and
    precision phase; the run directory defaults to the resumed one. ``resume="auto"``: continue from
    ``out_dir``'s latest complete checkpoint if it has one, else start fresh there
    (:func:`fp8kit.train.rundir.plan_resume`).

    SIGTERM, SIGINT or SIGUSR1 during the loop stop the run after the current step with a checkpoint
    and status ``interrupted`` (:mod:`fp8kit.train.preempt`); the result's ``interrupted`` is then the
    signal number (``fp8kit train`` exits with 128 + it).

    ``fault``: deterministic faults for tests of the divergence guard (:class:`fp8kit.train.guard.LrSpike`).

    Raises:
        Fp8kitError: bad input of any kind, before anything is written; TrainingDiverged when the
            loss becomes NaN/inf (metrics and summary are written first).
    """
    console = console or make_console()
    launched = launched_world_size() > 1
    if launched and launched_rank() != 0:
        console = Console(quiet=True)  # only rank 0 prints
    from_config = resume is None and bool(cfg.train.resume)
    plan = plan_resume(cfg.train.resume if from_config else resume,
                       Path(out_dir) if out_dir is not None else None,
                       where="train.resume =" if from_config else "--resume")
    resume_path, resume_run = plan.checkpoint, plan.into_run
    check_loggers(cfg.train.log_to)  # a missing tensorboard / wandb package: one line, nothing written
    if out_dir is None:
        name = Path(cfg.model.pretrained).name if cfg.model.pretrained else (
            cfg.model.preset if not cfg.model.hf_config else "custom")
        out_dir = resume_run or default_run_dir(name, cfg.train.mixed_precision)
    out_dir = Path(out_dir)
    resuming_here = resume_run is not None and out_dir.resolve() == resume_run.resolve()
    check_writable(out_dir, resuming_here=resuming_here)

    if cfg.train.cuda_graphs:
        torch._dynamo.reset()  # an earlier run of this process (fp8kit compare's BF16 run) left its graph trees
    with stage_status(console, "setting up") as (update, warn):
        setup = build_setup(cfg, resume=resume_path, status=update, warn=warn)
    asked_granularity = cfg.optim.granularity
    cfg = setup.cfg  # resolved (model.pretrained sets data.vocab_size / data.tokenizer)
    done = int(setup.resume_state["step"]) if setup.resume_state is not None else 0
    if done >= cfg.train.steps > 0:  # a finished run resumed (a requeued job, --resume auto), its set-up checked
        return _nothing_to_train(resume_path, done, cfg, out_dir if resuming_here else None, console)
    main = True
    if setup.distributed:
        import torch.distributed as dist

        main = is_main()
        box = [str(out_dir)]
        dist.broadcast_object_list(box, src=0)  # the default name holds the time: take rank 0's
        out_dir = Path(box[0])
    restore(setup)

    if main:
        create_run_dir(out_dir)
        # optim.granularity = auto stays auto in the record (the run prints and summarises what it chose): a resume
        # reads this file, and auto resumes with the checkpoint's scales in one process and per tensor under torchrun
        recorded = cfg if asked_granularity != "auto" else cfg.model_copy(
            update={"optim": cfg.optim.model_copy(update={"granularity": "auto"})})
        save_config(recorded, out_dir / "resolved_config.toml")
        (out_dir / "run_info.json").write_text(json.dumps(setup.info, indent=1) + "\n", encoding="utf-8")
        save_run_files(setup, out_dir)  # tokenizer/ (HF layout) + model_config.json, for `fp8kit export`
    if not main:
        return _train_other_rank(setup, out_dir, console)
    header = {
        "model": cfg.model.describe(),
        "mixed_precision": cfg.train.mixed_precision,
        "recipe": cfg.fp8.recipe,
        "device": setup.info["device"],
        "selective_fp8": cfg.selective.selective_fp8,
        "policy": cfg.selective.fp8_dynamic_policy_path,
        "warnings": "; ".join(setup.warnings) or "none",
    }
    save_report(setup.decisions, out_dir, header)
    _print_start(setup, console)
    if plan.auto:
        start = f"continuing from {resume_path}" if resume_path else f"no checkpoint in {out_dir}: step 0"
        console.print(f"--resume auto: {start}")

    writer = RunLoggers(out_dir, cfg.train.log_to, truncate_after_step=setup.start_step if resuming_here else None,
                        run_name=out_dir.name, config=cfg.to_dict())
    try:
        with StopSignals() as stop:  # SIGTERM / SIGINT / SIGUSR1: checkpoint after this step and stop
            loop = run_training(setup, out_dir, writer, console, stop, fault=fault)  # + health stats, guard
    finally:
        writer.close()
    records = read_metrics(out_dir / "metrics.jsonl")
    desc = {
        "model": cfg.model.describe(),
        "params_m": setup.params["total"] / 1e6,
        "precision": _precision_desc(cfg, setup.info.get("fast_accum"), setup.info.get("weight_cast_reuse")),
        "optimizer": _optim_desc(cfg),
        "state_bytes_per_param": setup.info["training_state_bytes"]["total"],
        "fp8_sites": " ".join(filter(None, [f"{summarize(setup.decisions)['fp8_sites']} of {len(setup.decisions)}",
                                            auto_summary(setup.info.get("selective_auto", {}))])),
        "wall_s": loop.wall_s,
        "status": "diverged" if loop.diverged else ("interrupted" if loop.interrupted else "ok"),
        "switches": loop.switches,
        "parallel": _parallel_desc(setup),
        "parallel_notes": setup.info["parallel"]["notes"],  # fallbacks and settings without effect (warnings)
        "parallel_facts": setup.info["parallel"]["facts"],  # e.g. how many SwiGLU MLPs run fused
        "world_size": setup.info["parallel"]["world_size"],
        "fp8_stats_every": cfg.fp8.stats_every,
        "recoveries": [r for r in read_metrics(out_dir / "metrics.jsonl", events=True) if "event" in r],
    }
    # the step this session started from: `done`, not setup.start_step, which a divergence rollback moves back
    summary = summarize_run(records, switches=[s for s, _ in loop.switches], info=setup.info, setup_desc=desc,
                            session_from=done)
    if loop.interrupted:
        summary["interrupted_at_step"] = records[-1]["step"] if records else setup.start_step
        summary["signal"] = signal_name(loop.interrupted)
    save_summary(summary, out_dir)
    print_summary(summary, console)
    console.print(f"run directory: {out_dir}")
    if loop.interrupted:
        console.print(
            f"[bold yellow]interrupted[/] by {summary['signal']} after step {summary['interrupted_at_step']} "
            f"(checkpoint {loop.checkpoints[-1] if loop.checkpoints else '-'}); the same command with "
            f"--resume auto, or --resume {out_dir}, continues it"
        )
    if loop.diverged:
        raise TrainingDiverged(f"training diverged: {loop.diverged}; metrics and summary are in {out_dir}")
    barrier()  # torchrun: no rank ends (and gets the others stopped) before rank 0 has written the run
    return TrainResult(out_dir, summary, records, loop)


def _nothing_to_train(resume_path: Path, step: int, cfg: RunConfig, out_dir: Path | None,
                      console: Console) -> TrainResult:
    """A resumed checkpoint already at ``train.steps`` (after every compatibility check of the set-up): say so and
    return the run as it is (its summary and metrics untouched, nothing written), so a job requeued after it
    finished ends successfully. ``out_dir``: the resumed run's own directory, else ``None`` (nothing created)."""
    console.print(
        f"nothing to train: {resume_path} is at step {step} and train.steps = {cfg.train.steps}; "
        f"{f'the run directory {out_dir} is left as it is' if out_dir else 'nothing was written'} "
        f"(raise train.steps, e.g. --set train.steps={max(step, cfg.train.steps) * 2}, to train further)"
    )
    summary, records = {}, []
    if out_dir is not None and (out_dir / "summary.json").is_file():
        summary = json.loads((out_dir / "summary.json").read_text(encoding="utf-8"))
    if out_dir is not None and (out_dir / "metrics.jsonl").is_file():
        records = read_metrics(out_dir / "metrics.jsonl")
    return TrainResult(out_dir or Path(resume_path), summary, records, LoopResult())


def _train_other_rank(setup: Setup, out_dir: Path, console: Console) -> TrainResult:
    """A rank other than 0: the same loop (collectives, DCP checkpoints), nothing written but checkpoints."""

    class _NoWriter:
        def write(self, record: dict) -> None:
            pass

        def close(self) -> None:
            pass

    with StopSignals() as stop:
        loop = run_loop(setup, out_dir, _NoWriter(), console, stop)
    if loop.diverged:
        raise TrainingDiverged(f"training diverged: {loop.diverged}")
    barrier()  # until rank 0 has written the summary
    return TrainResult(out_dir, {}, loop.records, loop)


def _parallel_desc(setup: Setup) -> str:
    p = setup.info["parallel"]
    if p["world_size"] == 1:
        return "single process" + (f" ({' -> '.join(p['steps'])})" if p["steps"] else "")
    desc = f"{p['world_size']} ranks: dp_replicate {p['dp_replicate']} x dp_shard {p['dp_shard']} x tp {p['tp']}"
    desc += f" ({' -> '.join(p['steps'])})"
    if setup.cfg.train.mixed_precision == "fp8" and (p["dp_shard"] > 1 or p["dp_replicate"] > 1):
        desc += ", FP8 all-gather" if p["fp8_all_gather"] else ", BF16 all-gather"
    if p.get("grad_reduce_scatter"):  # distributed.fp8_reduce_scatter (else FSDP2 reduce-scatters in float32)
        desc += f", FP8 {p['grad_reduce_scatter'].upper()} gradient reduce-scatter"
    d = setup.cfg.distributed
    if d.ep > 1:  # the precision of the MoE token dispatch (moe/fp8_dispatch.py); the combine is bf16
        desc += f", EP dispatch: {_dispatch_desc(setup)}"
    return desc


_DISPATCH_WORDS = {"bf16": "bf16", "1x128": "E4M3 + 1x128 scales",
                   "rowwise": "E4M3 rowwise, straight into the FP8 experts"}


def _dispatch_desc(setup: Setup) -> str:
    """The token dispatch of the expert-parallel layers at the start of training (``expert_parallel.dispatch_format``
    per layer), e.g. ``fp8 (E4M3 + 1x128 scales)``, or each format with its layer count when they differ."""
    formats = Counter(dispatch_format(m, setup.device) for m in setup.model.modules()
                      if getattr(m, "ep_group", None) is not None)
    if set(formats) <= {"bf16"}:
        return "bf16"
    if len(formats) == 1:
        return f"fp8 ({_DISPATCH_WORDS[next(iter(formats))]})"
    parts = [f"{_DISPATCH_WORDS[f]}: {n} layer{'s' * (n != 1)}" for f, n in sorted(formats.items())]
    return f"fp8 ({'; '.join(parts)})"


def _precision_desc(cfg: RunConfig, fast_accum: list[str] | None = None,
                    weight_cast_reuse: dict[str, int | None] | None = None) -> str:
    """The run's precision in words; ``fast_accum``: the dense FP8 GEMMs with fast accumulation
    (``setup.run_fast_accum``, None when no dense linear is FP8), e.g. ``fp8 delayed (fast accumulation: fprop,
    wgrad)``; ``weight_cast_reuse``: micro-batches per cast of the FP8 weights (``setup.weight_cast_reuse``), e.g.
    ``...; weights cast once per step of 2 micro-batches``."""
    if cfg.train.mixed_precision != "fp8":
        return "bf16"
    notes = []
    if fast_accum is not None:
        notes.append(f"fast accumulation: {', '.join(fast_accum) or 'none'}")
    if weight_cast_reuse:
        said = {kind: "as decided at the switch to FP8" if n is None else f"once per step of {n} micro-batches"
                if n > 1 else "at every micro-batch" for kind, n in weight_cast_reuse.items()}
        if len(set(said.values())) == 1:
            notes.append(f"weights cast {next(iter(said.values()))}")
        else:
            kinds = {"dense": "dense", "experts": "expert"}
            notes.extend(f"{kinds[kind]} weights cast {how}" for kind, how in said.items())
    if cfg.fp8.bf16_warmup_steps or cfg.fp8.bf16_cooldown_steps:
        notes.append(f"bf16 warmup {cfg.fp8.bf16_warmup_steps}, cooldown {cfg.fp8.bf16_cooldown_steps} steps")
    return f"fp8 {cfg.fp8.recipe}" + (f" ({'; '.join(notes)})" if notes else "")


def _optim_desc(cfg: RunConfig) -> str:
    o = cfg.optim
    if o.name != "fp8_adamw":
        return f"AdamW ({cfg.train.param_dtype} parameters and states)"
    expand = f", {o.m_expand} expansion" if o.m_expand != "none" else ""
    return (f"FP8AdamW (master {o.master}, grad {o.grad}, m {o.m} rounded {o.m_rounding}{expand}, v {o.v}, "
            f"per {o.granularity})")


def _print_start(setup: Setup, console: Console) -> None:
    cfg, info = setup.cfg, setup.info
    console.print(
        f"[bold]fp8kit train[/bold]: {cfg.model.describe()}, {setup.params['total'] / 1e6:.1f}M parameters, "
        f"{_precision_desc(cfg, info.get('fast_accum'), info.get('weight_cast_reuse'))} on {info['device']}"
    )
    console.print(f"data: {info['corpus']}; {info['tokens']:,} tokens ({info['tokenizer']})")
    if cfg.train.mixed_precision == "fp8":  # a bf16 run has no FP8 GEMM to describe
        console.print(f"FP8: {setup.capability}")
    console.print(f"parallel: {_parallel_desc(setup)}")
    choice = f" ({info['optimizer_choice']})" if info.get("optimizer_choice") else ""
    console.print(f"optimizer: {_optim_desc(cfg)}{choice}; training state "
                  f"{format_state_bytes(info['training_state_bytes'])}")
    for w in setup.warnings:
        if w not in setup.shown_warnings:  # set-up printed it already, before its long stages
            console.print(f"[bold yellow]warning:[/] {w}")
    for fact in setup.facts:
        console.print(f"note: {fact}")
    print_auto_table(info.get("selective_auto", {}), console)  # selective_fp8 = "auto": the measured table
    print_report(setup.decisions, console)
    if setup.resume_from is not None:
        console.print(f"resuming from {setup.resume_from} at step {setup.start_step}")
