"""MoE token-path quantization on the CPU (:mod:`fp8kit.moe.token_quant`): the gather + blockwise cast and
the SwiGLU + blockwise cast against :func:`fp8kit.fp8.blockwise.quantize_act` of the same rows, the SwiGLU
values against torch, the SwiGLU backward against autograd, the custom ops under torch.compile, bad input.
The CUDA kernels are compared with these references bit for bit in tests/test_moe_token_quant_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8kit.fp8 import blockwise
from fp8kit.moe import routing
from fp8kit.moe import token_quant as tq
from tests.conftest import randn_outliers as _real

BF16_HALF_ULP = 2.0**-8  # relative rounding error bound of bf16 (8 significand bits)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same(got, ref, names, where):
    for name, a, b in zip(names, got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{where} {name}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        diff = (_bits(a) != _bits(b)).sum().item()
        assert diff == 0, f"{where} {name}: {diff} of {a.numel()} elements differ"


def _index(t: int, m: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, t + 1, (m,), generator=g)
    index[::5] = t  # zero rows
    return index


# ----------------------------------------------------------------------------- gather + quantize

@pytest.mark.parametrize("t,k,m", [(64, 256, 300), (64, 256, 1), (10, 384, 256), (33, 128, 129), (5, 128, 0)])
def test_gather_quantize_equals_quantize_act_of_gathered_rows(t, k, m):
    src = _real(t, k, seed=t + k + m)
    index = _index(t, m, seed=m)
    gathered = torch.stack([src[i] if i < t else src.new_zeros(k) for i in index.tolist()]) if m else src[:0]
    ref = blockwise.quantize_act(gathered)
    _assert_same(tq.gather_quantize_act(src, index), ref, ("q", "s_t", "qt", "st"), f"gather T={t} K={k} M={m}")
    mp = blockwise.padded_rows(m)
    assert ref[0].shape == (mp, k) and ref[1].shape == (k // 128, mp)


def test_gather_quantize_of_a_real_dispatch_and_int32_index():
    tokens, experts, topk, k = 100, 8, 2, 256
    src = _real(tokens, k, seed=1)
    top = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(i))[:topk]
                       for i in range(tokens)])
    d = routing.dispatch(top, experts)
    ref = blockwise.quantize_act(routing.gather(src, d))
    _assert_same(tq.gather_quantize_act(src, d.gather_idx), ref, ("q", "s_t", "qt", "st"), "dispatch")
    _assert_same(tq.gather_quantize_act(src, d.gather_idx.int()), ref, ("q", "s_t", "qt", "st"), "int32 index")
    # Padding rows of the dispatch (index == T) quantize to zeros.
    pad = d.gather_idx == tokens
    assert pad.any() and not ref[0][: d.rows][pad].float().any()


# ----------------------------------------------------------------------------- SwiGLU + quantize

def test_sigmoid_f32_accuracy_and_clamps():
    g = torch.cat([torch.linspace(-87, 87, 100001), torch.randn(50000) * 4])
    s = tq.sigmoid_f32(g)
    rel = ((s.double() - torch.sigmoid(g.double())).abs() / torch.sigmoid(g.double())).max().item()
    assert rel <= 3e-7, f"sigmoid_f32 max relative error {rel:.3g} > 3e-7 (about 5 float32 ulps)"
    edge = tq.sigmoid_f32(torch.tensor([-1e4, -87.5, 87.5, 1e4, 0.0]))
    assert edge.tolist() == [0.0, 0.0, 1.0, 1.0, 0.5], edge.tolist()


@pytest.mark.parametrize("m,i,dtype", [(300, 256, torch.bfloat16), (1, 128, torch.bfloat16),
                                       (129, 128, torch.float16), (64, 128, torch.float32)])
def test_swiglu_values_within_rounding_of_torch(m, i, dtype):
    h = _real(m, 2 * i, scale=3.0, seed=m + i, dtype=dtype)
    a = tq.swiglu_quantize_act(h)[0]
    g, u = h[:, :i].float(), h[:, i:].float()
    exact = F.silu(g.double()) * u.double()
    # One rounding to dtype (half an ulp; absolute below the smallest normal) after a float32 product a few
    # float32 ulps off; for g < -87 sigmoid is 0 by definition, an error below |g u| e^-87.
    half_ulp = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}[dtype]
    allowed = (half_ulp + 2.0**-21) * (exact.abs() + torch.finfo(dtype).smallest_normal)
    allowed += (g < -tq.SILU_CLAMP).double() * (g * u).double().abs() * 1.7e-38
    worst = ((a.double() - exact).abs() / allowed).max().item()
    assert a.dtype == dtype and a.shape == (m, i)
    assert worst <= 1.0, f"a vs float64 silu(g) * u: worst error {worst:.3f}x the allowed rounding error"
    # Against torch's float32 silu: its sigmoid differs in the last float32 ulp; rounded to 16 bits, rarely.
    same = (a == (F.silu(g) * u).to(dtype)).float().mean().item()
    floor = 0.99 if dtype != torch.float32 else 0.5
    assert same >= floor, f"only {same:.4f} of a equal torch's (silu(g) * u).to({dtype}) (floor {floor})"


def test_swiglu_extreme_gates():
    i = 128
    h = torch.ones(4, 2 * i)
    h[:, :i] = torch.tensor([-1e4, -87.5, 87.5, 1e4])[:, None]
    a = tq.swiglu_quantize_act(h)[0]
    assert a[:2].eq(0).all() and torch.equal(a[2:], h[2:, :i]), a[:, 0]


@pytest.mark.parametrize("m,i", [(300, 256), (1, 128), (256, 128)])
def test_swiglu_quantize_is_quantize_act_of_a_and_interleaving_is_a_column_order(m, i):
    h = _real(m, 2 * i, scale=3.0, seed=m * 3 + i)
    out = tq.swiglu_quantize_act(h, interleaved=False)
    _assert_same(out[1:], blockwise.quantize_act(out[0]), ("q", "s_t", "qt", "st"), f"swiglu {m}x{i}")
    mixed = torch.stack([h[:, :i], h[:, i:]], dim=2).reshape(m, 2 * i)  # gate0, up0, gate1, up1, ...
    _assert_same(tq.swiglu_quantize_act(mixed, interleaved=True), out, ("a", "q", "s_t", "qt", "st"), "interleaved")
    assert torch.equal(tq.split_gate_up(mixed, True)[0], h[:, :i])


# ----------------------------------------------------------------------------- SwiGLU backward

@pytest.mark.parametrize("interleaved", [False, True])
def test_swiglu_backward_matches_autograd(interleaved):
    m, i = 200, 256
    h = _real(m, 2 * i, scale=3.0, seed=7)
    da = _real(m, i, seed=8)
    dh = tq.swiglu_backward(h, da, interleaved)
    h64 = h.double().requires_grad_()
    gate, up = tq.split_gate_up(h64, interleaved)
    (ref,) = torch.autograd.grad(F.silu(gate) * up, h64, da.double())
    err = (dh.double() - ref).abs()
    bound = BF16_HALF_ULP * ref.abs() + 1e-6 * ref.abs().max()
    worst = (err / bound).max().item()
    assert dh.dtype == h.dtype and dh.shape == h.shape
    assert worst <= 1.0, f"dh vs float64 autograd: worst error {worst:.3f}x the bf16 rounding bound (max err {err.max():.3g})"


# ----------------------------------------------------------------------------- ops, compile, errors

def test_custom_ops_pass_opcheck():
    src, h = _real(40, 256), _real(100, 256)
    torch.library.opcheck(torch.ops.fp8kit.moe_gather_quant_act.default, (src, _index(40, 150, 0)))
    torch.library.opcheck(torch.ops.fp8kit.moe_swiglu_quant_act.default, (h, True))


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()

    def path(src, index, h, da):
        x = tq.gather_quantize_act(src, index)
        y = tq.swiglu_quantize_act(h, interleaved=True)
        return (*x, *y, tq.swiglu_backward(h, da, True))

    args = (_real(50, 256, seed=2), _index(50, 200, 3), _real(200, 512, seed=4), _real(200, 256, seed=5))
    eager = path(*args)
    compiled = torch.compile(path, fullgraph=True)(*args)
    names = ("q", "s_t", "qt", "st", "a", "q_a", "s_t_a", "qt_a", "st_a")
    _assert_same(compiled[:9], eager[:9], names, "compiled")
    # The backward is plain PyTorch that Inductor fuses (it may contract multiply-adds): within rounding.
    torch.testing.assert_close(compiled[9].float(), eager[9].float(), rtol=2 * BF16_HALF_ULP, atol=1e-5)


def test_bad_input_raises_value_error_naming_the_shape():
    with pytest.raises(ValueError, match=r"\(10, 200\)"):
        tq.gather_quantize_act(torch.zeros(10, 200), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"index must be a 1-D int64 / int32 tensor.*torch.float32 \(4,\)"):
        tq.gather_quantize_act(torch.zeros(10, 256), torch.zeros(4))
    with pytest.raises(ValueError, match=r"\(4, 2\)"):
        tq.gather_quantize_act(torch.zeros(10, 256), torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"I a multiple of 128, got shape \(8, 384\)"):
        tq.swiglu_quantize_act(torch.zeros(8, 384))
    with pytest.raises(ValueError, match=r"2-D bf16 / fp16 / fp32 tensor, got torch.int64"):
        tq.swiglu_quantize_act(torch.zeros(8, 256, dtype=torch.long))
    with pytest.raises(ValueError, match=r"da must have shape \(8, 128\)"):
        tq.swiglu_backward(torch.zeros(8, 256), torch.zeros(8, 256))
