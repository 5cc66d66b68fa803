"""FP8 grouped experts (fp8kit.moe): numerics against float64 references, routing edge cases, the HF swap.

References are computed independently of the code under test, in float64: a per-expert loop of
``x[rows of e] @ w[e].T`` (and its autograd for dgrad / wgrad), or the HF experts formula token by token.
On the CPU the FP8 grouped GEMM runs as the emulation (``torch._scaled_grouped_mm`` has no CPU kernel):
the same E4M3 operands and scales, multiplied in float32; ``benchmarks/grouped_gemm.py`` checks the
CUDA kernel against the same emulation on a GPU.

Thresholds (SQNR = 10 log10(sum ref^2 / sum (ref - got)^2), printed on failure):

- ``FP8_GEMM_DB`` = 25 dB for one FP8 grouped GEMM (fprop, dgrad, wgrad) against float64. E4M3 keeps
  3 mantissa bits: rounding one operand costs about 31 dB, a product of two quantized operands about
  28 dB (measured 28.2-28.6 dB on the shapes below); 25 dB leaves 3 dB of margin. ``NOT_QUANTIZED_DB``
  = 35 dB is an upper bound: above it the operands were not quantized to FP8 at all (bf16 alone gives
  more than 45 dB).
- ``OUT_DB`` = 18 dB / ``GRAD_DB`` = 17 dB for whole MoE layers and models (several FP8 GEMMs, an
  activation and a weighted sum in between): torchao's reliability floors for FP8 linears
  (``test/float8/test_base.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from fp8kit.base.errors import CapabilityError, ConfigError, Fp8kitError
from fp8kit.moe import grouped_mm as gmm
from fp8kit.moe import quantize as q
from fp8kit.moe import routing
from fp8kit.moe.experts import Float8GroupedExperts, check_supported, layout_problem, swap_in, swap_out
from fp8kit.moe.grouped_mm import (
    GroupedGemmConfig,
    emulated_scaled_grouped_mm,
    fp8_grouped_mm,
    resolve_grouped_kernel,
)
from tests.conftest import sqnr

OUT_DB, GRAD_DB = 18.0, 17.0
FP8_GEMM_DB, NOT_QUANTIZED_DB = 25.0, 35.0


def assert_sqnr(ref: torch.Tensor, got: torch.Tensor, floor: float, what: str, ceiling: float = math.inf) -> float:
    """Fail unless ``floor <= sqnr(ref, got) < ceiling``; the message names ``what`` and the measured dB."""
    db = sqnr(ref, got)
    assert floor <= db < ceiling, f"{what}: SQNR {db:.2f} dB, want >= {floor} dB and < {ceiling} dB"
    return db


def grouped_reference_f64(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, g: torch.Tensor):
    """float64 ``out, dx, dw`` of ``out[rows of e] = x[rows] @ w[e].T`` (loop over experts, autograd);
    rows past ``offs[-1]`` give zero output and zero dx."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ends = offs.tolist()
    rows = [x64[s:t] @ w64[e].T for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends, strict=True))]
    out = torch.cat([*rows, x64.new_zeros(x64.shape[0] - ends[-1], w64.shape[1])])
    out.backward(g.double())
    return out.detach(), x64.grad, w64.grad


def _reference_experts(h, w_up, w_down, idx, weights, act=torch.nn.functional.silu):
    """Token-by-expert loop (the HF eager experts formula) in the inputs' dtype (float64 here)."""
    out = torch.zeros_like(h)
    for e in range(w_up.shape[0]):
        tok, pos = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        gate, up = (h[tok] @ w_up[e].t()).chunk(2, dim=-1)
        y = (act(gate) * up) @ w_down[e].t()
        out.index_add_(0, tok, y * weights[tok, pos, None])
    return out


def _grouped_case(seed: int, dtype: torch.dtype):
    """x (P, 128), w (4, 64, 128), offs for groups of 32, 0 (an empty expert), 80, 16 rows + 16 padding rows, g."""
    gen = torch.Generator().manual_seed(seed)
    e, k, n = 4, 128, 64
    offs = torch.tensor([32, 0, 80, 16]).cumsum(0).to(torch.int32)
    p = int(offs[-1]) + 16
    x = torch.randn(p, k, generator=gen)
    x[int(offs[-1]):] = 0  # padding rows, as routing.gather makes them
    w = torch.randn(e, n, k, generator=gen) / k**0.5
    g = torch.randn(p, n, generator=gen)
    return x.to(dtype), w.to(dtype), offs, g.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_grouped_gemm_fprop_dgrad_wgrad_vs_float64_loop(dtype):
    """out, dx and dw of the FP8 grouped GEMM against a float64 per-expert loop: FP8_GEMM_DB <= SQNR <
    NOT_QUANTIZED_DB; the empty expert gets an exactly zero gradient."""
    x, w, offs, g = _grouped_case(0, dtype)
    ref_out, ref_dx, ref_dw = grouped_reference_f64(x, w, offs, g)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_grouped_mm(xx, ww, offs, "emulated")
    out.backward(g)
    last, used = int(offs[-1]), [0, 2, 3]
    assert out.dtype == dtype and ww.grad.dtype == dtype
    for what, ref, got in (("fprop out", ref_out[:last], out[:last]), ("dgrad dx", ref_dx[:last], xx.grad[:last]),
                           ("wgrad dw", ref_dw[used], ww.grad[used])):
        assert_sqnr(ref, got.float(), FP8_GEMM_DB, f"{dtype} {what}", ceiling=NOT_QUANTIZED_DB)
    assert ww.grad[1].abs().max().item() == 0.0, "the expert without rows got a nonzero wgrad"


def test_sqnr_check_rejects_wrong_grouped_results():
    """The check above can fail: results with the experts' weights permuted (rows multiplied by the wrong
    expert), with the groups shifted by 16 rows, or without FP8 quantization are rejected."""
    x, w, offs, g = _grouped_case(0, torch.float32)
    ref_out, _, _ = grouped_reference_f64(x, w, offs, g)
    last = int(offs[-1])
    permuted, _, _ = grouped_reference_f64(x, w.roll(1, dims=0), offs, g)
    shifted, _, _ = grouped_reference_f64(x, w, (offs + 16).clamp(max=x.shape[0]).to(torch.int32), g)
    unquantized = ref_out.float()  # what a "grouped GEMM" that skipped the FP8 casts would return
    for what, got in (("permuted experts", permuted), ("shifted groups", shifted), ("no FP8", unquantized)):
        with pytest.raises(AssertionError, match="SQNR"):
            assert_sqnr(ref_out[:last], got[:last], FP8_GEMM_DB, what, ceiling=NOT_QUANTIZED_DB)


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


def layer_case(idx: torch.Tensor, e: int, hdim: int, inter: int):
    """Random inputs of one MoE layer for routing ``idx`` (T, 2) over ``e`` experts, and the float64 reference
    (the HF experts formula, backward done). Returns ``(leaves, weights, g, ref_leaves, ref)``: ``leaves`` the
    bf16 ``(h, w_up, w_down)`` requiring grad, ``ref_leaves`` their float64 twins holding the reference grads."""
    tokens = idx.shape[0]
    h = torch.randn(tokens, hdim)
    w_up = torch.randn(e, 2 * inter, hdim) / hdim ** 0.5
    w_down = torch.randn(e, hdim, inter) / inter ** 0.5
    weights = torch.softmax(torch.randn(tokens, 2), dim=-1)
    g = torch.randn(tokens, hdim)
    ref_leaves = [t.double().requires_grad_() for t in (h, w_up, w_down)]
    ref = _reference_experts(*ref_leaves, idx, weights.double())
    ref.backward(g.double())
    leaves = [t.to(torch.bfloat16).requires_grad_() for t in (h, w_up, w_down)]
    return leaves, weights, g, ref_leaves, ref


def check_layer(where: str, idx: torch.Tensor, e: int, leaves, ref_leaves, ref, out) -> torch.Tensor:
    """Output >= OUT_DB and dx / dw of the experts with tokens >= GRAD_DB against the reference; experts no
    token chose got exactly zero weight gradients. Returns the mask of those unused experts."""
    assert_sqnr(ref, out, OUT_DB, f"{where}: output")
    assert_sqnr(ref_leaves[0].grad, leaves[0].grad, GRAD_DB, f"{where}: dx")
    used = torch.unique(idx)
    unused = torch.ones(e, dtype=torch.bool)
    unused[used] = False
    for i, wname in ((1, "dw_up"), (2, "dw_down")):
        assert_sqnr(ref_leaves[i].grad[used], leaves[i].grad[used].float(), GRAD_DB, f"{where}: {wname}")
        leftover = leaves[i].grad[unused].abs().max().item() if unused.any() else 0.0
        assert leftover == 0.0, f"{where}: experts without tokens got {wname} up to {leftover}"
    return unused


@pytest.mark.parametrize("tokens", [1, 7, 37, 200])
def test_fp8_experts_match_float64_reference(tokens):
    """A whole MoE layer (dispatch, FP8 gate_up, SiLU gate, FP8 down, weighted combine) against the HF
    experts formula in float64: output >= OUT_DB, dx / dw >= GRAD_DB; experts that no token chose get an
    exactly zero gradient (the ``empty-experts`` routing always has some)."""
    e, hdim, inter = 8, 64, 48
    torch.manual_seed(tokens)
    for name, idx in _routings(tokens, e):
        leaves, weights, g, ref_leaves, ref = layer_case(idx, e, hdim, inter)
        d = routing.dispatch(idx, e)
        x = routing.gather(leaves[0], d)
        up = fp8_grouped_mm(x, leaves[1], d.offs, "emulated")
        gate, u = up.chunk(2, dim=-1)
        y = fp8_grouped_mm(torch.nn.functional.silu(gate) * u, leaves[2], d.offs, "emulated")
        out = routing.combine(y, d, weights, torch.float32)
        out.backward(g)
        unused = check_layer(f"{name}, {tokens} tokens", idx, e, leaves, ref_leaves, ref, out)
        if name == "empty-experts":
            assert unused.any(), f"{name}: the routing was meant to leave experts 3.. without tokens"


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


def test_emulation_2d2d_matches_float64_sum_of_outer_products():
    """The wgrad form (2d x 2d): ``out[e] = sum over the rows p of group e of outer(a[:, p] sa_e, b[p] sb_e)``,
    computed row by row in float64 (a different summation from the emulation's matmul): float32 rounding
    only (relative error < 1e-5); the empty group is exactly zero."""
    torch.manual_seed(0)
    n, k, e = 32, 48, 3
    offs = torch.tensor([16, 16, 64], dtype=torch.int32)  # expert 1 empty
    a = torch.randn(n, 64).to(torch.float8_e4m3fn)
    b = torch.randn(64, k).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(e * n) + 0.5, torch.rand(e * k) + 0.5
    out = emulated_scaled_grouped_mm(a, b, sa, sb, offs, torch.float32)
    assert out.shape == (e, n, k)
    ref = torch.zeros(e, n, k, dtype=torch.float64)
    ends = offs.tolist()
    for grp, (s, t) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        for row in range(s, t):
            ref[grp] += torch.outer(a[:, row].double() * sa[grp * n:(grp + 1) * n].double(),
                                    b[row].double() * sb[grp * k:(grp + 1) * k].double())
    assert out[1].abs().max().item() == 0
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, f"2d x 2d emulation vs float64: relative error {rel:.2e}"


def test_bad_inputs_are_named():
    w = torch.randn(4, 32, 32)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_grouped_mm(torch.randn(16, 32), torch.randn(4, 24, 32), torch.tensor([4, 8, 12, 16], dtype=torch.int32), "emulated")
    with pytest.raises(ValueError, match="int32"):
        fp8_grouped_mm(torch.randn(16, 32), w, torch.tensor([4, 8, 12, 16]), "emulated")
    with pytest.raises(ValueError, match="do not match"):
        fp8_grouped_mm(torch.randn(16, 16), w, torch.tensor([4, 8, 12, 16], dtype=torch.int32), "emulated")
    with pytest.raises(ConfigError, match="unknown kernel 'cutlass9'"):
        resolve_grouped_kernel(GroupedGemmConfig(kernel="cutlass9"), torch.device("cpu"))
    with pytest.raises(CapabilityError, match="no CPU kernel"):
        resolve_grouped_kernel(GroupedGemmConfig(kernel="scaled_grouped_mm"), torch.device("cpu"))
    assert resolve_grouped_kernel(GroupedGemmConfig(), torch.device("cpu")) == "emulated"


def test_a_gpu_without_the_grouped_kernel_is_named_with_the_fallback(monkeypatch):
    """The MoE issue's bad input: a grouped recipe this GPU cannot run. The refusal names the GPU, its capability
    and torch, and the two ways on (``fp8.emulate``, or the experts kept BF16 by ``fp8.exclude``). The GPU facts go
    through ``grouped_fp8_verdict`` (this machine has no such GPU); ``grouped_fp8_support`` reads them from a real
    one and passes on the H200 (tests/test_moe_fused_gpu.py)."""
    from fp8kit.moe import grouped_mm

    ok, reason = grouped_mm.grouped_fp8_verdict("NVIDIA A100-SXM4-80GB", (8, 0), "2.11.0+cu130", True)
    assert not ok and "NVIDIA A100-SXM4-80GB (capability 8.0, torch 2.11.0+cu130)" in reason, reason
    assert "Hopper GPU" in reason, reason
    ok, reason = grouped_mm.grouped_fp8_verdict("NVIDIA H100 80GB HBM3", (9, 0), "2.5.0", False)
    assert not ok and "torch 2.5.0 has no torch._scaled_grouped_mm" in reason, reason
    assert grouped_mm.grouped_fp8_verdict("NVIDIA H200", (9, 0), "2.11.0", True)[0]
    # What a run on that GPU is told (the capability check answering for the A100 above):
    monkeypatch.setattr(grouped_mm, "grouped_fp8_support",
                        lambda device: grouped_mm.grouped_fp8_verdict("NVIDIA A100-SXM4-80GB", (8, 0), "2.11.0", True))
    cuda = torch.device("cuda", 0)
    with pytest.raises(CapabilityError) as err:
        resolve_grouped_kernel(GroupedGemmConfig(), cuda)
    for part in ("FP8 MoE experts", "NVIDIA A100-SXM4-80GB (capability 8.0", "fp8.emulate = true",
                 'fp8.exclude = ["experts"]'):
        assert part in str(err.value), f"{part!r} missing from: {err.value}"
    assert resolve_grouped_kernel(GroupedGemmConfig(emulate=True), cuda) == "emulated"  # asked for: no error


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
    from fp8kit.selective.decide import DecideOptions, decide
    from fp8kit.selective.sites import find_sites

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
    against the float64 loop (one scale per tensor would flush them towards the E4M3 subnormals)."""
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
    ref, ref_dx, ref_dw = grouped_reference_f64(x, w, offs, g)
    out = fp8_grouped_mm(x, w, offs, "emulated")
    out.backward(g)
    small = slice(0, None, 2)
    for what, r, got in (("out, small rows", ref[small], out[small]), ("dx, small rows", ref_dx[small], x.grad[small]),
                         ("out, small expert", ref[per:2 * per], out[per:2 * per]),
                         ("dw, small expert", ref_dw[1], w.grad[1])):
        assert_sqnr(r, got, FP8_GEMM_DB, what, ceiling=NOT_QUANTIZED_DB)


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

    from fp8kit.parallel.convert import apply_fp8
    from fp8kit.selective.decide import DecideOptions, decide
    from fp8kit.selective.sites import find_sites

    cfg = AutoConfig.for_model(model_type, **_OTHER_MOE[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits.float()
    decisions = [d for d in decide(find_sites(model), DecideOptions()) if d.site.is_grouped_weight]
    assert decisions and all(d.is_fp8 for d in decisions)
    assert apply_fp8(model, decisions) == len({d.site.module_fqn for d in decisions})
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
    """MoE MFU: ``flops_per_token`` against the FLOPs torch counts in a real forward + backward.

    Reference: ``torch.utils.flop_counter.FlopCounterMode`` over one training step of a Qwen3-MoE with the
    HF eager experts loop (each token runs its ``topk`` experts only) and eager attention, divided by
    the tokens, plus ``6 x`` the 1-D (norm) parameters, which PaLM's ``6 N`` counts but which do no
    matmul. Exact up to float rounding (rel 1e-9); counting every expert in full would be 2.2x off."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    from fp8kit.models.build import flops_per_token

    cfg = AutoConfig.for_model(
        "qwen3_moe", vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        head_dim=64,
    )
    cfg._attn_implementation = "eager"  # bmm: counted (the SDPA CPU kernel has no FLOP formula)
    cfg._experts_implementation = "eager"  # one mm per expert on its tokens (torch._grouped_mm is not counted)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    batch, seq = 2, 64
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(ids).logits.float().pow(2).mean().backward()
    norm_params = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    want = counter.get_total_flops() / (batch * seq) + 6.0 * norm_params
    got = flops_per_token(model, cfg, seq)
    assert got == pytest.approx(want, rel=1e-9), (
        f"flops/token {got:.6e}, FlopCounterMode {want:.6e} (ratio {got / want:.4f})"
    )


def test_gather_and_combine_backward_equal_autograd_indexing():
    """routing.gather / combine compute their backward as gathers (no sorting index_put); the gradients equal
    autograd's own backward of the plain indexing (float64: exact up to summation order, <= 1e-12)."""
    torch.manual_seed(0)
    t, e, topk, hdim = 37, 6, 3, 32
    idx = torch.stack([torch.randperm(e)[:topk] for _ in range(t)])
    d = routing.dispatch(idx, e)
    hidden = torch.randn(t, hdim, dtype=torch.float64, requires_grad=True)
    weights = torch.softmax(torch.randn(t, topk, dtype=torch.float64), dim=-1)
    rows = routing.gather(hidden, d)
    out = routing.combine(rows * 2.0, d, weights, torch.float64)
    g = torch.randn(t, hdim, dtype=torch.float64)
    out.backward(g)
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref_rows = torch.cat([ref_hidden, ref_hidden.new_zeros(1, hdim)])[d.gather_idx]
    ref_out = routing.weighted_sum((ref_rows * 2.0)[d.pair_rows], weights, torch.float64)  # plain indexing
    ref_out.backward(g)
    assert torch.equal(rows.detach(), ref_rows.detach()) and torch.equal(out, ref_out)
    err = (hidden.grad - ref_hidden.grad).abs().max().item()
    assert err <= 1e-12, f"gather/combine gradient differs from autograd indexing by {err:.2e}"


def test_combine_gradients_equal_plain_autograd_in_bf16():
    """``routing.combine`` (its own gather-only backward) against autograd through ``weighted_sum`` of plain
    indexing, bf16 rows and router weights that require grad: output, row gradients and router-weight gradients
    bit for bit on the CPU (the same float32 products and sums, rounded once; on CUDA the compiled kernels may sum
    in another order: ``tests/test_moe_fused_gpu.py``); rows that no pair uses (padding) get exactly zero."""
    torch.manual_seed(1)
    t, e, topk, hdim = 53, 8, 4, 64
    idx = torch.stack([torch.randperm(e)[:topk] for _ in range(t)])
    d = routing.dispatch(idx, e)
    base = torch.randn(d.rows, hdim).to(torch.bfloat16)
    wbase = torch.softmax(torch.randn(t, topk), dim=-1).to(torch.bfloat16)
    g = torch.randn(t, hdim).to(torch.bfloat16)
    rows, w = base.clone().requires_grad_(), wbase.clone().requires_grad_()
    out = routing.combine(rows, d, w, torch.bfloat16)
    out.backward(g)
    ref_rows, ref_w = base.clone().requires_grad_(), wbase.clone().requires_grad_()
    ref = routing.weighted_sum(ref_rows[d.pair_rows], ref_w, torch.bfloat16)
    ref.backward(g)
    assert torch.equal(out, ref), f"output differs by {(out.float() - ref.float()).abs().max().item()}"
    assert torch.equal(rows.grad, ref_rows.grad), \
        f"row gradients differ by {(rows.grad.float() - ref_rows.grad.float()).abs().max().item()}"
    used = torch.zeros(d.rows, dtype=torch.bool)
    used[d.pair_rows] = True
    assert rows.grad[~used].abs().max().item() == 0.0, "padding rows got a gradient"
    assert torch.equal(w.grad, ref_w.grad), \
        f"router-weight gradients differ by {(w.grad.float() - ref_w.grad.float()).abs().max().item()}"


def test_topk_sums_add_the_pairs_in_k_order():
    """``weighted_sum`` and ``sum_token_rows`` add a token's ``topk`` rows one ``k`` after the other in float32
    (``routing._topk_loop``, the form Inductor compiles into one gather kernel): bit for bit the explicit loop, and
    within the float32 summation bound of a float64 sum. Values of very different magnitude, so that another order
    would show."""
    torch.manual_seed(3)
    t, e, topk, hdim = 41, 8, 5, 48
    idx = torch.stack([torch.randperm(e)[:topk] for _ in range(t)])
    d = routing.dispatch(idx, e)
    rows = (torch.randn(d.rows, hdim) * torch.logspace(-4, 4, d.rows)[:, None]).to(torch.bfloat16)
    w = torch.softmax(torch.randn(t, topk), dim=-1).to(torch.bfloat16)
    picked = rows[d.pair_rows].view(t, topk, hdim).float()
    want_w = picked[:, 0] * w[:, 0, None].float()
    want_s = picked[:, 0].clone()
    for k in range(1, topk):
        want_w = want_w + picked[:, k] * w[:, k, None].float()
        want_s = want_s + picked[:, k]
    got_w = routing.weighted_sum(rows[d.pair_rows], w, torch.float32)
    got_s = routing.sum_token_rows(rows, d.pair_rows, t, torch.float32)
    assert torch.equal(got_w, want_w), f"weighted_sum differs by {(got_w - want_w).abs().max().item():.3g}"
    assert torch.equal(got_s, want_s), f"sum_token_rows differs by {(got_s - want_s).abs().max().item():.3g}"
    terms = rows[d.pair_rows].view(t, topk, hdim).double()
    # a float32 sum of topk terms is off by at most (topk - 1) * 2^-24 * sum |terms| (Higham, eq. 4.4)
    worst = ((got_s.double() - terms.sum(1)).abs() / (terms.abs().sum(1) * (topk - 1) * 2.0**-24)).max().item()
    assert worst <= 1.0, f"sum_token_rows vs float64: {worst:.3g} x the float32 summation bound"
