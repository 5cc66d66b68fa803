"""Graceful preemption: SIGTERM, SIGINT or SIGUSR1 stop the run after the current optimizer step.

What clusters send before they kill a job: SLURM sends SIGTERM at the time limit (and any signal asked
for with ``#SBATCH --signal=USR1@120`` that many seconds before it), Kubernetes SIGTERM at pod
deletion, torchrun forwards the signals it handles (``--signals-to-handle``) to its workers, a terminal
sends SIGINT on Ctrl-C. :class:`StopSignals` turns the first of them into a request: the handler only
records the signal; the loop checks it once per step, after ``optimizer.step()``
(:func:`agreed_stop`), saves a checkpoint through the normal path, writes metrics and a summary with
status ``interrupted``, and ``fp8kit train`` exits with ``128 + signal number`` (what a shell reports for
a process ended by that signal: 143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1).

A second signal, one second or more after the first, ends the process at once with the signal's
default action (exit status 128 + signal number; the checkpoint being written, if any, stays a
temporary directory and never counts). A repeat within that second is taken as the same request: a
terminal's Ctrl-C reaches every process of the foreground group, SLURM signals every process of a job
step, and torchrun forwards the signal it received to workers that got it already.

Under torchrun every rank may see the signal at a different step (or only some ranks see it), so the
ranks agree each step with one all-reduce MAX of the signal number (one integer; only when
distributed) and all stop after the same step, before the collective checkpoint.

Handlers are installed by ``fp8kit.train.trainer.train`` for the training loop only (never at import,
only from the main thread) and the previous handlers are restored afterwards.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGUSR1") if hasattr(signal, n))
REPEAT_WINDOW_S = 1.0  # a repeat of the request within this time is the same request


class StopSignals:
    """Context manager: SIGTERM / SIGINT / SIGUSR1 handlers that record a stop request.

    ``signum`` is the first signal received (0: none). Outside the main thread nothing is installed
    (Python delivers signals to the main thread only).
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS):
        self.signals = signals
        self.signum = 0
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            return
        if now - self._first_at < REPEAT_WINDOW_S:
            return
        signal.signal(signum, signal.SIG_DFL)  # a second request: end now, as the default action does
        os.kill(os.getpid(), signum)


def agreed_stop(stop: StopSignals | None, *, distributed: bool, device: torch.device) -> int:
    """The signal number every rank stops for after this step (0: go on).

    One process: the local request. Distributed: the MAX of every rank's request over the default group
    (every rank must call this once per step).
    """
    local = stop.signum if stop is not None else 0
    if not distributed:
        return local
    import torch.distributed as dist

    t = torch.tensor([local], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def signal_name(signum: int) -> str:
    """``15`` -> ``"SIGTERM"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
