"""Does a TMA store lift the transposed FP8 store above ~2 TB/s?

Sessions 19 and 32 found every Triton kernel of fp8kit that writes a transposed FP8 copy (``tl.store`` of
``tl.trans(tile)`` through pointers) plateaus at about 2 TB/s against a ~3 TB/s copy rate. This experiment times the
delayed recipe's cast-transpose (bf16 ``x[M, N]`` -> E4M3 ``q[M, N]``, ``qt[N, M]`` and the tile amaxes; 4 bytes per
element) four ways, at the Llama-3-8B activation / gradient shapes:

- ``base``: fp8kit's ``cast_transpose`` (pointer loads and stores, autotuned);
- ``tma_store``: the same kernel with both stores through tensor descriptors (``tl.make_tensor_descriptor``: on
  sm90 a TMA bulk store from shared memory);
- ``tma_both``: the load through a descriptor as well;
- reference rates: ``x.to(E4M3)`` (3 bytes per element), ``x.t().contiguous()`` and ``x.clone()`` (4 each).

Every variant's outputs are checked bit for bit against ``base``'s. Timed as CUDA-graph replays
(``graph_timing.timed``), never on zeros.

    python benchmarks/experiments/tma_transpose/bench.py --out DIR

Result (session 33, H100, Triton 3.6; ``benchmarks/results/session33/tma_transpose/``): rejected. The plain
kernel already moves 2.3-2.65 TB/s (87-89% of ``clone`` at the large shapes); both TMA variants are slower
(1.6-2.0 and 1.9-2.4 TB/s), and ``tma_store`` with pointer loads wrote wrong bytes at every shape (``tma_both``
was exact). The ~2 TB/s of the fused kernels comes from their extra stores, not from the transposed store itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graph_timing import same_bits, timed  # noqa: E402

from fp8kit.fp8.kernels.cast_transpose_triton import _max_nan, cast_transpose  # noqa: E402

E4 = torch.float8_e4m3fn

_CONFIGS = [
    triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=1)
    for bm, bn, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8), (64, 256, 8),
                      (256, 64, 8))
]


@triton.autotune(configs=_CONFIGS, key=["M", "N", "LOAD_TMA"])
@triton.jit
def _cast_transpose_tma_kernel(x_ptr, scale_ptr, q_ptr, qt_ptr, partial_ptr, M, N,
                               FP8_MAX: tl.constexpr, LOAD_TMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    qt_desc = tl.make_tensor_descriptor(qt_ptr, shape=[N, M], strides=[M, 1], block_shape=[BN, BM])
    if LOAD_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
        x = x_desc.load([pid_m * BM, pid_n * BN]).to(tl.float32)
    else:
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
    scale = tl.load(scale_ptr)
    y = tl.minimum(tl.maximum(x * scale, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                   propagate_nan=tl.PropagateNan.ALL)
    q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    q_desc.store([pid_m * BM, pid_n * BN], q)
    qt_desc.store([pid_n * BN, pid_m * BM], tl.trans(q))
    amax = tl.reduce(tl.reduce(tl.abs(x), 1, _max_nan), 0, _max_nan)
    tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_n, amax)


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def cast_transpose_tma(x, scale, load_tma: bool):
    m, n = x.shape
    q = torch.empty(m, n, dtype=E4, device=x.device)
    qt = torch.empty(n, m, dtype=E4, device=x.device)
    partial = torch.empty((triton.cdiv(m, 64) * triton.cdiv(n, 64),), dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(m, meta["BM"]), triton.cdiv(n, meta["BN"]))  # noqa: E731
    _cast_transpose_tma_kernel[grid](x, scale, q.view(torch.uint8), qt.view(torch.uint8), partial, m, n,
                                     FP8_MAX=448.0, LOAD_TMA=load_tma)
    best = _cast_transpose_tma_kernel.best_config.kwargs
    return q, qt, partial[: triton.cdiv(m, best["BM"]) * triton.cdiv(n, best["BN"])].amax()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="8192x14336,16384x14336,8192x4096,14336x4096,4096x4096")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    triton.set_allocator(_alloc)
    rows = []
    for shape in args.shapes.split(","):
        m, n = map(int, shape.split("x"))
        torch.manual_seed(0)
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 3
        scale = torch.tensor(448.0 / 20.0, device="cuda")
        ref = cast_transpose(x, scale, E4, True)
        row = {"shape": shape, "ms": {}, "tb_s": {}, "bits_equal": {}}
        variants = {
            "base": lambda x=x, scale=scale: cast_transpose(x, scale, E4, True),
            "tma_store": lambda x=x, scale=scale: cast_transpose_tma(x, scale, False),
            "tma_both": lambda x=x, scale=scale: cast_transpose_tma(x, scale, True),
            "to_e4m3": lambda x=x, scale=scale: (x.float() * scale).clamp(-448, 448).to(E4),
            "transpose_bf16": lambda x=x: x.t().contiguous(),
            "clone_bf16": lambda x=x: x.clone(),
        }
        nbytes = {"to_e4m3": 3 * m * n}
        for name, fn in variants.items():
            try:
                res = fn()
                if name.startswith("tma") or name == "base":
                    row["bits_equal"][name] = same_bits(res, ref)
                ms = timed(fn)
            except Exception as e:  # a variant Triton can't compile is a result, not a crash
                row["ms"][name] = f"error: {type(e).__name__}: {str(e)[:300]}"
                print(shape, name, row["ms"][name], flush=True)
                continue
            row["ms"][name] = round(ms, 4)
            row["tb_s"][name] = round(nbytes.get(name, 4 * m * n) / ms / 1e9, 3)
            cfg = None
            if name.startswith("tma"):
                cfg = str(_cast_transpose_tma_kernel.best_config)
            print(shape, name, f"{ms:.4f} ms", f"{row['tb_s'][name]} TB/s", row["bits_equal"].get(name, ""),
                  cfg or "", flush=True)
        rows.append(row)
    meta = {"torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name(), "rows": rows}
    (out / "tma_transpose.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
