"""Faults for tests/test_resilience.py, injected from this test script (nothing in fp8kit reads them).

Usage:

``python tests/resilience_worker.py block-write STEP FP8KIT_ARGS...``
    ``fp8kit FP8KIT_ARGS`` in this process, with the background DCP write of checkpoint STEP stopped
    forever just before its ``.metadata`` (torch's ``FileSystemWriter.finish`` is wrapped here): the data
    files are on disk, the checkpoint is not complete, and the step loop goes on (asynchronous save). The
    test kills the process there: a crash mid-write.

``python tests/resilience_worker.py hold-after STEP FP8KIT_ARGS...``
    ``fp8kit FP8KIT_ARGS`` in this process (one micro-batch per step), held before the micro-batch of step
    ``STEP + 1`` until a stop signal has reached the run's handler (``train.preempt.StopSignals``), or 120 s: a
    test that waits for STEP steps and then sends SIGTERM knows the run is still there to receive it, however
    slowly the test's process is scheduled (without the hold, a run on a loaded machine could end first).

``torchrun --nproc_per_node 2 --max-restarts 2 tests/resilience_worker.py torchrun OUT CACHE``
    Attempt 0 (``TORCHELASTIC_RESTART_COUNT``): an uninterrupted reference run into ``OUT/ref``. Every
    attempt: the run ``OUT/run`` with ``train.resume = "auto"`` and asynchronous checkpoints every 2
    steps, where rank 1 kills itself with SIGKILL (attempt 0) once ``step_000004`` is complete, and sends
    itself SIGTERM (attempt 1) in its third step, which stops both ranks after the same step. Each rank
    records what its attempt returned in ``OUT/attempt<A>_rank<R>.json`` and exits as ``fp8kit train``
    does (128 + the signal number when stopped), so torchrun restarts the group until the run is done.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the 2-rank run of tests/test_resilience.py (global batch 4 sequences; FSDP2 with FP8 all-gather)
TORCHRUN_SETS = ["train.steps=10", "train.eval_every=0", "train.checkpoint_every=2",
                 "train.mixed_precision=fp8", "train.micro_batch_size=2"]


def block_write(step: int, argv: list[str]) -> int:
    from torch.distributed.checkpoint import filesystem

    original = filesystem._FileSystemWriter.finish
    name = f".step_{step:06d}.tmp"

    def finish(self, metadata, results):
        if name in str(self.path):
            print(f"write of step {step} blocked before .metadata", flush=True)
            threading.Event().wait()  # forever: the test kills the process
        return original(self, metadata, results)

    filesystem._FileSystemWriter.finish = finish
    from fp8kit.cli.main import main

    return main(argv)


def hold_after(step: int, argv: list[str]) -> int:
    import time

    from fp8kit.train import loop, preempt

    signalled = threading.Event()
    handle = preempt.StopSignals._handle

    def recording_handle(self, signum, frame):
        signalled.set()
        return handle(self, signum, frame)

    preempt.StopSignals._handle = recording_handle  # bound by StopSignals.__enter__, after this
    original, calls = loop.next_micro_batch, [0]

    def next_micro_batch(setup):
        calls[0] += 1
        end = time.monotonic() + 120.0
        while calls[0] > step and not signalled.is_set() and time.monotonic() < end:
            time.sleep(0.02)
        return original(setup)

    loop.next_micro_batch = next_micro_batch
    from fp8kit.cli.main import main

    return main(argv)


def torchrun(out: Path, cache: str) -> int:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from fp8kit.config import load_config
    from fp8kit.train import loop
    from fp8kit.train.checkpoint import is_complete
    from fp8kit.train.trainer import train
    from tests.conftest import small_run_overrides

    attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
    sets = small_run_overrides(cache) + TORCHRUN_SETS
    if attempt == 0:
        train(load_config(None, sets), out / "ref")
    if rank == 1 and attempt < 2:
        original, calls = loop.next_micro_batch, [0]

        def next_micro_batch(setup):
            calls[0] += 1
            if attempt == 0 and is_complete(out / "run" / "checkpoints" / "step_000004"):
                os.kill(os.getpid(), signal.SIGKILL)
            if attempt == 1 and calls[0] == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return original(setup)

        loop.next_micro_batch = next_micro_batch
    res = train(load_config(None, sets + ["train.async_checkpoint=true", "train.resume=auto"]), out / "run")
    last = res.loop.records[-1]["step"] if res.loop.records else None
    result = {"interrupted": res.interrupted, "last_step": last}
    (out / f"attempt{attempt}_rank{rank}.json").write_text(json.dumps(result))
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)
    return 128 + res.interrupted if res.interrupted else 0


if __name__ == "__main__":
    if sys.argv[1] == "block-write":
        raise SystemExit(block_write(int(sys.argv[2]), sys.argv[3:]))
    if sys.argv[1] == "hold-after":
        raise SystemExit(hold_after(int(sys.argv[2]), sys.argv[3:]))
    raise SystemExit(torchrun(Path(sys.argv[2]), sys.argv[3]))
