"""Clipping folded into fused AdamW equals clip_grad_norm_ followed by the same optimizer."""

from __future__ import annotations

import copy

import pytest
import torch

from fp8kit.train.clip import clip_grad_norm


@pytest.mark.parametrize("fused", [True, False])
def test_clip_matches_torch_clip_grad_norm(fused):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=fused)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2, fused=fused)
    clipped = 0
    for step in range(30):
        x = torch.randn(16, 64) * (20.0 if step % 3 == 0 else 0.05)  # some steps clip, some don't
        a(x).square().mean().backward()
        b(x).square().mean().backward()
        ref = torch.nn.utils.clip_grad_norm_(a.parameters(), 1.0)
        norm = clip_grad_norm(list(b.parameters()), 1.0, opt_b)
        clipped += bool(ref > 1.0)
        torch.testing.assert_close(norm, ref)
        opt_a.step(), opt_b.step()
        opt_a.zero_grad(), opt_b.zero_grad()
    assert 5 <= clipped <= 25, clipped
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


def test_no_clip_leaves_gradients_alone():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    opt = torch.optim.AdamW([p], fused=True)
    norm = clip_grad_norm([p], 0.0, opt)
    assert float(norm) == 6.0 and p.grad.eq(3.0).all() and getattr(opt, "grad_scale", None) is None
