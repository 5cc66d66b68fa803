# ruff: noqa: B023  (each lambda runs inside its loop iteration)
"""The per-(expert, column) wgrad casts of the fused FP8 experts (``quantize_group_cols_dual``), timed alone on the
GPU at the expert shapes of ``benchmarks/moe_layer.py``: the committed launch (one program per (group, 64-column
block), 64-row slices) against other tile shapes and against a persistent launch (``P`` programs per SM walking the
(group, column block) items, so that far fewer column strips are in flight and each program's second pass, the
cast, re-reads its strip from L2 instead of HBM). Every variant is checked bit for bit against the committed kernel.

    python benchmarks/experiments/group_cols/bench.py --out /tmp/group_cols.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_timing import same_bits as same  # noqa: E402
from graph_timing import timed  # noqa: E402

from fp8kit.moe import rowwise_quant_triton as rq  # noqa: E402
from fp8kit.moe.routing import dispatch  # noqa: E402

# name -> (experts, topk, hidden, expert width); 16384 tokens, as moe_layer.py
MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v3": (128, 8, 7168, 2048), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = 16384


@triton.jit
def _persistent_dual_kernel(
    g_ptr, g_data_ptr, g_inv_ptr, N, stride_g,
    x_ptr, idx_ptr, x_data_ptr, x_inv_ptr, K, stride_x, T,
    offs_ptr, P, E, NB_G, NB, NPROG,
    GATHER: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
    EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
):
    total = (E + 1) * NB
    for item in range(tl.program_id(0), total, NPROG):
        pid_g = item // NB
        pid_c = item % NB
        if pid_c < NB_G:
            rq._group_cols_block(g_ptr, idx_ptr, g_ptr, offs_ptr, g_data_ptr, g_inv_ptr, pid_g, pid_c, T, P, N, E,
                                 stride_g, False, False, BR, BC, EPS, AMAX_MAX, FP8_MAX)
        else:
            rq._group_cols_block(x_ptr, idx_ptr, x_ptr, offs_ptr, x_data_ptr, x_inv_ptr, pid_g, pid_c - NB_G, T, P, K,
                                 E, stride_x, GATHER, False, BR, BC, EPS, AMAX_MAX, FP8_MAX)


def dual_args(g, x, offs, index_x, bc):
    """``(outputs, args, column blocks of g, of x)``: the committed dual launch's buffers and arguments up to ``NB_G``
    (``g`` read plainly, as the down projection's wgrad operand)."""
    p, n = g.shape
    k = x.shape[1]
    e = offs.shape[0]
    g_data, g_inv = rq._group_out(g, p, n, e)
    x_data, x_inv = rq._group_out(x, p, k, e)
    nb_g, nb_x = triton.cdiv(n, bc), triton.cdiv(k, bc)
    x, t = rq._gather_source(x)
    args = (g, g_data, g_inv, n, g.stride(0), x, x if index_x is None else index_x, x_data, x_inv, k, x.stride(0), t,
            offs, p, e, nb_g)
    return (g_data, g_inv, x_data, x_inv), args, nb_g, nb_x


def launch(g, x, offs, index_x, br, bc, warps, per_sm):
    out, args, nb_g, nb_x = dual_args(g, x, offs, index_x, bc)
    e = offs.shape[0]
    if per_sm == 0:
        g_, g_data, g_inv, n, stride_g, *rest = args
        rq._group_cols_dual_kernel[(e + 1, nb_g + nb_x)](g_, g_, g_, g_data, g_inv, n, stride_g, 0, *rest,
                                                          G_GATHER=False, GATHER=index_x is not None, BR=br, BC=bc,
                                                          num_warps=warps, **rq._KW)
    else:
        nprog = min(per_sm * torch.cuda.get_device_properties(0).multi_processor_count, (e + 1) * (nb_g + nb_x))
        _persistent_dual_kernel[(nprog,)](*args, nb_g + nb_x, nprog, GATHER=index_x is not None, BR=br, BC=bc,
                                          num_warps=warps, **rq._KW)
    return out


def operands(name):
    e, k, h, i = MODELS[name]
    gen = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.rand(TOKENS, e, generator=gen).argsort(dim=1)[:, :k].cuda()
    d = dispatch(idx, e)
    p = d.rows
    dev = "cuda"

    def rnd(*shape):
        t = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
        t[:, ::97] *= 30.0  # a few outlier columns
        return t

    hidden = rnd(TOKENS, h)
    # (label, g, x, index_x): down_proj's wgrad (dy, a) and gate_up_proj's (dh, tokens through the dispatch index)
    return p, [("down", rnd(p, h), rnd(p, i), None), ("up", rnd(p, 2 * i), hidden, d.gather_idx)], d.offs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--configs", default="", help="'BR,BC,warps,per_sm;...' instead of the default sweep")
    args = ap.parse_args()
    configs = [(64, 64, 4, 0), (128, 64, 4, 0), (128, 64, 8, 0), (64, 128, 4, 0), (128, 128, 8, 0), (32, 64, 4, 0)]
    configs += [(br, bc, w, ps) for ps in (1, 2, 4) for br, bc, w in ((64, 64, 4), (128, 64, 8), (128, 128, 8))]
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "configs": "BR, BC, num_warps, programs per SM (0 = one program per item)", "rows": []}
    for name in args.models.split(","):
        p, ops, offs = operands(name)
        for label, g, x, idx in ops:
            ref = rq.quantize_group_cols_dual(g, x, offs, idx)
            elems = p * (g.shape[1] + x.shape[1])
            row = {"model": name, "gemm": label, "P": p, "N": g.shape[1], "K": x.shape[1], "results": []}
            for br, bc, w, ps in configs:
                try:
                    out = launch(g, x, offs, idx, br, bc, w, ps)
                    ok = same(out, ref)
                    ms = timed(lambda: launch(g, x, offs, idx, br, bc, w, ps), reps=10)
                    r = {"cfg": [br, bc, w, ps], "ms": round(ms, 4), "tb_s_min": round(elems * 3 / ms / 1e9, 3),
                         "bit_equal": ok}
                except Exception as exc:  # noqa: BLE001 - record and go on
                    r = {"cfg": [br, bc, w, ps], "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                row["results"].append(r)
                print(name, label, r, flush=True)
            rec["rows"].append(row)
            Path(args.out).write_text(json.dumps(rec, indent=1))
        del ops
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
