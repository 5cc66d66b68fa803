"""Find every linear-like "site" of a model and label it with LoongForge adaptive FP8's vocabulary.

A :class:`Site` is plain data: ``plan`` prints sites, ``train`` converts them, ``bench-layers`` times
them. The vocabulary (``module_kind``, ``ub_name``) is the one of LoongForge's adaptive (selective) FP8,
named after Megatron-LM / Transformer Engine module classes, so that its policy files work unchanged:

================  ====================  =========================================================
module_kind       Megatron/TE class      HF modules (last name part, with its parent's role)
================  ====================  =========================================================
layernorm_column  TELayerNormColumn...   q/k/v projections (ub_name ``qkv``), gate/up (``fc1``),
                                         MLA up-projections (``q_up_proj`` / ``kv_up_proj``)
column            TEColumnParallel...    other column-parallel linears
row               TERowParallelLinear    attention output (``proj``), MLP down (``fc2``)
duplicated        TELinear               MLA down-projections (``q_down_proj`` / ``kv_down_proj``)
column_grouped    TEColumnParallelGr...  MoE expert gate/up (``fc1``), ``num_gemms`` = experts
row_grouped       TERowParallelGrouped   MoE expert down (``fc2``)
================  ====================  =========================================================

Sites that are never FP8 candidates get descriptive kinds outside LoongForge's set: ``embedding``,
``head`` (lm_head / output / classifier), ``router`` (MoE gate) and ``linear`` (a linear layer whose
role we do not recognise; static rules may still convert it, a policy never has a rule for it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

# name part -> (module_kind, ub_name) for linears inside an attention block
_ATTENTION_NAMES = {
    "q_proj": ("layernorm_column", "qkv"),
    "k_proj": ("layernorm_column", "qkv"),
    "v_proj": ("layernorm_column", "qkv"),
    "qkv_proj": ("layernorm_column", "qkv"),
    "query_key_value": ("layernorm_column", "qkv"),
    "Wqkv": ("layernorm_column", "qkv"),
    "qkv": ("layernorm_column", "qkv"),
    "proj": ("row", "proj"),
    "c_attn": ("layernorm_column", "qkv"),
    "query": ("layernorm_column", "qkv"),
    "key": ("layernorm_column", "qkv"),
    "value": ("layernorm_column", "qkv"),
    "o_proj": ("row", "proj"),
    "out_proj": ("row", "proj"),
    "dense": ("row", "proj"),
    "c_proj": ("row", "proj"),
    "wo": ("row", "proj"),
    # Multi-head latent attention (DeepSeek-V2/V3): TELinear down-projections, column up-projections.
    "q_a_proj": ("duplicated", "q_down_proj"),
    "kv_a_proj_with_mqa": ("duplicated", "kv_down_proj"),
    "q_b_proj": ("layernorm_column", "q_up_proj"),
    "kv_b_proj": ("layernorm_column", "kv_up_proj"),
}
# name part -> (module_kind, ub_name) for linears inside an MLP block
_MLP_NAMES = {
    "gate_proj": ("layernorm_column", "fc1"),
    "up_proj": ("layernorm_column", "fc1"),
    "gate_up_proj": ("layernorm_column", "fc1"),
    "fc1": ("layernorm_column", "fc1"),
    "w1": ("layernorm_column", "fc1"),
    "w3": ("layernorm_column", "fc1"),
    "c_fc": ("layernorm_column", "fc1"),
    "dense_h_to_4h": ("layernorm_column", "fc1"),
    "down_proj": ("row", "fc2"),
    "fc2": ("row", "fc2"),
    "w2": ("row", "fc2"),
    "c_proj": ("row", "fc2"),
    "dense_4h_to_h": ("row", "fc2"),
}
# Generic names that only mean qkv/proj/fc2 inside an attention or MLP block.
_CONTEXT_ONLY = {"qkv", "proj", "dense", "c_proj", "query", "key", "value", "wo"}
_ATTENTION_PARENTS = {"self_attn", "attention", "attn", "self_attention", "cross_attn", "mixer"}
_MLP_PARENTS = {"mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "shared_expert", "shared_experts"}
_EXPERT_PARTS = {"experts"}
_HEAD_NAMES = {"lm_head", "output", "output_head", "classifier", "score", "head"}
_ROUTER_NAMES = {"gate", "router", "wg"}
_VISION_PARTS = {"visual", "vision_tower", "vision_model", "vision_encoder", "image_encoder", "vit"}
_LAYER_CONTAINERS = {"layers", "h", "blocks", "layer", "block"}

# LoongForge adaptive FP8's module kinds (Megatron-LM / Transformer Engine classes).
DENSE_KINDS = ("layernorm_column", "column", "row", "duplicated")
GROUPED_KINDS = ("column_grouped", "row_grouped")
MODULE_KINDS = DENSE_KINDS + GROUPED_KINDS
UB_NAMES = ("qkv", "proj", "fc1", "fc2", "q_down_proj", "kv_down_proj", "q_up_proj", "kv_up_proj")


@dataclass(frozen=True)
class Site:
    """One linear-like module of a model, described for the FP8 decision.

    Attributes:
        fqn: fully qualified module name (for a 3-D expert weight: module FQN + "." + parameter name).
        module_type: the module's class name.
        role: ``attention``, ``mlp``, ``expert``, ``head``, ``router``, ``embedding`` or ``other``.
        module_kind: LoongForge's kind (see the module docstring) or a descriptive kind.
        ub_name: LoongForge's (Transformer Engine tp-comm) buffer name (``qkv`` / ``proj`` / ``fc1`` / ``fc2`` / ...) or None.
        weight_shape: shape of the weight: ``(out_features, in_features)`` for a linear layer,
            ``(num_experts, out, in)`` for grouped experts.
        in_features / out_features: the GEMM's K and N (per expert for grouped sites), or None.
        num_gemms: number of experts of a grouped site (before expert parallelism), else None.
        layer: index of the transformer layer the site belongs to, or None.
        component: ``llm`` or ``vision`` (each component takes its own policy and token count).
        has_bias: whether the linear layer has a bias.
        unsupported: for a 3-D expert weight whose module layout the FP8 grouped experts cannot run
            (``fp8kit.moe.experts.layout_problem``), the reason; else None.
        tied: for an output head: its weight is also an ``nn.Embedding``'s (tied word embeddings).
        fused_mlp: for a 3-D expert weight: its module's gate is the one the fused rowwise FP8 MLP computes
            (``fp8kit.moe.experts.fused_gate_problem`` is None), so with both weights in FP8 on the ``fused``
            grouped kernel the two run as one MLP (``moe/fused_experts.py``) and are timed and decided together.
    """

    fqn: str
    module_type: str
    role: str
    module_kind: str
    ub_name: str | None
    weight_shape: tuple[int, ...]
    in_features: int | None
    out_features: int | None
    num_gemms: int | None = None
    layer: int | None = None
    component: str = "llm"
    has_bias: bool = False
    unsupported: str | None = None
    fused_mlp: bool = False
    tied: bool = False

    @property
    def is_grouped(self) -> bool:
        return self.module_kind in GROUPED_KINDS

    @property
    def is_grouped_weight(self) -> bool:
        """A 3-D expert weight (transformers v5 fused experts): the FP8 grouped-GEMM path applies."""
        return self.is_grouped and len(self.weight_shape) == 3

    @property
    def module_fqn(self) -> str:
        """The FQN of the module holding the weight (for a 3-D expert weight, without the parameter name)."""
        return self.fqn.rpartition(".")[0] if self.is_grouped_weight else self.fqn

    def to_dict(self) -> dict:
        d = asdict(self)
        d["weight_shape"] = list(self.weight_shape)
        return d


def _layer_index(parts: list[str]) -> int | None:
    for i, p in enumerate(parts[:-1]):
        if p in _LAYER_CONTAINERS and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _component(parts: list[str]) -> str:
    return "vision" if any(p in _VISION_PARTS for p in parts) else "llm"


def _classify_linear(parts: list[str], module: nn.Linear) -> tuple[str, str, str | None]:
    """(role, module_kind, ub_name) of an ``nn.Linear`` from its name parts."""
    name = parts[-1]
    parents = set(parts[:-1])
    in_expert = bool(parents & _EXPERT_PARTS)
    if name in _HEAD_NAMES and not (parents & (_ATTENTION_PARENTS | _MLP_PARENTS)):
        return "head", "head", None
    if name in _ROUTER_NAMES and not in_expert:
        return "router", "router", None
    role, kind, ub = "other", "linear", None
    if parents & _ATTENTION_PARENTS and name in _ATTENTION_NAMES:
        role, (kind, ub) = "attention", _ATTENTION_NAMES[name]
    elif (parents & _MLP_PARENTS or in_expert) and name in _MLP_NAMES:
        role, (kind, ub) = "mlp", _MLP_NAMES[name]
    elif name in _MLP_NAMES and name not in _CONTEXT_ONLY:
        role, (kind, ub) = "mlp", _MLP_NAMES[name]
    elif name in _ATTENTION_NAMES and name not in _CONTEXT_ONLY:
        role, (kind, ub) = "attention", _ATTENTION_NAMES[name]
    if in_expert and "shared_expert" not in parents and "shared_experts" not in parents:
        # LoongForge adaptive FP8: expert column/layernorm_column -> column_grouped, row -> row_grouped.
        role = "expert"
        kind = "row_grouped" if kind == "row" else "column_grouped"
    return role, kind, ub


def _expert_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """3-D expert weights held directly by a module (HF transformers v5 fused experts)."""
    return [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 3]


def find_sites(model: nn.Module) -> list[Site]:
    """Every embedding, linear layer, router and grouped-expert weight of ``model``, in module order.

    Works on any device including ``meta`` (only shapes are read).
    """
    sites: list[Site] = []
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for fqn, module in model.named_modules():
        if not fqn:
            continue
        parts = fqn.split(".")
        layer, component = _layer_index(parts), _component(parts)
        if isinstance(module, nn.Embedding):
            sites.append(
                Site(fqn, type(module).__name__, "embedding", "embedding", None,
                     tuple(module.weight.shape), None, None, layer=layer, component=component)
            )
        elif isinstance(module, nn.Linear):
            role, kind, ub = _classify_linear(parts, module)
            sites.append(
                Site(fqn, type(module).__name__, role, kind, ub, tuple(module.weight.shape),
                     module.in_features, module.out_features, layer=layer, component=component,
                     has_bias=module.bias is not None, tied=id(module.weight) in embedding_weights)
            )
        elif "router" in type(module).__name__.lower() or (
            parts[-1] in _ROUTER_NAMES and isinstance(getattr(module, "weight", None), nn.Parameter)
        ):
            w = getattr(module, "weight", None)
            if isinstance(w, nn.Parameter):
                sites.append(
                    Site(fqn, type(module).__name__, "router", "router", None, tuple(w.shape),
                         w.shape[-1] if w.dim() == 2 else None, w.shape[0] if w.dim() == 2 else None,
                         layer=layer, component=component)
                )
        elif parts[-1] in _EXPERT_PARTS or "expert" in type(module).__name__.lower():
            from fp8kit.moe.experts import fused_gate_problem, layout_problem

            problem = layout_problem(module)
            fusable = problem is None and fused_gate_problem(module) is None
            for pname, p in _expert_params(module):
                ub = "fc2" if "down" in pname or pname in ("w2", "fc2") else "fc1"
                kind = "row_grouped" if ub == "fc2" else "column_grouped"
                e, n, k = p.shape
                sites.append(
                    Site(f"{fqn}.{pname}", type(module).__name__, "expert", kind, ub, tuple(p.shape),
                         k, n, num_gemms=e, layer=layer, component=component, unsupported=problem,
                         fused_mlp=fusable)
                )
    return sites
