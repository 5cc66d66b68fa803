"""Reproduce session 50's `fp8kit_delayed_grad` error at 8192x2048x2048 with its traceback (device only)."""
import sys
import traceback

import torch
import torch._dynamo
from torch import nn

sys.path.insert(0, "benchmarks")
import linear_fwd_bwd as L  # noqa: E402

for shape in [(4096, 2048, 2048), (8192, 2048, 2048), (8192, 2048, 8192)]:
    torch._dynamo.reset()
    m, k, n = shape
    dev = torch.device("cuda")
    base = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    for v in ["fp8kit_delayed_grad", "fp8kit_delayed_fused"]:
        try:
            mod = L.build(v, base)
            w = L.weight_of(mod)
            xv = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)

            def step(mod=mod, w=w, xv=xv, dy=dy):
                return torch.autograd.grad(mod(xv), (xv, w), dy)

            L.warm_up(step)
            print(shape, v, "warm ok", flush=True)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            g.replay()
            torch.cuda.synchronize()
            print(shape, v, "graph ok", flush=True)
        except Exception:
            traceback.print_exc()
            print(shape, v, "FAILED", flush=True)
            sys.exit(1)
