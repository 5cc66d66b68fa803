"""The amax-history state of delayed scaling (``fp8.recipe = "delayed"``): settings, per-module tensors, the
once-per-step update of every history and scale, and the checkpoint format. The numerics are documented in
:mod:`fp8kit.fp8.delayed`.

When the state changes, and why there (``torch.compile`` without graph breaks, host syncs or per-module work):

- A module's **training forward** reads its scales (and their reciprocals, the GEMMs' dequantization scales),
  float32 ``[]`` tensors that nothing in its graph writes, and writes this step's input and weight amaxes into
  its ``forward_amax`` record; its **backward** writes the output gradient's amax into ``grad_amax``. These are the only
  writes in compiled graphs: no scale is computed from the history there and nothing reads the record.
- **Once per step**, before the next forward with grad enabled of the model the state is attached to
  (:meth:`DelayedScalingState.attach`: a forward pre-hook, run eagerly), :meth:`DelayedScalingState.roll` takes
  every record of the step that has its backward's amax, MAX-reduces them over :attr:`DelayedScalingState.group`
  in one all-reduce, rolls them into the histories, counts the steps, and computes every module's scales, in a
  fixed number of kernels for the whole model (Transformer Engine likewise reduces every amax of a step at once
  and updates all scales in one fused kernel, ``amax_and_scale_update``). Before, each module rolled its own
  history and recomputed its scales inside its compiled graphs: about 13 more small kernels per module and step
  and a Python custom op, which left a llama-125m step waiting on the host (docs/benchmarks.md section 6,
  session 35).
- Since the forward only reads state that nothing in the step writes, every recomputation of the forward
  (activation checkpointing, the partitioner's) sees this step's scales.
- One Python flag per module, ``started`` (the history holds a step), picks the forward's code: dynamic
  warm-start scales for the first steps, history scales after. The roll sets it from the step counts, read
  with a copy to the host that it starts and waits for at the next roll (a step old: no wait in practice, and
  every rank flips the same flags at the same roll), so on CUDA a module runs one step more on dynamic scales
  than it must. Dynamo only reads it (a guard: a compiled block compiles once for the warm-start steps and once
  for every later one).
- The scales a forward reads are one of two sets per module; each roll writes the other and binds it, so a roll
  between a forward and its backward (a checkpoint, a precision switch) leaves the scales that backward saved.
  Forwards without grad (evaluation) roll nothing: they cast with the scales of the last roll.

The schedule is the one of rolling the history in at the end of the backward: step t casts with the history of
steps < t. With gradient accumulation every micro-batch is a step of the history (each is a forward of the
attached model); with ``DelayedScaling.cache_weights`` (set with gradient accumulation where the weight cache applies)
the weight row advances only at the first roll after an optimizer step, so a step's micro-batches cast their weights
at one scale and share one cast (:mod:`fp8kit.fp8.delayed_weight_cache`). A module's record is written by its forward and completed by its backward; one without its
backward (an evaluation forward with grad enabled, a forward whose output needs no gradient) is dropped.

One :class:`DelayedScalingState` per run owns the tensors, keyed by the module's plain FQN, outside the
modules: the FP8 module holds a reference to its :class:`DelayedEntry`, so a precision switch to BF16 and
back (``fp8kit.parallel.convert``) finds the same history, ``model.state_dict()`` keys do not change, and the
training checkpoint saves :meth:`DelayedScalingState.state_dict` beside the model (``train/loop.py``,
``train/guard.py``; restored by ``train/setup.py``). :meth:`DelayedScalingState.load_state_dict` updates the
existing entries (the modules keep their references).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from fp8kit.fp8.delayed_weight_cache import weight_scales_changed
from fp8kit.fp8.recipes import GEMMS, RECIPES
from fp8kit.fp8.scaling import scale_from_amax
from fp8kit.fp8.weight_cache import install_step_hook, optimizer_steps

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: Operand order of every history / scale tensor.
OPERANDS = ("input", "weight", "grad_output")
DTYPES = (E4M3, E4M3, E5M2)
AMAX_ALGOS = ("max", "most_recent")
#: Which operands' casts run fp8kit's fused cast-transpose kernel (``fp8kit::cast_transpose``: one read writes
#: both FP8 layouts and records the amax) once the history gives a scale; the rest are plain tensor ops that
#: ``torch.compile`` fuses into the kernel producing the operand. ``"weight_grad"``: weights and output
#: gradients (no producer to fuse into: a parameter, a tensor entering the backward); ``"grad_output"``: the
#: output gradients only (where Inductor would write their transposed copy from RMSNorm's backward row kernel).
#: The default is ``"none"``: on Llama-3-8B layers the opaque kernel cost more than it saved (docs/benchmarks.md
#: section 6).
FUSED_CASTS = {"all": OPERANDS, "weight_grad": ("weight", "grad_output"), "grad_output": ("grad_output",), "none": ()}


@dataclass(frozen=True)
class DelayedScaling:
    """The delayed-scaling settings (``[fp8]`` ``amax_history_len``, ``amax_compute_algo``, ``margin``,
    ``delayed_fused_cast``: a key of :data:`FUSED_CASTS`; ``fast_accum``: the GEMMs of ``fp8.recipes.GEMMS`` that
    run with fast accumulation, ``fp8.fast_accum`` resolved by ``fp8.recipes.fast_accum_for``, by default the
    recipe table's: fprop and wgrad; ``cache_weights``: each weight is cast once per optimizer step, at a weight scale
    held for the step, and reused by the step's micro-batches (:mod:`fp8kit.fp8.delayed_weight_cache`; set by
    ``prepare_model`` with gradient accumulation; the weights must be updated by ``torch.optim`` optimizers, whose
    steps advance the weight histories)).

    Raises:
        ValueError: ``amax_history_len < 1``, an unknown ``amax_compute_algo`` or ``fused_cast``, a
            negative ``margin``, or a ``fast_accum`` name that is not a GEMM.
    """

    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    margin: int = 0
    fused_cast: str = "none"
    fast_accum: tuple[str, ...] = RECIPES["delayed"].fast_accum
    cache_weights: bool = False

    def __post_init__(self) -> None:
        if self.amax_history_len < 1:
            raise ValueError(f"fp8.amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(f"fp8.amax_compute_algo: unknown {self.amax_compute_algo!r}; choose max or most_recent")
        if self.margin < 0:
            raise ValueError(f"fp8.margin must be >= 0, got {self.margin}")
        if self.fused_cast not in FUSED_CASTS:
            raise ValueError(f"fp8.delayed_fused_cast: unknown {self.fused_cast!r}; choose {', '.join(FUSED_CASTS)}")
        if not isinstance(self.fast_accum, tuple) or any(g not in GEMMS for g in self.fast_accum):
            raise ValueError(f"fp8.fast_accum: {self.fast_accum!r} must be a tuple of names from {', '.join(GEMMS)}")


#: The value of an amax record not written this step (amaxes are >= 0).
UNRECORDED = -1.0


def _scalar(device: torch.device | str, value: float = 1.0) -> torch.Tensor:
    """A float32 ``[]`` tensor of its own (an allocation of its own: a 16-byte-aligned pointer for cuBLASLt)."""
    return torch.full((), value, dtype=torch.float32, device=device)


class DelayedEntry:
    """One module's delayed-scaling state.

    Attributes:
        history: ``[3, L]`` float32 amax per operand (rows :data:`OPERANDS`) of the last ``L`` recorded steps,
            column 0 the most recent; zeros where no step was recorded yet. Rolled by
            :meth:`DelayedScalingState.roll` (and set by checkpoint loads and ``fp8.delayed_siblings``).
        steps: ``[]`` int64, steps recorded (rolled into ``history``); for a projection that shares its input with
            siblings, those of its input row, which ``fp8.delayed_siblings.align_input_histories`` sets to a
            sibling's when it comes back from BF16.
        forward_amax: ``[2]`` float32, this step's record of the input and weight amax, written by the training
            forward (not reduced over a group); :data:`UNRECORDED` where not written since the last roll.
        grad_amax: ``[1]`` float32, the output gradient's, written by that forward's backward. Two tensors, so that
            no tensor is written by both the forward and the backward graph of one compiled region (AOTAutograd's
            partitioner refuses a forward's write of an input that its backward writes again).
        scale: three float32 ``[]`` tensors, the scales of the next casts (input, weight, output gradient), from
            ``history`` (:meth:`DelayedScalingState.roll`); meaningful once ``started``.
        inv_scale: their reciprocals (the GEMMs' dequantization scales), three float32 ``[]`` tensors.
        group_scale, group_inv_scale: float32 ``[]``: the smallest input scale of this entry's sibling group and its
            reciprocal, when this entry leads a group (``fp8.delayed_siblings``); every member's forward reads these
            two tensors, so ``torch.compile`` makes one cast of the shared input.
            These eight tensors are one of two sets the entry owns (``sets``, ``bound``): each roll writes the
            other set and binds it, so a roll between a forward and its backward (a checkpoint, a precision switch,
            a second forward) never writes a scale that backward saved.
        leader: the entry whose ``group_scale`` this one's input cast uses (itself when it leads), or None (no group).
        members: the entries of the group this entry leads (``()`` unless it leads one).
        started: ``history`` holds at least one step, and the scales are those of the history.
        group_ready: this entry has a group whose members have all started, so its input is cast at the group's
            scale (set by ``fp8.delayed_siblings.link_input_siblings`` and whenever ``started`` flags change).
        active: a module of the model the state is attached to uses this entry (False for a projection swapped to
            BF16: its entry keeps its history but is not waited for to start).
    """

    def __init__(self, length: int, device: torch.device | str) -> None:
        self.history = torch.zeros(3, length, dtype=torch.float32, device=device)
        self.steps = torch.zeros((), dtype=torch.int64, device=device)
        self._scalars(device)
        self.leader: DelayedEntry | None = None
        self.members: tuple[DelayedEntry, ...] = ()
        self.started = False
        self.group_ready = False
        self.active = True

    def _scalars(self, device: torch.device | str) -> None:
        """Fresh record and scale tensors on ``device`` (unrecorded; scales 1 until the first roll), set 0 bound."""
        self.forward_amax = torch.full((2,), UNRECORDED, dtype=torch.float32, device=device)
        self.grad_amax = torch.full((1,), UNRECORDED, dtype=torch.float32, device=device)
        #: two sets of (3 scales, 3 reciprocals, group scale, its reciprocal)
        self.sets = tuple(tuple(_scalar(device) for _ in range(8)) for _ in range(2))
        self.bind(0)

    def bind(self, k: int) -> None:
        """Make set ``k`` of :attr:`sets` the entry's ``scale``, ``inv_scale``, ``group_scale``, ``group_inv_scale``."""
        s = self.sets[k]
        self.bound = k
        self.scale, self.inv_scale = s[0:3], s[3:6]
        self.group_scale, self.group_inv_scale = s[6], s[7]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The device tensors of this entry by attribute name (``scale.<i>`` / ``inv_scale.<i>`` per operand)."""
        out = {"history": self.history, "steps": self.steps, "forward_amax": self.forward_amax,
               "grad_amax": self.grad_amax, "group_scale": self.group_scale,
               "group_inv_scale": self.group_inv_scale}
        for i, op in enumerate(OPERANDS):
            out[f"scale.{op}"], out[f"inv_scale.{op}"] = self.scale[i], self.inv_scale[i]
        return out


def reduce_max(amax: torch.Tensor, group=None) -> torch.Tensor:
    """``amax`` (float32, any shape) MAX-reduced over ``group`` (a functional all-reduce, traceable by
    ``torch.compile``; eagerly it waits here), or ``amax`` itself when ``group`` is None."""
    if group is None:
        return amax
    from torch.distributed import _functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(amax, "max", group))


def record_(amax: torch.Tensor, index: int, value: torch.Tensor) -> None:
    """Write ``value`` (float32 ``[]``) into slot ``index`` of an entry's ``forward_amax`` / ``grad_amax`` record, in
    place (a graph input written by a compiled forward / backward: Inductor stores it from the reduction that
    computes it)."""
    amax[index:index + 1].copy_(value.reshape(1))


class _Layout:
    """The state of the live entries stacked for :meth:`DelayedScalingState.roll` (host bookkeeping, built once per
    change of the entries): ``history`` ``[N, 3, L]`` and ``steps`` ``[N]``, which the entries' own ``history`` /
    ``steps`` become views of (only eager code reads them); ``local`` ``[N, 3]``, where the records are gathered
    (one ``_foreach_copy_`` into the kept views ``local_views``: fewer host microseconds than a stack); ``scales`` ``[N, 6]`` (scales, then reciprocals) with the entries' scale tensors
    it is copied into (``scale_tensors``, per set of ``DelayedEntry.sets``; one ``_foreach_copy_`` from the kept views
    ``scale_views``: the scales that compiled graphs read stay allocations of their own, see
    ``DelayedScalingState.scale_tensors``; ``next``: the set the next roll writes), and the same for
    the group leaders' shared input scale (``group`` ``[G, 2]``; ``members`` / ``lead`` / ``picked``: int64 rows of
    the grouped entries, of their leaders, of the leaders). Index tensors are made here once: one made from a list at
    every roll would be a host-to-device copy that waits."""

    def __init__(self, live: list[DelayedEntry]) -> None:
        device = live[0].history.device
        n = len(live)
        self.history = torch.stack([e.history for e in live])
        self.steps = torch.stack([e.steps for e in live])
        for i, e in enumerate(live):
            e.history, e.steps = self.history[i], self.steps[i]
        self.local = torch.empty(n, 3, dtype=torch.float32, device=device)
        self.records = [t for e in live for t in (e.forward_amax, e.grad_amax)]
        self.local_views = [v for row in self.local.unbind(0) for v in (row[:2], row[2:])]
        self.grad_records = self.records[1::2]
        self.unrecorded = [torch.full((1,), UNRECORDED, dtype=torch.float32, device=device)] * n
        # True but for the weight row: the rows a roll takes when the weights did not change (cache_weights)
        # (made by a fill, not from a list: a host-to-device copy here waits for the GPU, see ``rows``)
        self.rows_but_weight = torch.ones(1, 3, 1, dtype=torch.bool, device=device)
        self.rows_but_weight[:, OPERANDS.index("weight")] = False
        self.scales = torch.empty(n, 6, dtype=torch.float32, device=device)
        self.scale_tensors = [[t for e in live for t in e.sets[k][:6]] for k in (0, 1)]
        self.scale_views = list(self.scales.view(-1).unbind(0))
        self.live = live
        self.next = 1 - live[0].bound  # the set the next roll writes and binds
        index = {id(e): i for i, e in enumerate(live)}
        grouped = [i for i, e in enumerate(live) if e.leader is not None and id(e.leader) in index]
        self.leaders = [e for e in live if e.leader is e]

        def rows(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.members = rows(grouped)
        self.lead = rows([index[id(live[i].leader)] for i in grouped])
        self.picked = rows([index[id(e)] for e in self.leaders])
        self.group = torch.empty(len(self.leaders), 2, dtype=torch.float32, device=device)
        self.group_tensors = [[t for e in self.leaders for t in e.sets[k][6:]] for k in (0, 1)]
        self.group_views = list(self.group.view(-1).unbind(0))
        self.key = self.key_of(live)

    @staticmethod
    def key_of(live: list[DelayedEntry]) -> tuple:
        """What the layout depends on: the entries, their tensors' identities and their leaders."""
        return tuple((id(e), id(e.history), id(e.steps), id(e.forward_amax), id(e.grad_amax), id(e.sets),
                      id(e.leader)) for e in live)


class DelayedScalingState:
    """The amax histories of every delayed-scaling module of a model (module docstring).

    Args:
        config: :class:`DelayedScaling` (default settings when None).
        group: process group whose ranks share one scale per tensor (``prepare_model`` sets the
            data-parallel group under FSDP2, and the group of all data- and tensor-parallel ranks with
            ``tp > 1``: ``fp8kit.parallel.tp_own.amax_group``); None: no reduction.

    Who rolls: once :meth:`attach` has hooked a model, the roll runs before each of its forwards with grad enabled;
    a state never attached is attached to the first of its modules that runs a forward (:meth:`attach_first`);
    ``manual = True`` leaves every roll to the caller (``bench-layers`` times steps on fixed scales that way).
    """

    def __init__(self, config: DelayedScaling | None = None, group=None) -> None:
        self.config = config or DelayedScaling()
        self.entries: dict[str, DelayedEntry] = {}
        self.group = group
        self.manual = False
        #: a model's forward rolls this state (:meth:`attach`); a plain flag, read by compiled forwards
        self.attached = False
        # model -> handle of the roll's forward pre-hook (weak: a model freed leaves no stale entry)
        self._hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._armed = False  # a forward with grad enabled ran since the last roll: it may have recorded
        # (layout, pinned host copy of its step counts, event recorded after the copy): read at the next roll
        self._steps_copy: tuple[_Layout, torch.Tensor, torch.cuda.Event] | None = None
        self._lay: _Layout | None = None
        # config.cache_weights: the optimizer step count (fp8.weight_cache) at the last roll; the weight row of the
        # records is rolled in only when it changed (the weights changed), so the weight scale holds for a step
        self._weights_of_step: int | None = None
        if self.config.cache_weights:
            install_step_hook()  # before the first optimizer step: optimizer_steps() counts from here

    # -- entries ---------------------------------------------------------------------------------------

    def entry(self, name: str, device: torch.device | str) -> DelayedEntry:
        """The entry of module ``name``, created (empty, on ``device``) on first use."""
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = DelayedEntry(self.config.amax_history_len, device)
        return e

    @staticmethod
    @torch.compiler.disable
    def place(e: DelayedEntry, device: torch.device) -> None:
        """Move ``e``'s tensors to ``device`` (an entry created on ``meta`` starts empty there; its record and
        scales start fresh: :meth:`roll` computes the scales)."""
        bound = None if e.history.is_meta else [t.to(device) for t in e.sets[e.bound]]
        e.history = torch.zeros_like(e.history, device=device) if e.history.is_meta else e.history.to(device)
        e.steps = torch.zeros_like(e.steps, device=device) if e.steps.is_meta else e.steps.to(device)
        e._scalars(device)
        if bound is not None:
            for dst, src in zip(e.sets[0], bound, strict=True):
                dst.copy_(src)

    # -- the roll --------------------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module) -> None:
        """Roll before every forward of ``model`` (a forward pre-hook; idempotent; ``link_input_siblings`` calls it
        after every FP8 swap). The roll never enters a graph: fp8kit compiles the blocks, not the root, so the hook
        runs eagerly; under ``torch.compile(model)`` the roll is a ``torch.compiler.disable`` call at the start of the
        frame (no break inside the graph, but ``fullgraph=True`` refuses it: compile the blocks, or attach the state
        to a module outside the compiled one)."""
        handle = self._hooks.get(model)
        if handle is None or handle.id not in model._forward_pre_hooks:
            self._hooks[model] = model.register_forward_pre_hook(self._pre_forward)
        self.attached = True

    def ensure_rolled(self, module: torch.nn.Module) -> None:
        """Called by every delayed forward: when neither a model nor the caller rolls this state (not
        :attr:`attached`, not :attr:`manual`), :meth:`attach_first` to ``module``. Plain attribute reads, which
        Dynamo traces without a break; the attaching call itself runs once, outside the graph."""
        if not (self.attached or self.manual):
            self.attach_first(module)

    @torch.compiler.disable
    def attach_first(self, module: torch.nn.Module) -> None:
        """For a state no model was attached to (modules made with ``Float8DelayedLinear.from_linear`` and used
        as they are): attach it to ``module``, the first of its modules to run a forward, and roll as the hook
        would have before this forward. The roll then runs before each forward of that module: right for a lone
        linear or a stack of them called in order; a model should be attached instead (``apply_fp8`` does)."""
        if not self.attached:
            self.attach(module)
            self._pre_forward(module, ())

    def _pre_forward(self, _module, _args) -> None:
        """Before a forward with grad enabled: roll the records of the forwards with grad enabled since the last
        roll (the first such forward has nothing to roll). A forward without grad (evaluation) records nothing and
        rolls nothing: it casts with the scales of the last roll, and a training step's record it falls between
        (a probe between a forward and its backward) stays for the next training forward."""
        if not torch.is_grad_enabled():
            return
        if self._armed:
            self.roll()
        self._armed = True

    def _live(self) -> list[DelayedEntry]:
        """The entries not on ``meta``, all on one device: an entry left on the CPU while the others are on an
        accelerator (a state loaded onto the CPU, a module not moved yet) joins them there, as its module's first
        forward would move it."""
        live = [e for e in self.entries.values() if not e.history.is_meta]
        devices = {e.history.device for e in live}
        if len(devices) > 1:
            target = next(d for d in devices if d.type != "cpu")
            for e in live:
                if e.history.device != target:
                    self.place(e, target)
        return live

    @torch.no_grad()
    @torch.compiler.disable
    def roll(self, sync: bool = False) -> None:
        """Fold every complete record of the last step into its history and recompute every scale (module
        docstring): one MAX all-reduce over :attr:`group` of all records, then a fixed number of kernels for the
        whole model, on stacked copies of the state (:class:`_Layout`) that the entries' histories and step counts
        are views of. Runs by itself before each forward of an :meth:`attach`-ed model; call it to read the
        histories of steps whose next forward has not run. Call it between steps: it resets every output-gradient
        record, so a record whose backward has not run yet is dropped (and, compiled, that backward finds its record
        written in place). The scales it writes are the set not bound (``DelayedEntry.sets``): the scales a pending
        backward saved stay as they were.

        Args:
            sync: read the step counts now (a host sync) to set ``started``, instead of at the next roll.
        """
        live = self._live()
        if not live:
            return
        self._armed = False
        lay = self._layout(live)
        length = self.config.amax_history_len
        torch._foreach_copy_(lay.local_views, lay.records)
        amax = reduce_max(lay.local, self.group)  # [N, 3]
        done = amax[:, 2] >= 0  # the backward wrote its amax: a complete step
        rolled = torch.cat([amax[:, :, None], lay.history[:, :, :length - 1]], dim=2)
        take = done[:, None, None]
        if self._hold_weight_scales():
            # the same weights as the last roll's: their row and scale hold, except in an entry's first recorded
            # step (no weight amax yet: its scale is dynamic until it starts, so nothing of it is cached)
            fresh = (lay.steps == 0)[:, None, None]
            take = take & (lay.rows_but_weight | fresh)
        lay.history.copy_(torch.where(take, rolled, lay.history))
        lay.steps.add_(done)
        torch._foreach_copy_(lay.grad_records, lay.unrecorded)
        self._write_scales(lay)
        self._update_started(live, lay.steps, sync)

    def _hold_weight_scales(self) -> bool:
        """Whether this roll leaves the weight rows of the histories (so the weight scales) as they are: with
        ``config.cache_weights``, at every roll but the first after an optimizer step (or the first roll), so the
        weight scale is the same at every micro-batch of a step (:mod:`fp8kit.fp8.delayed_weight_cache`; the roll
        still takes an entry's first recorded step whole). At a roll that takes them, the step marker advances and
        the cached weight casts are dropped (one made since the optimizer step, an evaluation's, used the old
        scale)."""
        if not self.config.cache_weights:
            return False
        now = optimizer_steps()
        if now == self._weights_of_step:
            return True
        self._weights_of_step = now
        weight_scales_changed()
        return False

    def _write_scales(self, lay: _Layout) -> None:
        """Every entry's scales and reciprocals from the histories (the module docstring's formula of
        :mod:`fp8kit.fp8.delayed`), and each group leader's smallest input scale of its group."""
        amax = lay.history.amax(dim=2) if self.config.amax_compute_algo == "max" else lay.history[:, :, 0]
        margin = 2.0 ** self.config.margin
        scales = torch.stack([scale_from_amax(amax[:, i], dt) for i, dt in enumerate(DTYPES)], dim=1) / margin
        lay.scales.copy_(torch.cat([scales, scales.reciprocal()], dim=1))  # [N, 6]: scales, then reciprocals
        k = lay.next  # the set not bound now: a backward pending from the last forward holds the bound one
        torch._foreach_copy_(lay.scale_tensors[k], lay.scale_views)
        if lay.leaders:
            group = torch.full((lay.steps.numel(),), float("inf"), device=scales.device).scatter_reduce(
                0, lay.lead, scales[:, 0].index_select(0, lay.members), "amin").index_select(0, lay.picked)
            lay.group.copy_(torch.stack([group, group.reciprocal()], dim=1))
            torch._foreach_copy_(lay.group_tensors[k], lay.group_views)
        for e in lay.live:
            e.bind(k)
        lay.next = 1 - k

    def _layout(self, live: list[DelayedEntry]) -> _Layout:
        """The :class:`_Layout` of ``live``, built when the entries, their tensors or their groups change."""
        if self._lay is None or self._lay.key != _Layout.key_of(live):
            self._lay = _Layout(live)
        return self._lay

    @staticmethod
    def update_groups(live: list[DelayedEntry]) -> None:
        """Set every entry's ``group_ready`` from its group's ``started`` flags (host only)."""
        for e in live:
            lead = e.leader
            e.group_ready = lead is not None and all(m.started for m in lead.members)

    def _update_started(self, live: list[DelayedEntry], steps: torch.Tensor, sync: bool) -> None:
        """Set ``started`` of the active entries whose step count is > 0, from a copy of the counts started at the
        previous roll and waited for now (a step old, so the wait is over at once: the GPU has long passed it; and
        every rank flips the same flags at the same roll), or from the counts now with ``sync`` or on the CPU."""
        waiting = [i for i, e in enumerate(live) if e.active and not e.started]
        if not waiting:
            self._steps_copy = None
            return
        if sync or steps.device.type != "cuda":
            counts = steps.tolist()
        else:
            prev, counts = self._steps_copy, None
            if prev is not None and prev[0] is self._lay:
                prev[2].synchronize()
                counts = prev[1].tolist()
            host = torch.empty(steps.shape, dtype=steps.dtype, pin_memory=True)
            host.copy_(steps, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._steps_copy = (self._lay, host, event)
        if counts is not None and any(counts[i] > 0 for i in waiting):
            for i in waiting:
                live[i].started = counts[i] > 0
            self.update_groups(live)

    # -- reads -----------------------------------------------------------------------------------------

    def advance(self, e: DelayedEntry, amax: torch.Tensor) -> None:
        """Record one complete step of ``e`` (amaxes ``[3]`` float32: input, weight, output gradient) and roll it
        in now (with every other complete record), setting ``started`` at once."""
        e.forward_amax.copy_(amax[:2])
        e.grad_amax.copy_(amax[2:])
        self.roll(sync=True)

    def scales(self, e: DelayedEntry) -> torch.Tensor | None:
        """``[3]`` float32 scales (input, weight, output gradient) of ``e``'s next casts from its history, or None
        while it has not started (``scale = fp8_max / max(amax, eps) / 2 ** margin``,
        ``fp8.scaling.scale_from_amax``)."""
        parts = self.scale_tensors(e)
        return None if parts is None else torch.stack(parts)

    def scale_tensors(self, e: DelayedEntry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The three scales of :meth:`scales` as the entry's own float32 ``[]`` tensors (what its casts read), or
        None while it has not started. Separate allocations, not views of one ``[3]`` tensor: a view at an offset
        of 4 or 8 bytes is no 16-byte-aligned scale pointer for cuBLASLt (``CUBLAS_STATUS_NOT_SUPPORTED`` from
        ``torch._scaled_mm``, seen on the H100)."""
        return e.scale if e.started else None

    # -- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Histories and step counts (CPU copies), for the training checkpoint, after rolling in the last step's
        records (every rank of :attr:`group` must call it: the roll all-reduces)."""
        self.roll(sync=True)
        cpu = {n: (e.history.to("cpu", copy=True), e.steps.to("cpu", copy=True)) for n, e in self.entries.items()}
        return {
            "config": {"amax_history_len": self.config.amax_history_len,
                       "amax_compute_algo": self.config.amax_compute_algo, "margin": self.config.margin},
            "entries": {n: {"history": h, "steps": int(c)} for n, (h, c) in cpu.items()},
        }

    def load_state_dict(self, sd: dict, device: torch.device | str = "cpu") -> None:
        """Restore :meth:`state_dict` into the existing entries (modules keep their references); entries the
        checkpoint lacks start empty; records of steps not rolled in are dropped, and the scales are recomputed.
        A history of another length is refused (it changes every scale). Checkpoints of fp8kit versions that
        rolled the last step in at the next forward (``pending``, ``has_pending``) load with that step rolled in,
        as that forward would have.

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
            e._scalars(device)  # with the others, on ``device``; fresh record
            e.started = steps > 0
        self._steps_copy = None
        self._weights_of_step = None  # the loaded weight rows are new: the roll below counts them as changed
        self.update_groups(list(self.entries.values()))
        self.roll(sync=True)  # the scales of the loaded histories
