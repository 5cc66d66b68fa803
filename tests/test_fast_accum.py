"""Fast accumulation per GEMM (``Recipe.fast_accum`` in ``fp8kit.fp8.recipes``): the tensorwise-scaled recipes run
fprop with the tensor cores' fast accumulation and dgrad / wgrad with the split (FP32-promoting) accumulator, as
Transformer Engine and torchao do. On the CPU ``torch._scaled_mm`` computes the same either way, so these tests
check what reaches it: every ``aten._scaled_mm`` call of a training step, seen by a dispatch mode, forward ones
fast and backward ones split. The GPU check of the numbers is tests/test_delayed_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8kit.fp8.recipes import FPROP_FAST_ACCUM, GEMMS, RECIPES, float8_linear_config
from tests.conftest import prepared_llama


class _ScaledMMCalls(TorchDispatchMode):
    """Records ``use_fast_accum`` of every ``aten._scaled_mm`` call while active."""

    def __init__(self):
        super().__init__()
        self.fast: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._scaled_mm.default:
            # schema: (self, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
            self.fast.append(bool(kwargs.get("use_fast_accum", args[7] if len(args) > 7 else False)))
        return func(*args, **kwargs)


def test_the_recipe_table_names_gemms_and_follows_transformer_engine():
    for r in RECIPES.values():
        assert set(r.fast_accum) <= set(GEMMS), (r.name, r.fast_accum)
    for name in ("tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"):
        assert RECIPES[name].fast_accum == FPROP_FAST_ACCUM == ("fprop",), name
    assert RECIPES["blockwise"].fast_accum == ()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_torchao_configs_take_the_table_accumulation(recipe):
    cfg = float8_linear_config(recipe)
    got = (cfg.gemm_config_output.use_fast_accum, cfg.gemm_config_grad_input.use_fast_accum,
           cfg.gemm_config_grad_weight.use_fast_accum)
    assert got == (True, False, False), got


@pytest.mark.parametrize("fused", [True, False])
def test_delayed_forward_gemms_accumulate_fast_and_backward_gemms_split(fused):
    """Three steps of a two-layer llama: the delayed linears (step 1, dynamic scales; every step unfused) and the
    fused delayed MLP (steps 2-3) call forward GEMMs fast and backward GEMMs split. (torchao's linears call
    ``_scaled_mm`` from a tensor subclass, below a dispatch mode: their config is checked above.)"""
    model, _ = prepared_llama(["fp8.recipe=delayed", f"fp8.delayed_fused_mlp={str(fused).lower()}"])
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, 1024, (2, 64), generator=gen)
        model.zero_grad(set_to_none=True)
        with _ScaledMMCalls() as fwd:
            loss = model(input_ids=ids, labels=ids).loss
        with _ScaledMMCalls() as bwd:
            loss.backward()
        # 2 layers x 7 linears (the head stays BF16): 14 forward GEMMs, 28 backward (dgrad + wgrad)
        assert fwd.fast == [True] * 14, f"step {step}: forward use_fast_accum {fwd.fast}"
        assert bwd.fast == [False] * 28, f"step {step}: backward use_fast_accum {bwd.fast}"
