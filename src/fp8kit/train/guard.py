"""Divergence guard (``train.on_divergence``): stop (the default), or roll back, skip and continue.

``stop``: a non-finite loss or gradient norm ends the run (``TrainingDiverged``, exit status 1), as before.

``recover``: after each optimizer step the guard checks for

- a non-finite loss or gradient norm, or
- a loss spike: ``loss > train.spike_factor x`` the mean of the last 100 accepted steps' losses (checked
  once 5 losses are known; the spiking step does not enter the mean),

and on such an event (at most ``train.max_recoveries`` times; the next one stops the run as ``stop`` would):

1. rolls back to the last rollback point: model, optimizer, LR schedule, RNG, delayed-scaling histories
   and the loss window as they were after the last checkpoint step (every ``train.checkpoint_every`` steps,
   and the run's first step); if the run diverges again from that point before the next one is taken,
   the next recovery goes back to the point before it (two are kept), in case the last one was taken
   while the run was already going wrong;
2. skips the batches that led to the event: the data position stays where the event left it, so the
   micro-batches of the rolled-back steps are never seen again (PaLM, arXiv:2204.02311 section 5.1,
   restarts about 100 steps before a spike and skips 200-500 batches);
3. moves FP8 linear layers to BF16 for ``train.recover_bf16_steps`` steps (``train.recover_layers``:
   ``worst``: layers whose latest FP8 health stats (``fp8.stats_every``) show non-finite values, plus the five
   with the highest underflow / saturation fraction; all FP8 linear layers when no stats were taken or
   none is unhealthy; ``all``: every FP8 linear layer), through the same module swapper as the precision
   schedule (``parallel.convert.restore_bf16`` / ``apply_fp8``), after which they return to FP8;
4. continues from the rollback step; the event ``{"step", "event": "recovery", "cause", "rolled_back_to",
   "skipped_micro_batches", "layers_to_bf16", "bf16_until_step"}`` goes into the metrics (and the summary).

Rollback points are kept **in memory**: CPU copies of the model and optimizer state dicts (plus scheduler,
data position, RNG), taken at each checkpoint step, so a rollback reads no file and waits for no
background write. The two kept cost twice the model plus optimizer state in host memory (e.g. 2 x 6 bytes
per parameter for bf16 AdamW, 2 x 16 with fp32 master weights) and one device-to-host copy per checkpoint. FP8
MoE experts (grouped GEMMs) are rolled back but not moved to BF16. Rollback points and BF16 windows are
not saved in checkpoints: a resumed run starts without them. Single-process runs only (``fp8kit train``
refuses ``recover`` under torchrun).
"""

from __future__ import annotations

import copy
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console

from fp8kit.parallel.convert import apply_fp8, restore_bf16
from fp8kit.train import checkpoint as ckpt
from fp8kit.train.health import WORST_K, FP8HealthMonitor, badness
from fp8kit.train.loop import LoopResult, modules_swapped, run_loop, set_precision
from fp8kit.train.setup import Setup, phase_at

#: Losses of the running mean (the spike reference) and how many must be known before spikes count.
LOSS_WINDOW = 100
MIN_LOSSES = 5


@dataclass(frozen=True)
class LrSpike:
    """A deterministic fault for tests (the guard's test seam): the learning rate times ``factor`` for
    one optimizer step, the first time 0-based step ``step`` runs. A recovered run that replays the step
    does not see it again (a transient fault, like a bad batch that is skipped)."""

    step: int
    factor: float


@dataclass
class _Snapshot:
    step: int  # completed optimizer steps
    state: dict = field(repr=False)
    losses: list[float] = field(default_factory=list)


def _cpu_copy(obj):
    """``obj`` with every tensor copied to the CPU (containers rebuilt; other values deep-copied)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


class DivergenceGuard:
    """The per-step checks, rollback points and forced-BF16 layers of ``train.on_divergence`` (module doc).

    Args:
        setup: the run.
        faults: test faults (:class:`LrSpike`), each applied once.
    """

    def __init__(self, setup: Setup, faults: list[LrSpike] | tuple[LrSpike, ...] = ()):
        t = setup.cfg.train
        self.setup = setup
        self.recover = t.on_divergence == "recover"
        self.losses: deque[float] = deque(maxlen=LOSS_WINDOW)
        self.snapshots: list[_Snapshot] = []  # the last two rollback points, newest last
        self._retried: int | None = None  # step of the rollback point the last recovery went back to
        self.forced: dict[str, int] = {}  # plain FQN -> 0-based step at which the layer returns to FP8
        self.events: list[dict] = []
        self.recoveries = 0
        self.last_health: list[dict] | None = None
        self.faults = {f.step: f for f in faults}  # 0-based step -> fault not applied yet

    # -- per step (called by run_loop) ---------------------------------------------------------------
    def before_step(self, step: int, phase: str, say) -> None:
        """At the top of 0-based ``step`` (after a precision-schedule switch): apply the test fault, return
        layers whose BF16 window ended to FP8, keep the others in BF16."""
        s = self.setup
        fault = self.faults.pop(step, None)
        if fault is not None:
            for g in s.optimizer.param_groups:  # the scheduler sets lr again at its next step
                g["lr"] = g["lr"] * fault.factor
            say(f"step {step}: injected fault: learning rate x {fault.factor:g} for this step")
        back = sorted(f for f, until in self.forced.items() if step >= until)
        for f in back:
            del self.forced[f]
        if phase != "fp8":
            return
        n = 0
        if back:
            n += apply_fp8(s.model, [d for d in s.decisions if d.fqn in set(back)], s.prepared.conversion)
            say(f"step {step}: {len(back)} layers back to FP8 after their BF16 window")
        if self.forced:
            n += restore_bf16(s.model, fqns=set(self.forced))
        modules_swapped(s, n)

    def observe(self, done: int, loss: float) -> str | None:
        """After step ``done`` (1-based) with a finite loss and gradient norm: the cause of a loss spike,
        or None (then the loss joins the window and, at a checkpoint step, a rollback point is taken)."""
        if not self.recover:
            return None
        factor = self.setup.cfg.train.spike_factor
        if len(self.losses) >= MIN_LOSSES:
            mean = statistics.fmean(self.losses)
            if loss > factor * mean:
                return f"loss spike: {loss:.4g} > {factor:g} x running mean {mean:.4g}"
        self.losses.append(loss)
        every = self.setup.cfg.train.checkpoint_every
        if every and done % every == 0:
            self.take_snapshot(done)
        return None

    # -- rollback ------------------------------------------------------------------------------------
    def take_snapshot(self, done: int) -> None:
        """Keep the training state after ``done`` steps as the rollback point (CPU copies); a state whose
        weights are not all finite (this step's update blew up; its loss was computed before it) is not
        kept: the next step diverges and goes back to the previous point."""
        s = self.setup
        model = s.model.state_dict()
        floats = [t for t in model.values() if t.is_floating_point()]
        if floats and not bool(torch.stack([torch.isfinite(t).all() for t in floats]).all()):
            return  # checked on the device: one host sync
        state = _cpu_copy({
            "model": model,
            "optimizer": s.optimizer.state_dict(),
            "scheduler": s.scheduler.state_dict(),
            "data": s.data.packed.state_dict(),
            "rng": ckpt.rng_state(s.device),
            "delayed": s.prepared.conversion.delayed.state_dict(),
        })
        self.snapshots = [*self.snapshots[-1:], _Snapshot(done, state, list(self.losses))]

    def try_recover(self, result: LoopResult, writer, say) -> bool:
        """After a run segment ended on an event: roll back and return True, or record why not and return
        False (``stop``, or ``train.max_recoveries`` reached)."""
        if not self.recover or not result.records or not self.snapshots:
            return False
        t = self.setup.cfg.train
        last = result.records[-1]
        done, cause = last["step"], _cause(last, result.diverged)
        if self.recoveries >= t.max_recoveries:
            event = {"step": done, "event": "divergence", "cause": cause,
                     "note": f"train.max_recoveries = {t.max_recoveries} reached: stopping"}
            writer.write(event)
            self.events.append(event)
            return False
        if self._retried == self.snapshots[-1].step and len(self.snapshots) > 1:
            self.snapshots.pop()  # diverged again from the newest point: go back one further
        s, snap = self.setup, self.snapshots[-1]
        self._retried = snap.step
        skip_to = s.data.packed.state_dict()  # after the event's batches: they are skipped
        s.model.load_state_dict(snap.state["model"])
        s.optimizer.load_state_dict(snap.state["optimizer"])
        s.scheduler.load_state_dict(copy.deepcopy(snap.state["scheduler"]))
        s.data.packed.load_state_dict(skip_to)
        ckpt.set_rng_state(snap.state["rng"], s.device)
        s.prepared.conversion.delayed.load_state_dict(snap.state["delayed"], s.device)
        self.losses = deque(snap.losses, maxlen=LOSS_WINDOW)
        layers = self.choose_layers() if t.recover_bf16_steps else []
        until = snap.step + t.recover_bf16_steps
        for f in layers:
            self.forced[f] = max(until, self.forced.get(f, 0))
        set_precision(s, phase_at(s.cfg, snap.step))  # run_loop starts from the rollback step's phase
        s.start_step = snap.step
        self.recoveries += 1
        event = {
            "step": done, "event": "recovery", "cause": cause, "recovery": self.recoveries,
            "rolled_back_to": snap.step, "skipped_micro_batches": (done - snap.step) * t.grad_accum,
            "layers_to_bf16": layers, "bf16_until_step": until if layers else None,
        }
        writer.write(event)
        self.events.append(event)
        say(f"[bold yellow]recovery {self.recoveries}/{t.max_recoveries}[/] at step {done} ({cause}): rolled back "
            f"to step {snap.step}, skipped {event['skipped_micro_batches']} micro-batches, {len(layers)} layers "
            f"in BF16 until step {until}")
        return True

    def choose_layers(self) -> list[str]:
        """The FP8 linear layers to move to BF16 (``train.recover_layers``; module docstring)."""
        s = self.setup
        fp8 = sorted({d.fqn for d in s.decisions if d.is_fp8 and not d.site.is_grouped})
        if s.cfg.train.recover_layers == "all" or not self.last_health:
            return fp8
        score: dict[str, float] = {}
        for row in self.last_health:
            if row["layer"] in fp8:
                score[row["layer"]] = max(score.get(row["layer"], 0.0), badness(row))
        ranked = sorted((f for f in score if score[f] > 0), key=lambda f: (-score[f], f))
        chosen = {f for f in ranked if math.isinf(score[f])} | set(ranked[:WORST_K])
        return sorted(chosen) or fp8

    def note_health(self, records: list[dict]) -> None:
        """Remember the latest FP8 health rows of ``records`` (the basis of ``recover_layers = "worst"``)."""
        for r in reversed(records):
            if r.get("fp8_health"):
                self.last_health = r["fp8_health"]
                return


def _cause(record: dict, diverged: str | None) -> str:
    loss, gnorm = record.get("loss"), record.get("grad_norm")
    if loss is None or not math.isfinite(loss):
        return f"non-finite loss ({loss})"
    if gnorm is None or not math.isfinite(gnorm):
        return f"non-finite gradient norm ({gnorm})"
    return diverged or "loss spike"


def run_training(setup: Setup, out_dir: Path, writer, console: Console, stop=None, *,
                 fault: LrSpike | list[LrSpike] | None = None) -> LoopResult:
    """:func:`fp8kit.train.loop.run_loop` with FP8 health stats (``fp8.stats_every``) and the divergence
    guard (``train.on_divergence``): after a recovery the loop runs again from the rollback step.

    Args:
        stop: the preemption signals (:class:`fp8kit.train.preempt.StopSignals`), passed to the loop.
        fault: test faults (:class:`LrSpike`, or a list of them).

    Returns:
        The run's :class:`LoopResult` (records of every segment, rolled-back steps included; ``events``:
        the recovery events).
    """
    cfg = setup.cfg
    health = None
    if cfg.fp8.stats_every:
        health = FP8HealthMonitor(setup.model, cfg.fp8.stats_every, compile_stats=setup.device.type == "cuda")
    faults = [fault] if isinstance(fault, LrSpike) else list(fault or [])
    guard = DivergenceGuard(setup, faults) if cfg.train.on_divergence == "recover" or faults else None
    if guard is not None and guard.recover:
        guard.take_snapshot(setup.start_step)
    total = LoopResult()
    try:
        while True:
            part = run_loop(setup, out_dir, writer, console, stop, guard=guard, health=health)
            total.records += part.records
            total.switches += part.switches
            total.checkpoints += part.checkpoints
            total.wall_s += part.wall_s
            total.diverged, total.interrupted = part.diverged, part.interrupted
            if guard is None or not part.diverged:
                break
            guard.note_health(part.records)
            if not guard.try_recover(part, writer, console.print):
                break
            total.diverged = None
    finally:
        if health is not None:
            health.close()
    total.events = list(guard.events) if guard is not None else []
    return total
