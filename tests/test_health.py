"""FP8 numerics health (``fp8.stats_every``, ``fp8kit.train.health``): underflow and saturation fractions per
layer and operand, checked against the real casts (torchao's, delayed scaling's), per-row scales, the same
numbers inside ``torch.compile``'d blocks, hooks only while a monitor lives, and the records' consumers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8kit.base.torchao_lib import torchao_float8
from fp8kit.fp8.delayed import DelayedScalingState, Float8DelayedLinear
from fp8kit.fp8.recipes import float8_linear_config
from fp8kit.train.health import FP8HealthMonitor, OperandCast, health_markdown, operand_stats, worst_layers
from fp8kit.train.loggers import scalars


class _TwoBranches(nn.Module):
    """Two independent linear layers, each fed its own input (``tiny``, ``ok``)."""

    def __init__(self):
        super().__init__()
        self.tiny = nn.Linear(64, 64, bias=False)
        self.ok = nn.Linear(64, 64, bias=False)

    def forward(self, x_tiny, x_ok):
        return self.tiny(x_tiny).float().sum() + self.ok(x_ok).float().sum()


def _model(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    model = _TwoBranches().to(torch.bfloat16)
    torchao_float8().convert_to_float8_training(model, config=float8_linear_config(recipe))
    return model


def _inputs():
    g = torch.Generator().manual_seed(1)
    x_tiny = torch.randn(8, 64, generator=g) * 1e-9
    x_tiny[0, 0] = 1e3  # one large outlier sets the tensorwise scale
    x_ok = torch.randn(8, 64, generator=g)
    return x_tiny.to(torch.bfloat16), x_ok.to(torch.bfloat16)


def _measure(model, step=1, every=1, inputs=None):
    mon = FP8HealthMonitor(model, every)
    try:
        mon.arm(step)
        model(*(inputs or _inputs())).float().sum().backward()
        probe = mon.collect()
        return None if probe is None else {(r["layer"], r["operand"]): r for r in probe.rows()}
    finally:
        mon.close()


def test_tiny_inputs_underflow_well_scaled_ones_do_not():
    rows = _measure(_model("tensorwise"))
    tiny, ok = rows[("tiny", "input")], rows[("ok", "input")]
    assert tiny["underflow"] > 0.99, f"1e-9 inputs under a 1e3 outlier: underflow {tiny['underflow']}"
    assert ok["underflow"] == 0.0, f"well-scaled randn input: underflow {ok['underflow']}"
    assert tiny["saturation"] == 0.0 and ok["saturation"] == 0.0, "dynamic scaling never saturates"
    assert tiny["amax"] == 1000.0 and tiny["scale"] == pytest.approx(448 / tiny["amax"], rel=1e-6)
    # the HYBRID format of torchao's tensorwise recipe: E4M3 forward operands, E5M2 output gradient
    assert (tiny["dtype"], rows[("tiny", "weight")]["dtype"], rows[("tiny", "grad_output")]["dtype"]) == (
        "e4m3", "e4m3", "e5m2")
    assert {op for _, op in rows} == {"input", "weight", "grad_output"} and len(rows) == 6


def test_underflow_equals_the_zeros_of_torchaos_own_cast():
    """The stats re-compute the scale; for dynamic scaling the fraction is that of the GEMM's actual cast."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    x_tiny, x_ok = _inputs()
    rows = _measure(_model("tensorwise"), inputs=(x_tiny, x_ok))
    for name, x in (("tiny", x_tiny), ("ok", x_ok)):
        cast = hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig())
        zeros = ((cast._data.float() == 0) & (x != 0)).sum().item() / (x != 0).sum().item()
        assert rows[(name, "input")]["underflow"] == zeros, (name, rows[(name, "input")]["underflow"], zeros)
        assert rows[(name, "input")]["scale"] == cast._scale.item()


def test_rowwise_scales_per_row_keep_small_rows():
    """Rowwise: the outlier's row has its own scale, the other rows' tiny values survive; E4M3 gradients."""
    # on a GPU machine the model runs on CUDA: torch 2.11's CPU _scaled_mm takes per-tensor scales only; 16 rows
    # (the inputs twice: the same fractions), as the CUDA wgrad GEMM's reduction over tokens needs a multiple of 16
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = tuple(x.repeat(2, 1).to(dev) for x in _inputs())
    tensorwise = _measure(_model("tensorwise").to(dev), inputs=inputs)[("tiny", "input")]["underflow"]
    rows = _measure(_model("rowwise").to(dev), inputs=inputs)
    rowwise = rows[("tiny", "input")]["underflow"]
    assert rowwise < 0.2 < 0.99 < tensorwise, f"rowwise {rowwise} vs tensorwise {tensorwise}"
    assert rows[("tiny", "input")]["granularity"] == "rowwise" and rows[("tiny", "grad_output")]["dtype"] == "e4m3"


def test_operand_stats_match_a_real_cast_across_magnitudes():
    """Underflow by the rounding bound equals the zeros of an actual cast, for E4M3 and E5M2 and per row."""
    torch.manual_seed(0)
    x = (torch.randn(64, 256) * torch.logspace(-12, 0, 256)).to(torch.bfloat16)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for gran in ("tensorwise", "rowwise"):
            s = operand_stats(x, OperandCast(dtype, gran, pow2=gran == "rowwise"))
            scale = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
            amax = x.float().abs().amax(dim=-1, keepdim=True) if gran == "rowwise" else x.float().abs().amax()
            sc = torch.exp2(torch.floor(torch.log2(scale / amax))) if gran == "rowwise" else scale / amax
            q = (x.float() * sc).to(dtype).float()
            real = ((q == 0) & (x != 0)).sum().item() / (x != 0).sum().item()
            assert s[2].item() == pytest.approx(real, abs=1e-12), (dtype, gran, s[2].item(), real)
            assert 0.1 < real < 0.9  # the test data spans the underflow boundary


def test_blockwise_underflow_equals_the_zeros_of_its_1x128_quantization():
    from fp8kit.fp8.blockwise import quantize_1x128
    from fp8kit.fp8.linear import Float8BlockwiseLinear

    torch.manual_seed(0)
    model = nn.Sequential(Float8BlockwiseLinear.from_linear(nn.Linear(256, 256, bias=False)))
    x = torch.randn(64, 256) * torch.logspace(-10, 0, 256)  # magnitudes across each 128-block
    rows = _measure(model, inputs=(x,))
    q, _ = quantize_1x128(x)
    real = ((q.float() == 0) & (x != 0)).sum().item() / (x != 0).sum().item()
    assert rows[("0", "input")]["underflow"] == real > 0, (rows[("0", "input")]["underflow"], real)
    assert [rows[("0", op)]["granularity"] for op in ("input", "weight", "grad_output")] == [
        "block1x128", "block128x128", "block1x128"]


def test_delayed_scaling_saturates_after_a_jump():
    """recipe = delayed: a 100x jump of the input is cast with the stale scale of the history: saturation."""
    torch.manual_seed(0)
    state = DelayedScalingState()
    model = nn.Sequential(Float8DelayedLinear.from_linear(nn.Linear(64, 64, bias=False), state, "0"))
    mon = FP8HealthMonitor(model, 1)
    x = torch.randn(32, 64)
    sat = []
    for step, mult in enumerate([1.0, 100.0], start=1):
        mon.arm(step)
        model(x * mult).sum().backward()
        rows = {r["operand"]: r for r in mon.collect().rows()}
        sat.append(rows["input"]["saturation"])
    # the scales the step's casts used (the module's probe gets them from its forward; no roll since)
    used = [float(s) for s in model[0].cast_scales()]
    got = [rows[op]["scale"] for op in ("input", "weight", "grad_output")]
    assert got == used, f"scales in the stats {got} vs the casts' {used}"
    mon.close()
    assert model[0].health_probe is None, "the delayed module's probe is left after close()"
    assert sat[0] == 0.0 and sat[1] > 0.5, f"saturation before / after the jump: {sat}"
    assert rows["grad_output"]["dtype"] == "e5m2" and rows["input"]["granularity"] == "tensorwise"


def test_hooks_only_on_stats_steps_and_removed_on_close():
    model = _model("tensorwise")
    mon = FP8HealthMonitor(model, 3)
    assert [mon.arm(s) for s in (1, 2, 3)] == [False, False, True]
    assert mon.collect() is not None and mon.collect() is None  # collect deactivates
    mon.arm(4)
    model(*_inputs()).backward()
    assert mon.collect() is None
    mon.close()
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    assert hooks == 0, f"{hooks} hooks left after close()"


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_an_activation_checkpointing_recompute_is_not_measured_twice(recipe):
    """Eagerly, a checkpointed block's forward runs again inside the backward: the hooks measure each module's input
    and weight once per stats step (the forward's), and the numbers equal an un-checkpointed step's."""
    from torch.utils.checkpoint import checkpoint

    def measured(ckpt: bool):
        torch.manual_seed(0)
        model = _TwoBranches().to(torch.bfloat16)
        if recipe == "delayed":
            state = DelayedScalingState()
            model.tiny = Float8DelayedLinear.from_linear(model.tiny, state, "tiny")
            model.ok = Float8DelayedLinear.from_linear(model.ok, state, "ok")
        else:
            torchao_float8().convert_to_float8_training(model, config=float8_linear_config(recipe))
        mon = FP8HealthMonitor(model, 1)
        calls = []
        inner = mon._stats
        mon._stats = lambda *a: (calls.append(1), inner(*a))[1]  # counts the eager input / weight measurements
        try:
            mon.arm(1)
            x = _inputs()
            y = checkpoint(model, *x, use_reentrant=False) if ckpt else model(*x)
            y.float().sum().backward()
            return len(calls), {(r["layer"], r["operand"]): r for r in mon.collect().rows()}
        finally:
            mon.close()

    (n_ckpt, rows_ckpt), (n_plain, rows_plain) = measured(True), measured(False)
    assert n_ckpt == n_plain == 4, (n_ckpt, n_plain)  # two modules x (input, weight)
    assert rows_ckpt == rows_plain, (rows_ckpt, rows_plain)


@pytest.mark.parametrize("cast, given_scale", [
    (OperandCast(torch.float8_e5m2), False),  # torchao tensorwise, dynamic: one scale from the whole tensor
    (OperandCast(torch.float8_e5m2, source="delayed"), True),  # the history's scale
    (OperandCast(torch.float8_e4m3fn, "rowwise", pow2=True), False),
    (OperandCast(torch.float8_e4m3fn, "block1x128", source="fp8kit"), False),
    (OperandCast(torch.float8_e4m3fn, "block128x128", source="fp8kit"), False),
])
def test_chunked_stats_equal_one_pass(cast, given_scale):
    """``operand_stats_chunked`` (what an eager gradient hook runs) gives ``operand_stats``' numbers over row chunks:
    rows of very different magnitude (so a chunk's own amax would give another tensorwise scale), zeros, one NaN."""
    from fp8kit.train.health import operand_stats_chunked

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g) * torch.logspace(-12, 3, 512).unsqueeze(1)
    x[7, :100] = 0.0
    x = x.to(torch.bfloat16)
    scale = torch.tensor(3.0e2) if given_scale else None
    for nan in (False, True):
        if nan:
            x[300, 5] = float("nan")
        want = operand_stats(x, cast, scale)
        got = operand_stats_chunked(x, cast, scale, chunk_elements=128 * 256)  # 4 chunks of 128 rows
        assert torch.allclose(got, want, rtol=1e-12, atol=0, equal_nan=True), (cast, nan, got.tolist(), want.tolist())
        one = operand_stats_chunked(x, cast, scale)  # fits one chunk: the same call
        assert torch.allclose(one, want, rtol=0, atol=0, equal_nan=True), (one.tolist(), want.tolist())


def test_eager_output_gradients_are_measured_in_their_hook_and_not_kept():
    """An eager backward's gradient hooks measure each output gradient as it passes (the buffer is written before
    ``collect()``), and drop it: keeping every FP8 linear's ``[tokens, features]`` output gradient (the LM head's
    ``[tokens, vocab]`` one too) to the end of the backward raised a stats step's peak memory."""
    import gc
    import weakref

    model = _model("tensorwise")
    mon = FP8HealthMonitor(model, 1)
    seen = []
    try:
        mon.arm(1)
        h = model.ok.register_full_backward_hook(lambda m, gi, go: seen.append(weakref.ref(go[0])))
        model(*_inputs()).float().sum().backward()
        h.remove()
        bufs = [slot[3] for *_, slots in mon._hooked.values() for slot in slots if slot[1] == "grad_output"]
        assert len(bufs) == 2 and all(torch.isfinite(b).all() for b in bufs), bufs  # written before collect()
        gc.collect()
        assert seen and all(r() is None for r in seen), "an output gradient outlived the backward"
        rows = {(r["layer"], r["operand"]): r for r in mon.collect().rows()}
        assert rows[("ok", "grad_output")]["amax"] == 1.0, rows[("ok", "grad_output")]  # d(sum)/dy = 1
    finally:
        mon.close()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_same_numbers_inside_compiled_blocks_without_recompiling(recipe):
    """Per-block torch.compile (train.compile): the stats variant is compiled once, numbers equal eager's. Delayed:
    the module's probe and the gradient-scale buffer traced into the compiled forward and backward."""
    from torch._dynamo.utils import counters

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False)

        def forward(self, x):
            return x + self.b(torch.relu(self.a(x)))

    def run(compiled):
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block()).to(torch.bfloat16)
        if recipe == "delayed":
            state = DelayedScalingState()
            for i, block in enumerate(model):
                block.a = Float8DelayedLinear.from_linear(block.a, state, f"{i}.a")
                block.b = Float8DelayedLinear.from_linear(block.b, state, f"{i}.b")
            state.attach(model)  # rolled before the model's forward, outside the compiled blocks
        else:
            torchao_float8().convert_to_float8_training(model, config=float8_linear_config("tensorwise"))
        mon = FP8HealthMonitor(model, 2)
        mon.arm(1)  # hooks registered before the first compile, as the training loop does
        mon.collect()
        if compiled:
            for block in model:
                block.compile()
        x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        out, graphs = [], []
        for step in range(1, 5):
            mon.arm(step)
            model(x).float().pow(2).mean().backward()
            probe = mon.collect()
            out.append(probe.rows() if probe else None)
            graphs.append(counters["stats"]["unique_graphs"])
        mon.close()
        return out, graphs

    torch._dynamo.reset()
    counters.clear()
    eager, _ = run(False)
    compiled, graphs = run(True)
    torch._dynamo.reset()
    assert [r is None for r in compiled] == [True, False, True, False]
    # every operand of every linear measured (rows() leaves out a buffer no hook or probe wrote)
    assert len(compiled[1]) == len(compiled[3]) == 2 * 2 * 3, compiled[1]
    assert compiled[1] == eager[1] and compiled[3] == eager[3], "compiled stats differ from eager"
    # step 4 (stats) reuses what steps 1-3 compiled; delayed compiles once more at step 3: each roll switches to the
    # other of its two scale sets, fixed-address graph inputs, so each set has its graphs (fp8.delayed_state)
    assert graphs[3] == graphs[2], f"a stats step after the first recompiled: unique graphs {graphs}"
    if recipe == "tensorwise":
        assert graphs[1] == graphs[3], f"a step after the first stats step recompiled: unique graphs {graphs}"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_worst_layers_summary_and_tensorboard_tags():
    records = [
        {"step": 2, "fp8_health": [
            {"layer": "a", "operand": "input", "dtype": "e4m3", "granularity": "tensorwise", "amax": 1.0,
             "scale": 448.0, "underflow": 0.3, "saturation": 0.0, "nonfinite": 0.0},
            {"layer": "b", "operand": "grad_output", "dtype": "e5m2", "granularity": "tensorwise", "amax": None,
             "scale": None, "underflow": None, "saturation": None, "nonfinite": 0.5}]},
        {"step": 3, "loss": 1.0},
        {"step": 4, "fp8_health": [
            {"layer": "a", "operand": "weight", "dtype": "e4m3", "granularity": "tensorwise", "amax": 1.0,
             "scale": 448.0, "underflow": 0.01, "saturation": 0.0, "nonfinite": 0.0}]},
    ]
    worst = worst_layers(records)
    assert [(w["layer"], w["operand"], w["step"]) for w in worst] == [("b", "grad_output", 2), ("a", "input", 2)]
    md = "\n".join(health_markdown(worst, 2))
    assert "FP8 health: worst 2 layers" in md and "| a | input | 2 | e4m3 | tensorwise | 1 | 448 | 30.00% |" in md
    tags = scalars(records[0])
    assert tags["fp8_health/a/input/underflow"] == 0.3 and "fp8_health/b/grad_output/amax" not in tags
