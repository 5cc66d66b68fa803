"""Which modules get converted, rule by rule (sites on the meta device: shapes only)."""

from __future__ import annotations

import pytest
from torch import nn

from fp8kit.base.errors import ConfigError
from fp8kit.config import ModelConfig
from fp8kit.models.build import build_model
from fp8kit.selective.decide import DecideOptions, decide, summarize
from fp8kit.selective.patterns import compile_pattern
from fp8kit.selective.sites import find_sites
from tests.conftest import tiny_moe_model


def _decisions(model, **kw):
    for key in ("include", "exclude"):
        kw[key] = tuple(kw.get(key, ()))
    return {d.fqn: d for d in decide(find_sites(model), DecideOptions(**kw))}


@pytest.mark.parametrize(
    "pattern, fqn, hit",
    [
        ("layers.2", "model.layers.2.mlp.down_proj", True),
        ("layers.2", "model.layers.20.mlp.down_proj", False),
        ("layers.2", "model.layers.12.mlp", False),
        ("mlp", "model.layers.3.mlp.up_proj", True),
        ("mlp", "model.layers.3.mlpx.up_proj", False),
        ("layers.*.mlp", "model.layers.17.mlp.gate_proj", True),
        ("*_proj", "model.layers.0.self_attn.q_proj", True),
        ("q_proj", "model.layers.0.self_attn.q_proj_extra", False),
        ("re:layers\\.(1|2)", "model.layers.2.mlp", True),
        ("re:layers\\.(1|2)", "model.layers.12.mlp", False),
        ("re:layers\\.(1|2)", "model.layers.21.mlp", False),
        ("re:(q|k|v)_proj", "model.layers.0.self_attn.k_proj", True),
        ("re:proj", "model.layers.0.self_attn.k_proj", False),
    ],
)
def test_patterns_match_whole_parts(pattern, fqn, hit):
    assert compile_pattern(pattern).matches(fqn) is hit


def test_bad_patterns():
    for bad in ("", "layers..2", "re:", "re:(x"):
        with pytest.raises(ConfigError):
            compile_pattern(bad)


@pytest.fixture(scope="module")
def llama8b():
    return build_model(ModelConfig(preset="llama3-8b"), 128256, device="meta")


def test_llama3_8b_rules(llama8b):
    d = _decisions(llama8b)
    assert len(d) == 2 + 32 * 7  # embedding + head + 7 linears in each of 32 layers
    fp8 = [k for k, v in d.items() if v.is_fp8]
    assert len(fp8) == 32 * 7
    assert d["model.embed_tokens"].rule == "embedding" and not d["model.embed_tokens"].is_fp8
    assert d["lm_head"].rule == "head" and not d["lm_head"].is_fp8
    q = d["model.layers.0.self_attn.q_proj"]
    assert (q.site.module_kind, q.site.ub_name, q.site.weight_shape) == ("layernorm_column", "qkv", (4096, 4096))
    k = d["model.layers.5.self_attn.k_proj"]
    assert (k.site.module_kind, k.site.ub_name, k.site.weight_shape) == ("layernorm_column", "qkv", (1024, 4096))
    o = d["model.layers.31.self_attn.o_proj"]
    assert (o.site.module_kind, o.site.ub_name) == ("row", "proj")
    up = d["model.layers.7.mlp.up_proj"]
    assert (up.site.module_kind, up.site.ub_name, up.site.weight_shape) == ("layernorm_column", "fc1", (14336, 4096))
    down = d["model.layers.7.mlp.down_proj"]
    assert (down.site.module_kind, down.site.ub_name, down.site.layer) == ("row", "fc2", 7)
    s = summarize(list(d.values()))
    assert s["fp8_sites"] == 224 and 0.9 < s["fp8_param_fraction"] < 0.98


def test_include_exclude_on_llama3_8b(llama8b):
    d = _decisions(llama8b, exclude=["layers.2"], include=["mlp"])
    assert not d["model.layers.2.mlp.down_proj"].is_fp8
    assert d["model.layers.2.mlp.down_proj"].reason == "matches fp8.exclude 'layers.2'"
    assert d["model.layers.20.mlp.down_proj"].is_fp8  # layers.2 must not match layers.20
    assert d["model.layers.20.mlp.down_proj"].reason == "matches fp8.include 'mlp'"
    assert d["model.layers.20.self_attn.q_proj"].rule == "include" and not d["model.layers.20.self_attn.q_proj"].is_fp8
    assert sum(v.is_fp8 for v in d.values()) == 31 * 3


def test_bf16_run_decides_everything_bf16(llama8b):
    d = _decisions(llama8b, mixed_precision="bf16")
    assert not any(v.is_fp8 for v in d.values())
    assert d["model.layers.0.mlp.up_proj"].reason == "train.mixed_precision = 'bf16'"


def test_tiny_preset_rules():
    model = build_model(ModelConfig(preset="tiny"), 4096, device="meta")
    d = _decisions(model)
    assert sum(v.is_fp8 for v in d.values()) == 4 * 7
    assert {v.rule for v in d.values() if not v.is_fp8} == {"embedding", "head"}


class _Odd(nn.Module):
    """A model with layers the static filter must refuse."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj_in = nn.Linear(32, 48)  # ok
        self.odd = nn.Linear(48, 30)  # out not divisible by 16
        self.odd_in = nn.Linear(30, 64)  # in not divisible by 16
        self.classifier = nn.Linear(64, 16)  # head


def test_dims_divisible_by_16_and_heads():
    d = _decisions(_Odd())
    assert d["proj_in"].is_fp8
    assert d["odd"].rule == "dims%16" and "out_features=30" in d["odd"].reason
    assert d["odd_in"].rule == "dims%16" and "in_features=30" in d["odd_in"].reason
    assert d["classifier"].rule == "head"
    assert d["embed"].rule == "embedding"


def test_moe_router_stays_bf16_and_experts_go_grouped_fp8():
    """Qwen3-MoE (transformers v5 fused 3-D experts): routers stay BF16; the 3-D expert weights are FP8
    grouped-GEMM sites (rowwise, whatever the dense recipe)."""
    model, _ = tiny_moe_model()
    d = _decisions(model)
    experts = [v for v in d.values() if v.site.role == "expert"]
    assert {v.site.module_kind for v in experts} == {"column_grouped", "row_grouped"}
    assert all(v.site.num_gemms == 8 and v.is_fp8 and v.rule == "grouped" and v.recipe == "rowwise" for v in experts)
    gate_up = d["model.layers.0.mlp.experts.gate_up_proj"].site
    assert (gate_up.in_features, gate_up.out_features, gate_up.ub_name) == (256, 256, "fc1")
    routers = [v for v in d.values() if v.site.role == "router"]
    assert len(routers) == 2 and all(v.rule == "router" and not v.is_fp8 for v in routers)
    assert d["model.layers.1.self_attn.q_proj"].is_fp8


def test_mla_projections_use_the_loongforge_vocabulary():
    """DeepSeek-V3 multi-head latent attention: down-projections are `duplicated` (TELinear)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "deepseek_v3", vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=128, kv_lora_rank=64,
        qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    d = _decisions(model)
    attn = "model.layers.0.self_attn."
    assert (d[attn + "q_a_proj"].site.module_kind, d[attn + "q_a_proj"].site.ub_name) == ("duplicated", "q_down_proj")
    kv = d[attn + "kv_a_proj_with_mqa"].site
    assert (kv.module_kind, kv.ub_name) == ("duplicated", "kv_down_proj")
    assert d[attn + "q_b_proj"].site.ub_name == "q_up_proj" and d[attn + "o_proj"].site.ub_name == "proj"
    assert d["model.layers.0.mlp.down_proj"].is_fp8  # first_k_dense_replace: layer 0 is a dense MLP
    experts = [v for v in d.values() if v.site.role == "expert"]
    assert experts and all(v.is_fp8 and v.site.is_grouped_weight for v in experts)
    assert any(v.site.role == "router" for v in d.values())
