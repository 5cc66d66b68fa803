"""The fused rowwise FP8 expert MLP (``moe/fused_experts.py``, grouped kernel ``fused``) on the CPU reference path.

On the CPU its casts run the PyTorch references of ``moe/rowwise_quant.py`` and its GEMMs the float32 emulation of
``torch._scaled_grouped_mm``; the GPU test of ``rowwise_quant`` checks the Triton kernels against those references
bit for bit. Thresholds as ``tests/test_moe_grouped.py``: whole layer vs float64 output >= 18 dB, gradients >= 17 dB
(torchao's floors); fused vs the unfused per-weight path (same casts, SwiGLU rounded once instead of twice)
>= 30 dB on every output and gradient.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from fp8kit.moe import routing
from fp8kit.moe.experts import Float8GroupedExperts
from fp8kit.moe.fused_experts import fused_rowwise_experts
from fp8kit.moe.grouped_mm import GroupedGemmConfig, emulated_scaled_grouped_mm
from tests.conftest import sqnr
from tests.test_moe_grouped import _routings, check_layer, layer_case


@pytest.mark.parametrize("tokens", [1, 37, 200])
def test_fused_mlp_matches_float64_reference(tokens):
    """Uniform, unbalanced and empty-expert routings; experts without tokens get exactly zero gradients."""
    e, hdim, inter = 8, 64, 48
    torch.manual_seed(tokens)
    for name, idx in _routings(tokens, e):
        leaves, weights, g, ref_leaves, ref = layer_case(idx, e, hdim, inter)
        d = routing.dispatch(idx, e)
        y = fused_rowwise_experts(leaves[0], leaves[1], leaves[2], d.gather_idx, d.pair_rows, d.offs,
                                  emulated_scaled_grouped_mm, torch.bfloat16)
        out = routing.combine(y, d, weights, torch.float32)
        out.backward(g)
        assert leaves[1].grad.dtype == leaves[2].grad.dtype == torch.bfloat16
        check_layer(f"{name}, {tokens} tokens", idx, e, leaves, ref_leaves, ref, out)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of ``a`` and ``b`` differ in their bits (NaN-safe)."""
    return int((a.view(torch.int16 if a.element_size() == 2 else torch.int32)
                != b.view(torch.int16 if b.element_size() == 2 else torch.int32)).sum())


@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32])
def test_combine_fused_into_the_mlp_equals_the_mlp_then_the_combine(wgrad, hidden_dtype):
    """``fused_rowwise_experts(..., top_k_weights=w)``, whose backward casts the output gradient read through the
    pairs (``dy (P, H)`` never written), equals the uncombined call followed by ``routing.combine``, bit for bit on
    the output and on the gradients of the tokens, both weights and the router weights: with FP8 and bf16 weight
    gradients, for bf16 tokens and float32 ones (GEMM outputs then float32 too, as on the CPU where the experts
    module passes the tokens' dtype). Routings with empty experts and unbalanced load."""
    e, hdim, inter = 8, 64, 48
    for name, idx in _routings(37, e):
        torch.manual_seed(5)
        d = routing.dispatch(idx, e)
        h = torch.randn(37, hdim).to(hidden_dtype)
        w_up = (torch.randn(e, 2 * inter, hdim) / hdim ** 0.5).to(torch.bfloat16)
        w_down = (torch.randn(e, hdim, inter) / inter ** 0.5).to(torch.bfloat16)
        weights = torch.softmax(torch.randn(37, 2), dim=-1).to(hidden_dtype)
        g = torch.randn(37, hdim).to(hidden_dtype)
        runs = []
        for fused_combine in (False, True):
            leaves = [t.clone().requires_grad_() for t in (h, w_up, w_down, weights)]
            args = (leaves[0], leaves[1], leaves[2], d.gather_idx, d.pair_rows, d.offs, emulated_scaled_grouped_mm,
                    hidden_dtype)
            if fused_combine:
                out = fused_rowwise_experts(*args, cache_weights=False, wgrad=wgrad, top_k_weights=leaves[3])
            else:
                out = routing.combine(fused_rowwise_experts(*args, cache_weights=False, wgrad=wgrad), d, leaves[3],
                                      hidden_dtype)
            out.backward(g)
            runs.append([out.detach(), *(t.grad for t in leaves)])
        for what, a, b in zip(("output", "dx", "dw_up", "dw_down", "d_router_weights"), *runs, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{name} {what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}"
            diff = _bits_equal(a, b)
            assert diff == 0, f"{name}, wgrad {wgrad}, {hidden_dtype}: {what} differs in {diff} of {a.numel()}"


def test_combine_fused_into_the_mlp_refuses_bad_router_weights():
    e = 4
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]])
    d = routing.dispatch(idx, e)
    h = torch.randn(3, 32, dtype=torch.bfloat16)
    w_up, w_down = torch.randn(e, 32, 32, dtype=torch.bfloat16), torch.randn(e, 32, 16, dtype=torch.bfloat16)
    args = (h, w_up, w_down, d.gather_idx, d.pair_rows, d.offs, emulated_scaled_grouped_mm, torch.bfloat16)
    with pytest.raises(ValueError, match=r"top_k_weights \(3, 3\) must be \(T, topk\) for 3 tokens and 6 pairs"):
        fused_rowwise_experts(*args, top_k_weights=torch.rand(3, 3))
    with pytest.raises(ValueError, match="cannot be combined with an expert-parallel payload"):
        fused_rowwise_experts(*args, top_k_weights=torch.rand(3, 2), received=h)
    with pytest.raises(ValueError, match=r"hidden in the GEMMs' output dtype \(hidden torch.float32, out_dtype "
                                         r"torch.bfloat16\)"):
        fused_rowwise_experts(h.float(), *args[1:], top_k_weights=torch.rand(3, 2))


def test_experts_module_fuses_the_combine_only_for_tokens_in_the_gemms_dtype():
    """The experts module hands its router weights to the fused MLP when the tokens are in the GEMMs' output
    dtype, and combines outside otherwise (float32 tokens with bf16 GEMM outputs: the CUDA case under autocast)."""
    import fp8kit.moe.experts as experts_mod

    module = Float8GroupedExperts(_hf_experts(), frozenset(("gate_up_proj", "down_proj")),
                                  GroupedGemmConfig(kernel="fused"))
    seen = []
    real = experts_mod.fused_rowwise_experts
    experts_mod.fused_rowwise_experts = lambda *a, **kw: seen.append(kw["top_k_weights"] is not None) or real(*a, **kw)
    real_gemm = experts_mod.scaled_grouped_gemm
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(16)])
    weights = torch.softmax(torch.randn(16, 2), dim=-1)
    try:
        module(torch.randn(16, 128, dtype=torch.bfloat16), idx, weights.to(torch.bfloat16))
        experts_mod.scaled_grouped_gemm = lambda device: (emulated_scaled_grouped_mm, torch.bfloat16)
        out = module(torch.randn(16, 128), idx, weights)
    finally:
        experts_mod.fused_rowwise_experts = real
        experts_mod.scaled_grouped_gemm = real_gemm
    assert seen == [True, False], f"combine fused into the MLP per call: {seen}"
    assert out.dtype == torch.float32 and out.shape == (16, 128)
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="received .* and top_k_weights cannot be given together"):
        module.local_experts(x, routing.dispatch(idx, 8), received=x, top_k_weights=weights)


def _hf_experts(e: int = 8, hdim: int = 128, inter: int = 64) -> Qwen3MoeExperts:
    cfg = Qwen3MoeConfig(hidden_size=hdim, moe_intermediate_size=inter, num_experts=e, hidden_act="silu")
    mod = Qwen3MoeExperts(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        mod.gate_up_proj.copy_(torch.randn_like(mod.gate_up_proj) / hdim ** 0.5)
        mod.down_proj.copy_(torch.randn_like(mod.down_proj) / inter ** 0.5)
    return mod.to(torch.bfloat16)


def _run(module, hidden, idx, weights, g):
    x = hidden.clone().requires_grad_()
    module.gate_up_proj.grad = module.down_proj.grad = None
    out = module(x, idx, weights)
    out.backward(g)
    return out.detach().float(), x.grad.float(), module.gate_up_proj.grad.float(), module.down_proj.grad.float()


def test_fused_kernel_in_the_experts_module_matches_the_per_weight_path():
    """Float8GroupedExperts with kernel ``fused`` (whole-MLP path) against the same module on the per-weight
    emulated path: >= 30 dB on output and every gradient; one FP8 weight only, or a custom gate, falls back to
    the per-weight path (and says why)."""
    src = _hf_experts()
    t = 96
    torch.manual_seed(1)
    hidden = torch.randn(t, 128, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 2), dim=-1).to(torch.bfloat16)
    g = torch.randn(t, 128, dtype=torch.bfloat16)
    both = frozenset(("gate_up_proj", "down_proj"))
    fused = Float8GroupedExperts(src, both, GroupedGemmConfig(kernel="fused", wgrad="fp8"))
    assert fused.fused_problem(torch.device("cpu")) is None
    got = _run(fused, hidden, idx, weights, g)
    fused.fp8_weights = both
    per_weight = Float8GroupedExperts.__new__(Float8GroupedExperts)
    torch.nn.Module.__init__(per_weight)
    per_weight.__dict__.update({k: v for k, v in fused.__dict__.items() if k not in ("_parameters", "_modules")})
    per_weight.gate_up_proj, per_weight.down_proj = fused.gate_up_proj, fused.down_proj
    per_weight.config, per_weight._kernels = GroupedGemmConfig(kernel="emulated"), {}
    ref = _run(per_weight, hidden, idx, weights, g)
    for what, a, b in zip(("output", "dx", "dw_up", "dw_down"), ref, got, strict=True):
        db = sqnr(a, b)
        assert db >= 30.0, f"fused vs per-weight {what}: {db:.1f} dB < 30"
    fused.fp8_weights = frozenset(("down_proj",))
    assert "only ['down_proj'] in FP8" in fused.fused_problem(torch.device("cpu"))
    _run(fused, hidden, idx, weights, g)  # runs the per-weight path
    custom = _hf_experts()
    custom._apply_gate = lambda h: h[:, : h.shape[1] // 2]
    other = Float8GroupedExperts(custom, both, GroupedGemmConfig(kernel="fused"))
    assert "own _apply_gate" in other.fused_problem(torch.device("cpu"))


def test_fused_layer_compiled_equals_eager():
    """torch.compile of the fused layer (aot_eager) equals eager bit for bit on the CPU and takes the fused path
    (the casts are torch.library ops with fake kernels). Not fullgraph here: the CPU GEMM emulation reads the
    group offsets on the host; the CUDA grouped GEMM does not."""
    src = _hf_experts()
    module = Float8GroupedExperts(src, frozenset(("gate_up_proj", "down_proj")), GroupedGemmConfig(kernel="fused"))
    t = 64
    torch.manual_seed(2)
    hidden = torch.randn(t, 128, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 2), dim=-1).to(torch.bfloat16)
    calls = []
    import fp8kit.moe.experts as experts_mod

    real = experts_mod.fused_rowwise_experts
    experts_mod.fused_rowwise_experts = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    try:
        eager = module(hidden, idx, weights)
        compiled = torch.compile(module, backend="aot_eager")(hidden, idx, weights)
    finally:
        experts_mod.fused_rowwise_experts = real
    assert len(calls) == 2, f"the fused path ran {len(calls)} of 2 times"
    assert torch.equal(eager, compiled), f"max |diff| {(eager.float() - compiled.float()).abs().max().item()}"


def test_scale_hints_follow_the_weights_and_stay_out_of_the_state_dict():
    """The fused experts keep their weights' last scales as int32 hint buffers: not in the state_dict, untouched by
    ``.to(dtype)``, advanced by every forward (eager and compiled) to the scales of the weights it cast, and not used
    with the weight cache (which keeps its own)."""
    from fp8kit.moe.rowwise_quant import quantize_experts_dual

    both = frozenset(("gate_up_proj", "down_proj"))
    module = Float8GroupedExperts(_hf_experts(), both, GroupedGemmConfig(kernel="fused")).to(torch.bfloat16)
    names = [f"_hint_{w}_{p}" for w in ("gate_up_proj", "down_proj") for p in ("rows", "cols")]
    assert not any(n in module.state_dict() for n in names), list(module.state_dict())
    hints = [getattr(module, n) for n in names]
    assert [(h.dtype, tuple(h.shape)) for h in hints] == [(torch.int32, s) for s in ((8, 128), (8, 128), (8, 128),
                                                                                      (8, 64))]
    t = 64
    torch.manual_seed(4)
    hidden = torch.randn(t, 128, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 2), dim=-1).to(torch.bfloat16)

    def want() -> list[torch.Tensor]:
        casts = quantize_experts_dual(module.gate_up_proj.detach()), quantize_experts_dual(module.down_proj.detach())
        return [c[i] for c in casts for i in (1, 3)]

    for run in (module, torch.compile(module, backend="aot_eager")):
        for h in hints:
            h.zero_()
        run(hidden, idx, weights)
        wrong = [n for n, h, w in zip(names, hints, want(), strict=True) if not torch.equal(h.view(torch.float32), w)]
        assert not wrong, f"hints not advanced to the last cast's scales: {wrong}"
        with torch.no_grad():
            module.down_proj.mul_(2.0)
    cached = Float8GroupedExperts(_hf_experts(), both, GroupedGemmConfig(kernel="fused", cache_weights=True))
    cached(hidden, idx, weights)
    assert all(getattr(cached, n).count_nonzero() == 0 for n in names), "the cached path touched the hints"
    module.register_buffer(names[0], torch.zeros(4, 128, dtype=torch.int32), persistent=False)  # as if resharded
    with pytest.warns(UserWarning, match=r"scale hints .* do not match the local weights"):
        assert module.scale_hints(module.gate_up_proj, module.down_proj) is None
    module.reset_scale_hints()
    assert module.scale_hints(module.gate_up_proj, module.down_proj) is not None


def test_expert_weights_quantized_once_per_optimizer_step():
    """The fused path casts each expert weight once per weight version and optimizer step: the second micro-batch
    of a gradient-accumulation step hits the cache (outputs and accumulated gradients equal to the uncached run bit
    for bit); an optimizer step, and ``clear_weight_cache()``, make the next forward cast again."""
    from fp8kit.fp8.kernels.ops import clear_weight_cache
    from fp8kit.moe.rowwise_quant import experts_cache_stats

    both = frozenset(("gate_up_proj", "down_proj"))
    cached = Float8GroupedExperts(_hf_experts(), both, GroupedGemmConfig(kernel="fused", cache_weights=True))
    plain = Float8GroupedExperts(_hf_experts(), both, GroupedGemmConfig(kernel="fused"))  # the default: off
    t = 64
    torch.manual_seed(3)
    batches = []
    for _ in range(3):
        hidden = torch.randn(t, 128, dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(8)[:2] for _ in range(t)])
        weights = torch.softmax(torch.randn(t, 2), dim=-1).to(torch.bfloat16)
        batches.append((hidden, idx, weights, torch.randn(t, 128, dtype=torch.bfloat16)))

    def micro(module, b):
        out = module(b[0], b[1], b[2])
        out.backward(b[3])
        return out.detach()

    clear_weight_cache()
    s0 = experts_cache_stats()
    outs = [micro(cached, b) for b in batches[:2]]  # one accumulation step of two micro-batches
    s1 = experts_cache_stats()
    assert (s1["misses"] - s0["misses"], s1["hits"] - s0["hits"]) == (2, 2), f"cache stats {s0} -> {s1}"
    refs = [micro(plain, b) for b in batches[:2]]
    assert experts_cache_stats() == s1, "cache_weights=False must not touch the cache"
    for i, (a, b) in enumerate(zip(outs, refs, strict=True)):
        assert torch.equal(a, b), f"micro-batch {i}: cached output differs by {(a.float() - b.float()).abs().max()}"
    for name in both:
        ga, gb = getattr(cached, name).grad, getattr(plain, name).grad
        assert torch.equal(ga, gb), f"{name}: accumulated gradients differ by {(ga.float() - gb.float()).abs().max()}"
    for module in (cached, plain):
        torch.optim.SGD(module.parameters(), lr=0.1).step()  # changes the weights: the cache must not be reused
    a, b = micro(cached, batches[2]), micro(plain, batches[2])
    s2 = experts_cache_stats()
    assert s2["misses"] - s1["misses"] == 2 and torch.equal(a, b), f"after the optimizer step: {s1} -> {s2}"
    clear_weight_cache()
    micro(cached, batches[2])
    assert experts_cache_stats()["misses"] - s2["misses"] == 2, "clear_weight_cache() left the expert entries"


def test_trainer_caches_weights_only_with_accumulation():
    """``fp8kit train`` caches FP8 weights (blockwise linears and fused experts) with ``train.grad_accum > 1`` only
    (otherwise every step's optimizer step invalidates the cache and it only holds memory); the library default is
    off. One process, tiny-moe, blockwise: every FP8 linear and the experts' config carry the choice."""
    from fp8kit.config import load_config
    from fp8kit.config.options import options_from_config
    from fp8kit.config.prepare_options import prepare_options
    from fp8kit.fp8.linear import Float8BlockwiseLinear
    from fp8kit.models.build import build_hf_config, build_model
    from fp8kit.parallel.prepare import prepare_model
    from fp8kit.selective.decide import decide
    from fp8kit.selective.sites import find_sites

    assert GroupedGemmConfig().cache_weights is False
    for accum, want in ((1, False), (4, True)):
        cfg = load_config(None, ["model.preset=tiny-moe", "data.vocab_size=1024", "train.mixed_precision=fp8",
                                 "fp8.recipe=blockwise", "fp8.emulate=true", f"train.grad_accum={accum}"])
        opts = prepare_options(cfg, fp8_now=True, emulate=True)
        assert opts.cache_weights is want, (accum, opts.cache_weights)
        model = build_model(cfg.model, cfg.data.vocab_size, device="cpu", dtype=torch.bfloat16, seed=0)
        hf_cfg = build_hf_config(cfg.model, cfg.data.vocab_size)
        decisions = decide(find_sites(model), options_from_config(cfg, hf_cfg, "cpu"))
        done = prepare_model(model, decisions, opts, None, hf_cfg=hf_cfg)
        linears = [m for m in model.modules() if isinstance(m, Float8BlockwiseLinear)]
        assert linears and all(m.cache_weight is want for m in linears), (accum, [m.cache_weight for m in linears])
        assert done.conversion.grouped.cache_weights is want


@pytest.mark.parametrize("tokens", [1, 37, 200])
def test_bf16_wgrad_matches_float64_reference_and_leaves_fprop_dgrad_alone(tokens):
    """``wgrad="bf16"`` (fprop and dgrad in FP8, the weight gradients a bf16 grouped GEMM): output and dx equal the
    all-FP8 fused path bit for bit (same casts, same GEMMs); dw_up / dw_down against float64 pass the layer's
    floors and are no worse than the all-FP8 wgrad's (within 0.5 dB: their operands still carry the FP8 error
    of fprop / dgrad); experts without tokens get exactly zero."""
    e, hdim, inter = 8, 64, 48
    torch.manual_seed(tokens)
    for name, idx in _routings(tokens, e):
        leaves, weights, g, ref_leaves, ref = layer_case(idx, e, hdim, inter)
        d = routing.dispatch(idx, e)
        runs = {}
        for wgrad, keep_rows in (("fp8", False), ("bf16", False), ("bf16", True)):
            xs = [t.detach().clone().requires_grad_() for t in leaves]
            y = fused_rowwise_experts(xs[0], xs[1], xs[2], d.gather_idx, d.pair_rows, d.offs,
                                      emulated_scaled_grouped_mm, torch.bfloat16, wgrad=wgrad, keep_rows=keep_rows)
            out = routing.combine(y, d, weights, torch.float32)
            out.backward(g)
            runs[wgrad, keep_rows] = (out.detach(), xs)
        (out8, x8), (out16, x16), (out_kept, x_kept) = runs["fp8", False], runs["bf16", False], runs["bf16", True]
        where = f"{name}, {tokens} tokens"
        # the tokens' rows saved by the forward (fp8.grouped_wgrad_input = saved) or gathered again: the same bits
        assert torch.equal(out_kept, out16) and all(torch.equal(a.grad, b.grad) for a, b in zip(x_kept, x16, strict=True)), \
            f"{where}: saving the expert-order rows changed an output or gradient"
        assert torch.equal(out8, out16), f"{where}: output differs by {(out8 - out16).abs().max().item()}"
        assert torch.equal(x8[0].grad, x16[0].grad), f"{where}: dx differs"
        check_layer(where + ", bf16 wgrad", idx, e, x16, ref_leaves, ref, out16)
        used = torch.unique(idx)
        for i, wname in ((1, "dw_up"), (2, "dw_down")):
            db16 = sqnr(ref_leaves[i].grad[used], x16[i].grad[used].float())
            db8 = sqnr(ref_leaves[i].grad[used], x8[i].grad[used].float())
            assert db16 >= db8 - 0.5, f"{where}: {wname} bf16 wgrad {db16:.1f} dB < fp8 wgrad {db8:.1f} dB - 0.5"


def test_wgrad_input_saved_under_activation_checkpointing_only():
    """``fp8.grouped_wgrad_input = auto`` keeps the expert-order token rows from forward to backward only under
    activation checkpointing (one layer's saved tensors at a time); ``saved`` / ``gathered`` are taken as given; the
    prepared experts carry the choice; an unknown value is refused by the config and by the resolver."""
    from fp8kit.config import load_config
    from fp8kit.config.prepare_options import prepare_options
    from fp8kit.moe.grouped_mm import resolve_wgrad_input
    from fp8kit.parallel.prepare import prepare_model
    from fp8kit.selective.decide import decide
    from fp8kit.selective.sites import find_sites

    assert [resolve_wgrad_input("auto", ac) for ac in (False, True)] == ["gathered", "saved"]
    assert [resolve_wgrad_input(v, False) for v in ("saved", "gathered")] == ["saved", "gathered"]
    with pytest.raises(ValueError, match="wgrad_input = 'kept'"):
        resolve_wgrad_input("kept", True)
    with pytest.raises(Exception, match="grouped_wgrad_input"):
        load_config(None, ["fp8.grouped_wgrad_input=kept"])
    from fp8kit.config.options import options_from_config
    from fp8kit.models.build import build_hf_config, build_model

    for sets, want in (([], "gathered"), (["train.activation_checkpointing=true"], "saved"),
                       (["fp8.grouped_wgrad_input=saved"], "saved"),
                       (["train.activation_checkpointing=true", "fp8.grouped_wgrad_input=gathered"], "gathered")):
        cfg = load_config(None, ["model.preset=tiny-moe", "data.vocab_size=1024", "train.mixed_precision=fp8",
                                 "fp8.emulate=true", *sets])
        model = build_model(cfg.model, cfg.data.vocab_size, device="cpu", dtype=torch.bfloat16, seed=0)
        hf_cfg = build_hf_config(cfg.model, cfg.data.vocab_size)
        decisions = decide(find_sites(model), options_from_config(cfg, hf_cfg, "cpu"))
        done = prepare_model(model, decisions, prepare_options(cfg, fp8_now=True, emulate=True), None, hf_cfg=hf_cfg)
        assert done.conversion.grouped.wgrad_input == want, (sets, done.conversion.grouped.wgrad_input)
        experts = [m for m in model.modules() if isinstance(m, Float8GroupedExperts)]
        assert experts and all(m.config.wgrad_input == want for m in experts), sets


def test_saved_rows_under_activation_checkpointing_give_the_same_gradients():
    """The experts with ``wgrad_input = "saved"`` (what ``auto`` picks under activation checkpointing) inside
    ``torch.utils.checkpoint`` (non-reentrant: the forward runs again in the backward and its saved rows are the
    ones the wgrad reads) give the same output and gradients, bit for bit, as ``gathered`` without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(3)
    t = 48
    hidden = torch.randn(t, 128, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 2), dim=-1).to(torch.bfloat16)
    g = torch.randn(t, 128, dtype=torch.bfloat16)
    both = frozenset(("gate_up_proj", "down_proj"))
    results = []
    for wgrad_input, ac in (("gathered", False), ("saved", True)):
        torch.manual_seed(0)
        module = Float8GroupedExperts(_hf_experts(), both, GroupedGemmConfig(wgrad="bf16", wgrad_input=wgrad_input))
        x = hidden.clone().requires_grad_()
        out = checkpoint(module, x, idx, weights, use_reentrant=False) if ac else module(x, idx, weights)
        out.backward(g)
        results.append([out.detach(), x.grad, module.gate_up_proj.grad, module.down_proj.grad])
    for what, a, b in zip(("output", "dx", "dw_up", "dw_down"), *results, strict=True):
        assert torch.equal(a, b), f"{what}: saved rows under checkpointing differ by {(a - b).abs().max().item()}"


def test_wgrad_high_precision_is_the_per_expert_product():
    """``wgrad_high_precision`` against a float64 loop over the groups (empty group included): >= 40 dB in bf16
    (bf16 rounding of operands and result only) and >= 100 dB in float32; the empty expert gets exactly zero; rows
    past the last group are never read (NaN there changes nothing)."""
    from fp8kit.moe.fused_experts import wgrad_high_precision

    torch.manual_seed(4)
    offs = torch.tensor([16, 48, 48, 96], dtype=torch.int32)
    g = torch.randn(112, 40)
    x = torch.randn(112, 24)
    g[96:] = float("nan")
    starts = [0, 16, 48, 48]
    ref = torch.stack([g[s:e].double().t() @ x[s:e].double() for s, e in zip(starts, offs.tolist(), strict=True)])
    for dtype, floor in ((torch.bfloat16, 40.0), (torch.float32, 100.0)):
        got = wgrad_high_precision(g.to(dtype), x.to(dtype), offs)
        assert got.shape == (4, 40, 24) and got.dtype == dtype
        db = sqnr(ref[[0, 1, 3]], got[[0, 1, 3]].double())
        assert db >= floor, f"{dtype}: {db:.1f} dB < {floor}"
        assert torch.equal(got[2], torch.zeros_like(got[2])), "the empty expert's gradient is not zero"


def test_bf16_wgrad_config_is_checked_and_fallbacks_are_loud():
    """``wgrad="auto"`` (the default) is bf16 below the measured width and fp8 from it; ``wgrad="bf16"``: ``auto``
    resolves to the fused kernel (also on the CPU, with the emulated GEMMs); the
    blockwise recipe and the per-weight kernels refuse it with a ConfigError naming the setting; a layer that
    cannot take the fused path (one FP8 weight) warns that its weight gradients stay FP8; an unknown precision is
    refused by ``fused_rowwise_experts``; ``fp8.grouped_wgrad`` reaches the experts' config."""
    from fp8kit.base.errors import ConfigError
    from fp8kit.config import load_config
    from fp8kit.config.options import grouped_gemm_config
    from fp8kit.moe.grouped_mm import WGRAD_BF16_BELOW_WIDTH, resolve_grouped_kernel, resolve_wgrad

    cpu = torch.device("cpu")
    assert GroupedGemmConfig().wgrad == "auto"
    assert [resolve_wgrad("auto", w) for w in (768, WGRAD_BF16_BELOW_WIDTH - 1, WGRAD_BF16_BELOW_WIDTH, 2048)] == \
        ["bf16", "bf16", "fp8", "fp8"]
    assert resolve_wgrad("fp8", 64) == "fp8" and resolve_wgrad("bf16", 14336) == "bf16"
    assert resolve_grouped_kernel(GroupedGemmConfig(wgrad="bf16"), cpu) == "fused"
    assert resolve_grouped_kernel(GroupedGemmConfig(), cpu) == "emulated"  # auto: no bf16 demanded
    assert resolve_grouped_kernel(GroupedGemmConfig(recipe="blockwise"), cpu) == "blockwise_loop"
    for bad in (GroupedGemmConfig(recipe="blockwise", wgrad="bf16"), GroupedGemmConfig(kernel="torchao", wgrad="bf16"),
                GroupedGemmConfig(wgrad="fp16")):
        with pytest.raises(ConfigError, match="wgrad"):
            resolve_grouped_kernel(bad, cpu)
    cfg = load_config(None, ["model.preset=tiny-moe", "fp8.grouped_wgrad=bf16"])
    assert grouped_gemm_config(cfg).wgrad == "bf16"
    with pytest.raises(Exception, match="grouped_wgrad"):
        load_config(None, ["model.preset=tiny-moe", "fp8.grouped_wgrad=e5m2"])

    module = Float8GroupedExperts(_hf_experts(), frozenset(("down_proj",)), GroupedGemmConfig(wgrad="bf16"))
    t = 32
    hidden = torch.randn(t, 128, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, 2), dim=-1).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="wgrad = 'bf16' asked for.*only \\['down_proj'\\] in FP8"):
        module(hidden, idx, weights)
    d = routing.dispatch(idx, 8)
    w = module.gate_up_proj.detach()
    with pytest.raises(ValueError, match="wgrad = 'fp16'"):
        fused_rowwise_experts(hidden, w, module.down_proj.detach(), d.gather_idx, d.pair_rows, d.offs,
                              emulated_scaled_grouped_mm, torch.bfloat16, wgrad="fp16")


@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_received_rowwise_payload_gives_the_same_bits_as_casting_the_tokens_here(wgrad):
    """Expert parallel FP8 dispatch hands the fused MLP the tokens already cast (``received=``, the rowwise payload
    of ``moe/fp8_dispatch.py``) and a carrier for their gradient. Output: equal bit for bit to the fused path on
    the bf16 tokens (the same cast, made before the all-to-all). Gradients: equal bit for bit to the fused path
    on the tokens as they arrive (dequantized: the gate_up wgrad reads them), the carrier's gradient included."""
    from fp8kit.moe.rowwise_payload import dequantize_payload, gather_quantize_payload

    e, hdim, inter, t = 8, 64, 48, 53
    torch.manual_seed(7)
    idx = torch.stack([torch.randperm(e)[:2] for _ in range(t)])
    idx[:9] = torch.tensor([0, 1])  # uneven groups
    hidden = (torch.randn(t, hdim) * 2).to(torch.bfloat16)
    w_up = (torch.randn(e, 2 * inter, hdim) / hdim ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(e, hdim, inter) / inter ** 0.5).to(torch.bfloat16)
    dy_rows = None
    d = routing.dispatch(idx, e)
    payload = gather_quantize_payload(hidden, torch.arange(t))
    arrived = dequantize_payload(payload, hdim, torch.bfloat16)

    def run(x, received=None):
        nonlocal dy_rows
        leaves = [x.clone().requires_grad_(), w_up.clone().requires_grad_(), w_down.clone().requires_grad_()]
        y = fused_rowwise_experts(leaves[0], leaves[1], leaves[2], d.gather_idx, d.pair_rows, d.offs,
                                  emulated_scaled_grouped_mm, torch.bfloat16, wgrad=wgrad, received=received)
        if dy_rows is None:
            dy_rows = torch.randn_like(y)
        y.backward(dy_rows)
        return y.detach(), *(leaf.grad for leaf in leaves)

    plain = run(hidden)
    here = run(arrived)
    got = run(torch.zeros(t, hdim, dtype=torch.bfloat16), received=payload)  # the carrier's values are never read
    # the carrier as rowwise_dispatch makes it: an expanded zero that holds no memory; its gradient is the rows'
    base = torch.zeros((), dtype=torch.bfloat16, requires_grad=True)
    carrier, seen = base.expand(t, hdim), []
    carrier.register_hook(seen.append)
    y = fused_rowwise_experts(carrier, w_up, w_down, d.gather_idx, d.pair_rows, d.offs, emulated_scaled_grouped_mm,
                              torch.bfloat16, wgrad=wgrad, received=payload)
    y.backward(dy_rows)
    assert torch.equal(y.detach(), got[0]) and len(seen) == 1 and torch.equal(seen[0], got[1]), "expanded carrier"
    assert torch.equal(got[0], plain[0]), f"output differs from casting the bf16 tokens: {(got[0] - plain[0]).abs().max()}"
    for what, a, b in zip(("output", "d tokens", "dw_up", "dw_down"), got, here, strict=True):
        assert torch.equal(a, b), f"{what} ({wgrad} wgrad) differs from the arrived tokens' run by {(a - b).abs().max()}"


@pytest.mark.parametrize("cache_weights", [False, True])
def test_weight_copies_made_ahead_equal_the_layers_own_casts(cache_weights):
    """Expert parallelism makes the fused layer's FP8 weight copies while its dispatch all-to-all is in flight
    (``Float8GroupedExperts.fp8_weight_copies`` -> ``local_experts(weights=)``): the output, every gradient and the
    scale hints afterwards equal the layer casting its weights itself, bit for bit."""
    both = frozenset(("gate_up_proj", "down_proj"))
    torch.manual_seed(5)
    t = 48
    hidden = torch.randn(t, 128, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(t)])
    dy = torch.randn(t, 2, 128, dtype=torch.bfloat16)
    results = []
    for ahead in (False, True):
        torch.manual_seed(6)  # the same expert weights in both layers
        module = Float8GroupedExperts(_hf_experts(), both, GroupedGemmConfig(kernel="fused", cache_weights=cache_weights))
        module = module.to(torch.bfloat16)
        d = routing.dispatch(idx, module.num_experts)
        x = hidden.clone().requires_grad_()
        weights = module.fp8_weight_copies(x.device) if ahead else None
        assert (weights is not None) == ahead, "a fused layer has copies to make ahead (cached or hinted)"
        y = module.local_experts(x, d, weights=weights)
        rows = y[d.pair_rows].view(t, 2, 128)
        (rows.float() * dy.float()).sum().backward()
        hints = [getattr(module, n).clone() for n in module.scratch_buffers]
        results.append([y, x.grad, module.gate_up_proj.grad, module.down_proj.grad, *hints])
    names = ["y", "dx", "dw_up", "dw_down", *[f"hint {i}" for i in range(4)]]
    wrong = [n for n, a, b in zip(names, *results, strict=True) if not torch.equal(a, b)]
    assert not wrong, f"made ahead != made by the layer: {wrong}"
