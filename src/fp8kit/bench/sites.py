"""The benchmark sites of one transformer layer, with their per-rank GEMM shapes under TP / EP.

A benchmark site is one entry of the selective-FP8 policy: all linears of one transformer layer that
share ``(component, module_kind, ub_name)``. HF models keep q, k and v (and gate and up) as separate
linears on the same input; together they are Megatron's fused ``qkv`` (``fc1``) layer, whose names
the policy format of LoongForge's adaptive FP8 uses, so they are timed together and get one rule.

Per-rank shapes (Megatron-LM tensor parallelism with sequence parallelism, arXiv:2205.05198): a
column-parallel layer (``layernorm_column`` / ``column``) splits its output features N over ``tp``; a
row-parallel layer (``row``) splits its input features K; ``duplicated`` layers are not split. The GEMM's M is
the token count ``seq_length x micro_batch_size`` on every rank (the sequence-parallel all-gather
happens before the column GEMM and the reduce-scatter after the row GEMM). Grouped (MoE) sites split
experts over ``ep`` (``num_gemms = experts / ep``); each expert is whole on its rank (fp8kit has no expert
tensor parallelism), so their policy key is LoongForge's ``etp = 1``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from fp8kit.base.errors import ConfigError
from fp8kit.config import ModelConfig
from fp8kit.models.build import build_model
from fp8kit.selective.auto import COLUMN_KINDS, ROW_KINDS, per_rank_gemm
from fp8kit.selective.rules import StaticRules
from fp8kit.selective.sites import Site, find_sites

__all__ = ["COLUMN_KINDS", "ROW_KINDS", "BenchSite", "layer_sites"]


@dataclass
class BenchSite:
    """One timed unit.

    Attributes:
        component / module_kind / ub_name: the policy key (with ``tp`` or ``etp`` + ``num_gemms``).
        gemms: per-rank ``(K, N)`` of each linear in the site (``in_features``, ``out_features``).
        full_gemms: the unsplit ``(K, N)``.
        fqns: the layer-0 modules the site stands for.
        tp / etp / num_gemms: the parallel layout timed (``etp`` is always 1 for grouped sites: whole experts).
    """

    component: str
    module_kind: str
    ub_name: str
    gemms: list[tuple[int, int]]
    full_gemms: list[tuple[int, int]]
    fqns: list[str] = field(default_factory=list)
    tp: int = 1
    etp: int | None = None
    num_gemms: int | None = None

    @property
    def name(self) -> str:
        return f"{self.component}.{self.ub_name}" if self.component != "llm" else self.ub_name

    @property
    def is_grouped(self) -> bool:
        return self.num_gemms is not None

    def flops(self, num_tokens: int) -> float:
        """FLOPs of forward + backward (three GEMMs of 2*M*K*N each) at ``num_tokens``."""
        return sum(6.0 * num_tokens * k * n for k, n in self.gemms)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "component": self.component, "module_kind": self.module_kind,
            "ub_name": self.ub_name, "gemms": [list(g) for g in self.gemms],
            "full_gemms": [list(g) for g in self.full_gemms], "fqns": self.fqns, "tp": self.tp,
            "etp": self.etp, "num_gemms": self.num_gemms,
        }


def layer_sites(
    model_cfg: ModelConfig, vocab_size: int, *, tp: int = 1, ep: int = 1
) -> tuple[list[BenchSite], list[str]]:
    """Benchmark sites of the first transformer layer of each component, and notes on skipped ones.

    Raises:
        ConfigError: a parallel size that does not divide a dimension or the expert count.
    """
    model = build_model(model_cfg, vocab_size, device="meta")
    sites = find_sites(model)
    first_layer: dict[str, int] = {}
    for s in sites:
        if s.layer is not None:
            first_layer[s.component] = min(first_layer.get(s.component, s.layer), s.layer)
    static = StaticRules()
    groups: OrderedDict[tuple, list[Site]] = OrderedDict()
    notes: list[str] = []
    for s in sites:
        if s.layer is None or s.layer != first_layer.get(s.component) or s.ub_name is None:
            continue
        if s.role != "expert":
            verdict = static.check(s)
            if not verdict.candidate:
                notes.append(f"{s.fqn}: not an FP8 candidate ({verdict.reason})")
                continue
        groups.setdefault((s.component, s.module_kind, s.ub_name), []).append(s)
    out: list[BenchSite] = []
    for (component, kind, ub), members in groups.items():
        full = [(m.in_features, m.out_features) for m in members]
        if members[0].num_gemms is not None:
            experts = members[0].num_gemms
            if experts % ep:
                raise ConfigError(f"--ep {ep} does not divide the {experts} experts of {members[0].fqn}")
            site = BenchSite(component, kind, ub, list(full), full, [m.fqn for m in members], tp=1, etp=1,
                             num_gemms=experts // ep)
        else:
            gemms = [per_rank_gemm(kind, k, n, tp, m.fqn) for (k, n), m in zip(full, members, strict=True)]
            site = BenchSite(component, kind, ub, gemms, full, [m.fqn for m in members], tp=tp)
        bad = [(k, n) for k, n in site.gemms if k % 16 or n % 16]
        if bad:
            notes.append(
                f"{site.name}: per-rank GEMM {bad[0]} is not divisible by 16 at this parallel size; not timed"
            )
            continue
        out.append(site)
    return out, notes
