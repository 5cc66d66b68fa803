"""The delayed recipe's weight cast once per optimizer step (``DelayedScaling.cache_weights``,
``fp8kit.fp8.delayed_weight_cache``): the weight scale held for the step, one cast per weight version and step, the
same bits as casting every micro-batch at that scale, eager and compiled, and the run-level wiring (``train.grad_accum``)
with an exact resume. CPU: the op's reference path (the Triton cast is ``fp8kit::cast_transpose``'s, tested bit for bit
in ``tests/test_cast_transpose_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8kit.fp8.delayed import DelayedScaling, DelayedScalingState, Float8DelayedLinear
from fp8kit.fp8.delayed_weight_cache import CACHE
from fp8kit.fp8.weight_cache import clear_weight_caches

STEPS, MICRO = 3, 3
#: the CPU (the reference cast, what CI runs) and a GPU (the Triton cast; marker ``gpu``)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def _make(cache: bool, device: str = "cpu"):
    torch.manual_seed(0)
    state = DelayedScalingState(DelayedScaling(amax_history_len=4, cache_weights=cache))
    lin = Float8DelayedLinear.from_linear(nn.Linear(64, 96, bias=False), state, "l").bfloat16().to(device)
    return lin, state


def _run(lin, state, fn=None, clear_each_forward=False, change_weight_at=None, evaluate=False):
    """STEPS optimizer steps (SGD) of MICRO micro-batches; per micro-batch: output, input grad, the weight's grad so
    far, the history after the forward's roll. ``clear_each_forward``: drop the cache before every forward (every
    micro-batch casts its weight anew); ``change_weight_at``: (step, micro) before whose forward the weight is scaled
    in place (an update outside the optimizer); ``evaluate``: a forward without grad after each optimizer step (it
    casts the new weights at the scales of the last roll)."""
    fn = lin if fn is None else fn
    device = lin.weight.device
    state.attach(fn)  # the roll before each forward, outside a compiled graph
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    out = []
    for step in range(STEPS):
        for micro in range(MICRO):
            g = torch.Generator().manual_seed(100 * step + micro)
            x = (torch.randn(32, 64, generator=g) * (1 + micro)).bfloat16().to(device).requires_grad_(True)
            if clear_each_forward:
                clear_weight_caches()
            if change_weight_at == (step, micro):
                with torch.no_grad():
                    lin.weight.mul_(1.5)
            y = fn(x)
            y.backward(torch.randn(y.shape, generator=g).bfloat16().to(device))
            out.append([y.detach(), x.grad, lin.weight.grad.clone(), state.entries["l"].history.clone()])
        opt.step()
        opt.zero_grad()
        if evaluate:
            with torch.no_grad():
                x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).bfloat16().to(device)
                out.append([fn(x)])
    return out


def _assert_same(a_run, b_run, what):
    for i, (a, b) in enumerate(zip(a_run, b_run, strict=True)):
        for name, u, v in zip(("y", "dx", "dw", "history")[:len(a)], a, b, strict=True):
            assert torch.equal(u, v), f"{what}: micro-batch {i} {name} differs (max {(u.float() - v.float()).abs().max()})"


@pytest.mark.parametrize("device", DEVICES)
def test_one_cast_per_step_the_same_bits_as_a_cast_per_micro_batch(device):
    before = CACHE.stats()
    cached = _run(*_make(True, device))
    after = CACHE.stats()
    misses, hits = after["misses"] - before["misses"], after["hits"] - before["hits"]
    # the first micro-batch (two on CUDA: fp8.delayed_state) casts on dynamic warm-start scales, uncached; then one
    # miss per optimizer step and hits after it
    warm = 1 if device == "cpu" else 2
    assert (misses, hits) == (STEPS, STEPS * MICRO - warm - STEPS), (misses, hits)
    _assert_same(cached, _run(*_make(True, device), clear_each_forward=True), "cached vs cast every micro-batch")


def test_the_weight_row_advances_once_per_optimizer_step_the_others_per_micro_batch():
    run = _run(*_make(True))
    hist = [r[3] for r in run]  # after each forward's roll
    for step in range(STEPS):
        for micro in range(1, MICRO):
            i = step * MICRO + micro
            if i < 2:
                continue  # the first roll (before micro-batch 1 of step 0) takes the warm-start record in
            assert torch.equal(hist[i][1], hist[i - 1][1]), f"weight row moved inside step {step} (micro {micro})"
            assert not torch.equal(hist[i][0], hist[i - 1][0]), f"input row held at step {step} micro {micro}"
    firsts = [hist[s * MICRO][1] for s in range(1, STEPS)]
    assert all(not torch.equal(a, hist[s * MICRO - 1][1]) for s, a in zip(range(1, STEPS), firsts, strict=True)), \
        "the weight row must advance at the first roll after each optimizer step"


def test_a_roll_before_the_first_forward_still_takes_the_first_weight_amax():
    """A roll before any record (``link_input_siblings`` at conversion, a checkpoint's ``state_dict``, a BF16 -> FP8
    switch) is the first after the step: the first recorded step must still take its weight row, or the weight
    scale comes from an all-zero row and every weight saturates (found in review: relative error 1.0). Within the
    first optimizer step the weights, so their amax, are the same at every micro-batch: the outputs equal those
    without the cache bit for bit."""
    runs = {}
    for cache in (True, False):
        lin, state = _make(cache)
        state.attach(lin)
        state.roll()
        runs[cache] = _run(lin, state)
    for i in range(1, MICRO):  # micro-batch 0 runs on dynamic scales
        hist = runs[True][i][3]
        assert hist[1, 0] > 0, f"micro-batch {i}: the weight history row is {hist[1].tolist()}"
        y, y_ref = runs[True][i][0], runs[False][i][0]
        assert torch.equal(y, y_ref), f"micro-batch {i}: max diff {(y.float() - y_ref.float()).abs().max().item()}"


def test_a_weight_changed_in_place_is_cast_again():
    lin, state = _make(True)
    before = CACHE.stats()["misses"]
    changed = _run(lin, state, change_weight_at=(1, 2))
    assert CACHE.stats()["misses"] - before == STEPS + 1, "the in-place change must miss the cache"
    ref_lin, ref_state = _make(True)
    _assert_same(changed, _run(ref_lin, ref_state, clear_each_forward=True, change_weight_at=(1, 2)),
                 "changed weight vs cast every micro-batch")


def test_an_evaluation_between_steps_leaves_no_outdated_cast():
    """An evaluation forward after an optimizer step casts the new weights at the scales of the last roll, in the new
    optimizer step; the next training forward's roll changes the weight scales and must not reuse that cast."""
    cached = _run(*_make(True), evaluate=True)
    _assert_same(cached, _run(*_make(True), clear_each_forward=True, evaluate=True), "with evaluations")


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_equals_eager_without_a_graph_break(device):
    eager = _run(*_make(True, device))
    lin, state = _make(True, device)
    compiled = torch.compile(lin, fullgraph=True)
    _assert_same(eager, _run(lin, state, fn=compiled), "compiled vs eager")


@pytest.mark.parametrize("sets, want", [
    (["train.grad_accum=2"], True),
    (["train.grad_accum=1"], False),
    (["train.grad_accum=2", "train.compile=true", "train.cuda_graphs=true"], False),
    (["train.grad_accum=2", "fp8.weight_cache=false"], False),
])
def test_the_run_caches_delayed_weights_with_gradient_accumulation_only(sets, want):
    from tests.conftest import prepared_llama

    _, done = prepared_llama(["train.mixed_precision=fp8", "fp8.recipe=delayed", *sets])
    assert done.conversion.delayed.config.cache_weights is want, sets


@pytest.mark.slow
def test_a_run_with_gradient_accumulation_resumes_exactly(small_run, tmp_path):
    """``fp8kit train`` with ``train.grad_accum = 2``: the delayed linears reuse cached weights, and a resume from the
    step-2 checkpoint (written after an evaluation that cast the new weights at the old scales) continues bit for
    bit."""
    from fp8kit.config import load_config
    from fp8kit.train.trainer import train

    base = [*small_run, "fp8.recipe=delayed", "train.warmup_steps=2", "train.steps=4", "train.checkpoint_every=2",
            "train.eval_every=2", "train.grad_accum=2"]
    hits = CACHE.stats()["hits"]
    full = train(load_config(None, base), tmp_path / "full").metrics
    assert CACHE.stats()["hits"] > hits, "the run's delayed linears never reused a cached weight"
    ck = tmp_path / "full" / "checkpoints" / "step_000002"
    resumed = train(load_config(None, base), tmp_path / "resumed", resume=ck).metrics
    assert len(resumed) == 2, resumed
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]], (resumed, full)
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[2:]]


@pytest.mark.parametrize("sets, want", [
    (["fp8.recipe=delayed", "train.grad_accum=2"],
     ({"dense": 2}, "fp8 delayed (weights cast once per step of 2 micro-batches)")),
    (["fp8.recipe=delayed", "train.grad_accum=2", "fp8.weight_cache=false"],
     ({"dense": 1}, "fp8 delayed (weights cast at every micro-batch)")),
    (["fp8.recipe=tensorwise", "train.grad_accum=3"],  # torchao casts every micro-batch
     ({"dense": 1}, "fp8 tensorwise (weights cast at every micro-batch)")),
    (["fp8.recipe=delayed", "train.grad_accum=1"], (None, "fp8 delayed")),
    # the experts as prepared on this CPU: blockwise runs its per-expert loop, which caches; tensorwise the emulated
    # grouped GEMM, which casts at every call (the fused rowwise MLP, which caches, needs a Hopper GPU)
    (["model.preset=tiny-moe", "fp8.recipe=blockwise", "fp8.emulate=true", "train.grad_accum=2"],
     ({"dense": 2, "experts": 2}, "fp8 blockwise (weights cast once per step of 2 micro-batches)")),
    (["model.preset=tiny-moe", "fp8.recipe=tensorwise", "train.grad_accum=2"],
     ({"dense": 1, "experts": 1}, "fp8 tensorwise (weights cast at every micro-batch)")),
])
def test_the_precision_line_says_how_often_the_weights_are_cast(sets, want):
    """The run's start line and summary (``train.setup.weight_cast_reuse``, ``trainer._precision_desc``) say whether
    the FP8 weights are cast once per optimizer step (``fp8.weight_cache`` with gradient accumulation) or at every
    micro-batch, as the prepared model does it (torchao's dense recipes and the experts' grouped kernels other than
    the fused MLP and the blockwise loop: every micro-batch)."""
    from fp8kit.train.setup import weight_cast_reuse
    from fp8kit.train.trainer import _precision_desc
    from tests.conftest import prepared_run

    cfg, model, decisions, _ = prepared_run(sets, emulate="fp8.emulate=true" in sets)
    reuse = weight_cast_reuse(cfg, None, decisions, model, torch.device("cpu"))
    assert (reuse, _precision_desc(cfg, None, reuse)) == want, sets


def test_the_precision_line_names_dense_and_expert_casts_apart():
    """Where the dense linears and the experts differ, the line names each."""
    from fp8kit.config import load_config
    from fp8kit.train.trainer import _precision_desc

    cfg = load_config(None, ["train.mixed_precision=fp8", "fp8.recipe=tensorwise", "train.grad_accum=2"])
    got = _precision_desc(cfg, ["fprop"], {"dense": 1, "experts": 2})
    want = ("fp8 tensorwise (fast accumulation: fprop; dense weights cast at every micro-batch; expert weights cast "
            "once per step of 2 micro-batches)")
    assert got == want, got
    # a run starting in a BF16 phase: the expert layers are converted, and their casts decided, at the switch
    got = _precision_desc(cfg, None, {"dense": 2, "experts": None})
    want = ("fp8 tensorwise (dense weights cast once per step of 2 micro-batches; expert weights cast as decided at "
            "the switch to FP8)")
    assert got == want, got


def test_a_run_starting_in_bf16_leaves_the_experts_casts_to_the_switch():
    """``fp8.bf16_warmup_steps``: the experts are still BF16 modules at set-up, so ``weight_cast_reuse`` does not
    claim how their FP8 weights will be cast (None), while the dense linears' casts follow from the config."""
    from fp8kit.train.setup import weight_cast_reuse
    from tests.conftest import prepared_run

    cfg, model, decisions, _ = prepared_run(["fp8.recipe=blockwise", "fp8.emulate=true", "train.grad_accum=2",
                                             "fp8.bf16_warmup_steps=2"], emulate=True, preset="tiny-moe",
                                            fp8_now=False)
    assert weight_cast_reuse(cfg, None, decisions, model, torch.device("cpu")) == {"dense": 2, "experts": None}
