"""The auto-scale state of the FP8 gradient all-reduce: the factor ``mu`` per key and its counters.

FP8-LM (Peng et al. 2023, arXiv:2310.18313, section 2, "FP8 gradient and all-reduce communication",
auto-scaling; the paper's code is Microsoft's MS-AMP) multiplies each rank's
gradient by a factor ``mu`` before casting it to FP8 (``g'_i = mu * g_i``) and adapts ``mu``:

- if more than ``delta`` (0.1 %) of the values of ``mu * g_i`` saturate the FP8 maximum, ``mu <- mu / 2``;
- after ``growth_interval`` (1000) consecutive steps below ``delta``, ``mu <- mu * 2^(1/1000)``
  at every further quiet step (the first growth is at quiet step ``growth_interval + 1``).

Here ``backoff`` is the paper's ``1/2`` and ``growth_factor`` its ``2^(1/1000)``. A value *saturates*
when ``|mu * g| > FP8_MAX`` (float32), i.e. when the saturating cast clips it.

Current or delayed (``scaling``). With ``scaling="current"`` a call measures its own gradient
first: a stats pass and one scalar MIN all-reduce before the FP8 transfer, so a saturating step is halved on the
same step (and then clips at most what is left after one halving). With ``scaling="delayed"`` (the default) a call quantizes with
the ``mu`` the earlier calls left, in the same pass that measures this call's statistics; the statistics travel
with the payload (the "gather" algorithm appends them to each rank's row of its all-gather; "scatter" and the
FSDP2 reduce-scatter all-reduce them asynchronously beside the transfer) and decide the next call's ``mu``. This
is the paper's wording ("mu is set to 1/2 for the subsequent step") and Transformer Engine's delayed scaling: it
removes the stats pass and the scalar collective from the critical path (the latency that dominates below
~256 MB: on 2 x H200 over NVLink it took the 32M-256M-element all-reduce from 1.05-1.48x to 0.84-1.18x the
bf16 time, docs/benchmarks.md); the price is that a sudden jump of the gradient range clips that one step's values above
``FP8_MAX / mu`` (more than ``delta`` of them) and halves mu for the next. The rule, the unified scale and the
counters are the same in both modes; a key's first call (and a call while it is uninitialised) always runs
"current", since mu0 needs the global amax.

Initial mu. ``mu`` is set lazily, on the first call for a key, to ``mu0 = FP8_MAX / global_amax``
(``scale_from_amax`` of ``fp8kit.fp8.scaling``, the global amax taken over all ranks, so every rank
starts with the same ``mu``; rounded down by one float32 ulp where needed so that ``mu0 * amax <= FP8_MAX``
holds in float32 and the first call never saturates). An arbitrary start such as ``mu = 1`` does not work:
typical gradients of 1e-4 .. 1e-6 are then all below E4M3's smallest subnormal (2^-9 ~ 2e-3) and flush
to zero, and in E5M2 those below 2^-16 ~ 1.5e-5 flush to zero and those below 2^-14 ~ 6e-5 keep at most
one mantissa bit; the growth rule (x2 per 1000 quiet steps, after 1000 quiet steps) would then need
~10^4 steps per factor of 1000 to recover. A key whose first global amax is 0 (or not finite) stays
uninitialised until a call sees a non-zero finite amax.

The whole state changes only through the all-reduced scalars, so every rank holds the same ``mu``,
counters and decisions. The per-key numbers live in a small float64 tensor on the gradients' device, so
a call never waits for the device (no ``.item()``); ``mu()``, ``stats()`` and ``state_dict()`` read them
back (a device sync).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fp8kit.fp8.scaling import AMAX_EPS, DTYPE_MAX, storage_dtype

_FORMAT = "fp8kit.AutoScaleState/1"
_FP8_NAMES = ("e5m2", "e4m3")

# Layout of one key's float64 vector (device tensor).
MU, STEPS_BELOW, HALVINGS, GROWTHS, INITIALIZED, LAST_SATURATION = range(6)
_FIELDS = ("mu", "steps_below", "halvings", "growths", "initialized", "last_saturation")
_INT_FIELDS = ("steps_below", "halvings", "growths")


def ring_allreduce_bytes(numel: int, world_size: int, element_size: int = 2) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` elements: ``2 (N-1)/N * numel * element_size``.

    The ring algorithm's reduce-scatter and all-gather each send ``(N-1)/N`` of the buffer
    (Patarasuk & Yuan 2009; NCCL's "bus bandwidth" convention). ``element_size`` 2 is BF16, 4 is FP32.
    Rounded down to whole bytes; 0 for ``world_size`` 1.
    """
    return 2 * (world_size - 1) * numel * element_size // world_size


#: ``fp8_all_reduce``'s reduction algorithms (``algorithm=``); "auto" picks one from the world size.
ALGORITHMS = ("auto", "scatter", "gather")
#: When a call's ``mu`` is decided (``AutoScaleState.scaling``): from this call's statistics or from earlier calls'.
SCALINGS = ("current", "delayed")
#: The "gather" algorithm with delayed scaling appends this many bytes to each rank's row: its float64[4] statistics.
VEC_BYTES = 32
#: The "gather" algorithm pads each rank's FP8 row to a multiple of this many bytes (16-byte aligned rows for the
#: fused kernel's vector loads; at most 15 bytes more per rank).
GATHER_ROW_ALIGN = 16


def pick_algorithm(algorithm: str, world_size: int) -> str:
    """``"scatter"`` or ``"gather"``: ``algorithm`` itself, or for ``"auto"`` gather when ``world_size == 2``.

    Why (bytes per rank, ``L`` the FP8 tensor in bytes): scatter sends ``2 (N-1)/N L`` in two collectives
    (all-to-all, all-gather), gather ``(N-1) L`` in one (all-gather of every rank's whole tensor). At ``N = 2``
    both send ``L``, and gather saves a collective's latency and the second FP8 rounding; at ``N > 2`` gather
    sends ``N/2`` times the bytes (1.5x at 3, 4x at 8), so scatter is chosen.

    Raises:
        ValueError: ``algorithm`` is not one of :data:`ALGORITHMS`.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"fp8kit.comm: algorithm must be 'auto', 'scatter' or 'gather', got {algorithm!r}")
    if algorithm == "auto":
        return "gather" if world_size == 2 else "scatter"
    return algorithm


def gather_row_bytes(numel: int) -> int:
    """One rank's FP8 row in the "gather" algorithm: ``numel`` rounded up to :data:`GATHER_ROW_ALIGN` bytes."""
    return -(-numel // GATHER_ROW_ALIGN) * GATHER_ROW_ALIGN


def fp8_allreduce_bytes(numel: int, world_size: int, algorithm: str = "auto", scaling: str = "current") -> int:
    """Bytes one rank sends in one ``fp8_all_reduce(..., algorithm=algorithm)`` of ``numel`` elements (any dtype).

    ``"scatter"``: ``(N-1) * chunk`` (all-to-all of the FP8 chunks, the rank's own chunk stays local)
    ``+ (N-1) * chunk`` (ring all-gather of the FP8 mean chunks), ``chunk = ceil(numel / N)`` bytes (one byte
    per element): about half of ``ring_allreduce_bytes(numel, N, 2)`` (BF16) and a quarter of FP32.
    ``"gather"``: ``(N-1) * L`` (ring all-gather of every rank's whole FP8 tensor, ``L = gather_row_bytes(numel)``),
    the same as scatter at ``N = 2`` (up to the padding), ``N/2`` times it above.
    Both: ``+ 2 (N-1)/N * 32`` (ring all-reduce of the 4 float64 scalars), except gather with ``scaling="delayed"``,
    whose rows carry the 32 bytes of statistics instead: ``(N-1) * (L + 32)``. ``"auto"``: :func:`pick_algorithm`'s
    choice for ``world_size``. 0 for ``world_size`` 1 or an empty tensor (nothing is sent).

    Raises:
        ValueError: an unknown ``algorithm`` or ``scaling``.
    """
    algorithm = pick_algorithm(algorithm, world_size)
    if scaling not in SCALINGS:
        raise ValueError(f"fp8kit.comm: scaling must be 'current' or 'delayed', got {scaling!r}")
    if world_size <= 1 or numel == 0:
        return 0
    if algorithm == "gather" and scaling == "delayed":
        return (world_size - 1) * (gather_row_bytes(numel) + VEC_BYTES)
    if algorithm == "gather":
        wire = (world_size - 1) * gather_row_bytes(numel)
    else:
        wire = 2 * (world_size - 1) * -(-numel // world_size)
    return wire + ring_allreduce_bytes(4, world_size, 8)


@dataclass
class _Entry:
    """One key: its numbers (device float64[6], or a python list after ``load_state_dict``) and size."""

    values: torch.Tensor | list[float]
    numel: int | None
    reinits: int = 0
    calls: int = 0
    #: the host knows the key is initialised (delayed scaling may then skip the pre-transfer statistics)
    ready: bool = False


def _fresh() -> list[float]:
    # mu = 1 is a placeholder for an uninitialised key (the call then scales by mu0 / 1 = mu0).
    return [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


@dataclass
class AutoScaleState:
    """The auto-scale factor ``mu`` per key and its counters, for ``fp8_all_reduce`` / the DDP hook.

    Args:
        process_group: the group of the all-reduce (``None``: the default group). The DDP hook uses it;
            ``fp8_all_reduce(group=...)`` overrides it per call.
        fp8_dtype: ``"e5m2"`` (default: the gradient format, max 57344, wide range) or ``"e4m3"``
            (max 448, one more mantissa bit, narrower range).
        delta: saturation threshold, a fraction in (0, 1); default 1e-3 (the paper's 0.1 %).
        growth_interval: quiet steps (saturation <= delta) before mu starts growing; int >= 0.
        growth_factor: mu's factor at each quiet step after the interval; >= 1 (1 disables growth);
            default ``2 ** (1 / 1000)`` (the paper's).
        backoff: mu's factor on a saturated step, in (0, 1); default 0.5 (the paper's halving).
        scaling: ``"delayed"`` (default: mu from earlier calls, statistics sent with the payload; module
            docstring) or ``"current"`` (each call's mu from its own statistics, one scalar all-reduce before
            the transfer; saturation is halved on the same call). The FP8 all-reduce with delayed scaling runs in
            one pipeline piece.

    Counters (python ints, this rank): ``calls`` (calls that communicated), ``bytes_sent`` (bytes this
    rank sent, ``fp8_allreduce_bytes`` of each call's algorithm), ``bf16_ring_bytes`` (what a BF16 ring
    all-reduce of the same tensors would have sent, ``ring_allreduce_bytes``), ``last_bytes_sent`` (the last
    call's bytes).
    Per key (read with ``stats(key)``): ``mu``, ``steps_below`` (consecutive quiet steps), ``halvings``,
    ``growths``, ``initialized``, ``last_saturation`` (the largest per-rank saturated fraction of the
    last step), ``numel`` (a key used with another size is re-initialised from its amax, counted in
    ``reinits``) and ``calls`` (communicating calls with this key).

    Raises:
        ValueError: naming the argument, for an unknown ``fp8_dtype`` or an option out of range.
    """

    process_group: Any = None
    fp8_dtype: str = "e5m2"
    delta: float = 1e-3
    growth_interval: int = 1000
    growth_factor: float = 2.0 ** (1.0 / 1000.0)
    backoff: float = 0.5
    scaling: str = "delayed"
    calls: int = field(default=0, init=False)
    bytes_sent: int = field(default=0, init=False)
    bf16_ring_bytes: int = field(default=0, init=False)
    last_bytes_sent: int = field(default=0, init=False)
    _entries: dict[str | int, _Entry] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        where = "AutoScaleState"
        if self.fp8_dtype not in _FP8_NAMES:
            raise ValueError(f"{where}.fp8_dtype: unknown FP8 format {self.fp8_dtype!r}; valid: e5m2, e4m3")
        _check_number(self.delta, f"{where}.delta", lo=0.0, hi=1.0, text="in (0, 1)")
        if (
            isinstance(self.growth_interval, bool)
            or not isinstance(self.growth_interval, int)
            or self.growth_interval < 0
        ):
            raise ValueError(f"{where}.growth_interval: need an int >= 0, got {self.growth_interval!r}")
        _check_number(
            self.growth_factor, f"{where}.growth_factor", lo=1.0, hi=math.inf, text=">= 1", lo_open=False
        )
        _check_number(self.backoff, f"{where}.backoff", lo=0.0, hi=1.0, text="in (0, 1)")
        if self.scaling not in SCALINGS:
            raise ValueError(f"{where}.scaling: unknown {self.scaling!r}; valid: current, delayed")

    # -- read-only views -------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The FP8 torch dtype (``torch.float8_e5m2`` or ``torch.float8_e4m3fn``)."""
        return storage_dtype(self.fp8_dtype, "AutoScaleState.fp8_dtype")

    @property
    def fp8_max(self) -> float:
        """The format's largest finite value (57344 for E5M2, 448 for E4M3)."""
        return DTYPE_MAX[self.dtype]

    @property
    def mu_max(self) -> float:
        """Upper bound of mu: ``FP8_MAX / AMAX_EPS``, the scale of an all-zero tensor (keeps float32 finite)."""
        return self.fp8_max / AMAX_EPS

    def keys(self) -> list[str | int]:
        """The keys seen (or loaded), in first-use order."""
        return list(self._entries)

    def stats(self, key: str | int = "default") -> dict[str, Any]:
        """Python numbers of one key (a device sync). Raises KeyError for an unknown key."""
        e = self._entries[key]
        vals = e.values.tolist() if isinstance(e.values, torch.Tensor) else list(e.values)
        out: dict[str, Any] = dict(zip(_FIELDS, vals, strict=True))
        for k in _INT_FIELDS:
            out[k] = int(out[k])
        out["initialized"] = bool(out["initialized"])
        out["numel"] = e.numel
        out["reinits"] = e.reinits
        out["calls"] = e.calls
        return out

    def mu(self, key: str | int = "default") -> float:
        """The current mu of ``key`` (``nan`` while the key is not initialised). Raises KeyError."""
        s = self.stats(key)
        return s["mu"] if s["initialized"] else math.nan

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain python numbers (loadable with ``torch.load(weights_only=True)``); a device sync.

        ``{"format", "fp8_dtype", "delta", "growth_interval", "growth_factor", "backoff", "calls",
        "bytes_sent", "bf16_ring_bytes", "keys": {key: {"mu", "steps_below", "halvings", "growths",
        "initialized", "last_saturation", "numel", "reinits", "calls"}}}``. The options are saved for the record.
        """
        return {
            "format": _FORMAT,
            "fp8_dtype": self.fp8_dtype,
            "delta": self.delta,
            "growth_interval": self.growth_interval,
            "growth_factor": self.growth_factor,
            "backoff": self.backoff,
            "scaling": self.scaling,
            "calls": self.calls,
            "bytes_sent": self.bytes_sent,
            "bf16_ring_bytes": self.bf16_ring_bytes,
            "keys": {k: self.stats(k) for k in self._entries},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore mu and the counters per key (replacing all keys) and the byte counters.

        The options (``delta``, ``growth_interval``, ...) stay this object's own, so a resumed run may
        change them; ``fp8_dtype`` must match, since mu is relative to the format's maximum.

        Raises:
            ValueError: for a dict that is not an ``AutoScaleState.state_dict()`` or whose
                ``fp8_dtype`` differs, naming the key at fault.
        """
        where = "AutoScaleState.load_state_dict"
        if not isinstance(sd, dict) or sd.get("format") != _FORMAT:
            raise ValueError(f"{where}: not an AutoScaleState state dict (format {_FORMAT!r} expected)")
        if sd.get("fp8_dtype") != self.fp8_dtype:
            raise ValueError(
                f"{where}: fp8_dtype {sd.get('fp8_dtype')!r} in the state dict, {self.fp8_dtype!r} here "
                "(mu is relative to the format's maximum)"
            )
        entries: dict[str | int, _Entry] = {}
        for key, d in dict(sd.get("keys", {})).items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise ValueError(f"{where}: key {key!r} is not a str or int")
            missing = [f for f in (*_FIELDS, "numel") if f not in d]
            if missing:
                raise ValueError(f"{where}: keys[{key!r}] lacks {', '.join(missing)}")
            vals = [float(d[f]) for f in _FIELDS]
            if not (math.isfinite(vals[MU]) and vals[MU] > 0):
                raise ValueError(f"{where}: keys[{key!r}].mu must be finite and > 0, got {d['mu']!r}")
            numel = None if d["numel"] is None else int(d["numel"])
            entries[key] = _Entry(vals, numel, reinits=int(d.get("reinits", 0)), calls=int(d.get("calls", 0)),
                                  ready=vals[INITIALIZED] > 0)
        self._entries = entries
        self.calls = int(sd.get("calls", 0))
        self.bytes_sent = int(sd.get("bytes_sent", 0))
        self.bf16_ring_bytes = int(sd.get("bf16_ring_bytes", 0))

    # -- used by fp8_all_reduce ------------------------------------------------------------------
    def _values(self, key: str | int, numel: int, device: torch.device) -> torch.Tensor:
        """The key's float64[6] on ``device``; created (uninitialised), or reset when ``numel`` changed."""
        e = self._entries.get(key)
        if e is None:
            e = self._entries[key] = _Entry(values=_fresh(), numel=numel)
        elif e.numel != numel:
            e.values, e.numel, e.reinits, e.ready = _fresh(), numel, e.reinits + 1, False  # calls go on counting
        if not isinstance(e.values, torch.Tensor) or e.values.device != device:
            e.values = torch.tensor(e.values, dtype=torch.float64, device=device)
        return e.values

    def _delayed_ready(self, key: str | int, numel: int) -> bool:
        """Whether this call of ``key`` may use delayed scaling: ``scaling == "delayed"`` and the host knows the
        key is initialised for ``numel`` elements (no device sync)."""
        e = self._entries.get(key)
        return self.scaling == "delayed" and e is not None and e.numel == numel and e.ready

    def _store(self, key: str | int, values: torch.Tensor, sent: int, bf16: int) -> None:
        e = self._entries[key]
        if self.scaling == "delayed" and not e.ready:  # one device sync per key, until it is initialised
            e.ready = bool(values[INITIALIZED].item() > 0)
        e.values = values
        e.calls += 1
        self.calls += 1
        self.last_bytes_sent = sent
        self.bytes_sent += sent
        self.bf16_ring_bytes += bf16


def _check_number(v: Any, name: str, *, lo: float, hi: float, text: str, lo_open: bool = True) -> None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    ok = ok and (v > lo if lo_open else v >= lo) and v < hi
    if not ok:
        raise ValueError(f"{name}: need a number {text}, got {v!r}")
