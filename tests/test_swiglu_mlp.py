"""The fused SwiGLU MLP of the blockwise recipe (``fp8kit.fp8.swiglu``, ``fp8kit.fp8.swiglu_mlp``), on the CPU
reference path: its SwiGLU math against PyTorch's, the fused MLP against the three blockwise linears it replaces
and against float64, compile, the fallbacks, and the config switch. The Triton kernels' bit-for-bit check against
these references is tests/test_swiglu_mlp_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.fp8 import blockwise
from fp8kit.fp8.linear import Float8BlockwiseLinear
from fp8kit.fp8.swiglu import (
    swiglu_backward_quantize,
    swiglu_backward_ref,
    swiglu_quantize_act,
    swiglu_ref,
)
from fp8kit.fp8.swiglu_mlp import blockwise_swiglu_mlp, fused_mlp_blocker, fused_mlp_report
from tests.conftest import prepared_llama, sqnr
from tests.conftest import randn_outliers as _real

BF16_ULP = 2.0**-7  # relative spacing of bf16 values


def test_swiglu_reference_is_pytorchs_silu_rounded_once():
    g, u = _real(300, 256, seed=1), _real(300, 256, seed=2)
    ours = swiglu_ref(g, u).float()
    torch_ = (F.silu(g.float()) * u.float()).to(torch.bfloat16).float()
    rel = ((ours - torch_).abs() / torch_.abs().clamp_min(1e-30)).max().item()
    assert rel <= BF16_ULP, f"swiglu_ref differs from F.silu by {rel:.3g} relative (> one bf16 ulp)"


def test_swiglu_backward_reference_is_the_derivative():
    g, u, da = _real(200, 256, seed=3), _real(200, 256, seed=4), _real(200, 256, seed=5)
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    dg64, du64 = torch.autograd.grad(F.silu(g64) * u64, (g64, u64), da.double())
    dg, du = swiglu_backward_ref(da, g, u)
    for name, got, want in (("dg", dg, dg64), ("du", du, du64)):
        db = sqnr(want, got.double())
        assert db >= 45.0, f"{name} of swiglu_backward_ref: {db:.1f} dB against float64 autograd (< 45 dB)"


def test_fused_quantizations_are_the_blockwise_casts_of_the_rounded_values():
    g, u, da = _real(130, 384, seed=6), _real(130, 384, seed=7), _real(130, 384, seed=8)
    for wgrad_x in blockwise.WGRAD_X_BLOCKS:
        got = swiglu_quantize_act(g, u, wgrad_x)
        want = blockwise.quantize_act(swiglu_ref(g, u), wgrad_x)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype == blockwise.FP8 else a,
                                                      b.view(torch.uint8) if b.dtype == blockwise.FP8 else b)
    got = swiglu_backward_quantize(da, g, u)
    dg, du = swiglu_backward_ref(da, g, u)
    for a, b in zip(got, (*blockwise.quantize_act(dg), *blockwise.quantize_act(du)), strict=True):
        assert a.shape == b.shape and torch.equal(a.float(), b.float())


def test_ops_pass_opcheck_and_refuse_bad_shapes():
    g, u = _real(200, 256, seed=9), _real(200, 256, seed=10)
    torch.library.opcheck(torch.ops.fp8kit.blockwise_swiglu_quant.default, (g, u, "128x128"))
    torch.library.opcheck(torch.ops.fp8kit.blockwise_swiglu_bwd_quant.default, (_real(200, 256, seed=11), g, u))
    with pytest.raises(ValueError, match=r"fp8kit::blockwise_swiglu_quant: g must be .* multiple of 128"):
        swiglu_quantize_act(_real(4, 200), _real(4, 200))
    with pytest.raises(ValueError, match="fp8kit::blockwise_swiglu_bwd_quant: da, g, u must have one shape"):
        swiglu_backward_quantize(_real(4, 256), _real(4, 256), _real(8, 256))
    with pytest.raises(ValueError, match="wgrad_x must be one of"):
        swiglu_quantize_act(g, u, "1x128")


def _projections(hidden: int, inter: int, seed: int):
    torch.manual_seed(seed)
    return [nn.Linear(i, o, bias=False, dtype=torch.bfloat16) for i, o in ((hidden, inter), (hidden, inter),
                                                                          (inter, hidden))]


def _unfused(x, lins):
    g, u, d = lins
    return d(F.silu(g(x)) * u(x))


@pytest.mark.parametrize("wgrad_x", blockwise.WGRAD_X_BLOCKS)
@pytest.mark.parametrize("keep_weight_copy", [True, False])
def test_fused_mlp_matches_the_three_blockwise_linears(wgrad_x, keep_weight_copy):
    hidden, inter = 256, 384
    lins = _projections(hidden, inter, seed=12)
    fp8 = [Float8BlockwiseLinear.from_linear(lin, wgrad_x=wgrad_x, keep_weight_copy=keep_weight_copy)
           for lin in lins]
    x = _real(2, 75, hidden, seed=13).requires_grad_()
    dy = _real(2, 75, hidden, seed=14)
    weights = [lin.weight for lin in lins]

    y_ref = _unfused(x.double(), [lambda t, w=w: t @ w.double().t() for w in weights])
    ref = (y_ref, *torch.autograd.grad(y_ref, (x, *weights), dy.double()))
    y_un = _unfused(x, fp8)
    unfused = (y_un, *torch.autograd.grad(y_un, (x, *weights), dy))
    y_fu = blockwise_swiglu_mlp(x, *weights, keep_weight_copy=keep_weight_copy, wgrad_x=wgrad_x)
    fused = (y_fu, *torch.autograd.grad(y_fu, (x, *weights), dy))
    for name, r, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), ref, unfused, fused, strict=True):
        vs_unfused, vs_fp64 = sqnr(a.double(), b.double()), sqnr(r, b.double())
        # the two differ only where a SwiGLU value rounds to another bf16 (unfused: Inductor's SiLU in bf16)
        assert vs_unfused >= 35.0, f"{name}: fused vs unfused {vs_unfused:.1f} dB (< 35 dB)"
        # two FP8 GEMMs in series (gate/up, then down): ~24-25 dB on y where one linear holds ~28-30
        assert vs_fp64 >= 22.0, f"{name}: fused vs float64 {vs_fp64:.1f} dB (< 22 dB)"
        assert vs_fp64 >= sqnr(r, a.double()) - 0.5, f"{name}: fused {vs_fp64:.2f} dB loses to unfused"


def test_compiled_fused_mlp_equals_eager_without_graph_breaks():
    torch._dynamo.reset()
    weights = [lin.weight for lin in _projections(256, 256, seed=15)]
    x = _real(150, 256, seed=16).requires_grad_()
    dy = _real(150, 256, seed=17)

    def f(x, *w):
        return blockwise_swiglu_mlp(x, *w)

    y = f(x, *weights)
    grads = torch.autograd.grad(y, (x, *weights), dy)
    yc = torch.compile(f, fullgraph=True)(x, *weights)
    grads_c = torch.autograd.grad(yc, (x, *weights), dy)
    assert torch.equal(y, yc)
    for name, a, b in zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, grads_c, strict=True):
        assert torch.equal(a, b), f"compiled {name} differs: max {(a - b).abs().max().item()}"


def test_bad_weights_are_a_clear_error():
    g, u, d = (lin.weight for lin in _projections(256, 384, seed=18))
    with pytest.raises(ValueError, match=r"blockwise_swiglu_mlp: weights must be .* got gate \(384, 256\), "
                                         r"up \(384, 256\), down \(384, 256\)"):
        blockwise_swiglu_mlp(_real(4, 256), g, u, g)
    with pytest.raises(ValueError, match="does not match gate weight"):
        blockwise_swiglu_mlp(_real(4, 384), g, u, d)


def _llama(fused: bool, recipe: str = "blockwise", extra=()):
    return prepared_llama([f"fp8.recipe={recipe}", "fp8.emulate=true", f"fp8.blockwise_fused_mlp={str(fused).lower()}",
                           *extra], emulate=True)


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    return loss, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


def test_config_fuses_every_llama_mlp_and_trains_like_unfused():
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(0))
    fused_model, done = _llama(True)
    mlps = [m for m in fused_model.modules() if type(m).__name__ == "LlamaMLP"]
    assert len(mlps) == 2 and all(fused_mlp_blocker(m) is None for m in mlps)
    assert any("2 of 2 SwiGLU MLPs run with the SwiGLU's FP8 casts fused" in n for n in done.facts), done.facts
    assert not any("fused_mlp" in n for n in done.notes), done.notes  # all fused: a fact, not a warning
    plain_model, done_plain = _llama(False)
    assert not any("blockwise_fused_mlp" in n for n in done_plain.notes + done_plain.facts), done_plain.notes
    assert not any(hasattr(m, "_fp8kit_unfused_forward") for m in plain_model.modules())
    bf16_model, _ = _llama(False, extra=["train.mixed_precision=bf16"])
    assert not any(isinstance(m, Float8BlockwiseLinear) for m in bf16_model.modules())
    loss_f, grads_f = _loss_and_grads(fused_model, ids)
    loss_p, grads_p = _loss_and_grads(plain_model, ids)
    loss_b, grads_b = _loss_and_grads(bf16_model, ids)
    assert abs(loss_f.item() - loss_p.item()) <= 2e-3 * abs(loss_p.item()), (loss_f.item(), loss_p.item())
    # against the BF16 model's gradients, parameter by parameter: the fused model is as close as the unfused one
    for (name, _), gf, gp, gb in zip(bf16_model.named_parameters(), grads_f, grads_p, grads_b, strict=True):
        db_f, db_p = sqnr(gb.double(), gf.double()), sqnr(gb.double(), gp.double())
        assert db_f >= min(db_p - 1.5, 25.0), f"{name}: fused {db_f:.1f} dB vs unfused {db_p:.1f} dB from BF16"


def test_an_mlp_falls_back_to_its_own_forward_and_says_why():
    model, _ = _llama(True)
    mlp = next(m for m in model.modules() if type(m).__name__ == "LlamaMLP")
    x = _real(1, 40, mlp.gate_proj.in_features, seed=19)
    unfused = mlp._fp8kit_unfused_forward(x)
    handle = mlp.down_proj.register_forward_hook(lambda *a: None)  # what fp8.stats_every registers
    assert "forward hooks" in fused_mlp_blocker(mlp)
    assert torch.equal(mlp(x), unfused)  # the module's own forward, bit for bit
    handle.remove()
    assert fused_mlp_blocker(mlp) is None and not torch.equal(mlp(x), unfused)  # fused again (another rounding)
    mlp.up_proj = mlp.up_proj.to_linear()  # a policy or the precision schedule keeps up_proj BF16
    assert "not all of gate_proj / up_proj / down_proj are blockwise FP8" in fused_mlp_blocker(mlp)
    fused, blocked = fused_mlp_report(model)
    assert len(fused) == 1 and list(blocked.values()) == [fused_mlp_blocker(mlp)], (fused, blocked)


def test_recompute_and_other_recipes_leave_the_mlps_alone():
    model, done = _llama(True, extra=["fp8.blockwise_recompute=true", "train.compile=true"])
    assert any("2 MLP(s) run unfused" in n and "blockwise_recompute" in n for n in done.notes), done.notes
    model, done = _llama(True, recipe="tensorwise")
    assert not any("blockwise_fused_mlp" in n for n in done.notes + done.facts), done.notes + done.facts
    assert not any(hasattr(m, "_fp8kit_unfused_forward") for m in model.modules())


@pytest.mark.parametrize("recipe", ["blockwise", "delayed"])
def test_health_statistics_keep_the_mlps_unfused_and_the_run_says_so(cache_dir, tmp_path, recipe):
    """fp8.stats_every hooks (or, delayed, probes) every FP8 projection (its operands are measured per linear), so the
    fused MLPs run their own forward; the run's warnings say so rather than leaving the user to believe the MLPs were
    fused. The last step is measured too (the delayed MLP fuses only once its histories have started)."""
    import contextlib
    import io

    from fp8kit.config import load_config
    from fp8kit.train.trainer import train
    from tests.conftest import small_run_overrides

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        res = train(load_config(None, [*small_run_overrides(cache_dir), "model.preset=llama-125m", "train.steps=3",
                                       "train.mixed_precision=fp8", f"fp8.recipe={recipe}", "fp8.emulate=true",
                                       f"fp8.{recipe}_fused_mlp=true", "fp8.stats_every=1", "train.eval_every=0",
                                       "train.checkpoint_every=0", "train.final_checkpoint=false"]), tmp_path / "run")
    out = " ".join(buf.getvalue().split())
    assert f"warning: fp8.{recipe}_fused_mlp: the SwiGLU MLPs run unfused in this run: fp8.stats_every" in out, \
        out[-3000:]
    assert "SwiGLU MLPs run with the SwiGLU's FP8 casts fused" not in out, out[-3000:]  # no contradicting note
    for record in res.metrics:
        mlp = {row["layer"].rsplit(".", 1)[-1] for row in record["fp8_health"] if ".mlp." in row["layer"]}
        assert mlp == {"gate_proj", "up_proj", "down_proj"}, (record["step"], mlp)
