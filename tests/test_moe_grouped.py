"""FP8 grouped experts (fp8kit.moe): numerics against FP32, routing edge cases, the HF module swap.

Thresholds: torchao's reliability floors for FP8 linears (shared/anchors.md): output SQNR >= 18 dB,
input and weight gradients >= 17 dB. On the CPU the FP8 grouped GEMM runs as the emulation
(``torch._scaled_grouped_mm`` has no CPU kernel): the same E4M3 operands and scales, multiplied in
float32; ``benchmarks/grouped_gemm.py`` checks the CUDA kernel against the same emulation on a GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp8kit.errors import CapabilityError, ConfigError, Fp8kitError
from fp8kit.moe import grouped_mm as gmm
from fp8kit.moe import quantize as q
from fp8kit.moe import routing
from fp8kit.moe.experts import Float8GroupedExperts, check_supported, layout_problem, swap_in, swap_out
from fp8kit.moe.grouped_mm import (
    GroupedGemmConfig,
    emulated_scaled_grouped_mm,
    fp8_grouped_mm,
    resolve_backend,
)

OUT_DB, GRAD_DB = 18.0, 17.0


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    noise = (ref - x).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def _reference_experts(h, w_up, w_down, idx, weights, act=torch.nn.functional.silu):
    """Token-by-expert loop in float32: the HF eager experts formula."""
    out = torch.zeros_like(h)
    for e in range(w_up.shape[0]):
        tok, pos = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        gate, up = (h[tok] @ w_up[e].t()).chunk(2, dim=-1)
        y = (act(gate) * up) @ w_down[e].t()
        out.index_add_(0, tok, y * weights[tok, pos, None])
    return out


# Routings: (name, top_k_index builder) on T tokens, E experts, topk 2.
def _routings(t: int, e: int):
    g = torch.Generator().manual_seed(1)
    rnd = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
    yield "uniform", rnd
    skew = rnd.clone()
    skew[:, 0] = 0  # every token on expert 0: highly unbalanced
    skew[:, 1] = torch.where(skew[:, 1] == 0, 1, skew[:, 1])
    yield "unbalanced", skew
    empty = rnd % 3  # experts 3.. receive nothing
    empty[:, 1] = (empty[:, 0] + 1) % 3
    yield "empty-experts", empty


@pytest.mark.parametrize("tokens", [1, 7, 37, 200])
def test_fp8_experts_match_fp32_reference(tokens):
    e, hdim, inter = 8, 64, 48
    torch.manual_seed(tokens)
    for name, idx in _routings(tokens, e):
        h = torch.randn(tokens, hdim)
        w_up = torch.randn(e, 2 * inter, hdim) / hdim ** 0.5
        w_down = torch.randn(e, hdim, inter) / inter ** 0.5
        weights = torch.softmax(torch.randn(tokens, 2), dim=-1)
        g = torch.randn(tokens, hdim)

        ref_leaves = [t.clone().requires_grad_() for t in (h, w_up, w_down)]
        ref = _reference_experts(*ref_leaves, idx, weights)
        ref.backward(g)

        leaves = [t.to(torch.bfloat16).requires_grad_() for t in (h, w_up, w_down)]
        d = routing.dispatch(idx, e)
        x = routing.gather(leaves[0], d)
        up = fp8_grouped_mm(x, leaves[1], d.offs, "emulated")
        gate, u = up.chunk(2, dim=-1)
        y = fp8_grouped_mm(torch.nn.functional.silu(gate) * u, leaves[2], d.offs, "emulated")
        out = routing.combine(y, d, weights, torch.float32)
        out.backward(g)

        got = {"out": sqnr(ref, out), "dx": sqnr(ref_leaves[0].grad, leaves[0].grad)}
        for i, wname in ((1, "dw_up"), (2, "dw_down")):
            used = torch.unique(idx)
            got[wname] = sqnr(ref_leaves[i].grad[used], leaves[i].grad[used].float())
            unused = torch.ones(e, dtype=torch.bool)
            unused[used] = False
            assert leaves[i].grad[unused].abs().max().item() == 0 if unused.any() else True, (
                f"{name}, {tokens} tokens: experts without tokens got a nonzero {wname}")
        assert got["out"] >= OUT_DB, f"{name}, {tokens} tokens: output SQNR {got}"
        assert min(got["dx"], got["dw_up"], got["dw_down"]) >= GRAD_DB, f"{name}, {tokens} tokens: gradient SQNR {got}"


def test_dispatch_layout_is_aligned_and_complete():
    torch.manual_seed(0)
    t, e, topk = 53, 8, 2
    idx = torch.stack([torch.randperm(e)[:topk] for _ in range(t)])
    idx[:20, 0] = 5  # an unbalanced expert
    d = routing.dispatch(idx, e)
    counts = torch.bincount(idx.reshape(-1), minlength=e)
    assert torch.equal(d.tokens_per_expert, counts)
    ends = d.offs.long()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1]])
    assert bool(((ends - starts) % 16 == 0).all()), f"group sizes not multiples of 16: {(ends - starts).tolist()}"
    assert d.rows % 16 == 0 and d.rows >= int(ends[-1]), f"P={d.rows}, last end {int(ends[-1])}"
    # every pair lands exactly once, inside its expert's group, on its own token's row
    rows = d.pair_rows.view(t, topk)
    assert rows.unique().numel() == t * topk
    for tok in range(t):
        for k in range(topk):
            r, ex = int(rows[tok, k]), int(idx[tok, k])
            assert starts[ex] <= r < ends[ex]
            assert int(d.gather_idx[r]) == tok
    # every other row reads the zero row
    pad = torch.ones(d.rows, dtype=torch.bool)
    pad[d.pair_rows] = False
    assert bool((d.gather_idx[pad] == t).all())


def test_quantize_group_cols_scales_each_group_separately():
    torch.manual_seed(0)
    x = torch.randn(48, 32)
    x[16:32] *= 1000.0  # group 1 is 1000x larger: a shared scale would flush group 0 to zero
    offs = torch.tensor([16, 32, 48], dtype=torch.int32)
    gid = q.group_ids(offs, 48)
    data, inv = q.quantize_group_cols(x, gid, 3, transposed=False)
    deq = data.float() * inv.view(3, 32)[gid]
    for grp in range(3):
        rows = slice(16 * grp, 16 * grp + 16)
        assert sqnr(x[rows], deq[rows]) > 25, f"group {grp}: SQNR {sqnr(x[rows], deq[rows]):.1f} dB"
    assert data.stride() == (1, 48), f"right operand must be column-major, strides {data.stride()}"


def test_emulation_2d2d_matches_per_group_products():
    torch.manual_seed(0)
    n, k, e = 32, 48, 3
    offs = torch.tensor([16, 16, 64], dtype=torch.int32)  # expert 1 empty
    a = torch.randn(n, 64).to(torch.float8_e4m3fn)
    b = torch.randn(64, k).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(e * n) + 0.5, torch.rand(e * k) + 0.5
    out = emulated_scaled_grouped_mm(a, b, sa, sb, offs, torch.float32)
    assert out.shape == (e, n, k)
    assert out[1].abs().max().item() == 0
    want = (a[:, 16:].float() * sa[2 * n:, None]) @ (b[16:].float() * sb[2 * k:][None, :])
    torch.testing.assert_close(out[2], want)


def test_bad_inputs_are_named():
    w = torch.randn(4, 32, 32)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_grouped_mm(torch.randn(16, 32), torch.randn(4, 24, 32), torch.tensor([4, 8, 12, 16], dtype=torch.int32), "emulated")
    with pytest.raises(ValueError, match="int32"):
        fp8_grouped_mm(torch.randn(16, 32), w, torch.tensor([4, 8, 12, 16]), "emulated")
    with pytest.raises(ValueError, match="do not match"):
        fp8_grouped_mm(torch.randn(16, 16), w, torch.tensor([4, 8, 12, 16], dtype=torch.int32), "emulated")
    with pytest.raises(ConfigError, match="unknown backend"):
        resolve_backend(GroupedGemmConfig(backend="cutlass9"), torch.device("cpu"))
    with pytest.raises(CapabilityError, match="no CPU kernel"):
        resolve_backend(GroupedGemmConfig(backend="scaled_grouped_mm"), torch.device("cpu"))
    assert resolve_backend(GroupedGemmConfig(), torch.device("cpu")) == "emulated"


def _tiny_hf_moe(dtype=torch.bfloat16):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        head_dim=16,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(dtype)


def test_hf_model_swap_forward_backward_and_restore():
    model = _tiny_hf_moe()
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    ref_model = _tiny_hf_moe(torch.float32)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref_logits = ref_model(ids).logits
    ref_logits.float().pow(2).mean().backward()

    keys = list(model.state_dict())
    params = {n: p for n, p in model.named_parameters()}
    fqn = "model.layers.0.mlp.experts"
    swapped = swap_in(model, fqn, frozenset({"gate_up_proj", "down_proj"}))
    swap_in(model, "model.layers.1.mlp.experts", frozenset({"down_proj"}))
    assert "gate_up_proj" not in swapped.source._parameters, "the HF module still holds the expert weights"
    assert isinstance(model.get_submodule(fqn), Float8GroupedExperts) and swapped.gate_up_proj is params[f"{fqn}.gate_up_proj"]
    assert list(model.state_dict()) == keys, "state_dict keys changed by the swap"
    logits = model(ids).logits
    logits.float().pow(2).mean().backward()
    got = {"logits": sqnr(ref_logits.detach(), logits.detach())}
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                 "model.layers.1.mlp.experts.gate_up_proj", "model.embed_tokens.weight"):
        got[name] = sqnr(dict(ref_model.named_parameters())[name].grad, params[name].grad.float())
    assert got["logits"] >= OUT_DB, got
    assert min(v for k, v in got.items() if k != "logits") >= GRAD_DB, got

    assert swap_out(model) == 2
    assert not any(isinstance(m, Float8GroupedExperts) for m in model.modules())
    assert all(p is params[n] for n, p in model.named_parameters()), "restore changed the Parameter objects"
    assert list(model.state_dict()) == keys


def test_bf16_only_experts_equal_hf_grouped_mm():
    """With no weight in FP8 the swapped module computes what the HF experts do, up to the bf16 rounding of
    the sum over the topk experts (ours sums in float32, as transformers' grouped_mm experts do; the
    eager HF loop accumulates in bf16): 40 dB is about 1 bf16 ulp in 100, FP8 gives ~25 dB."""
    model = _tiny_hf_moe()
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        ref = model(ids).logits.float()
        swap_in(model, "model.layers.0.mlp.experts", frozenset())
        got = model(ids).logits.float()
    assert sqnr(ref, got) > 40, f"SQNR {sqnr(ref, got):.1f} dB, max difference {(ref - got).abs().max().item()}"


def test_unsupported_experts_layout_is_refused_and_decided_bf16():
    from fp8kit.fp8.decide import DecideOptions, decide
    from fp8kit.fp8.sites import find_sites

    model = _tiny_hf_moe()
    experts = model.get_submodule("model.layers.0.mlp.experts")
    experts.has_bias = True
    with pytest.raises(Fp8kitError, match="has_bias.*fp8.exclude"):
        check_supported(experts, "model.layers.0.mlp.experts")
    decisions = {d.fqn: d for d in decide(find_sites(model), DecideOptions())}
    d0 = decisions["model.layers.0.mlp.experts.gate_up_proj"]
    assert (d0.precision, d0.rule) == ("bf16", "expert-layout") and "has_bias" in d0.reason, d0
    assert decisions["model.layers.1.mlp.experts.gate_up_proj"].is_fp8
    # a module without the v5 layout flags (e.g. a custom experts class) is not taken for a supported one
    del experts.has_bias, experts.has_gate, experts.is_transposed
    assert "no has_gate attribute" in layout_problem(experts)


def test_rows_experts_and_columns_of_very_different_magnitude():
    """Rowwise scales: rows (tokens) and experts 1e5 x smaller than the rest keep their own precision
    (one scale per tensor would flush them towards the E4M3 subnormals)."""
    torch.manual_seed(0)
    e, k, n, per = 4, 64, 32, 32
    offs = torch.arange(1, e + 1, dtype=torch.int32) * per
    row_mag = torch.ones(e * per, 1)
    row_mag[::2] = 1e-5
    x = (torch.randn(e * per, k) * row_mag).requires_grad_()
    w = torch.randn(e, n, k) / k ** 0.5
    w[1] *= 1e-5
    w.requires_grad_()
    g = torch.randn(e * per, n) * row_mag
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([ref_x[i * per:(i + 1) * per] @ ref_w[i].t() for i in range(e)])
    ref.backward(g)
    out = fp8_grouped_mm(x, w, offs, "emulated")
    out.backward(g)
    small = slice(0, None, 2)
    got = {"out small rows": sqnr(ref[small], out[small]), "dx small rows": sqnr(ref_x.grad[small], x.grad[small]),
           "out small expert": sqnr(ref[per:2 * per], out[per:2 * per]), "dw small expert": sqnr(ref_w.grad[1], w.grad[1])}
    assert min(got.values()) >= GRAD_DB, got


def test_rows_past_the_last_group_are_never_read(monkeypatch):
    """The CUDA kernels leave rows past offs[-1] unwritten: poison them with NaN in the emulation and train
    a step; every logit and gradient must stay finite."""
    real = gmm.emulated_scaled_grouped_mm

    def poisoned(a, b, scale_a, scale_b, offs, out_dtype):
        out = real(a, b, scale_a, scale_b, offs, out_dtype)
        if b.dim() == 3:
            out[int(offs[-1]):] = float("nan")
        return out

    monkeypatch.setattr(gmm, "emulated_scaled_grouped_mm", poisoned)
    model = _tiny_hf_moe()
    for i in range(2):
        swap_in(model, f"model.layers.{i}.mlp.experts", frozenset({"gate_up_proj", "down_proj"}))
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = model(ids).logits
    logits.float().pow(2).mean().backward()
    assert torch.isfinite(logits).all()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients in {bad}"


_OTHER_MOE = {
    "deepseek_v3": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                        q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
    "mixtral": dict(vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
}


@pytest.mark.parametrize("model_type", sorted(_OTHER_MOE))
def test_other_hf_moe_architectures_swap(model_type):
    """DeepSeek-V3 (shared expert + grouped routing) and Mixtral use the same v5 experts interface."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fp8kit.fp8.convert import apply_fp8
    from fp8kit.fp8.decide import DecideOptions, decide
    from fp8kit.fp8.recipes import float8_linear_config
    from fp8kit.fp8.sites import find_sites

    cfg = AutoConfig.for_model(model_type, **_OTHER_MOE[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()
    decisions = [d for d in decide(find_sites(model), DecideOptions()) if d.site.is_grouped_weight]
    assert decisions and all(d.is_fp8 for d in decisions)
    assert apply_fp8(model, decisions, float8_linear_config("tensorwise")) == len({d.site.module_fqn for d in decisions})
    assert any(isinstance(m, Float8GroupedExperts) for m in model.modules())
    with torch.no_grad():
        got = model(ids).logits.float()
    db = sqnr(ref, got)
    # FP8 must have changed the numbers (a no-op swap would give inf) and kept them close
    assert OUT_DB <= db < 60, f"{model_type}: logits SQNR {db:.1f} dB"


def test_bucketed_rows_bound_the_layout_and_limit_distinct_shapes():
    """Expert parallel: the received pair count changes every step; the padded buffer takes few sizes."""
    sizes = {routing.bucketed_rows(r, 64, 65536) for r in range(60000, 72000, 97)}
    assert len(sizes) <= 3, sorted(sizes)
    assert all(routing.bucketed_rows(r, 64, 65536) >= routing.padded_rows(r, 64) for r in (1, 999, 65536, 70000))
    idx = torch.randint(0, 4, (50, 1), generator=torch.Generator().manual_seed(0))
    d = routing.dispatch(idx, 4, rows=256)
    assert d.rows == 256 and int(d.offs[-1]) <= 256
    with pytest.raises(ValueError, match="below"):
        routing.dispatch(idx, 4, rows=64)


def test_tune_once_without_the_triton_kernel_changes_nothing_and_says_so():
    """On a machine without Triton (this CPU build) torchao defines no such kernel: the call must warn and
    change nothing (the GPU effect is measured by benchmarks/ep_row_count_tuning.py)."""
    import importlib

    mod = importlib.import_module(gmm.TOKEN_KEYED_KERNELS[0][0])
    if hasattr(mod, gmm.TOKEN_KEYED_KERNELS[0][1]):
        pytest.skip("Triton kernels present: covered by the GPU benchmark")
    with pytest.warns(UserWarning, match="not found"):
        assert gmm.tune_once_for_all_row_counts() == []


def test_flops_per_token_counts_the_active_experts_only():
    """MoE MFU: the 3-D expert weights count with topk/E of their parameters (PaLM 6N on active params)."""
    from fp8kit.models.build import count_params, flops_per_token
    from tests.conftest import tiny_moe_model

    model, cfg = tiny_moe_model()
    experts = sum(p.numel() for p in model.parameters() if p.dim() == 3)
    assert experts > 0
    n_all = count_params(model)["non_embedding"] + (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)
    attn = 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * 64
    want = 6.0 * (n_all - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)) + attn
    got = flops_per_token(model, cfg, 64)
    assert got == pytest.approx(want, rel=1e-9), f"flops/token {got:.4e}, want {want:.4e}"
    assert got < 6.0 * n_all + attn
