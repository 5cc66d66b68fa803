"""Asynchronous checkpoints (``train.async_checkpoint = true``): the step loop stalls only for a copy.

Each save goes through ``torch.distributed.checkpoint.async_save`` (PyTorch docs, "Asynchronous Saving
with Distributed Checkpoint"; torchtitan's ``async_mode``), in one process and under torchrun alike:

1. ``get_state_dict`` gives the model and optimizer states keyed by parameter FQN (sharded as the run
   holds them), the same state dicts as the synchronous DCP save of a distributed run.
2. Staging: a persistent ``DefaultStager`` copies them to host memory, pinned on CUDA (the pinned
   buffers are kept and reused by the following saves). On CUDA the device-to-host copy runs on a side
   stream in a background thread and overlaps the next step's forward and backward; the loop calls
   :meth:`AsyncCheckpointer.before_update` before ``optimizer.step()`` so that the weights change only
   after they are copied. On the CPU the copy is made in the call (it is the whole stall).
3. The write (``dcp.save`` of the staged copy) runs in a background thread. Under torchrun its
   collectives use a separate gloo group (``dist.new_group(backend="gloo")``, created at the first save):
   ``async_save`` needs a CPU backend, and the training collectives stay on their own group.
4. When the write has finished, global rank 0 renames ``checkpoints/.step_N.tmp`` to ``step_N``
   (:func:`fp8kit.train.checkpoint.replace_dir`; ``train_state.pt`` was written into the temporary
   directory at save time). DCP's save finishes with a gather of every rank's write results before the
   coordinator writes ``.metadata``, so rank 0's future completes only after every rank has written.

The rename is the completeness marker: a crash (``kill -9``) during a background write leaves the
previous checkpoint the latest complete one, and ``--resume auto`` continues from it. A later save, and
the end of the run, wait for the previous write (:meth:`AsyncCheckpointer.wait`), so at most one write
is in flight and its pinned buffers are free again before they are reused.

``async_save`` needs no process group: without one ``dcp.save`` runs with ``no_dist`` (checked in the
source of torch 2.13; ``DefaultStager`` / ``StagingOptions`` exist since torch 2.9). A single-process
run then writes the DCP layout (``dcp/`` + ``train_state.pt`` with ``"format": "dcp"``) instead of
``model.safetensors``; resume and ``fp8kit export`` read both.
"""

from __future__ import annotations

import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn

from fp8kit.base.errors import CheckpointError
from fp8kit.base.runtime import barrier, distributed_ready, is_main
from fp8kit.train.checkpoint import DCP_DIR, STATE_FILE, dcp_options, plain_tensor, replace_dir


def stager_reusable(stager) -> bool:
    """Whether a ``DefaultStager`` can stage again: False once its inner ``StateDictStager`` was closed
    (torch 2.11 closes it at the end of every staging; pytorch/pytorch#183413)."""
    inner = getattr(stager, "_state_dict_stager", None)
    dispatch = getattr(inner, "_deepcopy_dispatch", None)
    return dispatch is None or len(dispatch) > 0


class AsyncCheckpointer:
    """Writes checkpoints in the background; one per run (every rank builds its own).

    Args:
        device: the run's device; on CUDA the staging copies go to pinned memory on a side stream.

    Use: :meth:`save` at a checkpoint step (returns at once after staging), :meth:`before_update` before
    each ``optimizer.step()``, :meth:`finish` at the end of the run.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._stager = None
        self._group = None
        self._staged: Future | None = None  # the staging copy of the last save (CUDA: a background copy)
        self._pending: Future | None = None  # the last write, completed after its rename (rank 0)
        self._pending_dir: Path | None = None

    def _stager_for_run(self):
        """The persistent stager (its cached host buffers are reused by every save).

        torch 2.11's ``DefaultStager._stage`` closes its inner ``StateDictStager`` after every staging
        (pytorch/pytorch#183413, fixed by #183424): the deepcopy dispatch table is emptied and the next
        save fails with ``KeyError: <class 'type'>``. A stager found closed that way is replaced by a new
        one (its host buffers were dropped by that close anyway, so nothing is lost but the reuse).
        """
        if self._stager is not None and not stager_reusable(self._stager):
            self._stager.close()
            self._stager = None
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = self.device.type == "cuda"
            self._stager = DefaultStager(StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda,
                use_non_blocking_copy=cuda,
            ))
        return self._stager

    def _process_group(self):
        """A gloo group for the background write's collectives (None in one process)."""
        if self._group is None and distributed_ready():
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")
        return self._group

    def save(self, directory: Path, model: nn.Module, optimizer, state: dict) -> Path:
        """Start writing a checkpoint of ``model``, ``optimizer`` and ``state`` to ``directory``.

        Waits for the previous write first. Collective under torchrun (every rank calls it at the same
        step). ``state`` (scheduler, data position, RNG, step, ...; no optimizer) is written to
        ``train_state.pt`` at once by rank 0, the DCP files in the background.

        Returns:
            ``directory`` (complete once :meth:`wait` returns).

        Raises:
            CheckpointError: the previous background write failed.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.wait()
        directory = Path(directory)
        tmp = directory.with_name(f".{directory.name}.tmp")
        main = is_main()
        if main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        barrier()
        group = self._process_group()
        if group is None:  # one process: DCP's "no process group, saving in a single process" is the intent here
            warnings.filterwarnings("ignore", category=UserWarning, message=r"torch\.distributed is disabled, "
                                    r"unavailable or uninitialized, assuming the intent is to save in a single")
        msd, osd = get_state_dict(model, optimizer, options=dcp_options())
        msd = {k: plain_tensor(v) for k, v in msd.items()}
        if main:
            shapes = {k: list(v.shape) for k, v in msd.items()}
            torch.save({**state, "format": "dcp", "param_shapes": shapes}, tmp / STATE_FILE)
        response = dcp.async_save(
            {"model": msd, "optim": osd}, checkpoint_id=str(tmp / DCP_DIR), process_group=group,
            async_stager=self._stager_for_run(),
        )
        upload = getattr(response, "upload_completion", response)
        self._staged = getattr(response, "staging_completion", None)
        done: Future = Future()

        def finish(write: Future) -> None:  # runs in the writer thread when the write ends
            try:
                write.result()
                if main:
                    replace_dir(tmp, directory)
                done.set_result(directory)
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                done.set_exception(e)

        upload.add_done_callback(finish)
        self._pending, self._pending_dir = done, directory
        return directory

    @property
    def in_flight(self) -> bool:
        """A write started by :meth:`save` has not finished (and been renamed into place) yet."""
        return self._pending is not None and not self._pending.done()

    def before_update(self) -> None:
        """Block until the last save's staging copy is complete (call before the weights change)."""
        if self._staged is not None:
            self._staged.result()
            self._staged = None

    def wait(self) -> None:
        """Block until the last write is complete and renamed into place.

        Raises:
            CheckpointError: the write failed (first line of the underlying error); the previous
                checkpoints are untouched.
        """
        self.before_update()
        if self._pending is None:
            return
        pending, directory = self._pending, self._pending_dir
        self._pending = self._pending_dir = None
        try:
            pending.result()
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"checkpoint {str(directory)!r}: the background write failed: {type(e).__name__}: {first}"
            ) from e  # the CLI prints the one line; a traceback (benchmarks, tests) shows the cause

    def finish(self) -> None:
        """End of the run: :meth:`wait`, then a barrier (under torchrun no rank leaves before rank 0 has
        renamed the last checkpoint into place), then :meth:`close`."""
        self.wait()
        barrier()
        self.close()

    def close(self) -> None:
        """Release the stager's host buffers (after :meth:`wait`)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None
