"""The blockwise FP8 all-gather's gathered weight on a CUDA GPU (marker ``gpu``; skipped without CUDA): the shards'
quantizations by the Triton weight cast, gathered, equal the whole weight's bit for bit, and the compiled linear and
fused SwiGLU MLP given them compute, with cuBLAS's blockwise GEMMs, exactly what they compute from the BF16 weights.
The CPU versions (reference casts, emulated GEMMs) are in tests/test_blockwise_all_gather.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8kit.fp8.blockwise_all_gather import BlockwiseFloat8Weight
from fp8kit.fp8.kernels import ops
from fp8kit.fp8.linear import blockwise_linear
from fp8kit.fp8.swiglu_mlp import blockwise_swiglu_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _gather(w: torch.Tensor, shards: int):
    parts = [BlockwiseFloat8Weight(s.contiguous()).fsdp_pre_all_gather(None)[0] for s in w.chunk(shards)]
    outputs = tuple(torch.cat([p[i] for p in parts]) for i in range(2))
    return BlockwiseFloat8Weight(w).fsdp_post_all_gather(outputs, None, w.dtype)[0]


def _weight(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cuda") * 0.02
    w[: n // 2, :128] *= 300.0
    return w.bfloat16()


@pytest.mark.parametrize("shards", [2, 8])
def test_gathered_shards_equal_the_whole_weights_cast_bit_for_bit(shards):
    w = _weight(4096, 2048, 0)
    got = ops.quantize_weight(_gather(w, shards), cache=False)
    want = ops.quantize_weight(w, cache=False)
    for name, a, b in zip(("wq", "ws", "wtq", "wts"), got, want, strict=True):
        a8 = a.view(torch.uint8) if a.element_size() == 1 else a
        b8 = b.view(torch.uint8) if b.element_size() == 1 else b
        assert a.shape == b.shape and torch.equal(a8, b8), f"{name}: {(a8 != b8).sum().item()} elements differ"


def test_compiled_mlp_and_linear_with_gathered_weights_equal_the_bf16_weights():
    ws = [_weight(1024, 512, 1), _weight(1024, 512, 2), _weight(512, 1024, 3), _weight(512, 512, 4)]
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)

    def fn(x_, g_, u_, d_, l_):
        h = blockwise_swiglu_mlp(x_, g_, u_, d_, cache_weight=False, keep_weight_copy=False)
        return blockwise_linear(h, l_, cache_weight=False, keep_weight_copy=False)

    def run(f, weights):
        xs = x.clone().requires_grad_(True)
        y = f(xs, *weights)
        y.backward(dy)
        return [y.detach(), xs.grad, *(w.grad for w in weights)]

    ref = run(torch.compile(fn, fullgraph=True), [nn.Parameter(w.clone()) for w in ws])
    got = run(torch.compile(fn, fullgraph=True), [nn.Parameter(_gather(w, 2)) for w in ws])
    for name, a, b in zip(("y", "dx", "d_gate", "d_up", "d_down", "d_linear"), got, ref, strict=True):
        assert torch.equal(a, b), f"{name}: max |diff| {(a.float() - b.float()).abs().max().item()}"
