"""The fused step + cast (``kernel.py``) against the unfused path (the per-block Triton step, then the hinted cast of
the new bf16 weights), bit for bit, in Triton's CPU interpreter. Run from the repository root:

    TRITON_INTERPRET=1 PYTHONPATH=src:. python benchmarks/experiments/fused_optimizer_cast/check_interpreter.py

(with a Triton install; tests/kernels_in_interpreter.py says how). The group holds a 1-D parameter before the expert
weight, so the weight starts at a flat offset other than 0; hints: the previous weights' exact scales (almost
nothing to fix) and zeros (everything recast). The interpreter's float32 -> E4M3 / bf16 conversions are not the
GPU's, but both paths use the same ones, so equality here checks the indexing, the masks and the order of the math.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

torch.library.wrap_triton = lambda k: k
import kernels_in_interpreter as kin  # noqa: E402
from kernel import adamw_step_with_expert_casts  # noqa: E402

from fp8kit.moe import rowwise_quant_triton as rqt  # noqa: E402
from fp8kit.moe import rowwise_weights_triton as rwt  # noqa: E402
from fp8kit.optim import numerics as N  # noqa: E402
from fp8kit.optim import triton_step  # noqa: E402
from fp8kit.optim.layout import FlatLayout  # noqa: E402

rqt._round_pow2 = kin._round_pow2  # libdevice is absent from the interpreter


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def main() -> int:
    shape = (2, 128, 256)
    numels = [384, shape[0] * shape[1] * shape[2]]
    spec = N.StateSpec(block=128, num_tensors=2, granularity="block", grad=torch.bfloat16, m=torch.float8_e4m3fn,
                       v=torch.float16, master=torch.float16, stochastic_rounding=False, m_rounding="stochastic")
    lay = FlatLayout.build(numels, 128, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    bufs = {}
    for name, dt, mag in (("m", spec.m, 1e-3), ("v", spec.v, 1e-6), ("w", spec.master, 0.02)):
        x = torch.randn(lay.total, generator=gen) * mag
        x = x.abs() if name == "v" else x
        x.view(-1)[lay.offsets[1]:][:: 97] *= 30.0  # a few large weights: row and column scales differ
        data, scale = torch.zeros(lay.total, dtype=dt), torch.ones(lay.num_blocks)
        N.store(x.view(-1, 128), data, scale, lay.block_owner, spec)
        bufs[name], bufs[name + "_scale"] = data, scale
    work = N.load(bufs["w"], bufs["w_scale"], lay.block_owner, spec).view(-1).to(torch.bfloat16)
    off, n_el = lay.offsets[1], numels[1]
    prev = rqt.quantize_experts_dual(work[off:off + n_el].view(shape))  # the previous step's copies: the hints
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) * 1e-2 for n in numels]
    hp = N.make_hp(3e-3, 0.9, 0.95, 1e-8, 0.1, 3, 1)
    table = torch.tensor([[g.data_ptr() for g in grads], numels], dtype=torch.int64)
    seg_start = torch.tensor(lay.offsets, dtype=torch.int64)
    hint_cases = {"previous scales": (prev[1], prev[3]),
                  "zero hints": (torch.zeros_like(prev[1]), torch.zeros_like(prev[3]))}
    for (name, (rh, ch)), k_fastest in itertools.product(hint_cases.items(), (False, True)):  # both program orders
        ref = {k: t.clone() for k, t in {**bufs, "work": work}.items()}
        triton_step.adamw_update_triton(None, None, ref["m"], ref["m_scale"], None, ref["v"], ref["v_scale"], ref["w"],
                                        ref["w_scale"], ref["work"], hp, lay.block_owner, spec, grad_table=table,
                                        seg_start=seg_start, grad_vec=8)
        ref_cast = rwt.quantize_experts_dual_hinted(ref["work"][off:off + n_el].view(shape), rh, ch)
        got = {k: t.clone() for k, t in {**bufs, "work": work}.items()}
        got_cast = adamw_step_with_expert_casts(1, shape, got["m"], got["m_scale"], got["v"], got["v_scale"], got["w"],
                                                got["w_scale"], got["work"], hp, spec, table, seg_start, off, rh, ch,
                                                k_fastest=k_fastest)
        blocks = slice(off // 128, (off + n_el) // 128)
        for k in ("m", "v", "w", "work"):
            a, b = raw(ref[k][off:off + n_el]), raw(got[k][off:off + n_el])
            assert torch.equal(a, b), f"{name}: {k} differs in {int((a != b).sum())} of {n_el} elements"
        for k in ("m_scale", "v_scale", "w_scale"):
            assert torch.equal(raw(ref[k][blocks]), raw(got[k][blocks])), f"{name}: {k} differs"
        for j, (a, b) in enumerate(zip(ref_cast, got_cast, strict=True)):
            assert torch.equal(raw(a), raw(b)), f"{name}: cast output {j} differs in {int((raw(a) != raw(b)).sum())}"
        print(f"{name}, k_fastest {k_fastest}: the fused step's states, weights and both copies equal the unfused path's; "
              f"rows / columns recast {got_cast[4].tolist()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
