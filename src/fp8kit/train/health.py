"""FP8 numerics health (``fp8.stats_every``): per FP8 layer and operand, amax, scale, underflow, saturation.

Every ``N``-th optimizer step (``fp8.stats_every = N``; 0 = off, nothing registered, zero cost), on the
first micro-batch of that step, for each FP8 linear layer and each operand of its GEMMs (``input`` and
``weight`` of fprop, ``grad_output`` of dgrad) this records, as Transformer Engine's debug tools do per
layer (``nvdlfw_inspect`` ``LogFp8TensorStats``: underflows / overflows):

``amax``        ``max |x|`` of the operand (the largest row / block amax for rowwise / blockwise scales);
``scale``       the scale of the cast, ``fp8_max / amax`` at the operand's granularity (the smallest one,
                i.e. that of the row / block holding the amax, for rowwise / blockwise);
``underflow``   the fraction of the operand's **non-zero** values that become 0 in FP8:
                ``0 < |x * scale| <= min_subnormal / 2`` (round-to-nearest-even flushes them);
``saturation``  the fraction of all values that the saturating cast clamps: ``|x * scale| > fp8_max +
                ulp(fp8_max) / 2``, i.e. beyond what rounds to ``fp8_max`` anyway. Zero by construction for
                dynamic (current) scaling, where the amax element lands on ``fp8_max``; non-zero for delayed
                scaling after a jump of the range (recipe ``delayed``) or a clamp;
``nonfinite``   the fraction of inf / NaN values (a diverging layer).

Formats and granularity are read from each module: torchao ``Float8Linear`` from its
``Float8LinearConfig`` (``cast_config_input`` / ``cast_config_weight`` / ``cast_config_grad_output``:
E4M3 / E4M3 / E5M2 under the HYBRID tensorwise recipe, E4M3 everywhere for torchao's rowwise recipes;
rowwise = one scale per row: per token for input and output gradient, per output channel for the weight;
``round_scales_to_power_of_2``); fp8kit's ``Float8BlockwiseLinear`` (E4M3, 1x128 blocks of input and
output gradient, 128x128 weight blocks) and ``Float8DelayedLinear`` (tensorwise, scale from the amax
history in ``DelayedScalingState``). Operands a recipe keeps in high precision are left out. The wgrad
GEMM's transposed casts (rowwise recipes cast input and output gradient a second time along the token
dimension) are not measured.

How it is measured. Hooks on the FP8 modules (registered when the monitor starts and on modules swapped
in later, before the next forward): a forward pre-hook (input, weight), and a forward hook that registers
a tensor hook on the module output (its gradient is the ``grad_output`` operand). A delayed-scaling module is
probed from inside its forward instead (``Float8DelayedLinear.health_probe``), with the scale tensors its casts
were given: the same numbers, and no second read of its scaling entry inside a compiled block. The hooks do nothing
unless the step is a stats step. The amax and the scale are a **re-computation** from the hooked tensor
with the recipe's own functions (torchao's ``tensor_to_amax`` / ``amax_to_scale``, fp8kit's
``scale_from_amax``), not a read of the scale the GEMM used: torchao does not keep it. For dynamic scaling
it is the same number, since the scale is a deterministic function of the tensor being cast (the same
amax, the same float64 -> float32 formula, the same power-of-two rounding); for delayed scaling the scale
is read from the module's history state, which is what its cast used.

Cost. On a stats step, two passes over each operand (its amax, then one fused reduction of the counts),
each operand's numbers written into its own small device buffer (no host sync until the step's loss is
read). Inside ``torch.compile``'d blocks (``train.compile``) the hooks, the gradient hook included, are
traced into the blocks' forward and backward graphs: a second compiled variant of each block, guarded on
the monitor's ``active`` flag, is compiled on the first stats step and reused afterwards, and steps
without stats run the unchanged graphs. Without compile the stats run eagerly (``torch.compile``'d stats
on CUDA for inputs and weights); each output gradient is measured in its gradient hook as it passes, by the
plain ops over row chunks (:func:`operand_stats_chunked`: bounded temporaries, nothing kept past the hook). ``benchmarks/health_overhead.py``
measures the step-time overhead. Single-process runs only (``fp8kit train`` refuses ``fp8.stats_every``
under torchrun).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from fp8kit.base.torchao_lib import quiet_torchao_imports, torchao_float8
from fp8kit.fp8.delayed import Float8DelayedLinear
from fp8kit.fp8.linear import Float8BlockwiseLinear
from fp8kit.fp8.scaling import scale_from_amax

with quiet_torchao_imports():  # module globals: the hooks are traced by torch.compile, imports are not
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

OPERANDS = ("input", "weight", "grad_output")
#: How many layers the summary lists (``summary.md``: "FP8 health: worst five layers").
WORST_K = 5
_DTYPE_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2",
                torch.float8_e4m3fnuz: "e4m3fnuz", torch.float8_e5m2fnuz: "e5m2fnuz"}
_BLOCK = 128


@dataclass(frozen=True)
class OperandCast:
    """How one operand of an FP8 layer is cast.

    Attributes:
        dtype: the FP8 format (``torch.float8_e4m3fn`` / ``torch.float8_e5m2``).
        granularity: ``tensorwise``, ``rowwise`` (one scale per row of the last dimension), ``block1x128``
            (one per 128 consecutive elements of a row) or ``block128x128`` (weights).
        pow2: scales rounded down to a power of two (torchao's rowwise recipes).
        source: who computes the scale: ``torchao`` (``amax_to_scale``), ``fp8kit``
            (``fp8kit.fp8.scaling.scale_from_amax``) or ``delayed`` (the module's amax history).
    """

    dtype: torch.dtype
    granularity: str = "tensorwise"
    pow2: bool = False
    source: str = "torchao"


def cast_bounds(dtype: torch.dtype) -> tuple[float, float]:
    """``(underflow bound, saturation bound)`` of an FP8 format, on ``|x * scale|``: half the smallest
    subnormal (at or below it round-to-nearest-even gives 0), and ``fp8_max + ulp(fp8_max) / 2`` (above it
    only the saturating clamp keeps the value finite; below it the value rounds to ``fp8_max`` anyway)."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps / 2, fi.max + 2.0 ** math.floor(math.log2(fi.max)) * fi.eps / 2


_BOUNDS = {dt: cast_bounds(dt) for dt in _DTYPE_NAMES}


def layer_casts(module: nn.Module) -> dict[str, OperandCast] | None:
    """``{operand: OperandCast}`` of an FP8 linear module (operands kept in high precision left out), or
    None for any other module."""
    if isinstance(module, Float8DelayedLinear):
        e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
        return {"input": OperandCast(e4, source="delayed"), "weight": OperandCast(e4, source="delayed"),
                "grad_output": OperandCast(e5, source="delayed")}
    if isinstance(module, Float8BlockwiseLinear):
        e4 = torch.float8_e4m3fn
        return {"input": OperandCast(e4, "block1x128", source="fp8kit"),
                "weight": OperandCast(e4, "block128x128", source="fp8kit"),
                "grad_output": OperandCast(e4, "block1x128", source="fp8kit")}
    if not isinstance(module, torchao_float8().Float8Linear):
        return None
    c = module.config
    out = {}
    for operand, cc in (("input", c.cast_config_input), ("weight", c.cast_config_weight),
                        ("grad_output", c.cast_config_grad_output)):
        if cc.scaling_type is ScalingType.DISABLED:
            continue
        gran = "rowwise" if cc.scaling_granularity is ScalingGranularity.AXISWISE else "tensorwise"
        out[operand] = OperandCast(cc.target_dtype, gran, bool(c.round_scales_to_power_of_2), "torchao")
    return out


def _amax_and_scale(x: torch.Tensor, cast: OperandCast) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x viewed in scale groups, amax, scale)`` with amax / scale broadcastable against the view."""
    if cast.granularity == "block1x128":
        x = x.reshape(-1, x.shape[-1] // _BLOCK, _BLOCK)
        amax = x.abs().amax(dim=-1, keepdim=True)
    elif cast.granularity == "block128x128":
        n, k = x.shape
        x = x.reshape(n // _BLOCK, _BLOCK, k // _BLOCK, _BLOCK)
        amax = x.abs().amax(dim=(1, 3), keepdim=True)
    elif cast.source == "torchao":
        if cast.granularity == "rowwise":
            amax = tensor_to_amax(x, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1)
        else:
            amax = tensor_to_amax(x)
    else:
        amax = x.abs().amax()
    return x, amax, _scale_of(amax, cast)


def _scale_of(amax: torch.Tensor, cast: OperandCast) -> torch.Tensor:
    """The scale(s) ``cast`` derives from ``amax``: torchao's ``amax_to_scale`` or fp8kit's ``scale_from_amax``."""
    if cast.source == "torchao" and cast.granularity in ("tensorwise", "rowwise"):
        return amax_to_scale(amax, cast.dtype, round_scales_to_power_of_2=cast.pow2)
    return scale_from_amax(amax, cast.dtype)


@torch.no_grad()
def operand_stats(x: torch.Tensor, cast: OperandCast, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The health numbers of one operand cast, on ``x``'s device, without a host sync.

    Args:
        x: the operand in high precision (any float dtype; ``[..., K]``; a weight ``[N, K]``); block
            granularities need the blocked dimensions to be multiples of 128.
        cast: how the operand is cast.
        scale: a given per-tensor scale (delayed scaling); None: computed from ``x`` (dynamic scaling).

    Returns:
        float64 ``[6]``: amax, scale (the smallest, for per-row / per-block scales), underflow fraction
        (of the non-zero values), saturation fraction, non-finite fraction (of all values), non-zero count.
    """
    xv, amax, computed = _amax_and_scale(x, cast)
    if scale is None:
        scale = computed
    under_bound, sat_bound = _BOUNDS[cast.dtype]
    a = (xv.float() * scale).abs()
    nonzero = xv != 0
    n_nonzero = nonzero.sum(dtype=torch.float64)
    under = (nonzero & (a <= under_bound)).sum(dtype=torch.float64)
    sat = (a > sat_bound).sum(dtype=torch.float64)
    nonfinite = (~torch.isfinite(xv)).sum(dtype=torch.float64)
    numel = max(1, x.numel())
    return torch.stack([
        amax.amax().double(), scale.amin().double(), under / n_nonzero.clamp(min=1.0), sat / numel,
        nonfinite / numel, n_nonzero,
    ])


#: The most elements :func:`operand_stats_chunked` measures at once (its plain ops' float32 and bool temporaries are
#: about 5x a bf16 operand's bytes: 2^25 elements keep them near 0.3 GB).
STATS_CHUNK_ELEMENTS = 1 << 25


@torch.no_grad()
def operand_stats_chunked(x: torch.Tensor, cast: OperandCast, scale: torch.Tensor | None = None,
                          chunk_elements: int = STATS_CHUNK_ELEMENTS) -> torch.Tensor:
    """:func:`operand_stats` of ``x`` ``[..., K]`` taken over row chunks of at most ``chunk_elements`` elements and
    combined (amax: max, scale: min, counts summed; a dynamic per-tensor scale from the whole tensor's amax, taken
    first), so the plain ops' temporaries stay bounded: what an eager backward's gradient hook runs on an output
    gradient as large as an LM head's ``[tokens, vocab]``. The same numbers as one call, up to float64 rounding of
    the fractions. ``block128x128`` chunks are whole 128-row blocks.

    Returns:
        float64 ``[6]``, as :func:`operand_stats`.
    """
    x2 = x.reshape(-1, x.shape[-1])
    step = _BLOCK if cast.granularity == "block128x128" else 1
    rows = max(step, chunk_elements // max(1, x2.shape[-1]) // step * step)
    if x2.shape[0] <= rows:
        return operand_stats(x2, cast, scale)
    chunks = x2.split(rows)
    if scale is None and cast.granularity == "tensorwise":  # one scale for the whole tensor
        scale = _scale_of(torch.stack([c.abs().amax() for c in chunks]).amax(), cast)
    parts = torch.stack([operand_stats(c, cast, scale) for c in chunks])  # [chunks, 6]
    # the fractions over all values weighted by each chunk's size: host numbers, no host-to-device copy
    share = [c.numel() / x2.numel() for c in chunks]
    n_nonzero = parts[:, 5].sum()
    return torch.stack([
        parts[:, 0].amax(), parts[:, 1].amin(), (parts[:, 2] * parts[:, 5]).sum() / n_nonzero.clamp(min=1.0),
        sum(p[3] * w for p, w in zip(parts, share, strict=True)),
        sum(p[4] * w for p, w in zip(parts, share, strict=True)), n_nonzero,
    ])


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


class HealthProbe:
    """The stats of one stats step (a device tensor, one row per measured operand); :meth:`rows` reads it."""

    def __init__(self, keys: list[tuple[str, str, OperandCast]], values: torch.Tensor | None):
        self.keys, self.values = keys, values

    def rows(self) -> list[dict]:
        """One dict per measured (layer, operand), sorted by layer: ``layer``, ``operand``, ``dtype``,
        ``granularity``, ``amax``, ``scale``, ``underflow``, ``saturation``, ``nonfinite`` (non-finite
        numbers as None, for JSON). One host sync."""
        if self.values is None:
            return []
        out = []
        for (layer, operand, cast), (amax, scale, under, sat, nonfinite, count) in zip(
                self.keys, self.values.cpu().tolist(), strict=True):
            if math.isnan(count):  # not written this step (e.g. an output that needs no gradient)
                continue
            out.append({
                "layer": layer, "operand": operand, "dtype": _DTYPE_NAMES.get(cast.dtype, str(cast.dtype)),
                "granularity": cast.granularity, "amax": _finite(amax), "scale": _finite(scale),
                "underflow": _finite(under), "saturation": _finite(sat), "nonfinite": _finite(nonfinite),
            })
        return out


class FP8HealthMonitor:
    """Hooks on a model's FP8 linear layers that measure :func:`operand_stats` on stats steps.

    Use per optimizer step: :meth:`arm` before the first micro-batch (hooks any FP8 module swapped in
    since the last call; returns whether this step is a stats step), :meth:`collect` after the first
    micro-batch's backward (a :class:`HealthProbe`, or None on other steps), :meth:`close` at the end.

    Each measured operand writes its :func:`operand_stats` into its own float64 ``[6]`` buffer
    (``Tensor.copy_``: inside compiled blocks that is an input mutation of the graph, so forward and
    backward stats compile into the blocks' graphs without a graph break); :meth:`arm` fills the buffers
    with NaN on stats steps, so an operand that was not reached reads as absent.

    Args:
        model: the model (FP8 modules are found by type, named by their plain FQN).
        every: measure every ``every``-th optimizer step (``step % every == 0``, 1-based), >= 1.
        compile_stats: run :func:`operand_stats` through ``torch.compile`` where it is called from eager
            code on the main thread (several fused passes instead of one kernel per op; for CUDA).

    Raises:
        ValueError: ``every < 1``.
    """

    def __init__(self, model: nn.Module, every: int, *, compile_stats: bool = False):
        if every < 1:
            raise ValueError(f"fp8.stats_every must be >= 1 for a monitor, got {every}")
        self.model, self.every = model, every
        self.active = False  # read inside the hooks (torch.compile guards on it: two variants of each graph)
        self._hooked: dict[int, tuple[weakref.ref, list, list]] = {}  # id -> (module, handles, slots)
        self._measured: set[int] = set()  # ids of the modules whose forward was measured eagerly this stats step
        self._stats = torch.compile(operand_stats, dynamic=True) if compile_stats else operand_stats

    def arm(self, step: int) -> bool:
        """Hook new FP8 modules; activate the hooks if optimizer step ``step`` (1-based) is a stats step."""
        self._hook_modules()
        self._measured.clear()
        self.active = step % self.every == 0
        if self.active:
            bufs = [buf for *_, slots in self._hooked.values() for *_, buf in slots]
            if bufs:
                torch._foreach_mul_(bufs, math.nan)  # NaN: not written (yet) this step
        return self.active

    def collect(self) -> HealthProbe | None:
        """Deactivate the hooks; the stats of the micro-batch measured (None when the step was not armed)."""
        if not self.active:
            return None
        self.active = False
        order = {op: i for i, op in enumerate(OPERANDS)}
        slots = sorted((s for *_, ss in self._hooked.values() for s in ss), key=lambda s: (s[0], order[s[1]]))
        if not slots:
            return HealthProbe([], None)
        return HealthProbe([s[:3] for s in slots], torch.stack([s[3] for s in slots]))  # no host sync yet

    def close(self) -> None:
        """Remove every hook."""
        for _ref, handles, _slots in self._hooked.values():
            for h in handles:
                h.remove()
        self._hooked.clear()
        self.active = False

    # -- hooks -------------------------------------------------------------------------------------
    def _hook_modules(self) -> None:
        from fp8kit.parallel.convert import plain_fqn

        live = set()
        for fqn, module in self.model.named_modules():
            casts = layer_casts(module)
            if casts is None:
                continue
            live.add(id(module))
            if id(module) not in self._hooked:
                self._hooked[id(module)] = (weakref.ref(module), *self._register(module, plain_fqn(fqn), casts))
        for key in [k for k, (ref, *_) in self._hooked.items() if k not in live or ref() is None]:
            for h in self._hooked.pop(key)[1]:  # swapped out (precision switch): drop its hooks
                h.remove()

    def _register(self, module: nn.Module, name: str, casts: dict[str, OperandCast]) -> tuple[list, list]:
        monitor = self
        delayed = isinstance(module, Float8DelayedLinear)
        autocast = not isinstance(module, (Float8DelayedLinear, Float8BlockwiseLinear))
        device = module.weight.device
        bufs = {op: torch.full((6,), math.nan, dtype=torch.float64, device=device) for op in casts}

        def stats(x, cast, scale=None):
            fn = operand_stats if torch.compiler.is_compiling() else monitor._stats
            return fn(x, cast, scale)

        def first_forward(mod) -> bool:
            """Whether to measure this forward of ``mod``: on a stats step, its first eager one only, so that an
            activation-checkpointing recompute (the forward again, inside the backward, on autograd's thread) is not
            measured twice; traced into a compiled block, always (the monitor's state is not read there)."""
            if torch.compiler.is_compiling():
                return True
            first = id(mod) not in monitor._measured
            monitor._measured.add(id(mod))
            return first

        def pre_hook(mod, args):
            if monitor.active and first_forward(mod):
                x = args[0]
                if autocast and torch.is_autocast_enabled():  # what torchao's Float8Linear.forward casts
                    x = x.to(torch.get_autocast_gpu_dtype())
                if "input" in bufs:
                    bufs["input"].copy_(stats(x, casts["input"]))
                if "weight" in bufs:
                    bufs["weight"].copy_(stats(mod.weight, casts["weight"]))

        def grad_hook(scale, grad):
            # traced into the compiled backward, or eagerly here: the plain ops in row chunks (an eager backward's
            # hooks run on autograd's device thread on CUDA, where the compiled stats are not called); measured now,
            # not kept for collect(): kept, every FP8 linear's output gradient would live to the end of the backward
            fn = operand_stats if torch.compiler.is_compiling() else operand_stats_chunked
            bufs["grad_output"].copy_(fn(grad.reshape(-1, grad.shape[-1]), casts["grad_output"], scale))

        def post_hook(mod, args, out):  # a recompute's output is not on the backward's path: its hook never fires
            if monitor.active and "grad_output" in bufs and out.requires_grad:
                out.register_hook(functools.partial(grad_hook, None))

        # the output gradient's history scale, copied in the forward for the gradient hook (below)
        g_scale = torch.ones((), dtype=torch.float32, device=device) if delayed else None

        def delayed_grad_hook(grad):
            grad_hook(g_scale, grad)  # measured in the hook, before a later forward writes g_scale again

        def delayed_probe(x, weight, scales, out):
            """Called by the delayed module's forward with the scales its casts used (None: first step, dynamic).
            Under ``train.compile`` on CUDA, Inductor's pre-grad pass failed ("graph input used before it has been
            defined") whenever the history's output-gradient scale tensor itself reached the gradient hook, read
            from the module's entry in a forward hook or passed from the forward (docs/benchmarks.md, session 37):
            the hook reads a copy of it in a buffer of its own."""
            if monitor.active and first_forward(module):
                sx, _, sw, _, sg, _ = scales
                bufs["input"].copy_(stats(x, casts["input"], sx))
                bufs["weight"].copy_(stats(weight, casts["weight"], sw))
                if out.requires_grad:
                    if sg is None:  # before the first roll: dynamic scales
                        out.register_hook(functools.partial(grad_hook, None))
                    else:
                        g_scale.copy_(sg)
                        out.register_hook(delayed_grad_hook)

        if delayed:
            module.health_probe = delayed_probe
            return [_ProbeHandle(module, delayed_probe)], [(name, op, casts[op], bufs[op]) for op in casts]
        handles = [module.register_forward_pre_hook(pre_hook), module.register_forward_hook(post_hook)]
        return handles, [(name, op, casts[op], bufs[op]) for op in casts]


class _ProbeHandle:
    """What ``remove()`` takes off a delayed module: its ``health_probe``, if it is still ``probe`` (a hook handle's
    interface)."""

    def __init__(self, module: nn.Module, probe):
        self._module, self._probe = weakref.ref(module), probe

    def remove(self) -> None:
        module = self._module()
        if module is not None and module.health_probe is self._probe:
            module.health_probe = None


# -- reading the records --------------------------------------------------------------------------------


def badness(row: dict) -> float:
    """How unhealthy one (layer, operand) row is: ``max(underflow, saturation)``; inf with non-finite values."""
    if row.get("nonfinite") or row.get("amax") is None:
        return math.inf
    return max(row.get("underflow") or 0.0, row.get("saturation") or 0.0)


def worst_layers(records: list[dict], k: int = WORST_K) -> list[dict]:
    """The ``k`` layers whose worst measured operand (over every stats step of ``records``) is the worst.

    Returns:
        One row per layer, the worst ``{step, layer, operand, dtype, granularity, amax, scale, underflow,
        saturation, nonfinite}`` observation, worst first (ties by layer name).
    """
    worst: dict[str, tuple[float, dict]] = {}
    for r in records:
        for row in r.get("fp8_health") or ():
            b = badness(row)
            if row["layer"] not in worst or b > worst[row["layer"]][0]:
                worst[row["layer"]] = (b, {"step": r["step"], **row})
    ranked = sorted(worst.values(), key=lambda e: (-e[0], e[1]["layer"]))
    return [row for _, row in ranked[:k]]


def _num(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def health_markdown(worst: list[dict], every: int | None = None) -> list[str]:
    """``summary.md`` lines: the "FP8 health: worst five layers" table (nothing when no stats were taken)."""
    if not worst:
        return []
    lines = ["", f"## FP8 health: worst {'five' if len(worst) == 5 else len(worst)} layers", ""]
    if every:
        lines += [f"Measured every {every} steps on the first micro-batch; each layer's worst operand and step. "
                  "underflow: fraction of its non-zero values that become 0 in FP8; saturation: fraction clamped "
                  "at the format's maximum.", ""]
    lines += ["| layer | operand | step | format | scaling | amax | scale | underflow | saturation | non-finite |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in worst:
        lines.append(
            f"| {r['layer']} | {r['operand']} | {r['step']} | {r['dtype']} | {r['granularity']} | "
            f"{_num(r['amax'], '.3g')} | {_num(r['scale'], '.3g')} | {_num(r['underflow'], '.2%')} | "
            f"{_num(r['saturation'], '.2%')} | {_num(r['nonfinite'], '.2%')} |"
        )
    return lines
