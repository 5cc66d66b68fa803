"""Meta-device initialisation: build the model on ``meta``, shard it, then initialise each rank's shards only.

Under torchrun every rank building the whole model first would cap the model at one GPU's memory. Here
the model is built on the ``meta`` device (shapes only) while a :class:`~torch.utils._python_dispatch.
TorchDispatchMode` records, per parameter and buffer, the writes of its initialisation: the module
constructors' (``nn.Linear.reset_parameters``' kaiming-uniform, ...) and then transformers'
``initialize_weights`` (``_init_weights``: ``normal_(0, initializer_range)`` for linears and embeddings,
``ones_`` for norms, the rotary ``inv_freq`` copied from the rope function, ...), exactly the writes a model
built on a real device receives, in the same order. ``prepare_model`` then shards the meta model (TP, EP,
FSDP2), and :func:`initialize_shards` gives each rank empty storage for its own shards (``to_empty``) and
replays the recorded writes on them: torchdistx's deferred initialisation (record on fake tensors, replay
later), with a shard-aware replay.

Random writes (``normal_``, ``uniform_``, ``trunc_normal_``) are not replayed through one RNG stream: the values of a
parameter are generated in fixed chunks of its global index space (:func:`chunk_layout`: at most
``chunk_numel`` elements, whole trailing dimensions), each chunk from its own generator seeded by
``hash(seed, parameter name, write index, chunk index)``. A rank generates only the chunks that overlap its
shard, so:

- the initialised model is the same for every layout (1 process with ``distributed.meta_init = true``,
  FSDP2 over 2 or 8 ranks, TP, HSDP, EP): replicated parameters are equal on all ranks, and every rank holds
  a different part of a sharded one;
- no rank allocates more than one chunk beside its own shards (the whole unsharded tensor never exists
  when it is larger than a chunk);
- the values follow the same distribution as transformers' initialisation but are not the same numbers
  (one process without meta init draws them from one torch RNG stream).

Constant writes (``fill_``, ``zero_``, ``ones``), element-wise in-place ops with number arguments (``mul_``,
``add_``, ``clamp_``, ...) and copies from real tensors (the rotary ``inv_freq``) are replayed on the shard's
part of their target (a block of the tensor: the padding row of an embedding). A write that cannot be
replayed shard by shard (a copy of values computed on ``meta``, ``orthogonal_``, a strided view) is refused
when the model is built, naming the parameter (``fp8kit.models.init_record``).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from fp8kit.base.errors import ConfigError
from fp8kit.models.init_record import InitProgram, Write, record_initialization

if TYPE_CHECKING:
    from fp8kit.config import ModelConfig

__all__ = ["CHUNK_NUMEL", "InitProgram", "Write", "build_model_on_meta", "chunk_layout", "chunk_seed",
           "initialize_shards", "record_initialization"]


# Elements of one generated chunk: 2^20 (4 MiB of float32). Chunks are whole trailing dimensions, so a
# chunk of a matrix is a block of rows (at most max(2^20, one row) elements).
CHUNK_NUMEL = 1 << 20

# Wrapper modules that insert a name into parameter FQNs (activation checkpointing, torch.compile).
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def build_model_on_meta(model_cfg: ModelConfig, vocab_size: int, *, dtype: torch.dtype = torch.bfloat16,
                        seed: int = 0) -> tuple[nn.Module, InitProgram]:
    """Build the causal LM on ``meta`` and record its initialisation (to replay with :func:`initialize_shards`).

    Returns:
        (model on ``meta``, :class:`InitProgram`).

    Raises:
        ConfigError: the config is not a causal LM (as :func:`~fp8kit.models.build.build_model`), or a
            parameter's initialisation cannot be replayed shard by shard (the message names it).
    """
    from fp8kit.base.torchao_lib import quiet_torchao_imports
    from fp8kit.models.build import build_model

    with quiet_torchao_imports():
        import transformers.initialization  # noqa: F401  (its table of torch.nn.init functions is wrapped)

    def build() -> nn.Module:
        model = build_model(model_cfg, vocab_size, device="meta", dtype=dtype, seed=seed)
        # transformers skips initialize_weights on meta (nothing to write); its writes are recorded here.
        model.initialize_weights()
        return model

    return record_initialization(build, seed=seed)


def initialize_shards(model: nn.Module, program: InitProgram, device: torch.device | str, *,
                      chunk_numel: int = CHUNK_NUMEL) -> None:
    """Materialise a (prepared) model built by :func:`build_model_on_meta` on ``device`` and initialise it.

    Each rank allocates its own shards only (``nn.Module.to_empty``; FSDP2 / TP / EP DTensors keep their
    placements) and replays the recorded writes on them (see the module docstring). Tied parameters stay
    one parameter.

    Args:
        model: the model, possibly prepared (``prepare_model``: wrappers, FP8 modules, DTensor parameters).
        program: its :class:`InitProgram`.
        device: this rank's device.
        chunk_numel: elements per generated random chunk (the values depend on it; the default is
            :data:`CHUNK_NUMEL`).

    Buffers that a module added after the build lists in its ``scratch_buffers`` attribute (names of buffers that
    hold no model state, e.g. the fused MoE experts' scale hints) are zeroed instead.

    Raises:
        ConfigError: a parameter or buffer that the program does not know (added after the build), or tied
            weights that are no longer one parameter.
    """
    model.to_empty(device=device)
    _retie(model, program)
    scratch = {id(getattr(m, name)) for m in model.modules() for name in getattr(m, "scratch_buffers", ())}
    seen: dict[str, int] = {}
    for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        done: set[int] = set()
        for raw, t in named:
            if kind == "buffer" and id(t) in scratch:
                with torch.no_grad():
                    t.zero_()
                continue
            name = _plain_name(raw)
            canonical = program.aliases.get(name)
            if canonical is None:
                raise ConfigError(f"meta init: {kind} {name!r} was not in the model when it was built (added by "
                                  f"prepare_model?); set distributed.meta_init = false")
            if canonical in seen and seen[canonical] != id(t):
                raise ConfigError(f"meta init: {name!r} and its tied weight {canonical!r} are no longer one "
                                  f"parameter after prepare_model; set distributed.meta_init = false")
            seen[canonical] = id(t)
            if id(t) in done:
                continue
            done.add(id(t))
            _replay(t, program, canonical, chunk_numel)


def chunk_layout(shape: tuple[int, ...], chunk_numel: int) -> tuple[int, int]:
    """``(dim, step)``: random chunks of a tensor of ``shape`` cover ``step`` indices of ``dim`` and all of
    the dimensions after it, one chunk per index of the dimensions before it.

    ``dim`` is the first dimension whose trailing block (the product of the later dimensions) fits in
    ``chunk_numel``; ``step = max(1, chunk_numel // trailing)``. A matrix is chunked in blocks of rows.
    """
    if not shape:
        return 0, 1
    for d in range(len(shape)):
        trailing = math.prod(shape[d + 1:])
        if trailing <= chunk_numel:
            return d, max(1, chunk_numel // max(trailing, 1))
    return len(shape) - 1, 1  # unreachable: the last trailing block is 1 element


def chunk_seed(seed: int, name: str, write: int, chunk: int) -> int:
    """The generator seed of one random chunk: 63 bits of BLAKE2b(seed / name / write index / chunk index)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{write}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# ----------------------------------------------------------------------------------------------- replay


def _plain_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _retie(model: nn.Module, program: InitProgram) -> None:
    """Tie again the plain parameters that ``to_empty`` split (``nn.Module._apply`` gives each module its own
    new Parameter when the device changes; FSDP2 keeps its tied DTensors one parameter)."""
    from torch.distributed.tensor import DTensor

    params = {_plain_name(n): (n, p) for n, p in model.named_parameters(remove_duplicate=False)}
    for name, canonical in program.aliases.items():
        if name == canonical or name not in params or canonical not in params:
            continue
        (raw, p), (_, keep) = params[name], params[canonical]
        if p is not keep and not isinstance(p, DTensor) and not isinstance(keep, DTensor):
            owner, _, leaf = raw.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, leaf, keep)


def _local(t: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(this rank's plain local tensor, its box in the global tensor's coordinates)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if tuple(local.shape) != tuple(shape):
            raise ConfigError(f"meta init: a local shard of shape {tuple(local.shape)} where its placements "
                              f"{t.placements} give {tuple(shape)}")
        box = tuple((o, o + n) for o, n in zip(offset, shape, strict=True))
    else:
        local = t.data if isinstance(t, nn.Parameter) else t
        box = tuple((0, n) for n in t.shape)
    inner = getattr(local, "_tensor", None)  # torchao's FP8 all-gather weight wraps the high-precision data
    if isinstance(inner, torch.Tensor) and type(local) is not torch.Tensor:
        local = inner
    return local, box


def _intersect(a: tuple, b: tuple) -> tuple | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


def _index(box: tuple, origin: tuple) -> tuple:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


@torch.no_grad()
def _replay(t: torch.Tensor, program: InitProgram, name: str, chunk_numel: int) -> None:
    local, lbox = _local(t)
    for i, w in enumerate(program.writes[name]):
        part = _intersect(lbox, w.box)
        if part is None:
            continue
        dst = local[_index(part, lbox)]
        if w.kind == "fill":
            dst.fill_(w.args[0])
        elif w.kind == "copy":
            dst.copy_(w.args[0].reshape(tuple(hi - lo for lo, hi in w.box))[_index(part, w.box)])
        elif w.kind == "elementwise":
            op, nums, kw = w.args
            getattr(dst, op)(*nums, **kw)
        else:  # normal / uniform / trunc_normal
            _random(dst, part, w, chunk_seed_base=(program.seed, name, i), chunk_numel=chunk_numel)


def _random(dst: torch.Tensor, part: tuple, w: Write, *, chunk_seed_base: tuple, chunk_numel: int) -> None:
    """Fill ``dst`` (the ``part`` of the write's box on this rank) with the chunks of the write that overlap it."""
    shape = tuple(hi - lo for lo, hi in w.box) or (1,)  # the written block in its own coordinates (0-d: 1)
    rel = tuple((lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(part, w.box, strict=True)) or ((0, 1),)
    dst = dst.reshape(1) if dst.dim() == 0 else dst
    dim, step = chunk_layout(shape, chunk_numel)
    n_steps = -(-shape[dim] // step)
    gen_dtype = torch.float64 if dst.dtype == torch.float64 else torch.float32
    lead_ranges = [range(lo, hi) for lo, hi in rel[:dim]]
    d_lo, d_hi = rel[dim]
    for lead in itertools.product(*lead_ranges):
        lead_flat = 0
        for idx, n in zip(lead, shape[:dim], strict=True):
            lead_flat = lead_flat * n + idx
        for j in range(d_lo // step, -(-d_hi // step)):
            c_lo, c_hi = j * step, min((j + 1) * step, shape[dim])
            g = torch.Generator(device=dst.device)
            g.manual_seed(chunk_seed(*chunk_seed_base, lead_flat * n_steps + j))
            vals = torch.empty((c_hi - c_lo, *shape[dim + 1:]), dtype=gen_dtype, device=dst.device)
            if w.kind == "normal":
                vals.normal_(w.args[0], w.args[1], generator=g)
            elif w.kind == "uniform":
                vals.uniform_(w.args[0], w.args[1], generator=g)
            else:
                torch.nn.init.trunc_normal_(vals, *w.args, generator=g)
            lo, hi = max(d_lo, c_lo), min(d_hi, c_hi)
            src = vals[(slice(lo - c_lo, hi - c_lo), *(slice(a, b) for a, b in rel[dim + 1:]))]
            out = dst[(*(i - r[0] for i, r in zip(lead, rel[:dim], strict=True)), slice(lo - d_lo, hi - d_lo))]
            out.copy_(src)
