"""``selective.selective_fp8 = "auto"``: FP8 only where a start-up measurement says FP8 is faster.

The pure half of the automatic choice (the measuring half is ``fp8kit.bench.auto``; the cache
``selective/auto_cache.py``):

1. :func:`auto_units`: the FP8 candidate sites grouped as ``bench-layers`` times them (the linears of one
   layer that share an input and a LoongForge ``ub_name``: q/k/v together as ``qkv``, gate/up as ``fc1``;
   one 3-D expert weight per grouped unit, or, where the experts run the fused rowwise FP8 MLP, both weights
   of a layer as one ``experts.mlp`` unit timed as that MLP), each with its per-rank GEMM shapes under TP /
   EP and the run's token count (``seq_length x micro_batch_size``; routed pairs ``x moe_router_topk`` for
   experts);
2. distinct :class:`AutoShape` values are timed once each (Llama-3-8B: four shapes for 224 linears);
3. :func:`auto_verdict`: FP8 when ``bf16_ms / fp8_ms >= min_speedup`` (``selective.auto_min_speedup``,
   default :data:`DEFAULT_MIN_SPEEDUP`), else BF16. ``selective/decide.py`` applies it per site.

Why a margin above 1.0: the v2 timing (``bench/timing.py``) has run-to-run noise, and an isolated site is
not the site inside a compiled training step (fusion with its neighbours, other layers' memory traffic).
5% keeps a site whose gain is within that uncertainty in BF16, so that a default run is not slower than
BF16 because of FP8; ``selective.auto_min_speedup`` changes it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from fp8kit.base.errors import ConfigError
from fp8kit.selective.sites import Site

#: FP8 must be at least this much faster (BF16 time / FP8 time) for ``auto`` to choose it.
DEFAULT_MIN_SPEEDUP = 1.05

COLUMN_KINDS = ("layernorm_column", "column", "column_grouped")
ROW_KINDS = ("row", "row_grouped")


def per_rank_gemm(kind: str, k: int, n: int, ways: int, where: str) -> tuple[int, int]:
    """``(K, N)`` of one rank under ``ways``-way tensor parallelism (Megatron-LM, arXiv:2205.05198):
    column-parallel kinds split N (out_features), row-parallel kinds split K (in_features), others neither.

    Raises:
        ConfigError: the split dimension is not divisible by ``ways`` (names ``where``).
    """
    if ways == 1:
        return k, n
    if kind in COLUMN_KINDS:
        if n % ways:
            raise ConfigError(f"{where}: out_features {n} is not divisible by the parallel size {ways}")
        return k, n // ways
    if kind in ROW_KINDS:
        if k % ways:
            raise ConfigError(f"{where}: in_features {k} is not divisible by the parallel size {ways}")
        return k // ways, n
    return k, n


@dataclass(frozen=True)
class AutoShape:
    """One timed shape: the linears of a unit applied to one ``[num_tokens, K]`` bf16 input.

    Attributes:
        gemms: per-rank ``(K, N)`` of each linear (``in_features``, ``out_features``; per expert when grouped).
        num_tokens: the GEMMs' M: tokens per micro-batch, or routed (token, expert) pairs for grouped units.
        num_gemms: local experts per rank (``num_experts / ep``) of a grouped unit, else None.
        mlp: a grouped unit of both expert weights, ``gemms = ((H, 2I), (I, H))``, timed as the whole gated MLP
            (gate_up -> SwiGLU -> down, the fused rowwise FP8 path against BF16's grouped GEMMs).
        topk: an ``mlp`` unit on one GPU: experts per token (the routing timed: ``num_tokens / topk`` tokens, top-k
            as the run routes them); 1 under expert parallelism (one row per received token).
    """

    gemms: tuple[tuple[int, int], ...]
    num_tokens: int
    num_gemms: int | None = None
    mlp: bool = False
    topk: int = 1

    @property
    def is_grouped(self) -> bool:
        return self.num_gemms is not None

    def describe(self) -> str:
        """``8192x4096x14336 (x2)``: M x K x N per distinct GEMM; ``64 experts, 4096 pairs: 2048x768`` grouped
        (``... pairs (top-8): MLP ...`` for an expert MLP timed with its top-k routing)."""
        counts: OrderedDict[tuple[int, int], int] = OrderedDict()
        for g in self.gemms:
            counts[g] = counts.get(g, 0) + 1
        if self.is_grouped:
            parts = [f"{k}x{n}" + (f" (x{c})" if c > 1 else "") for (k, n), c in counts.items()]
            what = "MLP " + " -> ".join(parts) if self.mlp else ", ".join(parts)
            routed = f" (top-{self.topk})" if self.topk > 1 else ""
            return f"{self.num_gemms} experts, {self.num_tokens} pairs{routed}: {what}"
        return ", ".join(f"{self.num_tokens}x{k}x{n}" + (f" (x{c})" if c > 1 else "") for (k, n), c in counts.items())

    def to_dict(self) -> dict:
        d = {"gemms": [list(g) for g in self.gemms], "num_tokens": self.num_tokens, "num_gemms": self.num_gemms}
        if self.mlp:  # only then: the cache keys of other shapes stay what they were
            d["mlp"] = True
        if self.topk > 1:  # an expert MLP timed with its top-k routing (before session 27: top-1 rows)
            d["topk"] = self.topk
        return d


@dataclass(frozen=True)
class AutoUnit:
    """Sites decided together: one unit of one layer (``name``: the policy's ``ub_name``, ``experts.`` prefixed for
    MoE expert weights, ``vision.`` for a vision component, or the FQN of a linear without one) and the shape it
    is timed at."""

    name: str
    shape: AutoShape
    fqns: tuple[str, ...]


@dataclass(frozen=True)
class Timing:
    """Forward + backward milliseconds of one :class:`AutoShape` in BF16 and in FP8.

    Attributes:
        bf16_ms / fp8_ms: median device milliseconds per call (``bench/timing.py``), None when not timed.
        source: ``"measured"`` (this start-up) or ``"cache"`` (an earlier run on the same GPU and versions).
        error: why a precision could not be timed (an FP8 module this GPU cannot run, out of memory).
    """

    bf16_ms: float | None
    fp8_ms: float | None
    source: str = "measured"
    error: str | None = None

    @property
    def speedup(self) -> float | None:
        """``bf16_ms / fp8_ms`` (> 1: FP8 is faster), None unless both were timed."""
        if self.bf16_ms and self.fp8_ms:
            return self.bf16_ms / self.fp8_ms
        return None

    def to_dict(self) -> dict:
        return {"bf16_ms": self.bf16_ms, "fp8_ms": self.fp8_ms, "speedup": self.speedup, "source": self.source,
                "error": self.error}


@dataclass(frozen=True)
class AutoOptions:
    """What ``decide`` needs for ``selective_fp8 = "auto"``.

    Attributes:
        num_tokens: component -> tokens per micro-batch (``"*"``: every other component).
        topk: experts per token (grouped units are timed at ``tokens x topk`` routed pairs).
        min_speedup: FP8 only where ``bf16_ms / fp8_ms >= min_speedup``.
        timings: the measured table (:class:`AutoShape` -> :class:`Timing`); None until measured (then the
            static rules decide, and the caller says so).
        fused_experts: the run's FP8 experts run the fused rowwise MLP (grouped kernel ``fused``): both weights
            of such a layer form one ``experts.mlp`` unit (:func:`auto_units`). Set by the measuring caller.
    """

    num_tokens: Mapping[str, int]
    topk: int = 1
    min_speedup: float = DEFAULT_MIN_SPEEDUP
    timings: Mapping[AutoShape, Timing] | None = None
    fused_experts: bool = False

    def tokens_for(self, component: str) -> int:
        return self.num_tokens.get(component, self.num_tokens["*"])


def unit_topk(topk: int, experts: int, ep: int) -> int:
    """Experts per token an ``experts.mlp`` unit routes when timed: the model's ``topk`` (at most ``experts`` local
    experts) on one GPU, 1 under expert parallelism (one row per received token, as the all-to-all delivers them)."""
    return min(topk, experts) if ep == 1 else 1


def auto_units(sites: Iterable[Site], *, tp: int, ep: int, num_tokens: Mapping[str, int],
               topk: int = 1, fused_experts: bool = False) -> list[AutoUnit]:
    """Group FP8 candidate ``sites`` into timed units (module docstring, step 1), in model order.

    Dense linears of one parent module with one ``(module_kind, ub_name)`` form a unit; a linear without an
    ``ub_name`` is a unit of its own. 3-D expert weights: with ``fused_experts``, the two weights of one experts
    module whose gate the fused MLP computes (``Site.fused_mlp``), both candidates, form one ``experts.mlp``
    unit (an :class:`AutoShape` with ``mlp``: that is how they run, and they are decided together); otherwise each
    weight is a unit of its own.

    Raises:
        ConfigError: ``tp`` or ``ep`` does not divide a dimension or the expert count.
    """
    sites = list(sites)
    per_module: dict[str, list[Site]] = {}
    for s in sites:
        if s.is_grouped_weight:
            per_module.setdefault(s.module_fqn, []).append(s)
    mlp_modules = {m for m, ws in per_module.items()
                   if fused_experts and len(ws) == 2 and all(w.fused_mlp for w in ws)
                   and {w.ub_name for w in ws} == {"fc1", "fc2"}}
    groups: OrderedDict[tuple, list[Site]] = OrderedDict()
    for s in sites:
        parent = s.module_fqn.rpartition(".")[0]
        if s.is_grouped_weight and s.module_fqn in mlp_modules:
            key: tuple = ("mlp", s.module_fqn)
        elif s.is_grouped_weight or s.ub_name is None:
            key = ("one", s.fqn)
        else:
            key = (parent, s.module_kind, s.ub_name)
        groups.setdefault(key, []).append(s)
    out = []
    for key, members in groups.items():
        first = members[0]
        tokens = num_tokens.get(first.component, num_tokens["*"])
        if first.is_grouped_weight:
            if first.num_gemms % ep:
                raise ConfigError(f"distributed.ep = {ep} does not divide the {first.num_gemms} experts of {first.fqn}")
            if key[0] == "mlp":
                up = next(m for m in members if m.ub_name == "fc1")
                down = next(m for m in members if m.ub_name == "fc2")
                gemms = ((up.in_features, up.out_features), (down.in_features, down.out_features))
                shape = AutoShape(gemms, tokens * topk, first.num_gemms // ep, mlp=True,
                                  topk=unit_topk(topk, first.num_gemms, ep))
            else:
                shape = AutoShape(((first.in_features, first.out_features),), tokens * topk, first.num_gemms // ep)
        else:
            gemms = tuple(per_rank_gemm(m.module_kind, m.in_features, m.out_features, tp, m.fqn) for m in members)
            shape = AutoShape(gemms, tokens)
        name = "mlp" if key[0] == "mlp" else first.ub_name or first.fqn
        if first.is_grouped_weight:
            name = f"experts.{name}"
        if first.component != "llm":
            name = f"{first.component}.{name}"
        out.append(AutoUnit(name, shape, tuple(m.fqn for m in members)))
    return out


def distinct_shapes(units: Iterable[AutoUnit]) -> OrderedDict[AutoShape, list[AutoUnit]]:
    """Each distinct shape (timed once) with the units that share it, in order of first appearance."""
    out: OrderedDict[AutoShape, list[AutoUnit]] = OrderedDict()
    for u in units:
        out.setdefault(u.shape, []).append(u)
    return out


def shape_names(units: list[AutoUnit]) -> str:
    """``"qkv, proj"``: the distinct unit names of one shape."""
    return ", ".join(dict.fromkeys(u.name for u in units))


def auto_verdict(timing: Timing | None, min_speedup: float, num_tokens: int,
                 unit: str = "tokens") -> tuple[bool | None, str]:
    """``(use_fp8, reason)`` for one measured shape at ``num_tokens`` rows (``unit``: ``tokens``, or ``pairs`` of
    a grouped shape); ``use_fp8`` is None when ``timing`` is None (not measured).

    FP8 iff ``bf16_ms / fp8_ms >= min_speedup``; a shape whose FP8 (or BF16) timing failed stays BF16.
    """
    if timing is None:
        return None, "auto: not measured yet"
    cached = ", cached" if timing.source == "cache" else ""
    if timing.error or timing.speedup is None:
        return False, f"auto: not timed ({timing.error or 'no timing'}) -> bf16"
    s = timing.speedup
    ms = f"bf16 {timing.bf16_ms:.3f} ms, fp8 {timing.fp8_ms:.3f} ms at {num_tokens} {unit}{cached}"
    if s >= min_speedup:
        return True, f"auto: FP8 {s:.2f}x BF16 ({ms}) >= {min_speedup:g} -> fp8"
    return False, f"auto: FP8 {s:.2f}x BF16 ({ms}) < {min_speedup:g} -> bf16"


def slower_in_fp8(units: Iterable[AutoUnit], timings: Mapping[AutoShape, Timing],
                  fp8_fqns: set[str]) -> list[tuple[str, float, int]]:
    """``(names, speedup, num_tokens)`` of every measured shape slower in FP8 than BF16 (speedup < 1) that has a
    site in ``fp8_fqns``: the warning of a run that forces FP8 (``selective_fp8 = false`` or a policy)."""
    out = []
    for shape, us in distinct_shapes(units).items():
        t = timings.get(shape)
        if t is None or t.speedup is None or t.speedup >= 1.0:
            continue
        hit = [u for u in us if fp8_fqns.intersection(u.fqns)]
        if hit:
            out.append((shape_names(hit), t.speedup, shape.num_tokens))
    return out
