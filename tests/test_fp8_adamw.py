"""FP8AdamW (fp8kit.optim) against torch.optim.AdamW on small problems, on the CPU (about 15 s).

Thresholds (measured on this machine; the margin is the gap between the two):

- all states fp32 and ``grad="param"``: equal to ``torch.optim.AdamW`` (two groups, LambdaLR warmup) over
  100 steps within 1e-5 absolute (measured 1.5e-7), and with clipping inside the step (measured 4.5e-8);
- paper defaults (fp16 master, e5m2 grad, e4m3 m, fp16 v), MLP regression, 100 steps, seeds 0 and 1:
  parameters' L2 distance to AdamW's < 15 % of AdamW's distance travelled (measured 4.4-5.1 % per tensor,
  4.6 % per block), every step's loss within 6 % (measured <= 2.9 %), final loss within 4 % (<= 1.7 %);
  each other state precision: < 15 % (3.4-7.8 %), v = e4m3 < 30 % (11-17 %), final loss within 4 % (<= 2.1 %);
- Zipf-frequency embeddings (where per-block scales should help): < 12 % (measured 6.8-7.0 % per tensor,
  6.1-6.2 % per block), last-10-step loss within 1 % (<= 0.11 %);
- FP8-LM's 1-D quadratic (a = logspace(-4, 0, 256), 200 steps, lr 1e-2): v fp16 within 2 % of AdamW's
  loss (measured 0.3 %), v e4m3 per tensor > 100x worse (measured 1138x; 76 of 256 entries of v flushed to
  zero after the first step), v e4m3 per 16-element block < 2x (measured 0.81x);
- E5M2 gradients: < 10 % relative L2 error against the exact gradient for one backward and for two
  accumulated micro-batches (measured 4.8 % and 6.5 %), < 12 % between the two (7.3 %).

Three tests pin bugs found while writing them (overflowing squared gradients, __del__ after a failed
constructor, weights written after construction); they were fixed in the source.
"""

from __future__ import annotations

import copy
import gc
import sys

import pytest
import torch
from torch import nn

from fp8kit.optim import FP8AdamW, FP8AdamWPrecision, training_state_bytes
from fp8kit.optim.numerics import load
from fp8kit.train.checkpoint import MODEL_FILE, load_model_weights, save_model_weights

FP32 = FP8AdamWPrecision(master="fp32", grad="param", m="fp32", v="fp32")
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tensors of a few thousand elements: intra-op threads only add synchronisation (and stall when
    another job shares the two cores), so this module runs single-threaded and restores the setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- helpers -------------------------------------------------------------------------------------------
def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def _groups(model: nn.Module, wd: float = 0.1) -> list[dict]:
    """Two groups as the trainer builds them: weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def _regression(seed: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 1, generator=g)
    return x, torch.sin(x @ w) + 0.1 * torch.randn(n, 1, generator=g)


def _warmup(opt) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))


def _fit(model, opt, sched, x, y, steps: int, start: int = 0, batch: int = 32) -> list[float]:
    losses = []
    for s in range(start, start + steps):
        i = torch.arange(s * batch, (s + 1) * batch) % len(x)
        loss = ((model(x[i]) - y[i]) ** 2).mean()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def _rel_dist(model, ref, init) -> float:
    """L2 distance to the reference parameters over the reference's L2 distance travelled."""
    a, b, c = _flat(model), _flat(ref), _flat(init)
    return ((a - b).norm() / (b - c).norm()).item()


def _state(opt: FP8AdamW, name: str, gi: int = 0) -> torch.Tensor:
    """Dequantized float32 flat state ``name`` (``grad``, ``m``, ``v``, ``master``) of group ``gi``."""
    fg = opt._flat[gi]
    return load(getattr(fg, name), getattr(fg, f"{name}_scale"), fg.layout.block_owner, fg.spec).reshape(-1)


# -- 1. exactness with fp32 states --------------------------------------------------------------------
def test_fp32_states_equal_torch_adamw():
    x, y = _regression(0)
    ref, fp8 = _mlp(0), _mlp(0)
    ref_opt = torch.optim.AdamW(_groups(ref), **HP)
    opt = FP8AdamW(_groups(fp8), **HP, precision=FP32)
    ref_sched, sched = _warmup(ref_opt), _warmup(opt)
    ref_loss = _fit(ref, ref_opt, ref_sched, x, y, 100)
    loss = _fit(fp8, opt, sched, x, y, 100)
    diff = max((a - b).abs().max().item() for a, b in zip(fp8.parameters(), ref.parameters(), strict=True))
    print(f"fp32 states vs torch AdamW, 100 steps: max |param diff| = {diff:.2e}")
    assert diff < 1e-5, f"max |param diff| {diff:.2e} >= 1e-5"
    assert max(abs(a - b) for a, b in zip(loss, ref_loss, strict=True)) < 1e-4
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_clip_inside_the_step_equals_torch_clip_grad_norm():
    """``clip_grad_norm_`` (the coefficient applied inside the step) against ``torch.nn.utils.clip_grad_norm_``
    + AdamW, all states fp32, clipping active on every step (every norm is above max_norm = 0.1)."""
    x, y = _regression(0)
    ref, fp8 = _mlp(0), _mlp(0)
    ref_opt, opt = torch.optim.AdamW(_groups(ref), **HP), FP8AdamW(_groups(fp8), **HP, precision=FP32)
    for s in range(20):
        i = torch.arange(s * 32, (s + 1) * 32) % len(x)
        for m in (ref, fp8):
            ((m(x[i]) - y[i]) ** 2).mean().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 0.1)
        norm = opt.clip_grad_norm_(0.1)
        assert abs(norm.item() - ref_norm.item()) < 1e-5 * ref_norm.item(), (s, norm.item(), ref_norm.item())
        assert ref_norm.item() > 0.1  # the test clips
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in zip(fp8.parameters(), ref.parameters(), strict=True))
    print(f"clipped, 20 steps: max |param diff| = {diff:.2e}")
    assert diff < 1e-5, f"max |param diff| {diff:.2e} >= 1e-5"


# -- 2. paper defaults track AdamW --------------------------------------------------------------------
@pytest.mark.parametrize("granularity", ["tensor", "block"])
@pytest.mark.parametrize("seed", [0, 1])
def test_paper_defaults_track_adamw(granularity, seed):
    """MLP regression, 100 steps, betas (0.9, 0.95), wd 0.1 on matrices, 10-step warmup."""
    x, y = _regression(seed)
    ref, fp8, init = _mlp(seed), _mlp(seed), _mlp(seed)
    ref_opt = torch.optim.AdamW(_groups(ref), **HP)
    opt = FP8AdamW(_groups(fp8), **HP, precision=FP8AdamWPrecision(granularity=granularity))
    ref_loss = _fit(ref, ref_opt, _warmup(ref_opt), x, y, 100)
    loss = _fit(fp8, opt, _warmup(opt), x, y, 100)
    dist = _rel_dist(fp8, ref, init)
    gap = max(abs(a - b) / b for a, b in zip(loss, ref_loss, strict=True))
    with torch.no_grad():
        final, ref_final = ((fp8(x) - y) ** 2).mean().item(), ((ref(x) - y) ** 2).mean().item()
    final_gap = abs(final - ref_final) / ref_final
    print(
        f"per {granularity} seed {seed}: param distance {dist:.3%} of AdamW's travel, max step loss gap "
        f"{gap:.2%}, final loss {final:.5f} vs {ref_final:.5f} ({final_gap:.2%})"
    )
    assert ref_loss[-1] < 0.3 * ref_loss[0], "the reference did not learn"  # sanity: a real trajectory
    assert dist < 0.15, f"per {granularity}: parameter distance {dist:.3%} of AdamW's travel >= 15%"
    assert gap < 0.06, f"per {granularity}: a step's loss differs {gap:.2%} from AdamW's (>= 6%)"
    assert final_gap < 0.04, (
        f"per {granularity}: final loss {final:.5f} vs AdamW {ref_final:.5f} ({final_gap:.2%})"
    )


STORAGE = {
    "fp16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "bf16_sr": torch.bfloat16,
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "param": torch.float32,
}
VARIANTS = [
    ("master", "fp32"),
    ("master", "bf16_sr"),
    ("grad", "e4m3"),
    ("grad", "param"),
    ("m", "fp16"),
    ("m", "bf16"),
    ("m", "fp32"),
    ("v", "e4m3"),
    ("v", "fp32"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32_params", "bf16_params"])
@pytest.mark.parametrize("field, choice", VARIANTS, ids=[f"{f}={c}" for f, c in VARIANTS])
def test_each_precision_choice_tracks_adamw(field, choice, dtype):
    """Every selectable state precision (one changed from the defaults) stores its state in that dtype and
    tracks fp32 AdamW on the MLP problem (measured: distance 3.4-7.8 % of AdamW's travel, 11-17 % for
    v = e4m3; final loss within 2.1 %)."""
    x, y = _regression(0)
    ref, init = _mlp(0), _mlp(0)
    ref_opt = torch.optim.AdamW(_groups(ref), **HP)
    _fit(ref, ref_opt, _warmup(ref_opt), x, y, 100)
    model = _mlp(0).to(dtype)
    opt = FP8AdamW(_groups(model), **HP, precision=FP8AdamWPrecision(**{field: choice}))
    fg = opt._flat[0]
    if field == "master" and choice == "bf16_sr" and dtype == torch.bfloat16:
        assert fg.master is None  # the bf16 working weights are the master
    else:
        assert getattr(fg, field).dtype == STORAGE[choice], f"{field} stored as {getattr(fg, field).dtype}"
    _fit(model, opt, _warmup(opt), x.to(dtype), y.to(dtype), 100)
    with torch.no_grad():
        final = ((model(x.to(dtype)) - y.to(dtype)) ** 2).float().mean().item()
        ref_final = ((ref(x) - y) ** 2).mean().item()
    dist, gap = _rel_dist(model, ref, init), abs(final / ref_final - 1)
    print(f"{field}={choice} {dtype}: distance {dist:.3%}, final loss gap {gap:.2%}")
    limit = 0.3 if field == "v" and choice == "e4m3" else 0.15
    assert dist < limit, f"{field}={choice}: parameter distance {dist:.3%} of AdamW's travel >= {limit:.0%}"
    assert gap < 0.04, f"{field}={choice}: final loss {final:.5f} vs AdamW {ref_final:.5f} ({gap:.2%} >= 4%)"


def test_bf16_stochastic_rounding_is_unbiased():
    from fp8kit.optim.numerics import round_to_bf16_stochastic

    torch.manual_seed(0)
    x = torch.full((200_000,), 1 + 2**-10)  # an eighth of the way from bf16 1.0 to 1.0078125
    r = round_to_bf16_stochastic(x).float()
    frac_up = (r > 1).float().mean().item()
    assert set(r.unique().tolist()) == {1.0, 1 + 2**-7}
    assert abs(frac_up - 0.125) < 0.005, f"rounded up {frac_up:.4f} of the time, want 0.125"
    assert abs(r.mean().item() - x[0].item()) < 2e-5


def _zipf_model(seed: int) -> nn.ModuleDict:
    torch.manual_seed(seed)
    return nn.ModuleDict({"emb": nn.Embedding(512, 128), "out": nn.Linear(128, 16)})


def _zipf_fit(model, opt, seed: int, steps: int = 100) -> list[float]:
    """Bag-of-embeddings classification with Zipf token frequencies: rows of the embedding see gradients
    of very different sizes, the case where one scale per tensor wastes FP8 range."""
    g = torch.Generator().manual_seed(seed)
    p = 1.0 / torch.arange(1, 513).float() ** 1.1
    toks = torch.multinomial(p / p.sum(), 4096 * 8, replacement=True, generator=g).view(4096, 8)
    label = torch.randint(0, 16, (512,), generator=g)[toks[:, 0]]
    losses = []
    for s in range(steps):
        i = torch.arange(s * 64, (s + 1) * 64) % len(toks)
        loss = nn.functional.cross_entropy(model["out"](model["emb"](toks[i]).mean(1)), label[i])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_block_vs_tensor_granularity_on_zipf_embeddings():
    """Measure per-tensor against per-block scales (both must track AdamW; which is better is printed)."""
    out = {}
    for seed in (0, 1):
        ref, init = _zipf_model(seed), _zipf_model(seed)
        ref_loss = _zipf_fit(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0), seed)
        for gran in ("tensor", "block"):
            m = _zipf_model(seed)
            opt = FP8AdamW(
                m.parameters(), lr=1e-2, weight_decay=0.0, precision=FP8AdamWPrecision(granularity=gran)
            )
            loss = _zipf_fit(m, opt, seed)
            tail = sum(loss[-10:]) / sum(ref_loss[-10:]) - 1
            out[gran, seed] = (_rel_dist(m, ref, init), tail)
    print(
        "Zipf embeddings, distance to AdamW / last-10 loss gap: "
        + ", ".join(f"{g} seed {s}: {d:.3%} / {t:+.3%}" for (g, s), (d, t) in out.items())
    )
    for (gran, seed), (dist, tail) in out.items():
        assert dist < 0.12, f"per {gran} seed {seed}: distance {dist:.3%} of AdamW's travel >= 12%"
        assert abs(tail) < 0.01, f"per {gran} seed {seed}: last-10 loss gap {tail:+.3%} (>= 1%)"


# -- 3. the paper's reason for an FP16 second moment --------------------------------------------------
A = torch.logspace(-4, 0, 256)


def _quadratic(make, steps: int = 200) -> tuple[torch.Tensor, float, torch.optim.Optimizer]:
    x = nn.Parameter(torch.ones(256))
    opt = make([x])
    for _ in range(steps):
        (0.5 * (A * x * x).sum()).backward()
        opt.step()
        opt.zero_grad()
    return x.detach(), (0.5 * (A * x * x).sum()).item(), opt


def test_quadratic_v_e4m3_underflows_fp16_does_not():
    """loss = 0.5 sum a_i x_i^2, a = logspace(-4, 0, 256): v_i ~ (1 - beta2) a_i^2 spans 8 decades, more
    than E4M3's range with one scale (448 / 2^-9 ~ 2.3e5) and less than FP16's (65504 / 2^-24 ~ 1.1e12)."""
    x_ref, ref, _ = _quadratic(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0))
    x16, l16, _ = _quadratic(lambda p: FP8AdamW(p, lr=1e-2, weight_decay=0.0))
    x8, l8, _ = _quadratic(
        lambda p: FP8AdamW(p, lr=1e-2, weight_decay=0.0, precision=FP8AdamWPrecision(v="e4m3"))
    )
    dev16 = (x16 - x_ref).abs().max().item()
    print(
        f"quadratic, 200 steps: AdamW {ref:.5f}, v fp16 {l16:.5f} (max |x - x_ref| {dev16:.1e}), "
        f"v e4m3 {l8:.4f} ({l8 / ref:.0f}x)"
    )
    assert abs(l16 - ref) < 0.02 * ref, f"v fp16: loss {l16:.5f} vs AdamW {ref:.5f} (> 2%)"
    assert dev16 < 1e-3, f"v fp16: max |x - x_ref| = {dev16:.1e}"
    assert l8 > 100 * ref, f"v e4m3: loss {l8:.5f} is not > 100x AdamW's {ref:.5f}"

    # the mechanism, after one step: small v_i are flushed to 0 in E4M3 but kept in FP16
    flushed = {}
    for v in ("e4m3", "fp16"):
        x = nn.Parameter(torch.ones(256))
        opt = FP8AdamW([x], lr=1e-2, weight_decay=0.0, precision=FP8AdamWPrecision(v=v))
        (0.5 * (A * x * x).sum()).backward()
        opt.step()
        v_ref = (1 - 0.999) * A * A  # fp32 AdamW's v after one step (g = a * x with x = 1)
        flushed[v] = int(((_state(opt, "v")[:256] == 0) & (v_ref > 0)).sum())
    print(f"entries of v flushed to zero after one step: {flushed}")
    # expected about 75: the a_i < 1.5e-3, whose v_i * scale = 448 (a_i / a_max)^2 is below 2^-10, half of
    # E4M3's smallest subnormal
    assert flushed["e4m3"] >= 50, f"v e4m3: only {flushed['e4m3']} of 256 entries of v flushed to 0"
    assert flushed["fp16"] == 0, f"v fp16: {flushed['fp16']} entries of v flushed to 0"


def test_quadratic_v_e4m3_per_block_is_rescued():
    """One scale per 16 elements brings E4M3's range back (each block spans a quarter decade of a)."""
    _, ref, _ = _quadratic(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0))
    prec = FP8AdamWPrecision(v="e4m3", granularity="block", block_size=16)
    _, loss, _ = _quadratic(lambda p: FP8AdamW(p, lr=1e-2, weight_decay=0.0, precision=prec))
    print(f"quadratic, v e4m3 per 16-block: {loss:.5f} vs AdamW {ref:.5f}")
    assert loss < 2 * ref, f"v e4m3 per block: {loss:.5f} vs AdamW {ref:.5f}"


# -- 4. state_dict ------------------------------------------------------------------------------------
def test_state_dict_round_trip_is_bit_exact(tmp_path):
    x, y = _regression(0)
    model = _mlp(0)
    opt = FP8AdamW(_groups(model), **HP)
    sched = _warmup(opt)
    _fit(model, opt, sched, x, y, 10)
    torch.save({"opt": opt.state_dict(), "sched": sched.state_dict()}, tmp_path / "opt.pt")
    sd = torch.load(tmp_path / "opt.pt", weights_only=True)
    assert sd["opt"]["fp8adamw"]["step"] == 10
    for g, flat in enumerate(sd["opt"]["flat"]):
        for name in ("master", "master_scale", "m", "m_scale", "v", "v_scale"):
            assert flat[name] is not None, f"group {g}: {name} not saved"
        assert flat["m"].dtype == torch.float8_e4m3fn and flat["v"].dtype == torch.float16
        assert torch.isfinite(flat["m_scale"]).all() and (flat["m_scale"] > 0).all()

    twin = _mlp(1)  # other initial weights: everything must come from the copies below
    twin.load_state_dict(model.state_dict())
    twin_opt = FP8AdamW(_groups(twin), **HP)
    twin_sched = _warmup(twin_opt)
    twin_opt.load_state_dict(sd["opt"])
    twin_sched.load_state_dict(sd["sched"])
    for a, b in zip(opt._flat, twin_opt._flat, strict=True):
        for name, buf in a.buffers().items():
            assert torch.equal(buf, b.buffers()[name]), f"{name} differs after load_state_dict"

    la = _fit(model, opt, sched, x, y, 10, start=10)
    lb = _fit(twin, twin_opt, twin_sched, x, y, 10, start=10)
    assert la == lb, f"losses after resume differ: {la} vs {lb}"
    for (n, a), b in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b), f"{n}: max diff {(a - b).abs().max().item():.2e} after 10 more steps"


def test_load_state_dict_refuses_other_precision_and_torch_adamw():
    model = _mlp(0)
    opt = FP8AdamW(model.parameters(), lr=1e-3)
    sd = opt.state_dict()
    other = FP8AdamW(_mlp(0).parameters(), lr=1e-3, precision=FP8AdamWPrecision(v="fp32"))
    with pytest.raises(ValueError, match="precision") as e:
        other.load_state_dict(sd)
    assert "'v': 'fp16'" in str(e.value) and "'v': 'fp32'" in str(e.value), str(e.value)
    torch_sd = torch.optim.AdamW(_mlp(0).parameters()).state_dict()
    with pytest.raises(ValueError, match="not an FP8AdamW state"):
        opt.load_state_dict(torch_sd)
    two_groups = FP8AdamW(_groups(_mlp(0)), lr=1e-3)
    with pytest.raises(ValueError, match="groups"):
        two_groups.load_state_dict(sd)


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


def test_huge_gradients_give_lr_sized_updates():
    """g ~ 1e15: FP8 scales take it (scale ~ 1e-11); AdamW normalizes, so every step moves lr * sign(g)."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(300, generator=gen) * 1e15
    w0 = torch.randn(300, generator=gen) * 0.1
    d, opt = _five_steps(KW, g, w0, fp8=True)
    d_ref, _ = _five_steps(KW, g, w0, fp8=False)
    err = (d - d_ref).abs().max().item()
    print(f"g = 1e15 * randn: |update| <= {d_ref.abs().max().item():.3f}, max |FP8AdamW - AdamW| {err:.1e}")
    _assert_finite_state(opt)
    assert torch.equal(torch.sign(d), torch.sign(d_ref))
    assert err < 0.02 * d_ref.abs().max().item(), f"g = 1e15: deviation {err:.1e} >= 2% of the update"


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
    opt_a, opt_s = FP8AdamW(accum.parameters(), lr=1e-3), FP8AdamW(single.parameters(), lr=1e-3)
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
    opt = FP8AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, precision=FP8AdamWPrecision(master="fp32"))
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


# -- 8. bad input -------------------------------------------------------------------------------------
# a failed FP8AdamW.__init__ makes __del__ raise (see test_failed_construction_leaves_no_unraisable_error)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(precision=FP8AdamWPrecision(master="fp8")), "master = 'fp8'"),
        (dict(precision=FP8AdamWPrecision(grad="e3m4")), "grad = 'e3m4'"),
        (dict(precision=FP8AdamWPrecision(m="e5m2")), "m = 'e5m2'"),
        (dict(precision=FP8AdamWPrecision(v="bf16")), "v = 'bf16'"),
        (dict(precision=FP8AdamWPrecision(granularity="row")), "granularity = 'row'"),
        (dict(precision=FP8AdamWPrecision(block_size=100)), "block_size = 100"),
        (dict(precision=FP8AdamWPrecision(block_size=0)), "block_size = 0"),
        (dict(precision=FP8AdamWPrecision(amax_eps=0.0)), "amax_eps"),
        (dict(lr=-1e-3), "lr = -0.001"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(betas=(-0.1, 0.999)), "betas"),
        (dict(eps=0.0), "eps = 0.0"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FP8AdamW(nn.Linear(4, 4).parameters(), **kwargs)


# a failed FP8AdamW.__init__ makes __del__ raise (see test_failed_construction_leaves_no_unraisable_error)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_bad_parameters():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="mixes devices/dtypes"):
        FP8AdamW([*a.parameters(), *b.parameters()])
    frozen = nn.Linear(4, 4)
    frozen.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="do not require grad"):
        FP8AdamW(frozen.parameters())
    with pytest.raises(ValueError, match="more than one"):
        FP8AdamW([{"params": [a.weight]}, {"params": [a.weight]}])
    with pytest.raises(ValueError, match="param group 1 is empty"):
        FP8AdamW([{"params": list(a.parameters())}, {"params": []}])
    FP8AdamW([{"params": a.parameters()}, {"params": b.parameters()}])  # one dtype per group is fine


def test_replaced_parameter_data_is_refused_at_step():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8))
    opt = FP8AdamW(model.parameters(), lr=1e-3)
    opt._flat[0].check_views()
    model[1].weight.data = model[1].weight.data.clone()
    model(torch.randn(2, 32)).sum().backward()
    with pytest.raises(RuntimeError, match=r"parameter 2 of shape \(8, 64\) no longer views"):
        opt.step()


def test_failed_construction_leaves_no_unraisable_error(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    with pytest.raises(ValueError):
        FP8AdamW(nn.Linear(4, 4).parameters(), lr=-1.0)
    gc.collect()
    assert not seen, f"__del__ of a half-built FP8AdamW raised: {seen[0].exc_value!r}"


# -- 9. bytes per parameter ---------------------------------------------------------------------------
def _model128(dtype: torch.dtype) -> nn.Module:
    """Every parameter numel a multiple of 128 and 776 blocks of 128 in all, a multiple of the layout's
    8-block alignment: no padding in the flat buffers."""
    return nn.Sequential(nn.Linear(128, 256), nn.LayerNorm(256), nn.Linear(256, 256)).to(dtype)


def test_bytes_per_param():
    bf16 = _model128(torch.bfloat16)
    opt = FP8AdamW(bf16.parameters())
    n = sum(p.numel() for p in bf16.parameters())
    assert opt._flat[0].layout.total == n, f"the test model is padded: {opt._flat[0].layout.total} for {n}"
    b = training_state_bytes(list(bf16.parameters()), opt)
    print(f"default over bf16: {b}")
    for role, want in (("master", 2), ("grad", 1), ("m", 1), ("v", 2), ("working", 2)):
        assert abs(b[role] - want) < 0.01, f"{role}: {b[role]:.4f} B/param, want {want}"
    assert abs(b["state"] - 6) < 0.01 and abs(b["total"] - 8) < 0.01, (
        f"state {b['state']:.4f}, total {b['total']:.4f}"
    )

    fp32 = _model128(torch.float32)
    b = training_state_bytes(list(fp32.parameters()), FP8AdamW(fp32.parameters()))
    assert abs(b["state"] - 6) < 0.01 and abs(b["total"] - 10) < 0.01, f"over fp32: {b}"

    sr = _model128(torch.bfloat16)
    b = training_state_bytes(
        list(sr.parameters()), FP8AdamW(sr.parameters(), precision=FP8AdamWPrecision(master="bf16_sr"))
    )
    assert abs(b["master"] - 2) < 0.01 and b["working"] == 0 and abs(b["total"] - 6) < 0.01, f"bf16_sr: {b}"

    block = _model128(torch.bfloat16)
    prec = FP8AdamWPrecision(granularity="block", block_size=128)
    b = training_state_bytes(list(block.parameters()), FP8AdamW(block.parameters(), precision=prec))
    # one float32 scale per 128 elements on each of master, grad, m, v: 4 * 4 / 128 = 0.125
    assert abs(b["state"] - 6.125) < 0.001, f"per block: {b}"

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
    assert total >= 384 and abs(b["state"] - 6 * total / 300) < 0.1, f"padding not charged: {total}, {b}"


# -- 10. the trainer's checkpoint helper --------------------------------------------------------------
def test_checkpoint_helper_with_flat_views(tmp_path):
    x, y = _regression(0)
    model = _mlp(0)
    opt = FP8AdamW(_groups(model), **HP)
    _fit(model, opt, None, x, y, 5)
    save_model_weights(model, tmp_path / MODEL_FILE)

    other = _mlp(1)
    other_opt = FP8AdamW(_groups(other), **HP)
    load_model_weights(tmp_path, other)
    for fg in other_opt._flat:
        fg.check_views()  # loading copied into the views, the parameters still alias the flat buffer
    for (n, a), b in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b), n

    other_opt.load_state_dict(opt.state_dict())
    la = _fit(model, opt, None, x, y, 3, start=5)
    lb = _fit(other, other_opt, None, x, y, 3, start=5)
    assert la == lb, f"{la} vs {lb}"


def test_tied_weights_round_trip_through_checkpoint_helper(tmp_path):
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64, bias=False))
    model[1].weight = model[0].weight  # tied, as embed_tokens / lm_head
    opt = FP8AdamW(model.parameters(), lr=1e-2)
    assert len(opt._flat[0].params) == 1
    model(torch.arange(8)).sum().backward()
    opt.step()
    save_model_weights(model, tmp_path / MODEL_FILE)
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        fresh[0].weight.zero_()
    load_model_weights(tmp_path, fresh)
    assert torch.equal(fresh[0].weight, model[0].weight) and fresh[1].weight is fresh[0].weight


def test_weights_loaded_after_construction_are_the_ones_stepped(tmp_path):
    """Loading weights in place (load_model_weights, load_state_dict, nn.init) after FP8AdamW was built
    keeps the views (check_views passes) but the next step starts from the old master copy."""
    src = _mlp(0)
    save_model_weights(src, tmp_path / MODEL_FILE)
    model = _mlp(1)
    opt = FP8AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, precision=FP8AdamWPrecision(master="fp32"))
    load_model_weights(tmp_path, model)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    drift = (_flat(model) - _flat(src)).abs().max().item()
    assert drift < 2e-3, f"after one step (lr 1e-3) the weights are {drift:.2f} away from the loaded ones"
