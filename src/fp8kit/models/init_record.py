"""Recording a model's initialisation while it is built on ``meta`` (the first half of meta init).

A :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every aten op of the build; for each
storage it keeps the writes: in-place ops on it (``normal_``, ``uniform_``, ``fill_``, ``zero_``, ``copy_``,
element-wise ops with number arguments) and the op that created it (``empty``, ``ones``, ``zeros``,
``full``, ``randn``, or any other: "computed"). ``torch.nn.init`` functions that return early on ``meta``
(``trunc_normal_``, ``orthogonal_``, ``sparse_``, ``dirac_``) are wrapped for the duration of the build so
that they are seen too. :func:`record_initialization` then maps every parameter and buffer to its storage's
writes from the last whole-tensor write on, with each write's target as a block (box) of the tensor, and
refuses what cannot be replayed on a shard. ``fp8kit.models.init`` replays the result.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fp8kit.base.errors import ConfigError

# In-place element-wise ops whose other arguments are numbers: replayed as they are on a shard.
_ELEMENTWISE = frozenset({
    "erfinv_", "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_", "abs_", "neg_", "exp_",
    "log_", "sqrt_", "tanh_", "sigmoid_", "reciprocal_", "pow_", "sign_",
})
_FILL_CREATION = {"ones": 1.0, "ones_like": 1.0, "zeros": 0.0, "zeros_like": 0.0}
_RESETS = ("fill", "normal", "uniform", "trunc_normal", "copy", "empty", "computed")  # kinds that overwrite all they target


@dataclass(frozen=True)
class Write:
    """One recorded write to (part of) a parameter's or buffer's storage.

    Attributes:
        kind: ``fill`` (args ``(value,)``), ``normal`` (``(mean, std)``), ``uniform`` (``(low, high)``),
            ``trunc_normal`` (``(mean, std, a, b)``),
            ``copy`` (``(src,)``: a real tensor of the target's shape), ``elementwise`` (``(op, args)``),
            ``empty`` (uninitialised storage), ``computed`` (values computed on ``meta``: not replayable),
            ``unsupported`` (a view that is not a box of the tensor).
        op: the aten op, for messages.
        box: ``((lo, hi), ...)`` per dimension of the tensor, the part written (set by :func:`_finalize`).
        args: see ``kind``.
    """

    kind: str
    op: str
    geometry: tuple = ()  # (size, stride, storage_offset) of the written view
    box: tuple = ()
    args: tuple = ()


@dataclass
class InitProgram:
    """The recorded initialisation of a model built on ``meta`` (see the module docstring).

    Attributes:
        seed: the run's seed (``train.seed``); every random chunk's generator is derived from it.
        writes: ``{name: [Write]}`` per parameter and buffer (canonical FQN), from its last whole-tensor
            write on.
        shapes: the global shape of each.
        aliases: ``{name: canonical}`` for every FQN (tied weights share one canonical name).
    """

    seed: int
    writes: dict[str, list[Write]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)


def record_initialization(build: Callable[[], nn.Module], *, seed: int) -> tuple[nn.Module, InitProgram]:
    """Run ``build`` (it must create its tensors on ``meta``) and record the writes to every parameter and
    buffer of the module it returns (see the module docstring).

    Returns:
        (the module, its :class:`InitProgram` with ``seed``).

    Raises:
        ConfigError: a parameter or buffer whose last writes cannot be replayed shard by shard (values
            computed on meta, a view that is not a block of it) or that is never initialised, named.
    """
    recorder = _Recorder()
    with _init_functions_seen(recorder), recorder:
        model = build()
    return model, _finalize(model, recorder, seed)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _geometry(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _number(x):
    """A Python number from a number or a real 0-d tensor, else None."""
    if isinstance(x, (int, float, bool)):
        return x
    if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_meta:
        return x.item()
    return None


class _Recorder(TorchDispatchMode):
    """Records every write (in-place op or fresh output) per storage while the model is built on meta."""

    def __init__(self):
        super().__init__()
        self.writes: dict[int, list[Write]] = {}
        self.keep: list = []  # storages stay alive so that their keys are not reused

    def _add(self, t: torch.Tensor, w: Write) -> None:
        key = _storage_key(t)
        if key not in self.writes:
            self.writes[key] = []
            self.keep.append(t.untyped_storage())
        self.writes[key].append(w)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        mutated = []  # the tensors the op writes into (``self`` of an in-place op, an ``out=`` tensor)
        for i, s in enumerate(func._schema.arguments):
            if s.alias_info is not None and s.alias_info.is_write:
                a = args[i] if i < len(args) else kwargs.get(s.name)
                if isinstance(a, torch.Tensor):
                    mutated.append(a)
        if mutated:
            for target in mutated:
                if target.is_meta:
                    w = (self._inplace(name, target, args, kwargs) if args and target is args[0]
                         else Write("computed", name, _geometry(target)))
                    self._add(target, w)
            return out
        ins = {_storage_key(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor) and o.is_meta and _storage_key(o) not in ins:
                self._add(o, self._creation(name, o, args, kwargs))
        return out

    @staticmethod
    def _inplace(name: str, target, args, kwargs) -> Write:
        g = _geometry(target)
        rest = args[1:]
        if name == "normal_":
            mean, std = (list(rest) + [0.0, 1.0][len(rest):])[:2]
            return Write("normal", name, g, args=(float(kwargs.get("mean", mean)), float(kwargs.get("std", std))))
        if name == "uniform_":
            lo, hi = (list(rest) + [0.0, 1.0][len(rest):])[:2]
            return Write("uniform", name, g, args=(float(kwargs.get("from", lo)), float(kwargs.get("to", hi))))
        if name == "zero_":
            return Write("fill", name, g, args=(0.0,))
        if name == "fill_" and _number(rest[0]) is not None:
            return Write("fill", name, g, args=(_number(rest[0]),))
        if name == "copy_" and isinstance(rest[0], torch.Tensor) and not rest[0].is_meta:
            src = rest[0].detach()
            if tuple(src.shape) == g[0]:
                return Write("copy", name, g, args=(src.clone(),))
        if name in _ELEMENTWISE:
            nums = [_number(a) for a in rest]
            if all(n is not None for n in nums) and all(_number(v) is not None for v in kwargs.values()):
                return Write("elementwise", name, g, args=(name, tuple(nums),
                                                           {k: _number(v) for k, v in kwargs.items()}))
        return Write("computed", name, g)

    @staticmethod
    def _creation(name: str, out, args, kwargs) -> Write:
        g = _geometry(out)
        if name in _FILL_CREATION:
            return Write("fill", name, g, args=(_FILL_CREATION[name],))
        if name in ("full", "full_like") and len(args) > 1 and _number(args[1]) is not None:
            return Write("fill", name, g, args=(_number(args[1]),))
        if name in ("empty", "empty_like", "empty_strided"):
            return Write("empty", name, g)
        if name in ("randn", "randn_like"):
            return Write("normal", name, g, args=(0.0, 1.0))
        if name in ("rand", "rand_like"):
            return Write("uniform", name, g, args=(0.0, 1.0))
        return Write("computed", name, g)


_SKIPPED_ON_META = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


@contextmanager
def _init_functions_seen(recorder: _Recorder):
    """Make visible the ``torch.nn.init`` functions that return early on ``meta`` (no aten op reaches the
    recorder): ``trunc_normal_`` is recorded as one random write, the others (whole-matrix constructions)
    as not replayable. They are wrapped in ``torch.nn.init`` and in transformers' table of the originals
    (``transformers.initialization.TORCH_INIT_FUNCTIONS``, which its ``init.*`` functions call) for the
    duration of the build, and restored after."""
    import torch.nn.init as torch_init

    hf = sys.modules.get("transformers.initialization")
    table = getattr(hf, "TORCH_INIT_FUNCTIONS", None)
    saved: list[tuple[object, str, object]] = []

    def wrap(name: str, original):
        def recorded(tensor, *args, **kwargs):
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                if name == "trunc_normal_":
                    p = dict(zip(("mean", "std", "a", "b"), args[:4], strict=False))
                    p.update({k: v for k, v in kwargs.items() if k in ("mean", "std", "a", "b")})
                    values = (float(p.get("mean", 0.0)), float(p.get("std", 1.0)), float(p.get("a", -2.0)),
                              float(p.get("b", 2.0)))
                    recorder._add(tensor, Write("trunc_normal", name, _geometry(tensor), args=values))
                else:
                    recorder._add(tensor, Write("computed", name, _geometry(tensor)))
            return original(tensor, *args, **kwargs)
        return recorded

    try:
        for name in _SKIPPED_ON_META:
            original = getattr(torch_init, name)
            saved.append((torch_init, name, original))
            setattr(torch_init, name, wrap(name, original))
            if isinstance(table, dict) and name in table:
                saved.append((table, name, table[name]))
                table[name] = wrap(name, table[name])
        yield
    finally:
        for where, name, original in reversed(saved):
            if isinstance(where, dict):
                where[name] = original
            else:
                setattr(where, name, original)


def _box(param_geometry: tuple, write_geometry: tuple) -> tuple | None:
    """The box (per-dimension ``(lo, hi)``) of a contiguous tensor that a view of its storage covers, or None
    when the view is not a box in row-major order (a transpose, a strided slice)."""
    shape, stride, offset = param_geometry
    w_size, w_stride, w_offset = write_geometry
    contiguous = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    if list(stride) != contiguous and math.prod(shape) > 1:
        return None
    rel = w_offset - offset
    if rel < 0:
        return None
    coord = [(rel // contiguous[d]) % shape[d] if shape[d] else 0 for d in range(len(shape))]
    if sum(c * s for c, s in zip(coord, contiguous, strict=True)) != rel:
        return None
    extent = [1] * len(shape)
    d = 0
    for size, st in zip(w_size, w_stride, strict=True):
        if size == 1:
            continue
        while d < len(shape) and not (contiguous[d] == st and shape[d] > 1):
            d += 1
        if d == len(shape) or coord[d] + size > shape[d]:
            return None
        extent[d] = size
        d += 1
    if math.prod(extent) != math.prod(w_size):
        return None
    return tuple((c, c + e) for c, e in zip(coord, extent, strict=True))


def _finalize(model: nn.Module, recorder: _Recorder, seed: int) -> InitProgram:
    program = InitProgram(seed=seed)
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    canonical: dict[int, str] = {}
    for name, t in tensors:
        program.aliases[name] = canonical.setdefault(id(t), name)
    for name, t in tensors:
        if canonical[id(t)] != name:
            continue
        g = _geometry(t)
        full = tuple((0, n) for n in t.shape)
        writes = []
        for w in recorder.writes.get(_storage_key(t), []):
            box = _box(g, w.geometry)
            if box is None:
                if w.kind in _RESETS or w.kind == "elementwise":
                    writes.append(Write("unsupported", w.op, w.geometry))
                continue
            if box == full and w.kind in _RESETS:
                writes = []  # a whole-tensor write: what came before is overwritten
            writes.append(Write(w.kind, w.op, w.geometry, box, w.args))
        what = "parameter" if isinstance(t, nn.Parameter) else "buffer"
        if not writes or writes[0].box != full or writes[0].kind not in _RESETS:
            raise ConfigError(f"meta init: {what} {name!r} {tuple(t.shape)} is not written as a whole by the "
                              f"model's initialisation; set distributed.meta_init = false")
        bad = next((w for w in writes if w.kind in ("computed", "unsupported", "empty")), None)
        if bad is not None and bad.kind == "empty":
            raise ConfigError(f"meta init: {what} {name!r} {tuple(t.shape)} is never initialised (torch.empty "
                              f"without an init); set distributed.meta_init = false")
        if bad is not None:
            why = {"computed": "from values computed at build time",
                   "unsupported": "through a view that is not a block of it"}[bad.kind]
            raise ConfigError(f"meta init: {what} {name!r} {tuple(t.shape)} is initialised {why} ({bad.op}), "
                              f"which cannot be replayed shard by shard; set distributed.meta_init = false")
        program.writes[name] = writes
        program.shapes[name] = tuple(t.shape)
    return program

