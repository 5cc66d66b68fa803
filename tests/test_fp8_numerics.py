"""FP8 linear numerics against an FP32 reference, on realistic shapes (CPU scaled matmul).

Floors are torchao's own test floors (shared/anchors.md): SQNR >= 18 dB for the output, >= 17 dB for
the input and weight gradients. SQNR = 20 log10(||ref|| / ||ref - out||).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fp8kit import convert_to_fp8
from fp8kit.config import FP8Config
from fp8kit.parallel.convert import count_fp8_modules, restore_bf16
from tests.conftest import sqnr

# (tokens M, in K, out N): Llama-3-8B k/v projection and MLP shapes at a CPU-friendly token count.
SHAPES = [(256, 4096, 1024), (256, 1024, 4096), (512, 2048, 512)]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_fp8_linear_sqnr(recipe, shape):
    m, k, n = shape
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(k, n, bias=False)).to(torch.bfloat16)
    ref_layer = copy.deepcopy(layer).float()
    fp8_layer = copy.deepcopy(layer)
    decisions = convert_to_fp8(fp8_layer, FP8Config(recipe=recipe))
    assert count_fp8_modules(fp8_layer) == 1 and decisions[0].is_fp8

    x = torch.randn(m, k, dtype=torch.bfloat16)
    grad = torch.randn(m, n, dtype=torch.bfloat16)
    x_ref = x.float().requires_grad_()
    x_fp8 = x.clone().requires_grad_()
    y_ref = ref_layer(x_ref)
    y_fp8 = fp8_layer(x_fp8)
    y_ref.backward(grad.float())
    y_fp8.backward(grad)

    out_db = sqnr(y_ref, y_fp8)
    gin_db = sqnr(x_ref.grad, x_fp8.grad)
    gw_db = sqnr(ref_layer[0].weight.grad, fp8_layer[0].weight.grad)
    assert y_fp8.dtype == torch.bfloat16
    assert out_db >= 18.0, f"output SQNR {out_db:.2f} dB < 18 ({recipe}, {shape})"
    assert gin_db >= 17.0, f"grad_input SQNR {gin_db:.2f} dB < 17 ({recipe}, {shape})"
    assert gw_db >= 17.0, f"grad_weight SQNR {gw_db:.2f} dB < 17 ({recipe}, {shape})"
    # FP8 is really used: it must differ from a plain bf16 matmul (which would give ~40+ dB).
    bf16_db = sqnr(y_ref, layer(x))
    assert out_db < bf16_db - 3.0, f"FP8 output {out_db:.1f} dB is as accurate as bf16 ({bf16_db:.1f} dB)"


def test_restore_bf16_keeps_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).to(torch.bfloat16)
    params = [id(p) for p in model.parameters()]
    convert_to_fp8(model)
    assert count_fp8_modules(model) == 2
    assert [id(p) for p in model.parameters()] == params
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    y8 = model(x)
    assert restore_bf16(model) == 2 and count_fp8_modules(model) == 0
    assert [id(p) for p in model.parameters()] == params
    assert type(model[0]) is nn.Linear
    y16 = model(x)
    assert 15 < sqnr(y16, y8) < 40  # same weights; fp8 vs bf16 numerics differ a little
