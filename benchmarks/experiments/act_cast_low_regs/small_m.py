"""Which outputs of the Gluon 128x1 cast differ from the reference at small M (session 47: M = 1 failed the GPU
test with 3570 of 16384 bytes of q wrong while M = 1000 / 1001 passed). For each M: the differing elements per
output, the rows of q that differ, with the production kernel and with a copy that does not specialize M (Triton
turns an integer argument equal to 1 into a constant), on poisoned (0x7F) output memory.

    python benchmarks/experiments/act_cast_low_regs/small_m.py
"""

from __future__ import annotations

import torch
from triton.experimental import gluon

from fp8kit.fp8 import blockwise
from fp8kit.fp8.kernels import blockwise_gluon as bg

nospec = gluon.jit(bg._act_quant_128x1_kernel.fn, do_not_specialize=["M"])


def run(x, kernel):
    m, k = x.shape
    mp = blockwise.padded_rows(m)
    torch.full((8 * mp * k + (1 << 20),), 0x7F, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    q = torch.empty(mp, k, dtype=blockwise.FP8, device="cuda")
    s_t = torch.empty(k // 128, mp, dtype=torch.float32, device="cuda")
    qt = torch.empty(k, mp, dtype=blockwise.FP8, device="cuda")
    st = torch.empty(mp // 128, k, dtype=torch.float32, device="cuda")
    kernel[(k // 128, mp // 128)](x, q, s_t, qt, st, m, mp, k, x.stride(0), EPS=1e-12, AMAX_MAX=3.4028234663852886e38,
                                  FP8_MAX=448.0, W=8, num_warps=8)
    torch.cuda.synchronize()
    return q, s_t, qt, st


def main() -> None:
    for m, k in ((1, 128), (2, 128), (1, 256), (17, 128), (127, 128), (129, 128), (1000, 128)):
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
        ref = blockwise.quantize_act(x.cpu())
        for name, kern in (("production", bg._act_quant_128x1_kernel), ("M not specialized", nospec)):
            got = run(x, kern)
            diffs = []
            for a, b in zip(got, ref, strict=True):
                a, b = a.cpu(), b
                a8 = a.view(torch.uint8) if a.dtype.itemsize == 1 else a.view(torch.int32)
                b8 = b.view(torch.uint8) if b.dtype.itemsize == 1 else b.view(torch.int32)
                diffs.append(int((a8 != b8).sum()))
            qrows = ((got[0].cpu().view(torch.uint8) != ref[0].view(torch.uint8)).any(1)).nonzero().flatten().tolist()
            print(f"M={m} K={k} {name}: differing q/s_t/qt/st {diffs}; q rows {qrows[:12]}{'...' if len(qrows) > 12 else ''}",
                  flush=True)


if __name__ == "__main__":
    main()
