"""The rowwise grouped GEMM as a loop of dense GEMMs (``moe/rowwise_loop.py``, ``fp8.grouped_gemm``) on the CPU.

On the CPU the loop runs the CPU ``torch._scaled_mm`` per expert and the grouped path the float32 emulation of
``torch._scaled_grouped_mm``: the same dequantized products in float32, so they must agree to float32 rounding
(threshold 60 dB; measured: equal). The GPU test (``tests/test_moe_fused_gpu.py``) compares the loop with the
CUTLASS grouped kernel.
"""

from __future__ import annotations

import pytest
import torch

from fp8kit.moe.grouped_mm import (
    LOOP_MIN_EXPERT_GFLOP,
    GroupedGemmConfig,
    emulated_scaled_grouped_mm,
    resolve_grouped_gemm,
)
from fp8kit.moe.rowwise_loop import loop_scaled_grouped_mm
from tests.conftest import sqnr

FP8 = torch.float8_e4m3fn


def _groups(sizes: list[int]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    ends = torch.tensor(sizes).cumsum(0)
    bounds = list(zip([0] + ends[:-1].tolist(), ends.tolist(), strict=True))
    return ends.to(torch.int32), bounds


@pytest.mark.parametrize("form", ["2d x 3d", "2d x 2d"])
def test_loop_equals_the_grouped_emulation_with_empty_and_uneven_groups(form):
    torch.manual_seed(0)
    sizes = [32, 0, 96, 16, 0]  # multiples of 16 (the routing pads groups), two empty experts
    offs, bounds = _groups(sizes)
    p, e, k, n = sum(sizes) + 16, len(sizes), 64, 48  # 16 padding rows past the last group
    if form == "2d x 3d":
        a = (torch.randn(p, k) * 40).to(FP8)
        b = (torch.randn(e, n, k) * 40).to(FP8).transpose(-2, -1)
        sa, sb = torch.rand(p) + 0.01, torch.rand(e, n) + 0.01
    else:
        a = (torch.randn(n, p) * 40).to(FP8)
        b = (torch.randn(k, p) * 40).to(FP8).t()
        sa, sb = torch.rand(e * n) + 0.01, torch.rand(e * k) + 0.01
    ref = emulated_scaled_grouped_mm(a, b, sa, sb, offs, torch.bfloat16)
    got = loop_scaled_grouped_mm(a, b, sa, sb, offs, torch.bfloat16, bounds)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    if form == "2d x 3d":
        ref, got = ref[: int(offs[-1])], got[: int(offs[-1])]  # rows past the last group are left unwritten
    else:
        assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(got[4], torch.zeros_like(got[4])), \
            "an expert without rows must get a zero weight gradient"
    db = sqnr(ref.float(), got.float())
    assert db >= 60.0, f"{form}: loop vs grouped emulation {db:.1f} dB < 60"


def test_loop_refuses_bounds_that_do_not_match_the_groups_and_other_ranks():
    a, b = torch.zeros(32, 16, dtype=FP8), torch.zeros(2, 16, 16, dtype=FP8)
    offs = torch.tensor([16, 32], dtype=torch.int32)
    with pytest.raises(ValueError, match="1 bounds for 2 groups"):
        loop_scaled_grouped_mm(a, b, torch.ones(32), torch.ones(2, 16), offs, torch.bfloat16, [(0, 32)])
    with pytest.raises(ValueError, match="neither 2d x 3d nor 2d x 2d"):
        loop_scaled_grouped_mm(b, b, torch.ones(32), torch.ones(2, 16), offs, torch.bfloat16, [(0, 16), (16, 32)])


def test_auto_picks_the_loop_only_for_large_expert_gemms_on_the_fp8_kernel():
    cuda, cpu = True, False  # fp8_kernel: a Hopper GPU runs the FP8 GEMMs; elsewhere the fused path is emulated
    # (experts, padded rows, hidden, width): the shapes of benchmarks/grouped_gemm_loop.py
    mixtral, dsv3_ep32 = (8, 32768, 4096, 14336), (8, 131072, 7168, 2048)
    qwen3, dsv3_128, qwen3_ep16 = (128, 131072, 2048, 768), (128, 131072, 7168, 2048), (8, 131072, 2048, 768)
    assert resolve_grouped_gemm("auto", *mixtral, cuda) == "loop"
    assert resolve_grouped_gemm("auto", *dsv3_ep32, cuda) == "loop"
    assert resolve_grouped_gemm("auto", *qwen3_ep16, cuda) == "grouped"  # 51.5 GFLOP: no gain in the layer
    assert resolve_grouped_gemm("auto", *qwen3, cuda) == "grouped"  # 3.2 GFLOP: host-bound (0.31x)
    assert resolve_grouped_gemm("auto", *dsv3_128, cuda) == "grouped"  # 30 GFLOP: below the margin
    assert resolve_grouped_gemm("auto", *mixtral, cpu) == "grouped"  # the emulation (CPU, or a GPU without the kernel)
    assert resolve_grouped_gemm("loop", *qwen3, cpu) == "loop"  # asked for: runs anywhere
    assert resolve_grouped_gemm("grouped", *mixtral, cuda) == "grouped"
    e, rows, h = 8, 4096, 4096
    width_at_threshold = int(LOOP_MIN_EXPERT_GFLOP * 1e9 / (2 * rows / e * h)) + 1
    assert resolve_grouped_gemm("auto", e, rows, h, width_at_threshold, cuda) == "loop"
    assert resolve_grouped_gemm("auto", e, rows, h, width_at_threshold - 2, cuda) == "grouped"
    with pytest.raises(ValueError, match="gemm = 'dense'; choose one of auto, grouped, loop"):
        resolve_grouped_gemm("dense", *mixtral, cuda)


def _module(gemm: str):
    from fp8kit.moe.experts import Float8GroupedExperts
    from tests.test_moe_fused import _hf_experts

    return Float8GroupedExperts(_hf_experts(), frozenset(("gate_up_proj", "down_proj")),
                                GroupedGemmConfig(kernel="fused", wgrad="fp8", gemm=gemm))


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_experts_with_the_loop_match_the_grouped_path(compiled, capsys, monkeypatch):
    """The whole fused expert MLP (forward + backward, an unused expert included) with ``gemm = "loop"`` against
    ``gemm = "grouped"``: >= 60 dB on the output and every gradient, eagerly and under ``torch.compile``
    (aot_eager: the loop runs outside the graph, ``torch.compiler.disable``); the loop really runs (6 GEMMs per step:
    fprop, dgrad, wgrad of both weights) and the grouped path never calls it; the choice is printed once per shape."""
    import fp8kit.moe.experts as experts_mod
    from tests.test_moe_fused import _run

    calls = {"n": 0}
    real = experts_mod.loop_scaled_grouped_mm

    def spy(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(experts_mod, "loop_scaled_grouped_mm", spy)
    monkeypatch.setattr(experts_mod, "_GEMM_SAID", set())

    t = 96
    torch.manual_seed(3)
    hidden = torch.randn(t, 128, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(7)[:2] for _ in range(t)])  # expert 7 never picked
    weights = torch.softmax(torch.randn(t, 2), dim=-1).to(torch.bfloat16)
    g = torch.randn(t, 128, dtype=torch.bfloat16)
    grouped, loop = _module("grouped"), _module("loop")
    if compiled:
        torch._dynamo.reset()
        loop.forward = torch.compile(loop.forward, backend="aot_eager")
    ref = _run(grouped, hidden, idx, weights, g)
    assert calls["n"] == 0, "the grouped path called the loop"
    got = _run(loop, hidden, idx, weights, g)
    assert calls["n"] == 6, f"{calls['n']} loop GEMMs in one step, not 6"
    got_again = _run(loop, hidden, idx, weights, g)
    for what, a, b, c in zip(("output", "dx", "dw_up", "dw_down"), ref, got, got_again, strict=True):
        db = sqnr(a, b)
        assert db >= 60.0, f"loop vs grouped {what}: {db:.1f} dB < 60"
        assert torch.equal(b, c), f"{what}: the loop is not deterministic"
    assert loop.down_proj.grad[7].abs().max().item() == 0.0
    said = [line for line in capsys.readouterr().out.splitlines() if "fp8.grouped_gemm = loop" in line]
    assert len(said) == 1 and "a loop of dense rowwise GEMMs" in said[0], said


def test_grouped_gemm_setting_reaches_the_experts_config():
    from fp8kit.base.errors import ConfigError
    from fp8kit.config.load import load_config
    from fp8kit.config.options import grouped_for_fp8

    cfg = load_config(None, ["fp8.grouped_gemm=loop"])
    assert grouped_for_fp8(cfg.fp8).gemm == "loop"
    assert grouped_for_fp8(load_config(None, []).fp8).gemm == "auto"
    with pytest.raises(ConfigError, match="grouped_gemm"):
        load_config(None, ["fp8.grouped_gemm=dense"])
