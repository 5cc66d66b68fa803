"""The delayed recipe's fused SwiGLU MLP (``fp8kit.fp8.delayed_mlp``, ``fp8kit.fp8.swiglu_delayed``) on the CPU
reference path: the backward cast op against its definition, the fused MLP against the three delayed linears it
replaces (outputs, gradients and the amax histories over training steps), compile, the fallbacks and the config
switch. The Triton kernel's bit-for-bit check is tests/test_delayed_mlp_gpu.py."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from fp8kit.fp8.delayed_state import E4M3, E5M2
from fp8kit.fp8.scaling import quantize
from fp8kit.fp8.swiglu import swiglu_backward_ref, swiglu_ref
from fp8kit.fp8.swiglu_delayed import swiglu_backward_cast
from fp8kit.fp8.swiglu_mlp import fused_mlp_blocker, fused_mlp_report
from tests.conftest import llama_steps, prepared_llama, sqnr
from tests.conftest import randn_outliers as _real


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def test_backward_cast_is_the_casts_of_the_swiglu_gradients():
    g, u, da = _real(130, 200, seed=1, scale=2.0), _real(130, 200, seed=2), _real(130, 200, seed=3, scale=1e-3)
    sg, su, sa = torch.tensor(3e6), torch.tensor(5e6), torch.tensor(20.0)
    qg, qgt, qu, qut, qat, amax = swiglu_backward_cast(g, u, da, sg, su, sa)
    dg, du = swiglu_backward_ref(da, g, u)
    want = (quantize(dg, sg, E5M2), quantize(dg, sg, E5M2).t().contiguous(), quantize(du, su, E5M2),
            quantize(du, su, E5M2).t().contiguous(), quantize(swiglu_ref(g, u), sa, E4M3).t().contiguous())
    for name, a, b in zip(("qg", "qgt", "qu", "qut", "qat"), (qg, qgt, qu, qut, qat), want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b)), name
    assert torch.equal(amax, torch.stack([dg.abs().amax().float(), du.abs().amax().float()]))
    # scales chosen so that some values saturate: the cast clamps rather than overflowing to inf / NaN
    assert (qg.float().abs() == 57344.0).any() and torch.isfinite(qg.float()).all()
    no_a = swiglu_backward_cast(g, u, da, sg, su)
    assert no_a[4].numel() == 0 and torch.equal(_bits(no_a[0]), _bits(qg))


def test_backward_cast_op_passes_opcheck_and_refuses_bad_input():
    g, u, da = _real(64, 128, seed=4), _real(64, 128, seed=5), _real(64, 128, seed=6)
    s = torch.tensor(100.0)
    torch.library.opcheck(torch.ops.fp8kit.delayed_swiglu_bwd_cast.default, (g, u, da, s, s, s))
    torch.library.opcheck(torch.ops.fp8kit.delayed_swiglu_bwd_cast.default, (g, u, da, s, s, None))
    with pytest.raises(ValueError, match=r"delayed_swiglu_bwd_cast: g, u and da must have one shape.*da .*\(64, 64\)"):
        swiglu_backward_cast(g, u, da[:, :64], s, s)
    with pytest.raises(ValueError, match="scale_u must be one float32 value"):
        swiglu_backward_cast(g, u, da, s, torch.ones(2))
    with pytest.raises(ValueError, match="g must be a 2-D"):
        swiglu_backward_cast(g[None], u, da, s, s)


def _llama(fused: bool, extra=()):
    return prepared_llama(["fp8.recipe=delayed", f"fp8.delayed_fused_mlp={str(fused).lower()}", *extra])


def _histories(model) -> dict[str, torch.Tensor]:
    state = next(m for m in model.modules() if type(m).__name__ == "Float8DelayedLinear").state
    state.roll()  # the last step's records (its next forward has not run)
    return {n: e.history.clone() for n, e in state.entries.items()} | {
        n + ".steps": e.steps.clone() for n, e in state.entries.items()}


def test_fused_mlp_trains_like_the_three_delayed_linears():
    """Three steps: the first runs the linears (no history yet), the next two the fused MLP. Its loss, gradients
    and histories match the unfused model's within the SwiGLU's bf16 rounding."""
    fused_model, done = _llama(True)
    mlps = [m for m in fused_model.modules() if type(m).__name__ == "LlamaMLP"]
    assert len(mlps) == 2 and all(fused_mlp_blocker(m) is None for m in mlps)
    assert any("fp8.delayed_fused_mlp: 2 of 2 SwiGLU MLPs run" in n for n in done.facts), done.facts
    assert not any("fused_mlp" in n for n in done.notes), done.notes  # all fused: a fact, not a warning
    plain_model, done_plain = _llama(False)
    assert not any("fused_mlp" in n for n in done_plain.notes + done_plain.facts), done_plain.notes
    calls, (loss_f, grads_f) = _count_fused_calls(lambda: llama_steps(fused_model, 3))
    assert calls == 4, f"the fused function ran {calls} times in 3 steps of 2 layers (want 2 x 2)"
    loss_p, grads_p = llama_steps(plain_model, 3)
    bf16_model, _ = _llama(False, extra=["train.mixed_precision=bf16"])
    loss_b, grads_b = llama_steps(bf16_model, 3)
    assert abs(loss_f.item() - loss_p.item()) <= 2e-3 * abs(loss_p.item()), (loss_f.item(), loss_p.item())
    # against the BF16 model's gradients, parameter by parameter: the fused model is as close as the unfused one
    # (E5M2 output gradients: a bf16 ulp of dg / du that moves an E5M2 rounding moves the gradients by more)
    for (name, _), gf, gp, gb in zip(fused_model.named_parameters(), grads_f, grads_p, grads_b, strict=True):
        db_f, db_p = sqnr(gb.double(), gf.double()), sqnr(gb.double(), gp.double())
        assert db_f >= db_p - 1.5, f"{name}: fused {db_f:.1f} dB vs unfused {db_p:.1f} dB from BF16"
    hf, hp = _histories(fused_model), _histories(plain_model)
    assert hf.keys() == hp.keys() and any("mlp.gate_proj" in k for k in hf)
    for k in hf:
        if k.endswith(".steps"):
            assert int(hf[k]) == int(hp[k]) == 3, (k, int(hf[k]), int(hp[k]))
        else:  # weight amaxes equal; inputs and output gradients carry the SwiGLU's other rounding onwards
            torch.testing.assert_close(hf[k][1], hp[k][1], rtol=0, atol=0, msg=k)
            torch.testing.assert_close(hf[k][0], hp[k][0], rtol=0.03, atol=0, msg=k)
            torch.testing.assert_close(hf[k][2], hp[k][2], rtol=0.1, atol=0, msg=k)


@pytest.mark.parametrize("fused_cast", ["grad_output", "all"])
def test_fused_mlp_with_casts_through_the_op_trains_to_the_same_bits(fused_cast):
    """``fp8.delayed_fused_cast`` routes down_proj's output gradient (and, with "all", x and the weights) through
    ``fp8kit::cast_transpose`` inside the fused MLP (and the attention's delayed linears): loss, every gradient and
    every history equal the default's ("none") bit for bit over 3 steps (linears first, then the fused MLP)."""
    import fp8kit.fp8.delayed as delayed

    ref_model, _ = _llama(True)
    op_model, _ = _llama(True, extra=[f"fp8.delayed_fused_cast={fused_cast}"])
    op_dtypes = []

    def counted(x, scale, dtype, *args, **kwargs):
        op_dtypes.append(dtype)
        return op(x, scale, dtype, *args, **kwargs)

    op = delayed.cast_transpose
    with mock.patch.object(delayed, "cast_transpose", counted):  # the op itself runs: this only counts its calls
        calls, (loss_o, grads_o) = _count_fused_calls(lambda: llama_steps(op_model, 3))
    assert calls == 4, f"the fused function ran {calls} times in 3 steps of 2 layers (want 2 x 2)"
    # steps 2-3 (history scales) of 2 layers: the output gradients of q / k / v / o_proj and the MLP's down_proj
    want_e5m2 = 2 * 2 * 5
    assert op_dtypes.count(torch.float8_e5m2) == want_e5m2, (op_dtypes.count(torch.float8_e5m2), want_e5m2)
    assert (torch.float8_e4m3fn in op_dtypes) == (fused_cast == "all"), set(op_dtypes)
    loss_r, grads_r = llama_steps(ref_model, 3)
    assert torch.equal(loss_o, loss_r), (loss_o.item(), loss_r.item())
    for (name, _), go, gr in zip(ref_model.named_parameters(), grads_o, grads_r, strict=True):
        assert torch.equal(go, gr), f"{name}: max diff {(go.float() - gr.float()).abs().max().item()}"
    ho, hr = _histories(op_model), _histories(ref_model)
    assert ho.keys() == hr.keys()
    for k in hr:
        assert torch.equal(ho[k], hr[k]), k


def test_compiled_fused_mlp_equals_eager_without_graph_breaks():
    torch._dynamo.reset()
    model, _ = _llama(True)
    mlp = next(m for m in model.modules() if type(m).__name__ == "LlamaMLP")
    x = _real(1, 48, mlp.gate_proj.in_features, seed=7).requires_grad_()
    dy = _real(1, 48, mlp.down_proj.out_features, seed=8)
    (mlp(x) * dy).sum().backward()  # the first recorded step: the linears, the histories start
    state = mlp.gate_proj.state
    state.roll()  # the model's forward rolls; this test calls the MLP itself
    assert all(p._entry.started for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    saved = {k: v.clone() for k, v in _histories(model).items()}
    params = [p for p in mlp.parameters()]
    y = mlp(x)
    grads = torch.autograd.grad(y, (x, *params), dy)
    eager_hist = _histories(model)
    for n, e in next(iter(mlp.modules())).gate_proj.state.entries.items():  # back to the state before that step
        e.history.copy_(saved[n])
        e.steps.copy_(saved[n + ".steps"])
    state.roll()  # their scales
    from torch._dynamo.utils import counters

    counters.clear()
    yc = torch.compile(mlp, fullgraph=True)(x)
    grads_c = torch.autograd.grad(yc, (x, *params), dy)
    assert not counters["graph_break"], dict(counters["graph_break"])
    # Not bit for bit: Inductor fuses a = silu(g) * u into a's E4M3 cast without rounding a to bf16 first
    # (torch._inductor.config.emulate_precision_casts is off), so an E4M3 rounding of a can move.
    for name, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), (y, *grads), (yc, *grads_c), strict=True):
        db = sqnr(a.double(), b.double())
        assert db >= 25.0, f"compiled {name} vs eager: {db:.1f} dB (< 25 dB)"
    for k, v in _histories(model).items():
        if k.endswith(".steps"):
            assert torch.equal(v, eager_hist[k]), k
        else:
            torch.testing.assert_close(v, eager_hist[k], rtol=0.1, atol=0, msg=k)


def test_an_mlp_falls_back_to_its_linears_and_says_why():
    model, _ = _llama(True)
    mlp = next(m for m in model.modules() if type(m).__name__ == "LlamaMLP")
    x = _real(1, 40, mlp.gate_proj.in_features, seed=9)
    handle = mlp.down_proj.register_forward_hook(lambda *a: None)  # what fp8.stats_every registers
    assert "forward hooks" in fused_mlp_blocker(mlp)
    handle.remove()
    assert fused_mlp_blocker(mlp) is None
    mlp.up_proj = mlp.up_proj.to_linear()  # a policy or the precision schedule keeps up_proj BF16
    assert "not all of gate_proj / up_proj / down_proj are delayed-scaling FP8" in fused_mlp_blocker(mlp)
    assert mlp(x).shape == x.shape  # its own forward
    fused, blocked = fused_mlp_report(model)
    assert len(fused) == 1 and list(blocked.values()) == [fused_mlp_blocker(mlp)], (fused, blocked)
    off, done = _llama(False)
    off_mlp = next(m for m in off.modules() if type(m).__name__ == "LlamaMLP")
    assert not hasattr(off_mlp, "_fp8kit_unfused_forward")
    from fp8kit.fp8.swiglu_mlp import install_fused_mlps

    install_fused_mlps(off, "blockwise")  # installed for the other recipe only
    assert fused_mlp_blocker(off_mlp) == "fp8.delayed_fused_mlp is off"
    with pytest.raises(ValueError, match="recipe must be 'blockwise' or 'delayed'"):
        install_fused_mlps(off, "tensorwise")


def _count_fused_calls(fn):
    import fp8kit.fp8.delayed_mlp as dm

    calls, orig = [], dm._DelayedSwiGLUMLPFn.apply
    dm._DelayedSwiGLUMLPFn.apply = lambda *a: calls.append(1) or orig(*a)
    try:
        out = fn()
    finally:
        dm._DelayedSwiGLUMLPFn.apply = orig
    return len(calls), out


def test_the_linears_run_where_the_fused_function_would_record_otherwise():
    """Evaluation, no_grad, float32 activations, and frozen weights on an input without grad run the three linears
    (the histories then advance exactly as theirs do); the fused function runs again once they are gone."""
    from fp8kit.fp8.delayed_mlp import delayed_swiglu_mlp_forward

    model, _ = _llama(True)
    mlp = next(m for m in model.modules() if type(m).__name__ == "LlamaMLP")
    h = mlp.gate_proj.in_features
    x = _real(1, 40, h, seed=10)
    (mlp(x.requires_grad_()).float().sum()).backward()  # first recorded step: the linears, histories start
    state = mlp.gate_proj.state
    state.roll()  # the model's forward rolls; this test calls the MLP itself
    for why, run in (
        ("eval", lambda: mlp.eval()(x.detach())),
        ("no_grad", lambda: torch.no_grad()(mlp.train())(x.detach())),
        ("float32", lambda: mlp.train()(x.detach().float().requires_grad_())),
    ):
        n, y = _count_fused_calls(run)
        assert n == 0 and y.shape == x.shape, (why, n)
    mlp.train()
    mlp.up_proj.weight.requires_grad_(False)
    steps = mlp.up_proj._entry.steps.clone()
    n, y = _count_fused_calls(lambda: mlp(x.detach()))
    y.float().sum().backward()
    state.roll()
    assert n == 0 and torch.equal(mlp.up_proj._entry.steps, steps), "frozen up_proj on a frozen input: recorded"
    n, y = _count_fused_calls(lambda: mlp(x.detach().requires_grad_()))
    y.float().sum().backward()
    state.roll()
    assert n == 1 and int(mlp.up_proj._entry.steps) == int(steps) + 1, (n, int(mlp.up_proj._entry.steps))
    with pytest.raises(ValueError, match=r"input of shape \(1, 40, 700\) does not match gate_proj \(768 input"):
        delayed_swiglu_mlp_forward(mlp, x[..., :700])


def test_gate_and_up_input_scales_that_differ_take_the_smaller_one():
    """After a checkpoint that lacked one entry the two input histories differ. The fused MLP casts x at the smaller
    scale: no saturation for either projection, so it is at least as close to BF16 as the linears, which saturate
    gate's input at its too-large scale."""
    model, _ = _llama(True)
    mlp = next(m for m in model.modules() if type(m).__name__ == "LlamaMLP")
    x = _real(1, 64, mlp.gate_proj.in_features, seed=11, scale=4.0).requires_grad_()
    dy = _real(1, 64, mlp.down_proj.out_features, seed=12)
    (mlp(x) * dy).float().sum().backward()  # histories start
    mlp.gate_proj.state.roll()  # the model's forward rolls; this test calls the MLP itself
    with torch.no_grad():
        bf16 = mlp.down_proj.to_linear()(torch.nn.functional.silu(mlp.gate_proj.to_linear()(x))
                                         * mlp.up_proj.to_linear()(x))
    mlp.gate_proj._entry.history[0].mul_(0.01)  # gate's input scale 100x too large: x saturates there
    state = mlp.gate_proj.state
    state.roll()  # the scales of the changed history
    s_gate, s_up = state.scale_tensors(mlp.gate_proj._entry)[0], state.scale_tensors(mlp.up_proj._entry)[0]
    assert s_gate > 50 * s_up
    n, fused = _count_fused_calls(lambda: mlp(x))
    unfused = mlp._fp8kit_unfused_forward(x)
    db_f, db_u = sqnr(bf16.double(), fused.double()), sqnr(bf16.double(), unfused.double())
    assert n == 1 and db_f >= 20.0 and db_f >= db_u, f"fused {db_f:.1f} dB, linears {db_u:.1f} dB from BF16"


def test_fp32_weights_say_the_mlps_run_as_linears():
    """train.param_dtype = fp32 makes the activations float32, which the fused MLP declines: the run's notes say so
    instead of claiming fused MLPs."""
    model, done = _llama(True, extra=["train.param_dtype=fp32"])
    assert any("run as their three linears in this run: FP32 weights" in n for n in done.notes), done.notes
    assert not any("SwiGLU MLPs run with the SwiGLU's FP8 casts fused" in n for n in done.notes + done.facts), done.facts
