"""FP8AdamW's first-moment remedies and its hook-free gradient path, on the CPU.

- The drift (issue 17, item 2): a 2-layer MLP 256-512-256 regressed onto a teacher MLP (512 samples, full
  batch, lr 1e-3, no weight decay, loss toward zero). Loss = mean of the 10 steps before step 200 / 400,
  gap = loss / FP32 AdamW's - 1. Threshold |gap| < 5 % at both for the defaults (E4M3 m rounded
  stochastically), seeds 0 and 1; measured (seeds 0-3, per tensor): defaults -0.12/+0.06/-0.17/-0.16 % at
  200 and -1.18/+0.20/-0.74/+4.50 % at 400; FP8-LM's nearest rounding +8.9/+7.8/+3.6/+9.3 % and
  +8.8/+8.6/+5.8/+12.3 %; COAT's expansion with nearest rounding +2.3/+2.7/+3.1/+2.4 % and
  +1.7/+5.4/+4.1/+4.4 %; COAT + stochastic -0.4..0 % and +0.8..3.9 %; an fp16 m (nearest) -0.2..0 % and
  -0.9..+4.7 % (the noise floor of this near-zero loss at 400 steps is a few %).
- The dead band of nearest rounding, which stochastic rounding removes (a pinned mechanism demo).
- Stochastic rounding: on the grid, unbiased, deterministic (hash of step, group and index).
- COAT's exponent and round trip.
- ``grad="param"``: no hooks, gradient accumulation and ``model.zero_grad()`` in autograd's hands,
  parameters without gradients, wrong gradient dtypes; one multi-tensor step equals per-tensor steps.
- ``load_state_dict`` across gradient modes and from checkpoints written before ``m_expand`` existed.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from fp8kit.optim import FP8AdamW, FP8AdamWPrecision
from fp8kit.optim import numerics as N
from tests.fp8_adamw_util import PAPER, fit, flat, mlp, one_thread, regression, state  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


# -- the drift on a regression trained toward zero loss -------------------------------------------------
def _teacher_problem(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    def net(s: int) -> nn.Module:
        torch.manual_seed(s)
        return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))

    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(512, 256, generator=g)
    with torch.no_grad():
        y = net(seed + 7)(x)
    return net(seed), x, y


def _window_losses(make_opt, seed: int, steps: int = 400) -> dict[int, float]:
    model, x, y = _teacher_problem(seed)
    opt = make_opt(model.parameters())
    losses = []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {e: sum(losses[e - 10 : e]) / 10 for e in (200, 400)}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_first_moment_drift_is_fixed(seed):
    kw = dict(lr=1e-3, weight_decay=0.0)
    ref = _window_losses(lambda p: torch.optim.AdamW(p, **kw), seed)
    ours = _window_losses(lambda p: FP8AdamW(p, **kw), seed)
    paper = _window_losses(lambda p: FP8AdamW(p, **kw, precision=dataclasses.replace(PAPER, grad="param")), seed)
    gap = {e: ours[e] / ref[e] - 1 for e in ref}
    gap_paper = {e: paper[e] / ref[e] - 1 for e in ref}
    print(f"seed {seed}: gap vs FP32 AdamW at 200 / 400 steps: defaults {gap[200]:+.2%} / {gap[400]:+.2%}; "
          f"m rounded to nearest {gap_paper[200]:+.2%} / {gap_paper[400]:+.2%} (AdamW {ref[200]:.3g} / {ref[400]:.3g})")
    assert ref[400] < 0.2 * ref[200], f"AdamW is not training toward zero loss: {ref}"
    for e in (200, 400):
        assert abs(gap[e]) < 0.05, f"seed {seed}: FP8AdamW loss at step {e} is {gap[e]:+.2%} off FP32 AdamW's"
    assert gap_paper[200] > 0.05, f"seed {seed}: nearest rounding no longer drifts ({gap_paper[200]:+.2%}): weak test"


def test_nearest_rounding_has_a_dead_band_stochastic_does_not():
    """m <- Q(0.9 m + 0.1 g) with g = 1 and m starting at 1.25 (E4M3 ulp 0.125 at scale 1): 0.9 * 1.25 + 0.1
    = 1.225 rounds back to 1.25 forever (25 % off); stochastic rounding converges to 1 on average."""
    block, n = 16, 4096
    spec = N.StateSpec(block=block, num_tensors=1, granularity="block", grad=torch.float32,
                       m=torch.float8_e4m3fn, v=torch.float16, master=None, stochastic_rounding=False)
    owner = torch.zeros(n // block, dtype=torch.int64)
    g = torch.ones(n // block, block)
    g[:, 0] = 448.0  # each block's amax: scale exactly 1
    out = {}
    for rounding in ("nearest", "stochastic"):
        sp = dataclasses.replace(spec, m_rounding=rounding)
        m, s = torch.zeros(n, dtype=torch.float8_e4m3fn), torch.ones(n // block)
        x = torch.full((n // block, block), 1.25)
        x[:, 0] = 448.0
        for step in range(1, 61):
            N.store_m(x, m, s, None, owner, sp, N.make_hp(1e-3, 0.9, 0.999, 1e-8, 0.0, step, 0))
            x = 0.9 * N.load_m(m, s, None, owner, sp) + 0.1 * g
        out[rounding] = N.load_m(m, s, None, owner, sp)[:, 1:]
    print(f"after 60 steps toward 1.0: nearest {out['nearest'].mean():.4f}, stochastic {out['stochastic'].mean():.4f}")
    assert torch.all(out["nearest"] == 1.25), "nearest rounding left the dead band"
    assert abs(out["stochastic"].mean().item() - 1.0) < 0.01, f"stochastic mean {out['stochastic'].mean():.4f}"


# -- stochastic rounding ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float16])
def test_stochastic_rounding_is_on_the_grid_and_unbiased(dtype):
    mx = 448.0 if dtype == torch.float8_e4m3fn else 65504.0
    gen = torch.Generator().manual_seed(0)
    y = (torch.rand(512, generator=gen) * 2 - 1) * torch.logspace(math.log10(mx) - 7, math.log10(mx), 512)
    draws = torch.stack([N.round_stochastic(y, torch.rand(512, generator=gen), dtype) for _ in range(2000)])
    assert torch.equal(draws.to(dtype).float(), draws), "a rounded value is not representable"
    mant, emin = N.SR_FORMATS[dtype]
    ulp = torch.exp2((torch.frexp(y).exponent - 1).clamp(min=emin) - mant).float()
    down = torch.floor(y.abs() / ulp) * ulp * y.sign()  # the neighbour toward zero (exact: ulp is a power of 2)
    up = down + ulp * y.sign()
    assert torch.all((draws == down) | (draws == up)), "a draw is not one of the two neighbours of y"
    bias = ((draws.mean(0) - y).abs() / ulp).max().item()
    print(f"{dtype}: max |mean - y| = {bias:.3f} ulp over 2000 draws")
    assert bias < 0.06, f"{dtype}: stochastic rounding biased by {bias:.3f} ulp (4 sigma of 2000 draws: 0.045)"


def test_noise_is_a_pinned_hash_of_step_group_and_index():
    """The Triton kernel reimplements the hash: these values pin it."""
    assert [int(v) for v in N.hash32(torch.tensor([0, 1, 2, 12345, 0xFFFFFFFF]))] == [
        0, 774041739, 1548083479, 4118015818, 3246642785]
    hp = N.make_hp(1e-3, 0.9, 0.999, 1e-8, 0.0, 7, 1)
    u = N.uniform_noise(64, 128, hp)
    assert torch.equal(u, N.uniform_noise(64, 128, hp))
    assert not torch.equal(u, N.uniform_noise(64, 128, N.make_hp(1e-3, 0.9, 0.999, 1e-8, 0.0, 8, 1)))
    assert not torch.equal(u, N.uniform_noise(64, 128, N.make_hp(1e-3, 0.9, 0.999, 1e-8, 0.0, 7, 0)))
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.01, (u.min(), u.max(), u.mean())


# -- COAT's dynamic range expansion -------------------------------------------------------------------
def test_coat_k_and_round_trip():
    """k = floor(16 log2(448^2/2) / log2(amax/amin)) / 16: 2.0625 for a range of 2^8. A narrow-range block
    (k > 1) round-trips with less error than plain E4M3, a wide one (k < 1) keeps its small values."""
    assert N.coat_k(torch.tensor([256.0]), torch.tensor([1.0])).item() == 2.0625
    spec = N.StateSpec(block=128, num_tensors=1, granularity="block", grad=torch.float32, m=torch.float8_e4m3fn,
                       v=torch.float16, master=None, stochastic_rounding=False)
    owner = torch.zeros(2, dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    narrow = torch.rand(128, generator=gen) * 3 + 1  # [1, 4]: k ~ 8 (clamped)
    wide = torch.logspace(-12, 0, 128) * torch.sign(torch.randn(128, generator=gen))  # 12 decades: k ~ 0.4
    x = torch.stack([narrow, wide])
    errs = {}
    for expand in ("none", "coat"):
        sp = dataclasses.replace(spec, m_expand=expand)
        m, s = torch.zeros(256, dtype=torch.float8_e4m3fn), torch.ones(2)
        k = torch.ones(2) if expand == "coat" else None
        N.store_m(x, m, s, k, owner, sp, N.make_hp(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 0))
        back = N.load_m(m, s, k, owner, sp)
        rel = ((back - x).abs() / x.abs())
        errs[expand] = (rel[0].max().item(), int((back[1] == 0).sum()))
    print(f"narrow block max rel error / wide block values flushed to 0: {errs}")
    assert errs["coat"][0] < errs["none"][0] / 4, errs
    assert errs["coat"][1] == 0 and errs["none"][1] > 40, errs


# -- grad = "param": autograd's gradients, no hooks -----------------------------------------------------
def test_param_grads_need_no_hooks_and_follow_autograd():
    """Gradient accumulation over two backward passes, ``model.zero_grad()`` and a parameter without a
    gradient: the step reads exactly what autograd left in ``param.grad`` (zero where there is none)."""
    x, y = regression(0, n=64)
    a, b = mlp(0), mlp(0)
    opt_a, opt_b = FP8AdamW(a.parameters(), lr=1e-2), FP8AdamW(b.parameters(), lr=1e-2)
    assert opt_a._hooks == [] and opt_a.precision.grad == "param"
    for i in (0, 1):
        ((a(x[i * 32 : (i + 1) * 32]) - y[i * 32 : (i + 1) * 32]) ** 2).mean().backward()
    assert all(p.grad is not None for p in a.parameters())
    grads = [p.grad.clone() for p in a.parameters()]
    for p, g in zip(b.parameters(), grads, strict=True):
        p.grad = g.clone()
    list(a.parameters())[-1].grad = None  # the output bias gets no gradient this step
    list(b.parameters())[-1].grad = torch.zeros_like(grads[-1])
    opt_a.step()
    opt_b.step()
    assert torch.equal(flat(a), flat(b)), f"max diff {(flat(a) - flat(b)).abs().max():.2e}"
    a.zero_grad()  # the framework's own zero_grad (set_to_none): the next backward allocates afresh
    b.zero_grad()
    fit(a, opt_a, None, x, y, 3)
    fit(b, opt_b, None, x, y, 3)
    assert torch.equal(flat(a), flat(b))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_param_grad_of_another_dtype_is_refused():
    model = nn.Linear(8, 4)
    opt = FP8AdamW(model.parameters())
    if hasattr(model.weight, "grad_dtype"):  # torch >= 2.12 checks gradient dtypes at assignment unless told not to
        model.weight.grad_dtype = None
    model.weight.grad = torch.zeros(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"parameter 0 of shape \(4, 8\) \(torch.float32\) has a gradient of .*float64"):
        opt.step()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_one_multi_tensor_step_equals_per_tensor_steps(rounding):
    """One flat group over all parameters against one optimizer per parameter (per-tensor scales: the
    same math). Rounded to nearest: bit for bit. Stochastically: other random numbers (the flat index
    differs), so the trajectories differ by the rounding noise only (measured 5.0 % of the distance
    travelled after 20 steps at lr 3e-3, as much as FP8 states move away from AdamW; threshold 10 %)."""
    x, y = regression(0)
    fused, unfused, init = mlp(0), mlp(0), mlp(0)
    prec = FP8AdamWPrecision(m_rounding=rounding)
    opt = FP8AdamW(fused.parameters(), lr=3e-3, precision=prec)
    opts = [FP8AdamW([p], lr=3e-3, precision=prec) for p in unfused.parameters()]

    class _All:
        def step(self):
            for o in opts:
                o.step()

        def zero_grad(self):
            for o in opts:
                o.zero_grad()

    fit(fused, opt, None, x, y, 20)
    fit(unfused, _All(), None, x, y, 20)
    dist = ((flat(fused) - flat(unfused)).norm() / (flat(unfused) - flat(init)).norm()).item()
    print(f"m {rounding}: one flat step vs per-tensor steps, distance {dist:.3%} of the distance travelled")
    if rounding == "nearest":
        assert dist == 0.0, f"multi-tensor step differs from per-tensor steps: {dist:.2e}"
    else:
        assert dist < 0.1, f"multi-tensor step {dist:.3%} away from per-tensor steps"


# -- state_dict across versions and modes -------------------------------------------------------------
def test_load_state_dict_across_grad_modes_and_older_checkpoints():
    x, y = regression(0)
    model = mlp(0)
    opt = FP8AdamW(model.parameters(), lr=1e-3, precision=PAPER)
    fit(model, opt, None, x, y, 3)
    sd = opt.state_dict()
    FP8AdamW(mlp(0).parameters(), lr=1e-3).load_state_dict(sd)  # e5m2/nearest -> param/stochastic: same states
    old = {**sd, "fp8adamw": {**sd["fp8adamw"], "precision": dict(sd["fp8adamw"]["precision"])}}
    for key in ("m_rounding", "m_expand"):  # written before these fields existed
        del old["fp8adamw"]["precision"][key]
    twin = FP8AdamW(mlp(0).parameters(), lr=1e-3, precision=PAPER)
    twin.load_state_dict(old)
    assert torch.equal(state(twin, "m"), state(opt, "m"))
    coat = FP8AdamW(mlp(0).parameters(), lr=1e-3, precision=FP8AdamWPrecision(m_expand="coat"))
    with pytest.raises(ValueError, match="differing in m_expand"):
        coat.load_state_dict(sd)


def test_coat_state_round_trips_bit_exact():
    x, y = regression(0)
    prec = FP8AdamWPrecision(m_expand="coat", granularity="block")
    a, b = mlp(0), mlp(1)
    opt_a = FP8AdamW(a.parameters(), lr=1e-3, precision=prec)
    fit(a, opt_a, None, x, y, 5)
    b.load_state_dict(a.state_dict())
    opt_b = FP8AdamW(b.parameters(), lr=1e-3, precision=prec)
    sd = opt_a.state_dict()
    assert all(g["m_k"] is not None and g["m_k"].numel() == opt_a._flat[0].layout.num_blocks for g in sd["flat"][:1])
    opt_b.load_state_dict(sd)
    assert fit(a, opt_a, None, x, y, 5, start=5) == fit(b, opt_b, None, x, y, 5, start=5)
    assert torch.equal(flat(a), flat(b))
