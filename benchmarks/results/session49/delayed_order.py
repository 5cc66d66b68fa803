"""Session 49: does the compiled delayed linear slow down when a second shape is compiled after a first?
Times (CUDA-graph replay) and profiles (kernel list of the replay) each shape in the given order, in one process.

    python benchmarks/results/session49/delayed_order.py 16384x4096x14336,8192x4096x4096
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "benchmarks")
from linear_fwd_bwd import build, time_step, warm_up, weight_of  # noqa: E402

torch._dynamo.config.cache_size_limit = 256
for item in sys.argv[1].split(","):
    m, k, n = (int(d) for d in item.split("x"))
    base = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for v in sys.argv[2].split(",") if len(sys.argv) > 2 else ["bf16", "fp8kit_delayed"]:
        mod = build(v, base)
        w = weight_of(mod)

        def step(mod=mod, w=w, x=x, dy=dy):
            return torch.autograd.grad(mod(x), (x, w), dy)

        ms, mode = time_step(step)
        warm_up(step)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
        print(f"{item} {v}: {ms:.4f} ms ({mode})", flush=True)
        rows = sorted(((e.self_device_time_total / 5e3, e.count // 5, e.key) for e in prof.key_averages()
                       if e.self_device_time_total), reverse=True)
        for t, c, key in rows[:14]:
            print(f"    {t:.4f} ms x{c}  {key[:110]}")
        del g, mod
