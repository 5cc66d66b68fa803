"""FP8AdamW on the CPU: all-zero, tiny and huge gradients, FP8 gradient accumulation in the backward hook,
zero_grad, and bytes per parameter (split from tests/test_fp8_adamw.py; thresholds in each test).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from fp8kit.optim import FP8AdamW, FP8AdamWPrecision, training_state_bytes
from tests.fp8_adamw_util import PAPER, one_thread  # noqa: F401 (fixture)
from tests.fp8_adamw_util import fit as _fit
from tests.fp8_adamw_util import flat as _flat
from tests.fp8_adamw_util import mlp as _mlp
from tests.fp8_adamw_util import regression as _regression
from tests.fp8_adamw_util import state as _state

pytestmark = pytest.mark.usefixtures("one_thread")


# -- 5. all-zero, tiny and huge gradients -------------------------------------------------------------
def _five_steps(opt_cls_kwargs, g: torch.Tensor, w0: torch.Tensor, fp8: bool):
    w = nn.Parameter(w0.clone())
    opt = FP8AdamW([w], **opt_cls_kwargs) if fp8 else torch.optim.AdamW([w], **opt_cls_kwargs)
    for _ in range(5):
        (w * g).sum().backward()  # d loss / d w = g
        opt.step()
        opt.zero_grad()
    return w.detach() - w0, opt


def _assert_finite_state(opt: FP8AdamW) -> None:
    for fg in opt._flat:
        for name, buf in (*fg.buffers().items(), ("grad_scale", fg.grad_scale), ("work", fg.work)):
            if buf is not None:
                assert torch.isfinite(buf.float()).all(), f"{name} has inf/NaN"
                if name.endswith("scale"):
                    assert (buf > 0).all(), f"{name} has a scale <= 0: {buf.min().item()}"


KW = dict(lr=1e-2, weight_decay=0.1)


def test_all_zero_gradients_only_decay():
    w0 = torch.randn(300, generator=torch.Generator().manual_seed(1))
    g = torch.zeros(300)
    d, opt = _five_steps(KW, g, w0, fp8=True)
    d_ref, _ = _five_steps(KW, g, w0, fp8=False)
    expect = w0 * ((1 - KW["lr"] * KW["weight_decay"]) ** 5 - 1)
    err = (d - expect).abs().max().item()
    print(f"zero gradients: max |delta - weight decay| = {err:.1e} (|w| <= {w0.abs().max():.2f})")
    _assert_finite_state(opt)
    assert torch.allclose(d_ref, expect, atol=1e-6)
    # fp16 master, scaled so the tensor's amax sits at 65504: each store rounds by at most half an ulp,
    # 2^-12 of amax; five stores (construction and steps 1-4; step 5 writes the fp32 working weights
    # unrounded) bound the error by 5 * 2^-12 * amax = 4.1e-3 here (measured 7.8e-4)
    assert err < 5 * 2**-12 * w0.abs().max().item(), (
        f"zero gradients moved parameters beyond weight decay: {err:.1e}"
    )


@pytest.mark.parametrize("mag", [1e-40, 1e-30])
def test_gradients_below_the_amax_floor(mag):
    """Below the amax floor (1e-12) a gradient counts as zero. AdamW's own update for it is lr * g / eps
    <= 1e-20 here, far below anything a parameter can register, so both stay put (and finite)."""
    g = torch.randn(300, generator=torch.Generator().manual_seed(0)) * mag
    w0 = torch.zeros(300)
    d, opt = _five_steps(KW, g, w0, fp8=True)
    d_ref, _ = _five_steps(KW, g, w0, fp8=False)
    diff = (d - d_ref).abs().max().item()
    print(
        f"g = {mag:g} * randn: |AdamW update| <= {d_ref.abs().max().item():.1e}, |FP8AdamW - AdamW| = {diff:.1e}"
    )
    _assert_finite_state(opt)
    assert d_ref.abs().max().item() < 1e-20
    assert diff < 1e-20, f"g = {mag:g}: |FP8AdamW - AdamW| = {diff:.1e}"


def test_small_gradients_keep_adamw_direction():
    """g ~ 1e-10 (v ~ 1e-23, beyond unscaled FP16 and FP8): the scales keep m and v, so the update
    follows AdamW's, lr * g / (|g| + eps), in sign and within 15 % (measured 5 %)."""
    g = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 1e-10
    d, opt = _five_steps(KW, g, torch.zeros(300), fp8=True)
    d_ref, _ = _five_steps(KW, g, torch.zeros(300), fp8=False)
    rel = ((d - d_ref).abs().max() / d_ref.abs().max()).item()
    print(f"g = 1e-10 * randn: |update| <= {d_ref.abs().max().item():.1e}, max rel deviation {rel:.2%}")
    _assert_finite_state(opt)
    assert torch.equal(torch.sign(d), torch.sign(d_ref)), "an update's sign differs from AdamW's"
    assert rel < 0.15, f"g = 1e-10: update deviates {rel:.2%} of its maximum from AdamW's"


@pytest.mark.parametrize("layout, limit", [("paper", 0.02), ("defaults", 0.125)])
def test_huge_gradients_give_lr_sized_updates(layout, limit):
    """g ~ 1e15: FP8 scales take it (scale ~ 1e-11); AdamW normalizes, so every step moves lr * sign(g).
    FP8-LM's layout (e5m2 gradients, m rounded to nearest): measured 0.4 % of the update. Defaults (exact
    gradients, m rounded stochastically): a store is off by up to one ulp of E4M3, 2^-3 of the value
    (measured 5.7 %; rounded to nearest with exact gradients 3.0 %)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(300, generator=gen) * 1e15
    w0 = torch.randn(300, generator=gen) * 0.1
    d, opt = _five_steps(dict(KW, precision=PAPER if layout == "paper" else FP8AdamWPrecision()), g, w0, fp8=True)
    d_ref, _ = _five_steps(KW, g, w0, fp8=False)
    err = (d - d_ref).abs().max().item()
    print(f"g = 1e15 * randn, {layout}: |update| <= {d_ref.abs().max().item():.3f}, max |FP8AdamW - AdamW| {err:.1e}")
    _assert_finite_state(opt)
    assert torch.equal(torch.sign(d), torch.sign(d_ref))
    assert err < limit * d_ref.abs().max().item(), f"g = 1e15: deviation {err:.1e} >= {limit:.1%} of the update"


def test_gradients_whose_square_overflows_stay_finite():
    """torch AdamW with |g| ~ 1e20 gets v = inf and a zero update (finite parameters); FP8AdamW stores
    inf * (65504 / inf) = NaN in v and the master (fp8kit/optim/numerics.py new_scale)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(300, generator=gen) * 1e20
    w0 = torch.randn(300, generator=gen) * 0.1
    d_ref, _ = _five_steps(KW, g, w0, fp8=False)
    assert torch.isfinite(d_ref).all()
    d, opt = _five_steps(KW, g, w0, fp8=True)
    assert torch.isfinite(d).all(), f"{int((~torch.isfinite(d)).sum())} of 300 parameters became inf/NaN"
    _assert_finite_state(opt)


# -- 6. gradient accumulation in the backward hook ----------------------------------------------------
def test_gradient_accumulation_in_fp8():
    x, y = _regression(0, n=64)

    def loss(m, i):
        return ((m(x[i * 32 : (i + 1) * 32]) - y[i * 32 : (i + 1) * 32]) ** 2).mean()

    exact_model = _mlp(0)
    exact = torch.autograd.grad(loss(exact_model, 0) + loss(exact_model, 1), list(exact_model.parameters()))
    exact_flat = torch.cat([e.reshape(-1) for e in exact])

    def dequantized(opt: FP8AdamW) -> torch.Tensor:
        fg = opt._flat[0]
        g = _state(opt, "grad")
        return torch.cat([fg.layout.segment(g, i) for i in range(len(fg.params))])

    accum, single = _mlp(0), _mlp(0)
    opt_a = FP8AdamW(accum.parameters(), lr=1e-3, precision=PAPER)
    opt_s = FP8AdamW(single.parameters(), lr=1e-3, precision=PAPER)
    for i in (0, 1):
        loss(accum, i).backward()
        assert all(p.grad is None for p in accum.parameters()), "param.grad kept after backward"
    (loss(single, 0) + loss(single, 1)).backward()
    assert all(p.grad is None for p in single.parameters())

    err_a = ((dequantized(opt_a) - exact_flat).norm() / exact_flat.norm()).item()
    err_s = ((dequantized(opt_s) - exact_flat).norm() / exact_flat.norm()).item()
    norm_err = abs(opt_a.grad_norm().item() / exact_flat.norm().item() - 1)
    print(
        f"E5M2 gradient rel L2 error: accumulated {err_a:.3%}, one backward {err_s:.3%}; norm {norm_err:.3%}"
    )
    # E5M2 keeps 2 mantissa bits: at most 12.5 % error per element and rounding, about 4.5 % RMS
    assert err_s < 0.1 and err_a < 0.1, (
        f"FP8 gradient error: accumulated {err_a:.3%}, single {err_s:.3%} (>= 10%)"
    )
    assert norm_err < 0.05, f"grad_norm off by {norm_err:.3%}"
    between = ((dequantized(opt_a) - dequantized(opt_s)).norm() / exact_flat.norm()).item()
    assert between < 0.12, f"accumulated vs one backward: rel L2 difference {between:.3%} (>= 12%)"
    w0 = _flat(accum)
    opt_a.step()
    opt_s.step()
    # the first step moves each weight by about lr * sign(g): count the weights that went opposite ways
    flips = ((_flat(accum) - w0).sign() != (_flat(single) - w0).sign()).float().mean().item()
    print(
        f"accumulated vs one backward: gradient difference {between:.3%}, first-step sign flips {flips:.3%}"
    )
    assert flips < 0.02, f"{flips:.3%} of the weights moved the other way than with one backward (>= 2%)"


# -- 7. zero_grad drops the FP8 gradient --------------------------------------------------------------
def test_zero_grad_then_step_only_decays():
    x, y = _regression(0, n=32)
    model = _mlp(0)
    w0 = _flat(model)
    opt = FP8AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, precision=dataclasses.replace(PAPER, master="fp32"))
    ((model(x) - y) ** 2).mean().backward()  # the hook stores an FP8 gradient ...
    opt.zero_grad()  # ... which zero_grad forgets
    opt.step()
    err = (_flat(model) - w0 * (1 - 1e-2 * 0.1)).abs().max().item()
    assert err < 1e-6, f"a step after zero_grad moved parameters beyond weight decay by {err:.1e}"


def test_zero_grad_then_step_equals_a_zero_gradient_step():
    """After real steps (m, v nonzero) a step without backward is a step with g = 0 (not a skip as in torch
    AdamW for ``grad is None``, and not a reuse of the stale FP8 gradient)."""
    x, y = _regression(0, n=64)
    a, b = _mlp(0), _mlp(0)
    opt_a, opt_b = FP8AdamW(a.parameters(), lr=1e-2), FP8AdamW(b.parameters(), lr=1e-2)
    for m, opt in ((a, opt_a), (b, opt_b)):
        _fit(m, opt, None, x, y, 3)
    ((a(x) - y) ** 2).mean().backward()
    opt_a.zero_grad()
    opt_a.step()
    (0 * ((b(x) - y) ** 2).mean()).backward()
    opt_b.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), f"max diff {(pa - pb).abs().max().item():.1e}"


# -- 9. bytes per parameter ---------------------------------------------------------------------------
def _model128(dtype: torch.dtype) -> nn.Module:
    """Every parameter numel a multiple of 128 and 776 blocks of 128 in all, a multiple of the layout's
    8-block alignment: no padding in the flat buffers."""
    return nn.Sequential(nn.Linear(128, 256), nn.LayerNorm(256), nn.Linear(256, 256)).to(dtype)


def _bytes(dtype: torch.dtype, **prec) -> dict[str, float]:
    model = _model128(dtype)
    opt = FP8AdamW(model.parameters(), precision=FP8AdamWPrecision(**prec))
    n = sum(p.numel() for p in model.parameters())
    assert opt._flat[0].layout.total == n, f"the test model is padded: {opt._flat[0].layout.total} for {n}"
    return training_state_bytes(list(model.parameters()), opt)


def test_bytes_per_param():
    """Defaults over bf16: master 2 + grad 2 (autograd's bf16 gradient, between backward and step) + m 1
    + v 2 = 7 B/param (9 with the working weights); FP8-LM's e5m2 gradients: 6 (8)."""
    b = _bytes(torch.bfloat16)
    print(f"default over bf16: {b}")
    for role, want in (("master", 2), ("grad", 2), ("m", 1), ("v", 2), ("working", 2)):
        assert abs(b[role] - want) < 0.01, f"{role}: {b[role]:.4f} B/param, want {want}"
    assert abs(b["state"] - 7) < 0.01 and abs(b["total"] - 9) < 0.01, f"state {b['state']:.4f}, total {b['total']:.4f}"
    b = _bytes(torch.bfloat16, grad="e5m2")
    assert abs(b["grad"] - 1) < 0.01 and abs(b["state"] - 6) < 0.01 and abs(b["total"] - 8) < 0.01, f"e5m2: {b}"
    b = _bytes(torch.float32)  # fp32 gradients (4) and working weights (4)
    assert abs(b["state"] - 9) < 0.01 and abs(b["total"] - 13) < 0.01, f"over fp32: {b}"
    b = _bytes(torch.float32, grad="e5m2")
    assert abs(b["state"] - 6) < 0.01 and abs(b["total"] - 10) < 0.01, f"e5m2 over fp32: {b}"
    b = _bytes(torch.bfloat16, master="bf16_sr")
    assert abs(b["master"] - 2) < 0.01 and b["working"] == 0 and abs(b["total"] - 7) < 0.01, f"bf16_sr: {b}"
    # per block: one float32 scale per 128 elements on each scaled state: 4 / 128 = 0.03125 each
    b = _bytes(torch.bfloat16, granularity="block")
    assert abs(b["state"] - (7 + 3 * 0.03125)) < 1e-6, f"per block: {b}"
    b = _bytes(torch.bfloat16, granularity="block", grad="e5m2")
    assert abs(b["state"] - 6.125) < 1e-6, f"per block, e5m2: {b}"
    b = _bytes(torch.bfloat16, granularity="block", m_expand="coat")  # + COAT's float32 k per block
    assert abs(b["m"] - (1 + 2 * 0.03125)) < 1e-6 and abs(b["state"] - 7.125) < 1e-6, f"COAT per block: {b}"
    b = _bytes(torch.bfloat16, m_expand="coat")  # per tensor: one k per tensor (5 tensors, 8 bytes each)
    assert abs(b["m"] - 1) < 0.001, f"COAT per tensor: {b}"

    ref = _model128(torch.float32)
    opt = torch.optim.AdamW(ref.parameters())
    b0 = training_state_bytes(list(ref.parameters()), opt)
    ref[0](torch.randn(2, 128)).sum().backward()
    opt.step()
    b1 = training_state_bytes(list(ref.parameters()), opt)
    assert b0["total"] == 16 and b1["total"] == 16, (
        f"torch AdamW over fp32: {b0['total']} before, {b1['total']} after"
    )


def test_bytes_per_param_charge_padding():
    # 300 elements, padded to whole blocks (and the layout's 8-block alignment) in the flat buffers
    model = nn.Linear(100, 3, bias=False)
    opt = FP8AdamW(model.parameters())
    total = opt._flat[0].layout.total
    b = training_state_bytes(list(model.parameters()), opt)
    print(f"300 parameters laid out in {total}: state {b['state']:.3f} B/param")
    # master, m, v (5 bytes) are padded; the gradient is autograd's own (2 bytes x 300, fp32 here: 4)
    want = (5 * total + 4 * 300) / 300
    assert total >= 384 and abs(b["state"] - want) < 0.1, f"padding not charged: {total}, {b}, want {want:.3f}"


def test_gradient_table_load_width():
    """The Triton step reads ``param.grad`` with 16-byte vector loads, so every entry of its gradient table must
    start on 16 bytes and hold whole vectors (``FlatGroup.update_grad_table``): aligned gradients are read in
    place; any other one goes through a zero-padded buffer of its own, refreshed each step and reused; when such
    gradients are most of the group, every gradient is read in place with element loads instead. The table is
    plain host bookkeeping, so this runs on the CPU."""
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 7)).to(torch.bfloat16)  # the last bias: 7 elements
    fg = FP8AdamW(model.parameters(), lr=1e-3)._flat[0]
    params = list(model.parameters())  # 2048, 64, 448 and 7 elements
    assert fg.grad_vec == 8

    def shifted(p: torch.Tensor) -> torch.Tensor:  # a gradient starting 2 bytes past an aligned address
        base = torch.zeros(p.numel() + 1, dtype=torch.bfloat16)
        g = base[1:].view(p.shape)
        g.copy_(torch.randn(p.shape))
        assert g.data_ptr() % 16 == 2
        return g

    grads = [torch.randn(p.shape).to(torch.bfloat16) for p in params]
    grads[1] = shifted(params[1])
    fg.update_grad_table(grads)
    assert fg.grad_vec == 8
    table = fg.grad_table.tolist()
    assert sorted(fg.grad_pad) == [1, 3], sorted(fg.grad_pad)  # the shifted bias and the 7-element bias
    for i, g in enumerate(grads):
        addr, count = table[0][i], table[1][i]
        assert addr % 16 == 0 and count % 8 == 0, (i, addr, count)
        if i in fg.grad_pad:
            pad = fg.grad_pad[i]
            assert addr == pad.data_ptr() and count == pad.numel() == -(-g.numel() // 8) * 8
            assert torch.equal(pad[: g.numel()], g.reshape(-1)) and not pad[g.numel():].any()
        else:
            assert (addr, count) == (g.data_ptr(), g.numel())
    # the next step's values go through the same buffers (same addresses: the device table is not rewritten)
    pads, table_host = {i: t.data_ptr() for i, t in fg.grad_pad.items()}, fg._table_host
    grads[3] = torch.randn(7).to(torch.bfloat16)
    fg.update_grad_table(grads)
    assert {i: t.data_ptr() for i, t in fg.grad_pad.items()} == pads and fg._table_host is table_host
    assert torch.equal(fg.grad_pad[3][:7], grads[3])
    grads[1] = torch.randn(64).to(torch.bfloat16)  # aligned again: its buffer is released
    fg.update_grad_table(grads)
    assert sorted(fg.grad_pad) == [3], sorted(fg.grad_pad)
    grads[1] = shifted(params[1])
    fg.update_grad_table([None, *grads[1:]])  # a missing gradient: address and count 0
    assert fg.grad_table[:, 0].tolist() == [0, 0]
    # most of the group misaligned (2048 + 64 + 7 of 2567 elements): copies would cost more than element loads,
    # and the buffers are released
    grads[0] = shifted(params[0])
    fg.update_grad_table(grads)
    assert fg.grad_vec == 1 and fg.grad_pad == {}, (fg.grad_vec, sorted(fg.grad_pad))
    assert fg.grad_table[:, 0].tolist() == [grads[0].data_ptr(), grads[0].numel()]
