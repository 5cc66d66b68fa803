"""The amax-history state of delayed scaling (``fp8.recipe = "delayed"``): settings, per-module tensors, the
in-place history update and the checkpoint format. The numerics are documented in :mod:`fp8kit.fp8.delayed`.

When the state changes, and why there (``torch.compile`` without graph breaks or host syncs):

- The **forward only reads** the history (its scales); the **backward** of a training step rolls that
  step's amaxes (input and weight from the forward, output gradient from the backward) into the history,
  in place (``copy_``). A forward that changed state it reads would be wrong under ``torch.compile``
  whenever AOTAutograd recomputes a read of that state in the backward (activation checkpointing always
  does; the min-cut partitioner may, pytorch/pytorch#197039): the recomputation would see the new value.
  Written only in the backward, the state every recomputation reads is still this step's. (The forward
  also writes ``forward_amax``, which nothing reads: it only makes ``torch.compile`` compute those two
  amaxes in the forward, fused into the casts.)
- AOTAutograd functionalizes the backward's in-place update of these graph inputs and writes the result
  back once per call; under FSDP2 the amaxes are all-reduced (MAX) with a functional collective first.
- One Python flag per module, ``started`` (the history holds a step), picks the forward's code: dynamic
  warm-start scales for the first step, history scales after it. It changes once in a run and never in
  traced code: the custom op ``fp8kit::delayed_advanced`` sets it when it runs (eagerly or inside a
  compiled backward), so Dynamo only reads it (a guard: a compiled block compiles once for the first
  training step and once for every later one).

The schedule is the same as advancing the history at the next training forward (Transformer Engine
updates after the step too): step t casts with the history of steps < t. With gradient accumulation every
micro-batch is a step of the history.

One :class:`DelayedScalingState` per run owns the tensors, keyed by the module's plain FQN, outside the
modules: the FP8 module holds a reference to its :class:`DelayedEntry`, so a precision switch to BF16 and
back (``fp8kit.parallel.convert``) finds the same history, ``model.state_dict()`` keys do not change, and the
training checkpoint saves :meth:`DelayedScalingState.state_dict` beside the model (``train/loop.py``,
``train/guard.py``; restored by ``train/setup.py``). :meth:`DelayedScalingState.load_state_dict` updates the
existing entries (the modules keep their references).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch

from fp8kit.fp8.scaling import scale_from_amax

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: Operand order of every history / scale tensor.
OPERANDS = ("input", "weight", "grad_output")
DTYPES = (E4M3, E4M3, E5M2)
AMAX_ALGOS = ("max", "most_recent")
#: Which operands' casts run fp8kit's fused cast-transpose kernel (``fp8kit::cast_transpose``: one read writes
#: both FP8 layouts and records the amax) once the history gives a scale; the rest are plain tensor ops that
#: ``torch.compile`` fuses into the kernel producing the operand. ``"weight_grad"``: weights and output
#: gradients (no producer to fuse into: a parameter, a tensor entering the backward). The default is ``"none"``:
#: on Llama-3-8B layers the opaque kernel cost more than it saved (docs/benchmarks.md section 6).
FUSED_CASTS = {"all": OPERANDS, "weight_grad": ("weight", "grad_output"), "none": ()}


@dataclass(frozen=True)
class DelayedScaling:
    """The delayed-scaling settings (``[fp8]`` ``amax_history_len``, ``amax_compute_algo``, ``margin``,
    ``delayed_fused_cast``: a key of :data:`FUSED_CASTS`).

    Raises:
        ValueError: ``amax_history_len < 1``, an unknown ``amax_compute_algo`` or ``fused_cast``, or a
            negative ``margin``.
    """

    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0
    fused_cast: str = "none"

    def __post_init__(self) -> None:
        if self.amax_history_len < 1:
            raise ValueError(f"fp8.amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"fp8.amax_compute_algo: unknown {self.amax_compute_algo!r}; choose max or most_recent")
        if self.margin < 0:
            raise ValueError(f"fp8.margin must be >= 0, got {self.margin}")
        if self.fused_cast not in FUSED_CASTS:
            raise ValueError(f"fp8.delayed_fused_cast: unknown {self.fused_cast!r}; choose {', '.join(FUSED_CASTS)}")


_UIDS = itertools.count()
_LIVE: weakref.WeakValueDictionary[int, DelayedEntry] = weakref.WeakValueDictionary()


class DelayedEntry:
    """One module's delayed-scaling state.

    Attributes:
        history: ``[3, L]`` float32 amax per operand (rows :data:`OPERANDS`) of the last ``L`` training
            steps, column 0 the most recent; zeros where no step was recorded yet.
        steps: ``[]`` int64, training steps recorded (rolled into ``history``); for a projection that shares its
            input with siblings, those of its input row, which ``fp8.delayed_siblings.align_input_histories`` sets
            to a sibling's when it comes back from BF16.
        started: ``history`` holds at least one step (``steps > 0``), so its scales exist.
        forward_amax: ``[2]`` float32, this rank's input and weight amax of the latest training forward (not
            reduced over a group), written by that forward (``fp8.delayed._DelayedLinearFn``: why), read by
            nothing in fp8kit; not checkpointed.
        uid: ``[]`` int64 CPU tensor naming this entry for ``fp8kit::delayed_advanced``: compiled graphs
            take it as an input shared by every block, not as a per-module constant they would guard on.
    """

    def __init__(self, length: int, device: torch.device | str) -> None:
        self.history = torch.zeros(3, length, dtype=torch.float32, device=device)
        self.steps = torch.zeros((), dtype=torch.int64, device=device)
        self.forward_amax = torch.zeros(2, dtype=torch.float32, device=device)
        self.started = False
        uid = next(_UIDS)
        self.uid = torch.tensor(uid, dtype=torch.int64)
        _LIVE[uid] = self

    def tensors(self) -> dict[str, torch.Tensor]:
        """The device tensors of this entry by attribute name."""
        return {"history": self.history, "steps": self.steps, "forward_amax": self.forward_amax}


@torch.library.custom_op("fp8kit::delayed_advanced", mutates_args=("steps",))
def _delayed_advanced(steps: torch.Tensor, uid: torch.Tensor) -> None:
    """Count a recorded step (``steps += 1``) and mark entry ``uid`` (a CPU int64 scalar) started. An
    opaque call in compiled graphs: the Python flag changes when the graph runs, never while tracing."""
    steps.add_(1)
    e = _LIVE.get(int(uid))
    if e is not None:
        e.started = True


@_delayed_advanced.register_fake
def _(steps, uid) -> None:
    return None


def reduce_max(amax: torch.Tensor, group=None) -> torch.Tensor:
    """``amax`` (float32, any shape) MAX-reduced over ``group`` (a functional all-reduce, traceable by
    ``torch.compile``; eagerly it waits here), or ``amax`` itself when ``group`` is None."""
    if group is None:
        return amax
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(amax, "max", group))


def advance_(history: torch.Tensor, steps: torch.Tensor, uid: torch.Tensor, amax: torch.Tensor, group=None) -> None:
    """Roll one training step's amaxes ``amax`` ``[3]`` float32 (input, weight, output gradient) into
    ``history`` ``[3, L]`` (newest in column 0) and count the step, in place, after the MAX all-reduce over
    ``group`` when one is given (a functional collective: traced into a compiled graph; eagerly it waits
    on first use). Traceable by ``torch.compile``; called by the backward of that step."""
    amax = reduce_max(amax, group)
    history.copy_(torch.cat([amax[:, None], history[:, :-1]], dim=1))
    torch.ops.fp8kit.delayed_advanced(steps, uid)


class DelayedScalingState:
    """The amax histories of every delayed-scaling module of a model (module docstring).

    Args:
        config: :class:`DelayedScaling` (default settings when None).
        group: process group whose ranks share one scale per tensor (``prepare_model`` sets the
            data-parallel group under FSDP2, and the group of all data- and tensor-parallel ranks with
            ``tp > 1``: ``fp8kit.parallel.tp_own.amax_group``); None: no reduction.
    """

    def __init__(self, config: DelayedScaling | None = None, group=None) -> None:
        self.config = config or DelayedScaling()
        self.entries: dict[str, DelayedEntry] = {}
        self.group = group

    def entry(self, name: str, device: torch.device | str) -> DelayedEntry:
        """The entry of module ``name``, created (empty, on ``device``) on first use."""
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = DelayedEntry(self.config.amax_history_len, device)
        return e

    @staticmethod
    @torch.compiler.disable
    def place(e: DelayedEntry, device: torch.device) -> None:
        """Move ``e``'s tensors to ``device`` (an entry created on ``meta`` starts empty there)."""
        for k, t in e.tensors().items():
            setattr(e, k, torch.zeros_like(t, device=device) if t.is_meta else t.to(device))

    def advance(self, e: DelayedEntry, amax: torch.Tensor) -> None:
        """Roll one training step's amaxes ``[3]`` float32 (input, weight, output gradient) into
        ``e.history``: :func:`advance_` with this state's :attr:`group`."""
        advance_(e.history, e.steps, e.uid, amax, self.group)

    def scales(self, e: DelayedEntry) -> torch.Tensor | None:
        """``[3]`` float32 scales (input, weight, output gradient) from ``e.history``, or None while it is
        empty (``scale = fp8_max / max(amax, eps) / 2 ** margin``, ``fp8.scaling.scale_from_amax``)."""
        parts = self.scale_tensors(e)
        return None if parts is None else torch.stack(parts)

    def scale_tensors(self, e: DelayedEntry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The three scales of :meth:`scales` as separate float32 ``[]`` tensors, or None while the history is
        empty. Separate tensors, not views of one ``[3]`` tensor: a view at an offset of 4 or 8 bytes is no
        16-byte-aligned scale pointer for cuBLASLt, and inductor may compute a scale's reciprocal in place
        in such a view (``CUBLAS_STATUS_NOT_SUPPORTED`` from ``torch._scaled_mm``, seen on the H100)."""
        if not e.started:
            return None
        return tuple(self.operand_scale(e, i) for i in range(3))

    def operand_scale(self, e: DelayedEntry, i: int) -> torch.Tensor:
        """The scale of operand ``i`` (row of :data:`OPERANDS`) from ``e``'s history (the module docstring's
        formula), float32 ``[]``; ``e`` must have started (:attr:`DelayedEntry.started`)."""
        # "max": the zeros of steps not recorded yet never win (amax >= 0).
        amax = e.history[i].amax() if self.config.amax_compute_algo == "max" else e.history[i, 0]
        return scale_from_amax(amax, DTYPES[i]) / (2.0 ** self.config.margin)

    def shared_input_scale(self, entries: tuple[DelayedEntry, ...]) -> torch.Tensor | None:
        """The smallest input scale of ``entries`` (modules that read one input tensor, e.g. q/k/v), float32
        ``[]``; None while one of them has no history. Every module of the group computes this same expression,
        so under ``torch.compile`` their casts of the shared input are one cast (CSE). The input histories of
        such modules hold the same amaxes, so the scales are equal in a run and the bits are those of separate
        scales; where they differ (a checkpoint that lacked an entry; a projection back from BF16 is aligned when
        it is linked again, ``fp8.delayed_siblings``), the smallest scale is the one no module's history saturates."""
        if not all(e.started for e in entries):
            return None
        scales = [self.operand_scale(e, 0) for e in entries]
        out = scales[0]
        for s in scales[1:]:
            out = torch.minimum(out, s)
        return out

    def state_dict(self) -> dict:
        """Histories and step counts (CPU copies: the live history changes in place), for the training
        checkpoint (one host sync per entry)."""
        return {
            "config": {"amax_history_len": self.config.amax_history_len,
                       "amax_compute_algo": self.config.amax_compute_algo, "margin": self.config.margin},
            "entries": {n: {"history": e.history.to("cpu", copy=True), "steps": int(e.steps)} for n, e in self.entries.items()},
        }

    def load_state_dict(self, sd: dict, device: torch.device | str = "cpu") -> None:
        """Restore :meth:`state_dict` into the existing entries (modules keep their references); entries the
        checkpoint lacks start empty. A history of another length is refused (it changes every scale).
        Checkpoints of fp8kit versions that rolled the last step in at the next forward (``pending``,
        ``has_pending``) load with that step rolled in, as that forward would have.

        Raises:
            ValueError: the saved ``amax_history_len`` differs from this state's.
        """
        saved_len = sd["config"]["amax_history_len"]
        if saved_len != self.config.amax_history_len:
            raise ValueError(f"fp8.amax_history_len = {self.config.amax_history_len}, but the checkpoint's "
                             f"histories have length {saved_len}")
        device = torch.device(device)
        for n in set(self.entries) | set(sd["entries"]):
            e = self.entry(n, device)
            history = torch.zeros(3, saved_len, dtype=torch.float32, device=device)
            steps = 0
            v = sd["entries"].get(n)
            if v is not None:
                history.copy_(v["history"])
                steps = int(v["steps"])
                if v.get("has_pending"):
                    history = torch.cat([v["pending"].to(device)[:, None], history[:, :-1]], dim=1)
                    steps += 1
            e.history, e.steps = history, torch.tensor(steps, dtype=torch.int64, device=device)
            e.forward_amax = torch.zeros(2, dtype=torch.float32, device=device)  # with the others, on ``device``
            e.started = steps > 0
