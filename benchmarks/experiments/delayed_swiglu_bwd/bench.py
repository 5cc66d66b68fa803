"""The delayed recipe's SwiGLU backward: fp8kit's one-read Triton kernel against what Inductor generates for the same
math (the unfused delayed MLP's backward casts), alone, at Llama-3-8B MLP shapes.

Both compute dg, du (bf16-rounded), their E5M2 copies in both layouts at known scales, their amaxes, and the E4M3
transposed copy of a = silu(g) * u. Timed as CUDA-graph replays (``graph_timing.timed``); the kernel's casts
checked bit for bit against the reference casts of the values it computed.

    python benchmarks/experiments/delayed_swiglu_bwd/bench.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graph_timing import same_bits, timed  # noqa: E402

from fp8kit.fp8.kernels import swiglu_delayed_triton as k  # noqa: E402
from fp8kit.fp8.scaling import quantize  # noqa: E402
from fp8kit.fp8.swiglu import swiglu_backward_ref, swiglu_ref  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def inductor_math(g, u, da, sg, su, sa):
    gf, uf, d = g.float(), u.float(), da.float()
    s = torch.sigmoid(gf)
    dg = (d * uf * s * (1.0 + gf * (1.0 - s))).to(g.dtype)
    du = (d * gf * s).to(g.dtype)
    a = (gf * s * uf).to(g.dtype)
    out = []
    for t, sc in ((dg, sg), (du, su)):
        q = (t.float() * sc).clamp(-57344.0, 57344.0).to(E5)
        out += [q, q.t().contiguous(), t.abs().amax(dim=-1).amax().float()]
    out.append((a.float() * sa).clamp(-448.0, 448.0).to(E4).t().contiguous())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="8192x14336,16384x14336,8192x4096")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    compiled = torch.compile(inductor_math)
    rows = []
    for shape in args.shapes.split(","):
        m, i = map(int, shape.split("x"))
        torch.manual_seed(0)
        g = torch.randn(m, i, device="cuda", dtype=torch.bfloat16) * 2
        u = torch.randn(m, i, device="cuda", dtype=torch.bfloat16)
        da = torch.randn(m, i, device="cuda", dtype=torch.bfloat16) * 1e-3
        sg, su = (torch.tensor(57344.0 / 6e-3, device="cuda") for _ in range(2))
        sa = torch.tensor(448.0 / 20.0, device="cuda")
        # bits: the kernel's casts of its own values == the reference casts of those values
        qg, qgt, qu, qut, qat, amax, vg, vu, va = k.swiglu_backward_cast(g, u, da, sg, su, sa, write_values=True)
        ok = same_bits((qg, qgt, qu, qut, qat), (quantize(vg, sg, E5), quantize(vg, sg, E5).t().contiguous(),
                                                 quantize(vu, su, E5), quantize(vu, su, E5).t().contiguous(),
                                                 quantize(va, sa, E4).t().contiguous()))
        ok_amax = torch.equal(amax, torch.stack([vg.abs().amax().float(), vu.abs().amax().float()]))
        rg, ru = swiglu_backward_ref(da, g, u)
        ra = swiglu_ref(g, u)
        ulp = max(((x.float() - y.float()).abs() > y.float().abs() * 2 ** -7 + 1e-30).float().mean().item()
                  for x, y in ((vg, rg), (vu, ru), (va, ra)))
        args = (g, u, da, sg, su, sa)
        t_kernel = timed(lambda a=args: k.swiglu_backward_cast(*a))
        t_kernel_no_a = timed(lambda a=args: k.swiglu_backward_cast(*a[:5], None))
        t_inductor = timed(lambda a=args: compiled(*a))
        gb = m * i * (3 * 2 + 5) / 1e9
        row = {"shape": shape, "kernel_ms": t_kernel, "kernel_no_a_ms": t_kernel_no_a, "inductor_ms": t_inductor,
               "kernel_TBps": gb / t_kernel, "floor_ms_at_3TBps": gb / 3.0, "casts_same_bits": ok,
               "amax_same": ok_amax, "frac_values_beyond_ulp": ulp,
               "config": str(k._swiglu_bwd_cast_kernel.best_config)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    (out / "delayed_swiglu_bwd.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                            "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
