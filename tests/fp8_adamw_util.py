"""Shared helpers of the FP8AdamW tests (tests/test_fp8_adamw*.py): small models, data, training loops."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8kit.optim import FP8AdamW, FP8AdamWPrecision
from fp8kit.optim import numerics as N
from fp8kit.optim.layout import FlatLayout
from fp8kit.optim.numerics import load, load_m

FP32 = FP8AdamWPrecision(master="fp32", grad="param", m="fp32", v="fp32")
#: FP8-LM's own layout: FP8 gradients from the backward hooks, E4M3 m rounded to nearest.
PAPER = FP8AdamWPrecision(grad="e5m2", m_rounding="nearest")
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)


@pytest.fixture
def one_thread():
    """Tensors of a few thousand elements: intra-op threads only add synchronisation (and stall when
    another job shares the two cores); run single-threaded and restore the setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def groups(model: nn.Module, wd: float = 0.1) -> list[dict]:
    """Two groups as the trainer builds them: weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def regression(seed: int, n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 1, generator=g)
    return x, torch.sin(x @ w) + 0.1 * torch.randn(n, 1, generator=g)


def warmup(opt) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))


def fit(model, opt, sched, x, y, steps: int, start: int = 0, batch: int = 32) -> list[float]:
    losses = []
    for s in range(start, start + steps):
        i = torch.arange(s * batch, (s + 1) * batch) % len(x)
        loss = ((model(x[i]) - y[i]) ** 2).mean()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def rel_dist(model, ref, init) -> float:
    """L2 distance to the reference parameters over the reference's L2 distance travelled."""
    a, b, c = flat(model), flat(ref), flat(init)
    return ((a - b).norm() / (b - c).norm()).item()


def state(opt: FP8AdamW, name: str, gi: int = 0) -> torch.Tensor:
    """Dequantized float32 flat state ``name`` (``grad`` (FP8 mode), ``m``, ``v``, ``master``) of group ``gi``."""
    fg = opt._flat[gi]
    if name == "m":
        return load_m(fg.m, fg.m_scale, fg.m_k, fg.layout.block_owner, fg.spec).reshape(-1)
    return load(getattr(fg, name), getattr(fg, f"{name}_scale"), fg.layout.block_owner, fg.spec).reshape(-1)


def flat_states(numels: list[int], spec: N.StateSpec, device: torch.device, gen: torch.Generator,
                pdtype: torch.dtype = torch.bfloat16) -> tuple[FlatLayout, dict, torch.Tensor]:
    """Random FP8AdamW states of one flat group, for driving the step functions directly: ``(layout, buffers,
    working weights)``; ``buffers`` holds ``m``, ``v``, ``w`` (the master) stored in ``spec``'s dtypes and their
    scales (``None`` for float32), from m ~ 1e-3, v ~ 1e-6 (positive) and w ~ 1 normals, zero in the padding
    as the optimizer keeps it; the working weights are the master loaded in ``pdtype``."""
    lay = FlatLayout.build(numels, spec.block, device)
    n_scales = len(numels) if spec.granularity == "tensor" else lay.num_blocks
    bufs = {}
    for name, dt, mag in (("m", spec.m, 1e-3), ("v", spec.v, 1e-6), ("w", spec.master, 1.0)):
        x = torch.randn(lay.total, generator=gen, device=device) * mag
        x = x.abs() if name == "v" else x
        for i in range(len(numels)):
            lay.padded_segment(x, i)[numels[i]:] = 0
        data = torch.zeros(lay.total, device=device, dtype=dt)
        scale = torch.ones(n_scales, device=device) if dt != torch.float32 else None
        N.store(x.view(-1, spec.block), data, scale, lay.block_owner, spec)
        bufs[name], bufs[name + "_scale"] = data, scale
    work = N.load(bufs["w"], bufs["w_scale"], lay.block_owner, spec).view(-1).to(pdtype)
    return lay, bufs, work
