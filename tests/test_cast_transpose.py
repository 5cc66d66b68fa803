"""``fp8kit::cast_transpose`` on the CPU reference path (the op CI runs): values, layouts, amax, errors, and
the delayed linear computing the same bits whichever operands use it (``fp8.delayed_fused_cast``).

The Triton kernel is checked bit for bit against the same reference in ``tests/test_cast_transpose_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8kit.fp8.delayed import DelayedScaling, DelayedScalingState, Float8DelayedLinear
from fp8kit.fp8.kernels.cast_ops import cast_transpose
from fp8kit.fp8.scaling import DTYPE_MAX

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_values_layouts_amax_saturation(dtype):
    torch.manual_seed(0)
    x = torch.randn(130, 70).bfloat16()
    x[3, 5] = 1e4  # saturates at scale 2 for E4M3 (max 448), not for E5M2 (57344)
    scale = torch.tensor(2.0)
    q, qt, amax = cast_transpose(x, scale, dtype)
    expect = (x.float() * 2.0).clamp(-DTYPE_MAX[dtype], DTYPE_MAX[dtype]).to(dtype)
    assert q.dtype == dtype and q.shape == (130, 70) and qt.shape == (70, 130) and qt.is_contiguous()
    assert torch.equal(q.view(torch.uint8), expect.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), expect.t().contiguous().view(torch.uint8))
    assert amax.dtype == torch.float32 and amax.item() == 1e4 - 1e4 % 64  # bf16 rounding of 1e4 (9984)
    # 9984 * 2 = 19968: E4M3 saturates at 448; E5M2 rounds to its nearest value, 20480
    assert q[3, 5].float().item() == (448.0 if dtype == E4M3 else 20480.0)


def test_no_transpose_and_strided_input():
    x = torch.randn(64, 96).bfloat16()[:, :80]  # row stride 96
    q, qt, amax = cast_transpose(x, torch.tensor(1.0), E4M3, transpose=False)
    assert qt.numel() == 0 and torch.equal(q.float(), x.float().to(E4M3).float())
    assert amax.item() == x.float().abs().max().item()


def test_nan_propagates_to_amax():
    x = torch.randn(8, 16)
    x[2, 3] = float("nan")
    assert torch.isnan(cast_transpose(x, torch.tensor(1.0), E4M3)[2])


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(2, 3, 4)), "must be 2-D"),
    (dict(dtype=torch.bfloat16), "float8_e4m3fn or float8_e5m2"),
    (dict(scale=torch.tensor([1.0, 2.0])), "one float32 value"),
    (dict(scale=torch.tensor(1.0, dtype=torch.float64)), "one float32 value"),
])
def test_bad_input(bad, match):
    args = dict(x=torch.randn(4, 8), scale=torch.tensor(1.0), dtype=E4M3) | bad
    with pytest.raises(ValueError, match=match):
        cast_transpose(args["x"], args["scale"], args["dtype"])


def test_unknown_fused_cast_setting():
    with pytest.raises(ValueError, match="delayed_fused_cast: unknown 'some'"):
        DelayedScaling(fused_cast="some")


def _train(fused_cast: str, steps: int = 3):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=False)
    state = DelayedScalingState(DelayedScaling(amax_history_len=4, fused_cast=fused_cast))
    mod = Float8DelayedLinear.from_linear(lin, state, "lin")
    out = []
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        x = (torch.randn(32, 64, generator=g) * (i + 1)).requires_grad_(True)
        y = mod(x)
        y.backward(torch.randn(y.shape, generator=g))
        out.append((y.detach(), x.grad, mod.weight.grad.clone(), state.entries["lin"].history.clone()))
        mod.weight.grad = None
    return out


def test_delayed_linear_same_bits_whichever_operands_use_the_op():
    ref = _train("none")
    for mode in ("all", "weight_grad", "grad_output"):
        for step, (a, b) in enumerate(zip(ref, _train(mode), strict=True)):
            for name, ta, tb in zip(("y", "dx", "dw", "history"), a, b, strict=True):
                assert torch.equal(ta, tb), f"{mode} step {step} {name}: max diff {(ta - tb).abs().max().item()}"


class _TwoCasts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        a = cast_transpose(x, s, E4M3, True, mergeable=True)
        b = cast_transpose(x, s, E4M3, True, mergeable=True)
        return a[0].view(torch.uint8), b[1].view(torch.uint8), a[2] + b[2]

    @staticmethod
    def backward(ctx, *grads):
        return None, None


def test_mergeable_casts_of_one_input_are_merged_in_a_compiled_training_graph(monkeypatch):
    """The premise of ``mergeable`` (sibling linears' input cast, ``fp8.delayed``): in a training step compiled by
    Inductor (its min-cut partitioner runs CSE on the joint graph) an input cast twice at one scale by the custom op is
    cast once. Counted by the op's calls into its implementation. (On CUDA the non-mergeable casts are the triton_op,
    launched once per call: the GPU test.)"""
    from fp8kit.fp8.kernels import cast_ops

    calls = []
    reference = cast_ops.cast_transpose_reference
    monkeypatch.setattr(cast_ops, "cast_transpose_reference", lambda *a: calls.append(1) or reference(*a))
    torch._dynamo.reset()
    fn = torch.compile(lambda x, s: _TwoCasts.apply(x * 2, s), fullgraph=True)
    x = torch.randn(64, 32).bfloat16().requires_grad_()
    scale = torch.tensor(2.0)
    eager = _TwoCasts.apply(x * 2, scale)
    assert len(calls) == 2, calls
    fn(x, scale)  # compiles (the fake implementation traces it)
    calls.clear()
    got = fn(x, scale)
    assert all(torch.equal(a, b) for a, b in zip(got, eager, strict=True)), "compiled != eager"
    assert len(calls) == 1, f"{len(calls)} casts in the compiled step (expected one merged cast)"
