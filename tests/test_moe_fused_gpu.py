"""The fused rowwise FP8 expert MLP on a Hopper GPU (marker ``gpu``; skipped without ``torch._scaled_grouped_mm``):
``wgrad="bf16"`` against the all-FP8 fused path and against the float32 GEMM emulation; the routing helpers compiled
on CUDA against eager; a compiled MoE block's gradients against eager (float32 weights under autocast).

Run on the H100: ``pytest -m gpu tests/test_moe_fused_gpu.py``. The expert weights cast with scale hints (the
module's, and the weight cache's recasts) across real optimizer steps equal the plain cast bit for bit. Shape: 4096
tokens routed top-8 over 32 experts
(4 never picked), hidden 2048, expert width 768 (Qwen3-30B-A3B's expert shape). Thresholds: output and dx equal
to the all-FP8 fused run bit for bit (the bf16 wgrad touches neither); every output and gradient against the same
layer with the float32 GEMM emulation >= 30 dB (the CUTLASS kernel accumulates in another order than the emulation,
and a one-ulp bf16 difference in ``h`` can flip an E4M3 rounding of the SwiGLU output: 39.0 dB measured on the
output, H100, 2026-11-25); experts without tokens get exactly zero weight gradients. The loop of dense GEMMs
(``fp8.grouped_gemm = "loop"``) against the grouped kernel: each GEMM >= 60 dB (the same products, another
accumulation order; 97-99 dB measured by ``benchmarks/grouped_gemm_loop.py``), the whole layer >= 30 dB (as the
emulation: a one-ulp difference in ``h`` can flip an E4M3 rounding downstream).
"""

from __future__ import annotations

import pytest
import torch

from fp8kit.moe import routing
from fp8kit.moe.fused_experts import fused_rowwise_experts
from fp8kit.moe.grouped_mm import emulated_scaled_grouped_mm, grouped_fp8_support, scaled_grouped_gemm
from tests.conftest import sqnr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and grouped_fp8_support(torch.device("cuda"))[0]),
                       reason="needs a Hopper GPU (torch._scaled_grouped_mm)"),
]

TOKENS, TOPK, EXPERTS, UNUSED, HIDDEN, WIDTH = 4096, 8, 32, 4, 2048, 768


def _layer(gemm, out_dtype, wgrad, inputs, d, keep_rows=False):
    h, w_up, w_down, weights, g = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (h, w_up, w_down)]
    y = fused_rowwise_experts(leaves[0], leaves[1], leaves[2], d.gather_idx, d.pair_rows, d.offs, gemm, out_dtype,
                              cache_weights=False, wgrad=wgrad, keep_rows=keep_rows)
    out = routing.combine(y, d, weights, torch.bfloat16)
    out.backward(g)
    torch.cuda.synchronize()
    return [out.detach()] + [t.grad for t in leaves]


def _case(seed: int):
    """``(dispatch, (hidden, w_up, w_down, router weights, output gradient))``: TOKENS tokens routed top-TOPK over
    EXPERTS experts, the last UNUSED never picked, Qwen3-30B-A3B's expert shape."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.rand(TOKENS, EXPERTS, generator=gen, device="cuda")
    logits[:, EXPERTS - UNUSED:] = -1.0
    top = logits.topk(TOPK, dim=-1)
    d = routing.dispatch(top.indices, EXPERTS)
    inputs = (torch.randn(TOKENS, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16),
              (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=gen, device="cuda") / HIDDEN ** 0.5).to(torch.bfloat16),
              (torch.randn(EXPERTS, HIDDEN, WIDTH, generator=gen, device="cuda") / WIDTH ** 0.5).to(torch.bfloat16),
              torch.softmax(top.values, dim=-1).to(torch.bfloat16),
              torch.randn(TOKENS, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16))
    return d, inputs


def test_bf16_wgrad_on_cuda_matches_fp8_wgrad_path_and_emulation():
    d, inputs = _case(0)
    gemm, out_dtype = scaled_grouped_gemm(torch.device("cuda"))
    fp8 = _layer(gemm, out_dtype, "fp8", inputs, d)
    bf16 = _layer(gemm, out_dtype, "bf16", inputs, d)
    emul = _layer(emulated_scaled_grouped_mm, torch.bfloat16, "bf16", inputs, d)
    for i, what in ((0, "output"), (1, "dx")):
        diff = (fp8[i].float() - bf16[i].float()).abs().max().item()
        assert torch.equal(fp8[i], bf16[i]), f"{what}: bf16 wgrad changed it (max |diff| {diff})"
    # fp8.grouped_wgrad_input = saved: the dispatch's own bf16 rows (dispatch_quantize_rows keep_rows) give the same bits
    kept = _layer(gemm, out_dtype, "bf16", inputs, d, keep_rows=True)
    for what, a, b in zip(("output", "dx", "dw_up", "dw_down"), kept, bf16, strict=True):
        assert torch.equal(a, b), f"{what}: saved rows vs gathered again: max |diff| {(a - b).abs().max().item()}"
    for what, a, b in zip(("output", "dx", "dw_up", "dw_down"), emul, bf16, strict=True):
        db = sqnr(a.float(), b.float())
        assert db >= 30.0, f"{what}: CUDA vs emulation {db:.1f} dB < 30"
    for i, what in ((2, "dw_up"), (3, "dw_down")):
        left = bf16[i][EXPERTS - UNUSED:].abs().max().item()
        assert left == 0.0, f"{what}: experts without tokens got gradients up to {left}"
        db = sqnr(bf16[i].float(), fp8[i].float())
        assert db >= 20.0, f"{what}: bf16 vs fp8 wgrad only {db:.1f} dB apart"


@pytest.mark.parametrize("wgrad", ["fp8", "bf16"])
def test_combine_fused_into_the_mlp_equals_the_mlp_then_the_combine(wgrad):
    """With ``top_k_weights`` the fused MLP combines its rows and casts the output gradient read through the pairs
    (Triton: ``dispatch_quantize_rows`` with the router weights and the weighted ``g`` of ``quantize_group_cols_dual``): output and
    the gradients of tokens, weights and router weights equal the MLP followed by ``routing.combine`` bit for bit."""
    d, (h, w_up, w_down, weights, g) = _case(3)
    gemm, out_dtype = scaled_grouped_gemm(torch.device("cuda"))
    runs = []
    for fused in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (h, w_up, w_down, weights)]
        args = (leaves[0], leaves[1], leaves[2], d.gather_idx, d.pair_rows, d.offs, gemm, out_dtype)
        if fused:
            out = fused_rowwise_experts(*args, cache_weights=False, wgrad=wgrad, top_k_weights=leaves[3])
        else:
            out = routing.combine(fused_rowwise_experts(*args, cache_weights=False, wgrad=wgrad), d, leaves[3],
                                  torch.bfloat16)
        out.backward(g)
        torch.cuda.synchronize()
        runs.append([out.detach(), *(t.grad for t in leaves)])
    for what, a, b in zip(("output", "dx", "dw_up", "dw_down", "d_router_weights"), *runs, strict=True):
        diff = (a.view(torch.int16) != b.view(torch.int16)).sum().item()
        assert diff == 0, f"wgrad={wgrad}: {what} differs in {diff} of {a.numel()} elements"


def test_compiled_routing_kernels_match_eager():
    """The routing helpers compiled on CUDA (``base.cuda_compile``) against their plain eager functions on the same
    GPU at Qwen3-30B-A3B's token shape (16384 tokens, top-8 of 128 experts, hidden 2048): gathers and the row
    gradient (elementwise) bit for bit; the float32 sums (summation order only) within one bf16 ulp where the
    result is bf16 (combine, token sum) and 1e-5 relative to the largest value where it is float32 (router-weight
    gradient)."""
    from fp8kit.moe.routing import (
        _sum_topk_rows,
        combine_rows,
        combine_rows_grad,
        combine_weights_grad,
        gather_rows,
        row_pairs,
    )

    gen = torch.Generator(device="cuda").manual_seed(1)
    t, topk, e, h = 16384, 8, 128, 2048
    top = torch.rand(t, e, generator=gen, device="cuda").topk(topk, dim=-1)
    d = routing.dispatch(top.indices, e)
    w = torch.softmax(top.values, dim=-1).to(torch.bfloat16)
    hidden = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
    rows = torch.randn(d.rows, h, generator=gen, device="cuda").to(torch.bfloat16)
    g = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
    row_pair = row_pairs(d.pair_rows, d.rows)
    exact = {
        "gather_rows": (gather_rows, (hidden, d.gather_idx)),
        "combine_rows_grad": (combine_rows_grad, (g, w, row_pair, torch.bfloat16)),
    }
    for name, (fn, args) in exact.items():
        a, b = fn(*args), fn.eager(*args)
        assert torch.equal(a, b), f"{name}: compiled differs from eager by {(a.float() - b.float()).abs().max().item()}"
    summed = {
        "combine_rows": (combine_rows, (rows, d.pair_rows, w, torch.bfloat16)),
        "sum_token_rows": (_sum_topk_rows, (rows, d.pair_rows, topk, torch.bfloat16)),  # its compiled part
        "combine_weights_grad": (combine_weights_grad, (rows, d.pair_rows, g, topk, torch.float32)),
    }
    for name, (fn, args) in summed.items():
        ref, got = fn.eager(*args).float(), fn(*args).float()
        tol = ref.abs() * 2.0**-7 if args[-1] == torch.bfloat16 else ref.abs().max() * 1e-5  # bf16: 8 mantissa bits
        worst = ((got - ref).abs() - tol).max().item()
        assert worst <= 0.0, f"{name}: compiled vs eager off by {worst:.3g} beyond the tolerance"


class _MoEBlock(torch.nn.Module):
    """RMSNorm -> router (softmax top-k) -> ``Float8GroupedExperts`` -> residual, float32 weights: the shape of a
    Qwen3-MoE block's MLP half as ``fp8kit train`` runs it (FP32 master weights under bf16 autocast)."""

    def __init__(self, experts, e: int, k: int, h: int):
        super().__init__()
        self.norm = torch.nn.RMSNorm(h, device="cuda")
        self.gate = torch.nn.Linear(h, e, bias=False, device="cuda")
        self.experts, self.k = experts, k

    def forward(self, x):
        y = self.norm(x)
        probs = torch.softmax(self.gate(y).float(), dim=-1)
        w, idx = probs.topk(self.k, dim=-1)
        return x + self.experts(y, idx, (w / w.sum(-1, keepdim=True)).to(y.dtype))


def compiled_block_gradients(wgrad: str, dtype: torch.dtype = torch.float32, wgrad_input: str = "gathered"
                             ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(name, eager gradient, compiled gradient)`` of the input and every parameter of :class:`_MoEBlock`
    (16 experts x 256, hidden 1024, top-4, 2048 tokens), eager vs Inductor: float32 weights under bf16 autocast
    (the experts combine outside the fused MLP), or bf16 weights and tokens (the combine fused into it)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fp8kit.moe.experts import Float8GroupedExperts
    from fp8kit.moe.grouped_mm import GroupedGemmConfig

    torch.manual_seed(0)
    t, e, k, h, i = 2048, 16, 4, 1024, 256
    src = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, hidden_act="silu"))
    with torch.no_grad():
        src.gate_up_proj.copy_(torch.randn_like(src.gate_up_proj) / h ** 0.5)
        src.down_proj.copy_(torch.randn_like(src.down_proj) / i ** 0.5)
    config = GroupedGemmConfig(wgrad=wgrad, wgrad_input=wgrad_input)
    experts = Float8GroupedExperts(src.to("cuda"), frozenset(("gate_up_proj", "down_proj")), config)
    block = _MoEBlock(experts, e, k, h).to(dtype)
    x0 = torch.randn(t, h, device="cuda", dtype=dtype)
    g = torch.randn(t, h, device="cuda")
    runs = []
    for fn in (block, torch.compile(block)):
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.float32):
            out = fn(x)
        out.float().backward(g)
        runs.append({"x": x.grad, **{n: p.grad.clone() for n, p in block.named_parameters()}})
    return [(n, runs[0][n], runs[1].get(n)) for n in runs[0]]


def test_compiled_block_gradients_equal_eager():
    """A Qwen3-MoE-like block (norm, router, fused FP8 experts, both wgrad precisions) in float32 under bf16
    autocast, compiled with Inductor as ``fp8kit train`` compiles each block, against eager: every gradient present,
    non-zero and >= 25 dB from eager's (the fused casts are the same bits; Inductor's float32 sums and kernels may
    round differently, and a one-ulp change can flip an E4M3 rounding). Guards session 13's regression: with
    ``routing._Combine`` traced by Dynamo, every gradient of the expert branch (experts, router, norm) came out
    zero for float32 inputs (bf16 inputs were not affected); session 21's combine fused into the fused MLP did the
    same for float32 inputs (all expert-branch gradients zero, x at 7.5 dB), so only bf16 tokens take it: the bf16
    block here runs it compiled."""
    for dtype in (torch.float32, torch.bfloat16):
        for wgrad, wgrad_input in (("fp8", "gathered"), ("bf16", "gathered"), ("bf16", "saved")):
            for name, a, b in compiled_block_gradients(wgrad, dtype, wgrad_input):
                where = f"{dtype}, wgrad={wgrad}, wgrad_input={wgrad_input}"
                assert b is not None and b.abs().max().item() > 0, f"{where}: compiled {name} gradient is zero or missing"
                db = sqnr(a.float(), b.float())
                assert db >= 25.0, f"{where}: compiled vs eager {name} {db:.1f} dB < 25"


@pytest.mark.parametrize("form", ["2d x 3d", "2d x 2d"])
def test_loop_of_dense_gemms_matches_the_grouped_kernel(form):
    from fp8kit.moe.rowwise_loop import loop_scaled_grouped_mm

    gen = torch.Generator(device="cuda").manual_seed(1)
    sizes = [1024, 0, 512, 2048, 16, 0, 768, 1024]
    ends = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    bounds = list(zip([0] + ends[:-1].tolist(), ends.tolist(), strict=True))
    p, e, k, n = sum(sizes) + 64, len(sizes), 2048, 1536

    def fp8(*shape):
        return (torch.randn(*shape, generator=gen, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn)

    if form == "2d x 3d":
        a, b = fp8(p, k), fp8(e, n, k).transpose(-2, -1)
        sa, sb = torch.rand(p, device="cuda") / 100, torch.rand(e, n, device="cuda") / 100
    else:
        a, b = fp8(n, p), fp8(k, p).t()
        sa, sb = torch.rand(e * n, device="cuda") / 100, torch.rand(e * k, device="cuda") / 100
    ref = torch._scaled_grouped_mm(a, b, sa, sb, offs=ends, out_dtype=torch.bfloat16, use_fast_accum=True)
    got = loop_scaled_grouped_mm(a, b, sa, sb, ends, torch.bfloat16, bounds)
    if form == "2d x 3d":
        ref, got = ref[: sum(sizes)], got[: sum(sizes)]
    else:
        assert got[1].abs().max().item() == 0.0 and got[5].abs().max().item() == 0.0
    db = sqnr(ref.float(), got.float())
    assert db >= 60.0, f"{form}: loop vs grouped kernel {db:.1f} dB < 60"


def test_fused_layer_with_the_loop_matches_the_grouped_kernel():
    from functools import partial

    from fp8kit.moe.grouped_loop import group_bounds
    from fp8kit.moe.rowwise_loop import loop_scaled_grouped_mm

    d, inputs = _case(2)
    gemm, out_dtype = scaled_grouped_gemm(torch.device("cuda"))
    loop = partial(loop_scaled_grouped_mm, bounds=group_bounds(d.offs))
    for wgrad in ("fp8", "bf16"):
        ref = _layer(gemm, out_dtype, wgrad, inputs, d)
        got = _layer(loop, out_dtype, wgrad, inputs, d)
        for what, a, b in zip(("output", "dx", "dw_up", "dw_down"), ref, got, strict=True):
            db = sqnr(a.float(), b.float())
            assert db >= 30.0, f"wgrad {wgrad}, {what}: loop vs grouped kernel {db:.1f} dB < 30"
        for i, what in ((2, "dw_up"), (3, "dw_down")):
            assert got[i][EXPERTS - UNUSED:].abs().max().item() == 0.0, f"{what}: experts without tokens"


def test_weights_cast_with_hints_across_optimizer_steps_equal_the_plain_cast():
    """Across real optimizer steps (AdamW, lr 3e-4) on the GPU, the module's casts with the previous step's scales as
    hints (no cache), the weight cache's entries recast from their outdated versions (``cache_weights``) and the
    two-kernel cast without hints give the same outputs and gradients bit for bit; the cache recasts from the
    outdated entry at every step after the first, and the hints hold the scales of the weights last cast."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fp8kit.moe.experts import Float8GroupedExperts
    from fp8kit.moe.grouped_mm import GroupedGemmConfig
    from fp8kit.moe.rowwise_quant import experts_cache_stats, quantize_experts_dual

    cfg = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=WIDTH, num_experts=EXPERTS, hidden_act="silu")
    both = frozenset(("gate_up_proj", "down_proj"))

    def module(cache: bool) -> Float8GroupedExperts:
        torch.manual_seed(0)
        src = Qwen3MoeExperts(cfg)
        with torch.no_grad():
            src.gate_up_proj.normal_(0, 0.02)
            src.down_proj.normal_(0, 0.02)
        return Float8GroupedExperts(src.to("cuda", torch.bfloat16), both,
                                    GroupedGemmConfig(kernel="fused", cache_weights=cache))

    hinted, cached, plain = module(False), module(True), module(False)
    plain.scale_hints = lambda w_up, w_down: None  # the two-kernel cast every step
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-4) for m in (hinted, cached, plain)]
    _, (h, _, _, _, g) = _case(5)
    gen = torch.Generator(device="cuda").manual_seed(6)
    top = torch.rand(TOKENS, EXPERTS, generator=gen, device="cuda").topk(TOPK, dim=-1)
    weights = torch.softmax(top.values, dim=-1).to(torch.bfloat16)
    for step in range(3):
        before = experts_cache_stats()
        runs = []
        for m in (hinted, cached, plain):
            x = h.clone().requires_grad_()
            m(x, top.indices, weights).backward(g)
            runs.append([x.grad, m.gate_up_proj.grad.clone(), m.down_proj.grad.clone()])
        after = experts_cache_stats()
        for name, run in (("hinted", runs[0]), ("cached", runs[1])):
            for what, a, b in zip(("dx", "d gate_up_proj", "d down_proj"), run, runs[2], strict=True):
                assert torch.equal(a, b), f"step {step}: {name} {what} differs from the plain cast by " \
                                          f"{(a.float() - b.float()).abs().max().item()}"
        want = 0 if step == 0 else 2
        assert after["requantized"] - before["requantized"] == want, f"step {step}: cache {before} -> {after}"
        scales = [c[i] for c in (quantize_experts_dual(hinted.gate_up_proj.detach()),
                                 quantize_experts_dual(hinted.down_proj.detach())) for i in (1, 3)]
        hints = hinted.scale_hints(hinted.gate_up_proj, hinted.down_proj)
        assert all(torch.equal(a.view(torch.float32), b) for a, b in zip(hints, scales, strict=True)), f"step {step}"
        for opt in opts:
            opt.step()
            opt.zero_grad()
