"""Delayed scaling on a CUDA GPU under ``torch.compile`` (marker ``gpu``; skipped without an FP8 GPU): no graph
break, compiled == eager, numerics against float64, and the cast fused into its producer (RMSNorm).

Run on the H100: ``pytest -m gpu tests/test_delayed_gpu.py -s`` (``-s`` prints the measured figures).
The CPU twin of each check is in ``tests/test_delayed.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from fp8kit.fp8.delayed import DelayedScaling, DelayedScalingState, Float8DelayedLinear
from tests.conftest import RMSNorm, sqnr

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU with FP8 tensor cores (sm89+)"),
]

#: Compiled vs eager, same FP8 recipe: inductor's Triton may round the float32 scale division / the
#: RMSNorm reduction differently by an ulp, which flips the FP8 rounding of a few elements; the FP8
#: quantization noise itself is ~30 dB against float64, so 40 dB means "the same casts but for a few".
MIN_DB_VS_EAGER = 40.0
#: The MLP branch chains three FP8 GEMMs (gate, up, then down on the re-quantized SwiGLU product); one
#: E4M3 x E4M3 GEMM gets ~29 dB, the chain ~23.6 dB (measured on the CPU path, same shapes / 16 rows).
MIN_DB_VS_FLOAT64 = 20.0


class _Block(nn.Module):
    """RMSNorm -> gate / up (delayed) -> SwiGLU -> down (delayed) + residual, Llama MLP shapes / 8."""

    def __init__(self, state, d=512, h=1792):
        super().__init__()
        self.norm = RMSNorm(d)
        self.gate = Float8DelayedLinear.from_linear(nn.Linear(d, h, bias=False), state, "gate")
        self.up = Float8DelayedLinear.from_linear(nn.Linear(d, h, bias=False), state, "up")
        self.down = Float8DelayedLinear.from_linear(nn.Linear(h, d, bias=False), state, "down")

    def forward(self, x):
        n = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(n)) * self.up(n))


def _make(fused_cast: str = "all"):
    torch.manual_seed(0)
    state = DelayedScalingState(DelayedScaling(amax_history_len=16, fused_cast=fused_cast))
    return _Block(state).cuda().bfloat16(), state


def _steps(model, state, fn, n):
    state.attach(fn)  # the roll before each call (outside the compiled graph), as apply_fp8 attaches the model
    out = []
    for i in range(n):
        g = torch.Generator(device="cuda").manual_seed(i)
        x = (torch.randn(4, 1024, 512, generator=g, device="cuda") * (1 + i)).bfloat16().requires_grad_(True)
        y = fn(x)
        dy = torch.randn(y.shape, generator=g, device="cuda").bfloat16()
        y.backward(dy)
        out.append({"y": y.detach(), "dx": x.grad, **{n: p.grad.clone() for n, p in model.named_parameters()},
                    **{f"history.{k}": e.history.clone() for k, e in state.entries.items()}})
        for p in model.parameters():
            p.grad = None
    return out


def test_compiled_block_no_graph_break_and_equals_eager():
    model, state = _make()
    state.attach(model)  # its roll runs before the graph (a disabled call: no graph break)
    x = torch.randn(4, 1024, 512, device="cuda").bfloat16().requires_grad_(True)
    for _ in range(2):  # the first-step graph (dynamic warm start) and the steady-state graph
        ex = torch._dynamo.explain(model)(x)
        assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
        model(x).sum().backward()

    eager_model, eager_state = _make()
    model, state = _make()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        eager, comp = _steps(eager_model, eager_state, eager_model, 4), _steps(model, state, compiled, 4)
    assert counter.frame_count == 2, f"{counter.frame_count} compilations for 4 steps (expected 2)"
    for step, (a, b) in enumerate(zip(eager, comp, strict=True)):
        for name in a:
            same = torch.equal(a[name], b[name])
            db = sqnr(a[name], b[name])
            print(f"step {step} {name}: {'bit for bit' if same else f'{db:.1f} dB'}")
            if name.startswith("history."):  # amaxes of (nearly) the same tensors
                torch.testing.assert_close(b[name], a[name], rtol=2e-2, atol=0)
            else:
                assert db >= MIN_DB_VS_EAGER, f"step {step} {name}: compiled vs eager {db:.1f} dB"
    state.roll()
    assert all(int(e.steps) == 4 for e in state.entries.values())


def test_compiled_block_against_float64():
    model, state = _make()
    compiled = torch.compile(model, fullgraph=True)
    state.attach(compiled)
    x = torch.randn(4, 1024, 512, device="cuda").bfloat16()
    for _ in range(4):  # steps 0-1 dynamic (``started`` is read a roll late), then history scales
        y = compiled(x.requires_grad_(True))
        y.float().pow(2).mean().backward()
    with torch.no_grad():
        xd = x.double()
        n = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * model.norm.weight.double()
        h = nn.functional.silu(n @ model.gate.weight.double().T) * (n @ model.up.weight.double().T)
        ref = h @ model.down.weight.double().T  # the MLP branch (the residual would hide its error)
    db = sqnr(ref, y.detach() - x)
    print(f"compiled delayed MLP branch vs float64: {db:.1f} dB")
    assert db >= MIN_DB_VS_FLOAT64, f"{db:.1f} dB < {MIN_DB_VS_FLOAT64}"


@pytest.mark.parametrize("fused_cast", ["none"])
def test_cast_is_fused_into_the_rmsnorm_kernel(fused_cast):
    """Steady-state forward with every cast left to torch.compile (``delayed_fused_cast = "none"``, the default):
    one Triton kernel holds both the RMSNorm (rsqrt) and an E4M3 cast (the scale is known before the cast, so
    inductor writes FP8 straight from the producer). Prints the kernel count. (With ``weight_grad`` inductor
    materialises the RMSNorm output in bf16 and casts it in the next kernel: 0 fused, H100 2026-11-24.)"""
    from torch._inductor.utils import run_and_get_code

    model, state = _make(fused_cast)
    compiled = torch.compile(model, fullgraph=True)
    state.attach(compiled)
    x = torch.randn(4, 1024, 512, device="cuda").bfloat16().requires_grad_(True)
    compiled(x).sum().backward()  # step 0: warm start; the next call compiles the steady-state graph
    state.roll(sync=True)
    _, codes = run_and_get_code(lambda: compiled(x))
    src = "\n".join(codes)
    kernels = src.split("@triton.jit")[1:]
    fused = [k for k in kernels if "rsqrt" in k and "float8e4nv" in k]
    print(f"{fused_cast}: {len(kernels)} Triton kernels in the forward; {len(fused)} with RMSNorm + E4M3 cast")
    for k in kernels:
        name = k.split("def ", 1)[1].split("(", 1)[0] if "def " in k else "?"
        print(f"  {name}: rsqrt {'rsqrt' in k}, e4m3 {'float8e4nv' in k}")
    assert fused, "no kernel computes RMSNorm and writes E4M3: the cast was not fused into its producer"


def test_steps_and_rolls_never_wait_for_the_gpu_and_started_follows_a_roll_late():
    """The roll (``DelayedScalingState.roll``) and the compiled steps make no host sync once the warm start is over
    (CUDA sync debug mode "error" raises on one): the step counts reach the host by a copy started at one roll and
    waited for at the next (a step old), so the first history scales come at the third step (the roll before it is
    left unchecked: it waits on that copy, and the step compiles), and every module's record and history stay exact."""
    model, state = _make()
    compiled = torch.compile(model, fullgraph=True)
    state.attach(compiled)
    x = torch.randn(4, 1024, 512, device="cuda").bfloat16().requires_grad_(True)
    started = []
    for step in range(5):
        if step >= 1:  # step 0 compiles (its autotuning may sync), as does the first history step (2)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if step != 2 else "default")
        try:
            compiled(x).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        started.append([e.started for e in state.entries.values()])
    print("started per step:", started)
    assert started[1] == [False] * 3 and started[2] == [True] * 3, started
    state.roll(sync=True)
    e = state.entries["gate"]
    assert int(e.steps) == 5 and bool((e.history[:, :5] > 0).all()) and not e.history[:, 5:].any(), e.history


@pytest.mark.parametrize("fast_accum", [("fprop",), ("fprop", "dgrad", "wgrad"), (), ("fprop", "wgrad")])
def test_gemms_accumulate_as_configured(fast_accum):
    """``DelayedScaling.fast_accum`` (``fp8.fast_accum``; default the recipe table's fprop and wgrad, session 42):
    the linear's three GEMMs equal ``torch._scaled_mm`` of the same FP8 operands with that setting, bit for bit. On
    Hopper / Ada the other setting gives other bits at these shapes, so the comparison tells them apart (Blackwell's
    cuBLAS has no fast-accumulation mode: there the bits may agree and only the equality is checked)."""
    from fp8kit.fp8.delayed import _cast
    from fp8kit.fp8.delayed_state import E4M3, E5M2

    torch.manual_seed(0)
    state = DelayedScalingState(DelayedScaling(amax_history_len=4, fast_accum=fast_accum))
    lin = Float8DelayedLinear.from_linear(nn.Linear(4096, 1024, bias=False), state, "lin").cuda().bfloat16()
    x = torch.randn(512, 4096, device="cuda").bfloat16().requires_grad_(True)
    dy = torch.randn(512, 1024, device="cuda").bfloat16()
    y = lin(x)  # the first step: dynamic scales, from these tensors
    y.backward(dy)
    x8, sx, _ = _cast(x.detach(), None, E4M3)
    w8, sw, _ = _cast(lin.weight.detach(), None, E4M3)
    g8, sg, _ = _cast(dy, None, E5M2)
    ix, iw, ig = sx.reciprocal(), sw.reciprocal(), sg.reciprocal()
    cm = lambda t: t.t().contiguous().t()  # noqa: E731  (column-major, as the recipe lays out its second operands)
    # fprop reduces over K = 4096, dgrad over N = 1024, wgrad over M = 512 tokens
    gemms = {"fprop": (y, x8, w8.t(), ix, iw), "dgrad": (x.grad, g8, cm(w8), ig, iw),
             "wgrad": (lin.weight.grad, g8.t().contiguous(), cm(x8), ig, ix)}
    hopper_or_ada = torch.cuda.get_device_capability() in ((8, 9), (9, 0))
    for name, (got, a, b, sa, sb) in gemms.items():
        fast = name in fast_accum
        want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
        other = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=not fast)
        print(f"{name}: fast accumulation {fast}; the other setting {sqnr(want.float(), other.float()):.1f} dB away")
        assert torch.equal(got, want), f"{name}: not the {'fast' if fast else 'split'}-accumulation GEMM"
        if hopper_or_ada:
            assert not torch.equal(want, other), f"{name}: both accumulations gave the same bits; the test cannot tell"


def test_output_gradients_through_the_op_train_to_the_same_bits():
    """``fp8.delayed_fused_cast = "grad_output"`` (each output gradient cast by ``fp8kit::cast_transpose``: one read,
    both FP8 layouts, the amax) trains the compiled block to the same bits as ``"none"`` (Inductor's casts): outputs,
    gradients and histories over 4 steps (2 warm-start, 2 from the history). Inductor fuses a cast into the kernel
    computing its operand (SwiGLU's backward for gate / up) and would cast the float32 value before its bf16
    rounding, which the op never sees: ``emulate_precision_casts`` makes it round first, as the op reads it."""
    runs = {}
    for mode in ("none", "grad_output"):
        # compiled code of another _Block (an earlier test's, the other mode's) would be reused by the guards, and
        # this file compiles _Block.forward near the recompile limit: each mode compiles its own two graphs here
        torch._dynamo.reset()
        model, state = _make(mode)
        counter = CompileCounterWithBackend("inductor")
        with torch._inductor.config.patch(emulate_precision_casts=True):
            runs[mode] = _steps(model, state, torch.compile(model, backend=counter, fullgraph=True), 4)
        assert counter.frame_count == 2, f"{mode}: {counter.frame_count} compilations for 4 steps (expected 2)"
    for step, (a, b) in enumerate(zip(runs["none"], runs["grad_output"], strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"step {step} {name}: {sqnr(a[name], b[name]):.1f} dB apart"
