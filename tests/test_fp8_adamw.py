"""FP8AdamW (fp8kit.optim) against torch.optim.AdamW on small problems, on the CPU (about 20 s).

Split: tests/test_fp8_adamw_edges.py (extreme gradients, FP8 gradient accumulation, zero_grad, bytes per
parameter), tests/test_fp8_adamw_numerics.py (the first-moment drift, stochastic rounding, COAT, the
hook-free gradient path), tests/test_fp8_adamw_gpu.py (the Triton step bit for bit).

Thresholds (measured on this machine; the margin is the gap between the two):

- all states fp32 and ``grad="param"``: equal to ``torch.optim.AdamW`` (two groups, LambdaLR warmup) over
  100 steps within 1e-5 absolute (measured 1.5e-7), and with clipping inside the step (measured 4.5e-8);
- fp8kit's defaults and FP8-LM's layout (fp16 master, e5m2 grad, e4m3 m rounded to nearest, fp16 v), MLP
  regression, 100 steps, seeds 0 and 1: parameters' L2 distance to AdamW's < 15 % of AdamW's distance
  travelled (measured 4.5-5.1 % for the paper's layout, 4.7-5.4 % for the defaults), every step's loss
  within 6 % (measured <= 2.4 %), final loss within 4 % (<= 1.6 %); each other state precision: < 15 %
  (3.4-7.8 %), v = e4m3 < 30 % (11-17 %), final loss within 4 % (<= 2.1 %);
- Zipf-frequency embeddings (where per-block scales should help): < 12 % (measured 6.8-7.0 % per tensor,
  6.1-6.2 % per block), last-10-step loss within 1 % (<= 0.11 %);
- FP8-LM's 1-D quadratic (a = logspace(-4, 0, 256), 200 steps, lr 1e-2), the paper's layout: v fp16 within
  2 % of AdamW's loss (measured 0.3 %), v e4m3 per tensor > 100x worse (measured 1138x; 76 of 256 entries
  of v flushed to zero after the first step), v e4m3 per 16-element block < 2x (measured 0.81x).

Three tests pin bugs found while writing them (overflowing squared gradients, __del__ after a failed
constructor, weights written after construction); they were fixed in the source.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import sys

import pytest
import torch
from torch import nn

from fp8kit.optim import FP8AdamW, FP8AdamWPrecision
from fp8kit.train.checkpoint import MODEL_FILE, load_model_weights, save_model_weights
from tests.fp8_adamw_util import FP32, HP, PAPER, one_thread  # noqa: F401 (fixture)
from tests.fp8_adamw_util import fit as _fit
from tests.fp8_adamw_util import flat as _flat
from tests.fp8_adamw_util import groups as _groups
from tests.fp8_adamw_util import mlp as _mlp
from tests.fp8_adamw_util import regression as _regression
from tests.fp8_adamw_util import rel_dist as _rel_dist
from tests.fp8_adamw_util import state as _state
from tests.fp8_adamw_util import warmup as _warmup

pytestmark = pytest.mark.usefixtures("one_thread")


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


# -- 2. defaults and the paper's layout track AdamW --------------------------------------------------
@pytest.mark.parametrize("layout", ["defaults", "paper"])
@pytest.mark.parametrize("granularity", ["tensor", "block"])
@pytest.mark.parametrize("seed", [0, 1])
def test_paper_defaults_track_adamw(layout, granularity, seed):
    """MLP regression, 100 steps, betas (0.9, 0.95), wd 0.1 on matrices, 10-step warmup; fp8kit's defaults
    and FP8-LM's layout (e5m2 gradients, E4M3 m rounded to nearest)."""
    x, y = _regression(seed)
    ref, fp8, init = _mlp(seed), _mlp(seed), _mlp(seed)
    ref_opt = torch.optim.AdamW(_groups(ref), **HP)
    base = PAPER if layout == "paper" else FP8AdamWPrecision()
    opt = FP8AdamW(_groups(fp8), **HP, precision=dataclasses.replace(base, granularity=granularity))
    ref_loss = _fit(ref, ref_opt, _warmup(ref_opt), x, y, 100)
    loss = _fit(fp8, opt, _warmup(opt), x, y, 100)
    dist = _rel_dist(fp8, ref, init)
    gap = max(abs(a - b) / b for a, b in zip(loss, ref_loss, strict=True))
    with torch.no_grad():
        final, ref_final = ((fp8(x) - y) ** 2).mean().item(), ((ref(x) - y) ** 2).mean().item()
    final_gap = abs(final - ref_final) / ref_final
    print(
        f"{layout} per {granularity} seed {seed}: param distance {dist:.3%} of AdamW's travel, max step loss gap "
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
}
VARIANTS = [
    ("master", "fp32"),
    ("master", "bf16_sr"),
    ("grad", "e4m3"),
    ("grad", "e5m2"),
    ("m_rounding", "nearest"),
    ("m_expand", "coat"),
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
    elif field == "grad":
        assert fg.spec.grad == STORAGE[choice] and fg.grad.dtype == STORAGE[choice], fg.spec
    elif field in ("m_rounding", "m_expand"):
        assert getattr(fg.spec, field) == choice and (fg.m_k is not None) == (choice == "coat"), fg.spec
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
    than E4M3's range with one scale (448 / 2^-9 ~ 2.3e5) and less than FP16's (65504 / 2^-24 ~ 1.1e12).
    FP8-LM's layout (e5m2 gradients, m rounded to nearest): with exact gradients the E4M3 first moment
    costs more on this problem (measured: defaults +4.9 %, m rounded to nearest +16 %, fp16 m +1.3 %;
    e5m2 gradients happen to make each m store exact here: 0.5 (a x)^2 scaled twice by powers of two)."""
    x_ref, ref, _ = _quadratic(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0))
    x16, l16, _ = _quadratic(lambda p: FP8AdamW(p, lr=1e-2, weight_decay=0.0, precision=PAPER))
    x8, l8, _ = _quadratic(
        lambda p: FP8AdamW(p, lr=1e-2, weight_decay=0.0, precision=dataclasses.replace(PAPER, v="e4m3"))
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
        opt = FP8AdamW([x], lr=1e-2, weight_decay=0.0, precision=dataclasses.replace(PAPER, v=v))
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
    prec = dataclasses.replace(PAPER, v="e4m3", granularity="block", block_size=16)
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


def test_per_block_states_recast_per_tensor_at_load_within_one_rounding():
    """A one-process checkpoint (per-block scales, ``optim.granularity = auto``) resumed under FSDP2 (per tensor):
    ``adapt_full_state`` recasts each scaled state with one scale per tensor, with a warning. Every loaded value is
    the saved one rounded once to the state's format at the tensor's scale: ``|a - b| <= 2^-(mant+1) |b| +
    2^(emin-mant-1) / scale`` (half an ulp, normal or subnormal)."""
    x, y = _regression(0)
    model = _mlp(0)
    opt = FP8AdamW(_groups(model), **HP, precision=FP8AdamWPrecision(granularity="block", block_size=16))
    _fit(model, opt, _warmup(opt), x, y, 10)
    sd = opt.state_dict()
    full = {"state": sd["state"], "param_groups": sd["param_groups"]}  # the per-parameter form a reshard loads
    twin = _mlp(1)
    twin.load_state_dict(model.state_dict())
    per_tensor = FP8AdamW(_groups(twin), **HP)
    with pytest.warns(UserWarning, match="recast with per-tensor scales once, at load"):
        osd = per_tensor.adapt_full_state(sd["fp8adamw"]["precision"], full)
    per_tensor.load_state_dict(osd)
    fmt = {torch.float8_e4m3fn: (3, -6), torch.float16: (10, -14)}
    loaded = per_tensor.state_dict()["state"]
    for key, st in sd["state"].items():
        for name in ("m", "v", "master"):
            data, scale = st[name], st[f"{name}_scale"]
            nb = -(-data.numel() // 16)
            want = (torch.nn.functional.pad(data.float().reshape(-1), (0, nb * 16 - data.numel())).view(nb, 16)
                    / scale[:nb, None]).reshape(-1)[: data.numel()]
            got_data, got_scale = loaded[key][name], loaded[key][f"{name}_scale"]
            assert got_scale.dim() == 0 and got_data.dtype == data.dtype, (key, name, got_scale.shape, got_data.dtype)
            got = got_data.float().reshape(-1) / got_scale
            mant, emin = fmt[data.dtype]
            bound = 2.0 ** -(mant + 1) * want.abs() + 2.0 ** (emin - mant - 1) / got_scale + 1e-30
            worst = ((got - want).abs() / bound).max().item()
            assert worst <= 1.0 + 1e-6, f"param {key} {name}: error {worst:.3f} x half an ulp at the tensor's scale"
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="differing in v"):  # others still refused
        FP8AdamW(_groups(_mlp(0)), **HP, precision=FP8AdamWPrecision(v="fp32")).adapt_full_state(
            sd["fp8adamw"]["precision"], full)


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
        (dict(precision=FP8AdamWPrecision(m_rounding="up")), "m_rounding = 'up'"),
        (dict(precision=FP8AdamWPrecision(m_expand="log")), "m_expand = 'log'"),
        (dict(precision=FP8AdamWPrecision(m="fp32", m_expand="coat")), "m_expand = 'coat' needs a scaled m"),
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
