"""FP8AdamW's chunked eager CPU step (optim/chunked_step.py) gives the whole-group reference step's bits.

Two FP8AdamW over identical parameters and gradients, one stepping with ``numerics.adamw_update`` over the whole
flat group, the other with ``adamw_update_chunked`` at a chunk of 3 blocks (so chunks straddle parameters and
end mid-tensor): after every one of 4 steps their working weights, states and scales must be equal bit for bit,
for the default precision and every per-block variant the chunked step takes (COAT, FP8 gradients, nearest
rounding, fp32 / bf16 / fp16 ``m``, fp32 master, another block size).
"""

from __future__ import annotations

import functools

import pytest
import torch

from fp8kit.optim.chunked_step import adamw_update_chunked, chunkable
from fp8kit.optim.fp8_adamw import FP8AdamW
from fp8kit.optim.numerics import adamw_update
from fp8kit.optim.precision import FP8AdamWPrecision

STATES = ("m", "m_scale", "m_k", "v", "v_scale", "master", "master_scale", "work")
VARIANTS = {
    "default": {},
    "coat": {"m_expand": "coat"},
    "e5m2_grads": {"grad": "e5m2"},
    "nearest_m": {"m_rounding": "nearest"},
    "fp32_m_fp32_master": {"m": "fp32", "master": "fp32"},
    "bf16_m_stochastic": {"m": "bf16"},
    "fp16_m_block_64": {"m": "fp16", "block_size": 64},
}


def _pair(prec: FP8AdamWPrecision):
    """Two optimizers over equal copies of the same small model (odd sizes: 5 parameters padded to blocks)."""
    torch.manual_seed(0)
    shapes = [(40, 24), (24,), (96, 40), (7, 13), (130, 3)]
    base = [torch.randn(s) * 0.1 for s in shapes]
    out = []
    for fn in (adamw_update, functools.partial(adamw_update_chunked, chunk_elements=3 * prec.block_size)):
        params = [torch.nn.Parameter(t.clone().bfloat16()) for t in base]
        opt = FP8AdamW(params, lr=1e-2, weight_decay=0.1, precision=prec)
        opt._flat[0].step_fn = fn
        out.append((params, opt))
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_step_equals_the_whole_group_step_bit_for_bit(variant):
    prec = FP8AdamWPrecision(granularity="block", **VARIANTS[variant])
    (pa, oa), (pb, ob) = _pair(prec)
    assert oa._flat[0].spec.granularity == "block" and chunkable(oa._flat[0].spec)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        grads = [torch.randn(p.shape, generator=g) * 10.0 ** -step for p in pa]  # shrinking: the scales move
        for params, opt in ((pa, oa), (pb, ob)):
            for p, gr in zip(params, grads, strict=True):
                p.grad = gr.bfloat16()
            opt.step()
        fa, fb = oa._flat[0], ob._flat[0]
        for name in STATES:
            a, b = getattr(fa, name, None), getattr(fb, name, None)
            if a is None:
                assert b is None, name
                continue
            same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            assert same, f"{variant}, step {step}: {name} differs in {(a.float() != b.float()).sum().item()} elements"


def test_cpu_eager_steps_pick_the_chunked_step_only_for_per_block_scales():
    for gran, chunked in (("block", True), ("tensor", False)):
        opt = FP8AdamW([torch.nn.Parameter(torch.randn(64, 64).bfloat16())],
                       precision=FP8AdamWPrecision(granularity=gran))
        assert opt.step_impl == "eager"
        assert (opt._flat[0].step_fn is adamw_update_chunked) == chunked, (gran, opt._flat[0].step_fn)
    opt = FP8AdamW([torch.nn.Parameter(torch.randn(64, 64).bfloat16())],
                   precision=FP8AdamWPrecision(granularity="block", master="bf16_sr"))
    assert opt._flat[0].step_fn is adamw_update, "a stochastically rounded bf16 master draws from the global generator"


def test_a_spec_it_cannot_chunk_is_refused():
    opt = FP8AdamW([torch.nn.Parameter(torch.randn(64, 64).bfloat16())], precision=FP8AdamWPrecision())
    fg = opt._flat[0]
    with pytest.raises(ValueError, match="granularity 'tensor'"):
        adamw_update_chunked(torch.zeros(fg.layout.total), None, fg.m, fg.m_scale, fg.m_k, fg.v, fg.v_scale,
                             fg.master, fg.master_scale, fg.work, fg.hp, fg.layout.block_owner, fg.spec)
