"""The blockwise recipe's FSDP2 FP8 all-gather (fp8.blockwise_all_gather, fp8.blockwise_gathered) on the CPU: the
shards' 128x128 quantizations, gathered, are the whole weight's bit for bit; the linear and the fused SwiGLU MLP
given the gathered weight compute what they compute from the BF16 weight, eagerly and compiled (fullgraph); a
weight whose shards would split a block is not wrapped, and says why. The 2-rank FSDP2 run through ``fp8kit train``
is ``tests/test_distributed.py::test_fsdp2_blockwise_e4m3_all_gather_trains_like_the_bf16_all_gather``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8kit.base.errors import Fp8kitError
from fp8kit.fp8 import blockwise
from fp8kit.fp8.blockwise_all_gather import BlockwiseFloat8Weight, gather_notes, shard_problem, wrap_weight
from fp8kit.fp8.blockwise_gathered import GatheredBlockwiseWeight
from fp8kit.fp8.kernels import ops
from fp8kit.fp8.linear import Float8BlockwiseLinear, blockwise_linear
from fp8kit.fp8.swiglu_mlp import blockwise_swiglu_mlp


def _gather(w: torch.Tensor, shards: int) -> GatheredBlockwiseWeight:
    """What FSDP2 does with a :class:`BlockwiseFloat8Weight` on ``shards`` ranks: each rank's
    ``fsdp_pre_all_gather`` on its dim-0 shard, the outputs concatenated along dim 0, ``fsdp_post_all_gather``."""
    parts = [BlockwiseFloat8Weight(s.contiguous()).fsdp_pre_all_gather(None) for s in w.chunk(shards)]
    assert all(meta is None for _, meta in parts)
    outputs = tuple(torch.cat([p[0][i] for p in parts]) for i in range(2))
    gathered, inner = BlockwiseFloat8Weight(w).fsdp_post_all_gather(outputs, None, w.dtype)
    assert inner == outputs
    return gathered


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[: n // 2, :128] *= 300.0  # blocks of very different ranges: a scale per block matters
    return w.bfloat16()


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_gathered_shards_are_the_whole_weights_quantization_bit_for_bit(shards):
    w = _weight(512, 384)
    got = ops.quantize_weight(_gather(w, shards), cache=False)
    want = blockwise.quantize_weight(w)
    for name, a, b in zip(("wq", "ws", "wtq", "wts"), got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
        same = a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a
        ref = b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b
        assert torch.equal(same, ref), f"{name}: {(same != ref).sum().item()} elements differ ({shards} shards)"
    wtq, wts = ops.quantize_weight_dgrad(_gather(w, shards))
    assert torch.equal(wtq.view(torch.uint8), want[2].view(torch.uint8)) and torch.equal(wts, want[3])


def _fwd_bwd(fn, x, weights, dy):
    x = x.clone().requires_grad_(True)
    ws = [w.detach().requires_grad_(True) for w in weights]
    y = fn(x, *ws)
    y.backward(dy)
    return [y.detach(), x.grad, *(w.grad for w in ws)]


@pytest.mark.parametrize("keep_weight_copy", [True, False])
def test_linear_with_the_gathered_weight_equals_the_linear_with_the_bf16_weight(keep_weight_copy):
    """Output, input and weight gradients bit for bit: the same blocks reach the same GEMMs; the weight's gradient
    is a plain ``[N, K]`` tensor of the parameter's dtype (what FSDP2 reduce-scatters)."""
    w, x, dy = _weight(256, 384), torch.randn(64, 384).bfloat16(), torch.randn(64, 256).bfloat16()

    def lin(x_, w_):
        return blockwise_linear(x_, w_, keep_weight_copy=keep_weight_copy, cache_weight=False)

    ref = _fwd_bwd(lin, x, [w], dy)
    gathered = nn.Parameter(_gather(w, 2))
    xg = x.clone().requires_grad_(True)
    y = lin(xg, gathered)
    y.backward(dy)
    got = [y.detach(), xg.grad, gathered.grad]
    assert type(gathered.grad) is torch.Tensor and gathered.grad.dtype == torch.bfloat16, type(gathered.grad)
    for name, a, b in zip(("y", "dx", "dw"), got, ref, strict=True):
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max().item()}"


def test_compiled_linear_and_fused_mlp_take_the_gathered_weights_without_a_graph_break():
    """fullgraph=True fails on any graph break; compiled equals eager with the BF16 weights, bit for bit (the
    blockwise ops are opaque to Inductor; the transpose of the gathered bytes is exact)."""
    wg, wu, wd, wl = _weight(256, 128, 1), _weight(256, 128, 2), _weight(256, 256, 3), _weight(256, 256, 4)
    x, dy = torch.randn(32, 128).bfloat16(), torch.randn(32, 256).bfloat16()

    def mlp(x_, g_, u_, d_, l_):  # the fused SwiGLU MLP, then a linear (keep_weight_copy=False: FSDP2's setting)
        h = blockwise_swiglu_mlp(x_, g_, u_, d_, cache_weight=False, keep_weight_copy=False)
        return blockwise_linear(h, l_, cache_weight=False, keep_weight_copy=False)

    ref = _fwd_bwd(mlp, x, [wg, wu, wd, wl], dy)
    params = [nn.Parameter(_gather(w, 2)) for w in (wg, wu, wd, wl)]
    compiled = torch.compile(mlp, fullgraph=True)
    xg = x.clone().requires_grad_(True)
    y = compiled(xg, *params)
    y.backward(dy)
    got = [y.detach(), xg.grad, *(p.grad for p in params)]
    for name, a, b in zip(("y", "dx", "d_gate", "d_up", "d_down", "d_linear"), got, ref, strict=True):
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max().item()}"


def test_a_weight_whose_shards_split_blocks_keeps_the_bf16_all_gather_and_says_why():
    assert shard_problem(512, 4) is None
    assert shard_problem(384, 2) == ("out_features 384 is not a multiple of 128 x 2 shards: a shard would split a "
                                     "128x128 block")
    model = nn.Sequential(Float8BlockwiseLinear.from_linear(nn.Linear(128, 512, bias=False)),
                          Float8BlockwiseLinear.from_linear(nn.Linear(512, 128, bias=False)))
    assert wrap_weight(model[0], 2) is None and wrap_weight(model[0], 2) is None  # idempotent
    assert isinstance(model[0].weight.data, BlockwiseFloat8Weight)
    assert wrap_weight(model[1], 2) == shard_problem(128, 2)
    assert type(model[1].weight.data) is torch.Tensor
    assert gather_notes(model, 2) == (
        ["fp8.enable_fsdp_float8_all_gather: 1 of 2 blockwise linears all-gather their 128x128-block E4M3 "
         "quantization (fp8kit.fp8.blockwise_all_gather)"],
        ["fp8.enable_fsdp_float8_all_gather: 1 of 2 blockwise linears keep the BF16 all-gather (out_features 128 is "
         "not a multiple of 128 x 2 shards: a shard would split a 128x128 block), e.g. 1"])


def test_other_ops_on_a_gathered_weight_fail_with_the_setting_named():
    g = _gather(_weight(256, 128), 2)
    assert g.shape == (256, 128) and g.dtype == torch.bfloat16
    assert isinstance(g.detach(), GatheredBlockwiseWeight)
    with pytest.raises(Fp8kitError, match=r"aten\.add.*fp8\.enable_fsdp_float8_all_gather = false"):
        g + 1

