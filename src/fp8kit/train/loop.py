"""The training loop: precision phases, micro-batches, clipping, AdamW, eval, metrics, checkpoints.

One optimizer step (``grad_accum`` micro-batches)::

    phase = precision_at(step)              # switch FP8 <-> BF16 modules when it changes
    for each micro-batch: logits = model(x); loss = CE(logits.float(), y); (loss / grad_accum).backward()
    grad_norm = clip_grad_norm(params, grad_clip, opt)  # folded into fused AdamW on CUDA (train/clip.py)
    optimizer.step(); scheduler.step(); zero_grad
    loss.item()                             # the one host sync of the step; time is taken after it

With ``train.async_loss`` (off by default: no measured gain, docs/benchmarks.md section 6) the sync of a plain step waits until the next step is queued: the host
fetches the next batch and launches its kernels while the GPU finishes this step, and the step's record,
divergence check and log line follow one step late. Evaluation, checkpoint, FP8-stats and last steps are read
at once (their saves and rollback points follow their own checks). A deferred step's time is the interval between
two steps' results; its peak memory covers both steps.

Fine-tuning (``data.format = "chat"``): a micro-batch is an :class:`fp8kit.data.sft.SFTBatch` (labels ``-100``
off the assistant tokens, position ids restarting per packed sample), and the step's loss is the mean over
its assistant tokens on all ranks (:func:`_loss_scales`: token-weighted micro-batches, one all-reduce).

The model arrives prepared (``fp8kit.parallel.prepare.prepare_model``, called by ``train.setup``: TP -> EP
-> FP8 -> AC -> FSDP2 -> compile). A precision switch swaps modules inside compiled blocks through the same
conversion functions (``fp8kit.parallel.convert``), so the compiled code is dropped
(``torch._dynamo.reset``) and rebuilt on the next step.

Distributed (torchrun, ``setup.distributed``): ``train.micro_batch_size`` is per data-parallel rank. Every
rank draws the same global micro-batch of ``micro_batch_size x dp`` windows and takes its own rows, so the
data order (and its resumable position) is the same for any layout with the same global batch. The loss
and the validation loss are averaged over the data-parallel ranks, the gradient norm is taken over the
DTensor shards (``fp8kit.train.clip``), and tokens/s counts all ranks.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from fp8kit.base.errors import Fp8kitError
from fp8kit.parallel.convert import apply_fp8, count_fp8_modules, restore_bf16
from fp8kit.parallel.parallelize import after_optimizer_step
from fp8kit.parallel.prepare import compile_fp8_heads
from fp8kit.selective.decide import fp8_head
from fp8kit.train import checkpoint as ckpt
from fp8kit.train.async_checkpoint import AsyncCheckpointer
from fp8kit.train.clip import clip_grad_norm
from fp8kit.train.cuda_graphs import keep_gradients, poll_skips, start_watch
from fp8kit.train.host_sync import batch_to_device, no_packed_sequence_check
from fp8kit.train.metrics import MetricsWriter, peak_memory_gib, reset_peak_memory
from fp8kit.train.preempt import StopSignals, agreed_stop, signal_name
from fp8kit.train.setup import Setup, global_batch, phase_at, run_fast_accum

if TYPE_CHECKING:  # pragma: no cover
    from fp8kit.train.guard import DivergenceGuard
    from fp8kit.train.health import FP8HealthMonitor


class TrainingDiverged(Fp8kitError):
    """The loss or the gradient norm became NaN or infinite."""


@dataclass
class LoopResult:
    records: list[dict] = field(default_factory=list)
    switches: list[tuple[int, str]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    diverged: str | None = None
    interrupted: int = 0  # the signal number the run stopped for after its last step (0: not stopped)
    events: list[dict] = field(default_factory=list)  # divergence-guard events (fp8kit.train.guard)


def set_precision(setup: Setup, phase: str) -> int:
    """Put the model in ``phase`` (``fp8``/``bf16``); returns how many modules were swapped."""
    if phase == "fp8":
        n = apply_fp8(setup.model, setup.decisions, setup.prepared.conversion)
    else:
        n = restore_bf16(setup.model)
    modules_swapped(setup, n)
    return n


def modules_swapped(setup: Setup, n: int) -> None:
    """After ``n`` modules were swapped between FP8 and BF16 (the precision schedule, the divergence guard's BF16
    windows): under ``train.compile`` the compiled code is dropped (the swapped modules live inside compiled
    blocks) and an FP8 output head swapped in, which lives outside them, is compiled itself
    (``parallel.prepare.compile_fp8_heads``)."""
    if n and setup.cfg.train.compile:
        torch._dynamo.reset()
        compile_fp8_heads(setup.model, setup.decisions, cuda_graphs=setup.cfg.train.cuda_graphs)


def _loss(setup: Setup, batch) -> torch.Tensor:
    """Mean cross-entropy of one micro-batch: pretraining windows ``[B, T + 1]`` (labels: the inputs shifted),
    or fine-tuning rows (:class:`fp8kit.data.sft.SFTBatch`: labels given, ``-100`` not learnt, position ids
    restarting per packed sample); the mean is over the learnt labels."""
    if isinstance(batch, torch.Tensor):
        batch = batch_to_device(batch, setup.device)  # pinned: no host sync (train/host_sync.py)
        x, y, extra = batch[:, :-1], batch[:, 1:], {}
    else:
        batch = batch.apply(functools.partial(batch_to_device, device=setup.device))  # each tensor pinned, as above
        x, y, extra = batch.input_ids, batch.labels, batch.model_kwargs()
    if setup.cfg.train.cuda_graphs:
        # a new iteration of the CUDA graph trees: the previous forward's outputs may be overwritten from here
        torch.compiler.cudagraph_mark_step_begin()
    # no position ids given (pretraining windows, unpacked fine-tuning rows): the model's own are arange, so
    # transformers' packed-sequence check (a host sync) is skipped; packed fine-tuning rows pass theirs and keep it
    unpacked = no_packed_sequence_check() if not extra else contextlib.nullcontext()
    # train.param_dtype = fp32: FP32 master weights, bf16 matmuls through autocast (standard AMP)
    with unpacked, torch.autocast(setup.device.type, dtype=torch.bfloat16,
                                  enabled=setup.cfg.train.param_dtype == "fp32"):
        logits = setup.model(input_ids=x, **extra).logits  # [B, T, V]
    return setup.loss_fn(logits, y)


def _num_labels(batch) -> int:
    """Learnt labels of a micro-batch: every position of pretraining windows, the assistant tokens of SFT rows."""
    return batch.shape[0] * (batch.shape[1] - 1) if isinstance(batch, torch.Tensor) else batch.num_supervised


def _loss_scales(setup: Setup, micro: list) -> tuple[list[float] | None, int]:
    """``(per micro-batch loss factors, learnt labels of the step on all dp ranks)``.

    Pretraining: ``None`` (each micro-batch loss is divided by ``grad_accum``: every window has the same
    number of labels). Fine-tuning: micro-batches hold different numbers of assistant tokens, so the step's
    loss is the mean over all of them, on all dp ranks: micro-batch ``i`` (a mean over its ``n_i`` labels) is
    weighted ``n_i * dp / N`` with ``N`` the step's labels summed over the ranks (one all-reduce; FSDP2 averages
    gradients over dp). This is the token-weighted gradient accumulation of Hugging Face's Trainer
    (``num_items_in_batch``).
    """
    dp, _ = _dp(setup)
    if isinstance(micro[0], torch.Tensor):
        return None, sum(_num_labels(b) for b in micro) * dp
    counts = [_num_labels(b) for b in micro]  # >= 1 each: every SFT row holds a sample with an assistant token
    total = sum(counts)
    if dp > 1:
        total = round(float(_dp_mean(setup, torch.tensor([float(total)], dtype=torch.float64,
                                                         device=setup.device))[0]) * dp)
    return [n * dp / total for n in counts], total


def _dp(setup: Setup) -> tuple[int, int]:
    """(data-parallel size, this rank's data-parallel index); (1, 0) for a single process."""
    if not setup.distributed:
        return 1, 0
    from fp8kit.parallel.mesh import dp_rank

    return setup.dims.dp, dp_rank(setup.mesh)


def _dp_mean(setup: Setup, values: torch.Tensor) -> torch.Tensor:
    """Average a tensor over the data-parallel ranks (identity for one process)."""
    dp, _ = _dp(setup)
    if dp == 1:
        return values
    import torch.distributed as dist

    from fp8kit.parallel.mesh import dp_group

    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=dp_group(setup.mesh))
    return values / dp


def _max_over_ranks(setup: Setup, value: float) -> float:
    """The largest ``value`` over all ranks (peak memory: the rank that needs the most)."""
    if not setup.distributed:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=setup.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def next_micro_batch(setup: Setup):
    """This rank's ``[micro_batch_size, seq_length + 1]`` rows of the next global micro-batch (fine-tuning:
    an :class:`fp8kit.data.sft.SFTBatch` of ``micro_batch_size`` rows)."""
    mbs = setup.cfg.train.micro_batch_size
    dp, r = _dp(setup)
    batch = setup.data.packed.next_batch(mbs * dp)
    return batch[r * mbs : (r + 1) * mbs] if dp > 1 else batch


def _eval_loss(setup: Setup, batch, rows: int) -> torch.Tensor:
    """:func:`_loss` of a validation batch; one of another row count than ``rows`` (the short last batch) runs
    eagerly under ``train.compile``. Compiled, that one batch would compile the blocks again, and Dynamo would
    mark their batch dimension dynamic for every later compile of them (the next precision phase's too)."""
    if len(batch) != rows and setup.cfg.train.compile:
        with torch.compiler.set_stance("force_eager"):
            return _loss(setup, batch)
    return _loss(setup, batch)


@torch.no_grad()
def evaluate(setup: Setup) -> float:
    """Mean cross-entropy over the fixed validation batches (token-weighted; averaged over dp ranks)."""
    setup.model.eval()
    mbs = setup.cfg.train.micro_batch_size
    dp, r = _dp(setup)
    total, count = 0.0, 0
    for batch in setup.data.packed.val_batches(mbs * dp, setup.cfg.train.eval_batches):
        if dp > 1:
            batch = batch[r * mbs : (r + 1) * mbs]
            if len(batch) == 0:  # a short last batch: keep every rank in the collectives
                batch = setup.data.packed.val_batches(1, 1)[0]
                _eval_loss(setup, batch, mbs)
                continue
        n = _num_labels(batch)
        total += _eval_loss(setup, batch, mbs).item() * n
        count += n
    setup.model.train()
    sums = _dp_mean(setup, torch.tensor([total, float(count)], dtype=torch.float64, device=setup.device))
    return float(sums[0] / sums[1])


def _rate(tokens_per_s: float) -> str:
    """A token rate for the step line: ``"850"``, ``"12.3K"``, ``"1.23M"`` (a slow CPU run is not "0.0K")."""
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    return f"{tokens_per_s / 1e3:.1f}K" if tokens_per_s >= 1e3 else f"{tokens_per_s:.0f}"


def _save(setup: Setup, out_dir: Path, step: int, phase: str, saver: AsyncCheckpointer | None = None) -> str:
    state = {
        "step": step,
        "phase": phase,
        "optimizer": None if setup.distributed else setup.optimizer.state_dict(),
        "scheduler": setup.scheduler.state_dict(),
        "data": setup.data.packed.state_dict(),
        "corpus_content": setup.data.content_fingerprint,  # a resume on other data is refused (check_resume_data)
        "global_batch": global_batch(setup),  # sequences per optimizer step (a resume on another says so)
        "rng": ckpt.rng_state(setup.device),
        "recipe": setup.cfg.fp8.recipe if setup.cfg.train.mixed_precision == "fp8" else None,
        # whether the output head was decided FP8 (fp8.output_head): a resume that changes it says so
        "output_head": fp8_head(setup.decisions),
        # the GEMMs with fast accumulation (fp8.fast_accum resolved; None: not FP8): a resume that changes it says so
        "fast_accum": run_fast_accum(setup.cfg, setup.prepared.conversion, setup.decisions),
        # FP8AdamW's state precision (optim.granularity = auto resumes with its scales; the DCP files do not say)
        "fp8adamw_precision": setup.optimizer.precision.as_dict() if setup.cfg.optim.name == "fp8_adamw" else None,
        "fp8_delayed": setup.prepared.conversion.delayed.state_dict(),  # amax histories (recipe delayed)
        # distributed.fp8_reduce_scatter: the gradient all-reduce's auto-scale factors (plain numbers)
        "grad_comm": setup.prepared.grad_comm.state_dict() if setup.prepared.grad_comm is not None else None,
    }
    directory = out_dir / "checkpoints" / ckpt.checkpoint_name(step)
    if setup.distributed or saver is not None:
        del state["optimizer"]  # in the DCP files, sharded
        state["layout"] = setup.info["parallel"]
        if saver is not None:  # train.async_checkpoint: DCP files written in the background
            return saver.save(directory, setup.model, setup.optimizer, state).name
        return ckpt.save_distributed_checkpoint(directory, setup.model, setup.optimizer, state).name
    return ckpt.save_checkpoint(directory, setup.model, state).name


def train_step(
    setup: Setup, params: list[torch.Tensor], micro: list, scales: list[float] | None, *,
    saver: AsyncCheckpointer | None = None, health: FP8HealthMonitor | None = None, read: bool = True,
) -> tuple[float | torch.Tensor, torch.Tensor, float, object]:
    """One optimizer step over the micro-batches ``micro`` (module docstring): forward and backward of each,
    gradient clipping, the optimizer and scheduler steps, ``zero_grad``, and the step's one host sync.

    Args:
        setup: the prepared run (model, optimizer, scheduler, data, device).
        params: the parameters whose gradients are clipped.
        micro: the step's ``train.grad_accum`` micro-batches (:func:`next_micro_batch`).
        scales: per-micro-batch loss weights of fine-tuning (:func:`_loss_scales`), None for pretraining.
        saver: the asynchronous checkpointer, waited on before the weights change.
        health: FP8 health statistics, collected from the first micro-batch.
        read: read the loss on the host (the step's sync); False returns it as a 0-d device tensor, so the host
            can queue the next step first (``train.async_loss``).

    Returns:
        ``(loss, grad_norm, lr, probe)``: the step's mean loss (a float, or the tensor with ``read=False``;
        averaged over data-parallel ranks),
        the gradient norm (a tensor: reading it is a second sync), the learning rate the step used, and the
        health probe (None off stats steps).
    """
    t, opt, sched = setup.cfg.train, setup.optimizer, setup.scheduler
    loss_sum = torch.zeros((), device=setup.device)
    probe = None
    kept: set[int] = set()  # train.cuda_graphs: parameters whose gradient this step was copied out of the graph pool
    for i, batch in enumerate(micro):
        loss = _loss(setup, batch)
        (loss / t.grad_accum if scales is None else loss * scales[i]).backward()
        loss_sum += loss.detach() if scales is None else loss.detach() * scales[i]
        if t.cuda_graphs and i < len(micro) - 1:
            keep_gradients(params, kept)  # out of the graphs' pool, which the next micro-batch's replay overwrites
        if i == 0 and health is not None:
            probe = health.collect()  # FP8 health of the first micro-batch (None off stats steps)
    if saver is not None:
        saver.before_update()  # the last save's copy of the weights must be complete
    grad_norm = clip_grad_norm(params, t.grad_clip, opt)
    opt.step()
    after_optimizer_step(setup.model, setup.prepared)  # FP8 all-gather: next step's weight scales
    lr = sched.get_last_lr()[0]
    sched.step()
    opt.zero_grad(set_to_none=True)
    loss = _dp_mean(setup, loss_sum / t.grad_accum if scales is None else loss_sum)
    return (loss.item() if read else loss), grad_norm, lr, probe


def run_loop(
    setup: Setup, out_dir: Path, writer: MetricsWriter, console: Console, stop: StopSignals | None = None, *,
    guard: DivergenceGuard | None = None, health: FP8HealthMonitor | None = None,
) -> LoopResult:
    """Train from ``setup.start_step`` to ``train.steps``; see the module docstring.

    With ``stop`` (:mod:`fp8kit.train.preempt`), a stop signal ends the run after the current step with a
    checkpoint at that step (``LoopResult.interrupted``: the signal number). ``guard`` and ``health``:
    the divergence guard and FP8 health stats (:func:`fp8kit.train.guard.run_training` passes them).
    """
    cfg, t = setup.cfg, setup.cfg.train
    model = setup.model
    params = [p for p in model.parameters() if p.requires_grad]
    dp, _ = _dp(setup)
    world = setup.dims.world_size if setup.dims else 1
    tokens_per_step = t.micro_batch_size * t.grad_accum * cfg.data.seq_length * dp  # all ranks
    result = LoopResult()
    # the phase prepare_model converted for (the resume step's phase); switches happen below
    phase = phase_at(cfg, setup.start_step)
    model.train()
    if t.cuda_graphs:
        start_watch(setup.info)  # graphs Inductor runs without CUDA graphs: warned about below
    start = time.perf_counter()
    progress = Progress(
        TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"), console=console, transient=False,
    )
    saver = AsyncCheckpointer(setup.device) if t.async_checkpoint else None
    pending: _StepStats | None = None  # a step whose loss is read at the next step (train.async_loss)
    last_ready = start

    def finish(st: _StepStats, halt: int = 0) -> bool:
        """Read step ``st``'s values (the host sync), then its divergence check, evaluation, metrics record,
        checkpoint and log line. Returns True when the run must stop (diverged or ``halt``)."""
        nonlocal last_ready
        loss_val, gnorm = float(st.loss), float(st.grad_norm)
        health_rows = st.probe.rows() if st.probe is not None else None  # read inside the step's time
        ready = time.perf_counter()
        dt = ready - max(st.t0, last_ready)  # deferred steps: the interval between two steps' results
        last_ready = ready
        done = st.done
        tps = tokens_per_step / dt
        record = {
            "step": done,
            "loss": loss_val,
            "lr": st.lr,
            "grad_norm": gnorm,
            "tokens_per_s": tps,
            "supervised_tokens": st.supervised,  # learnt labels of the step, all ranks (SFT: assistant tokens)
            "tokens_per_s_per_gpu": tps / world,
            "step_ms": dt * 1e3,
            "peak_mem_gib": _max_over_ranks(setup, peak_memory_gib(setup.device)),
            "state_bytes_per_param": setup.info["training_state_bytes"]["total"],
            "mfu": (tps / world * setup.flops_per_token / setup.peak_flops) if setup.peak_flops else None,
            "precision": st.phase,
            "fp8_modules": st.fp8_modules,
            "epoch": st.epoch,
        }
        if not (math.isfinite(loss_val) and math.isfinite(gnorm)):
            result.diverged = f"loss {loss_val} / grad norm {gnorm} at step {done}"
        elif guard is not None:
            result.diverged = guard.observe(done, loss_val)  # a loss spike (train.on_divergence = recover)
        if health_rows is not None:
            record["fp8_health"] = health_rows
        if halt:
            record.update(status="interrupted", signal=signal_name(halt))
            result.interrupted = halt
        if (t.eval_every and done % t.eval_every == 0) or done == t.steps or result.diverged:
            record["val_loss"] = evaluate(setup) if not result.diverged else None
        writer.write(record)
        result.records.append(record)
        every = t.checkpoint_every and done % t.checkpoint_every == 0
        if (every or (done == t.steps and t.final_checkpoint) or halt) and not result.diverged:
            result.checkpoints.append(_save(setup, out_dir, done, st.phase, saver))
        progress.update(task, completed=done, info=f"loss {loss_val:.4f} {st.phase} {_rate(tps)} tok/s")
        if done % t.log_every == 0 or done == t.steps or "val_loss" in record:
            val = f" val {record['val_loss']:.4f}" if record.get("val_loss") is not None else ""
            progress.console.print(
                f"step {done:>6}/{t.steps} loss {loss_val:.4f}{val} lr {st.lr:.2e} gnorm {gnorm:.3f} "
                f"{st.phase} {dt * 1e3:.0f} ms {_rate(tps)} tok/s"
                + (f" ({_rate(tps / world)}/{'GPU' if setup.device.type == 'cuda' else 'rank'})" if world > 1 else "")
            )
        return bool(result.diverged or halt)

    with progress, _finishing(saver):
        task = progress.add_task("train", total=t.steps, completed=setup.start_step, info="")
        for step in range(setup.start_step, t.steps):
            want = phase_at(cfg, step)
            if want != phase:
                n = set_precision(setup, want)
                result.switches.append((step, want))
                progress.console.print(f"step {step}: precision switch {phase} -> {want} ({n} modules swapped)")
                phase = want
            if guard is not None:
                guard.before_step(step, phase, progress.console.print)  # forced-BF16 layers, test fault
            if health is not None:
                health.arm(step + 1)  # hooks armed on stats steps (fp8.stats_every)
            if pending is None:  # a deferred step's peak is read with the next one's (one window)
                reset_peak_memory(setup.device)
            t0 = time.perf_counter()
            micro = [next_micro_batch(setup) for _ in range(t.grad_accum)]
            scales, supervised = _loss_scales(setup, micro)  # None: pretraining; SFT: token-weighted
            loss, grad_norm, lr, probe = train_step(setup, params, micro, scales, saver=saver, health=health,
                                                    read=False)
            done = step + 1
            for lost in poll_skips(setup.info) if t.cuda_graphs else ():
                progress.console.print(f"[bold yellow]warning:[/] {lost}")
            stats = _StepStats(done, t0, loss, grad_norm, lr, probe, phase, supervised,
                               count_fp8_modules(model) if phase == "fp8" else 0, setup.data.packed.epoch_fraction)
            if pending is not None:  # the previous step, read now that this one is queued on the device
                finish(pending)
                pending = None
                if result.diverged:  # seen one step late: this step's update is dropped with the run
                    break
            # a stop signal (preemption), agreed by all ranks: checkpoint this step and end
            halt = 0 if done == t.steps else agreed_stop(stop, distributed=setup.distributed, device=setup.device)
            if t.async_loss and not halt and probe is None and not _needs_values(t, done):
                pending = stats  # read at the next step, after its work is queued
                continue
            if finish(stats, halt):
                break
        if pending is not None:
            finish(pending)
    result.wall_s = time.perf_counter() - start
    return result


@dataclass
class _StepStats:
    """What a step leaves for its metrics record; ``loss`` / ``grad_norm`` are device tensors until read."""

    done: int
    t0: float
    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    probe: object
    phase: str
    supervised: int
    fp8_modules: int
    epoch: float


def _needs_values(t, done: int) -> bool:
    """Whether step ``done`` must be read before the next step runs: the last step, an evaluation step or a
    checkpoint step (their records and saves follow the step's own divergence check; the guard takes its rollback
    points there)."""
    return (done == t.steps or bool(t.eval_every and done % t.eval_every == 0)
            or bool(t.checkpoint_every and done % t.checkpoint_every == 0))


@contextlib.contextmanager
def _finishing(saver: AsyncCheckpointer | None):
    """At the end of the loop: wait for the last background checkpoint write (also after an error)."""
    try:
        yield
    except BaseException:
        if saver is not None:
            with contextlib.suppress(Exception):
                saver.wait()  # a staged checkpoint is consistent: finish it
            saver.close()
        raise
    if saver is not None:
        saver.finish()
