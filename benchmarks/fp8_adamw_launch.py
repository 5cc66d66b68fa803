"""Launch settings of the FP8AdamW Triton step: time ``opt.step()`` per ``num_warps``, blocks per program and
gradient load width (run on a GPU).

The optimizer is the one ``fp8kit train`` builds (``train.setup.build_optimizer``, ``optim.name = "fp8_adamw"``
with the ``[optim]`` defaults) on the real parameters of a preset (default: Llama-3-8B layer shapes x 8 and
a 32000 vocabulary, 2.0B parameters, bf16), with ``randn * 1e-3`` gradients handed over as autograd does.
For each value of ``--num-warps`` (the second of ``fp8kit.optim.triton_step.LAUNCH[granularity]``, a launch setting: the states are
the same bits for any value; ``tests/test_fp8_adamw_gpu.py`` checks the kernel against the reference) it
times ``--iters`` back-to-back steps with CUDA events after ``--warmup``, interleaving the settings over
``--repeats`` rounds, and reports the median, the bytes per parameter the kernels move and the bandwidth.
``--rows`` varies the blocks each program takes (the first of ``LAUNCH[granularity]``, also a launch setting; values
that do not divide the layout's alignment, ``fp8kit.optim.layout.ALIGN_BLOCKS``, are skipped with a message).
``--grad-vec`` also varies how ``param.grad`` is read: ``auto`` (16-byte vector loads, what the optimizer does:
``FlatGroup.update_grad_table`` pads the gradients that are not whole aligned vectors) or ``1`` (element loads in
every group, forced after the table is built; the kernel before session 25 also read by element). The copy
reference is ``Tensor.copy_`` (up to 4 GiB, scaled to the step's bytes: the bandwidth a streaming kernel can reach), and
every setting's states after one step from the same start are compared bit for bit with the first setting's.

    python benchmarks/fp8_adamw_launch.py --num-warps 1,2,4,8 --out /tmp/fp8_adamw_launch.json
    python benchmarks/fp8_adamw_launch.py --num-warps 2,4,8 --rows 2,4,8 --out /tmp/fp8_adamw_rows.json
    python benchmarks/fp8_adamw_launch.py --num-warps 4 --grad-vec 1,auto \
        --set model.preset=qwen3-30b-a3b --set model.num_layers=4 --set data.vocab_size=151936
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fp8kit.config import load_config  # noqa: E402
from fp8kit.config.optim_choice import resolve_optimizer  # noqa: E402
from fp8kit.models.build import build_model  # noqa: E402
from fp8kit.optim import triton_step  # noqa: E402
from fp8kit.optim.flat_group import FlatGroup  # noqa: E402
from fp8kit.optim.layout import ALIGN_BLOCKS  # noqa: E402
from fp8kit.train.setup import build_optimizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-warps", default="1,2,4,8")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="config override (default model: llama3-8b, 8 layers, vocab 32000)")
    ap.add_argument("--rows", default=None, help="comma-separated blocks per program (divisors of ALIGN_BLOCKS; default: the "
                    "shipped setting of the granularity)")
    ap.add_argument("--grad-vec", default="auto", help="comma-separated: auto (vector loads where aligned), 1")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = load_config(None, ["model.preset=llama3-8b", "model.num_layers=8", "data.vocab_size=32000",
                             "optim.name=fp8_adamw", *args.sets])
    cfg, _ = resolve_optimizer(cfg)  # optim.granularity = auto -> block (one process), as fp8kit train resolves it
    dev = torch.device("cuda")
    model = build_model(cfg.model, cfg.data.vocab_size, device=dev, dtype=torch.bfloat16, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    opt, _ = build_optimizer(cfg, model, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    grads = [torch.randn(p.shape, generator=g, device=dev, dtype=p.dtype) * 1e-3 for p in params]
    granularity = cfg.optim.granularity
    # bytes per parameter of the kernels (optim/triton_step.py): per tensor two passes, per block one
    bpp = 21.0 if granularity == "tensor" else 14.0

    groups = opt._flat  # the decay and no-decay groups

    def step() -> None:
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr
        opt.step()

    shipped = triton_step.LAUNCH[granularity]

    def use(w: int, vec: str, r: int) -> None:
        """Set the launch setting (warps, gradient width, blocks per program ``r``): every group's gradient table is rebuilt at the next step, with the width asked
        for ("auto": what the optimizer chooses; "1": element loads forced after the optimizer built its table)."""
        triton_step.LAUNCH[granularity] = (r, w)
        for fg in groups:
            fg._table_host = None
            fg.__dict__.pop("update_grad_table", None)
            if vec != "auto":
                def forced(grads, fg=fg):
                    FlatGroup.update_grad_table(fg, grads)
                    fg.grad_vec = 1
                fg.update_grad_table = forced

    def timed(fn) -> float:
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / args.iters

    rows_asked = [int(r) for r in (args.rows or str(shipped[0])).split(",")]
    for r in rows_asked:
        if ALIGN_BLOCKS % r:
            print(f"--rows {r}: skipped, does not divide the layout's {ALIGN_BLOCKS}-block alignment (ALIGN_BLOCKS)")
    settings = [(int(w), v, r) for w in args.num_warps.split(",") for v in args.grad_vec.split(",")
                for r in rows_asked if ALIGN_BLOCKS % r == 0]
    if any(v not in ("auto", "1") for _, v, _ in settings):
        raise SystemExit(f"--grad-vec: auto or 1, got {args.grad_vec!r}")
    # the copy reference: up to 4 GiB each way (its bandwidth does not depend on the size there), scaled to the bytes
    copy_bytes = min(int(n * bpp / 2), 4 << 30)
    copy_src = torch.empty(copy_bytes, dtype=torch.uint8, device=dev).random_()
    copy_dst = torch.empty_like(copy_src)
    times: dict = {s: [] for s in settings}
    copy_ms = []
    for _ in range(args.repeats):
        copy_ms.append(timed(lambda: copy_dst.copy_(copy_src)))
        for st in settings:
            use(*st)
            times[st].append(timed(step))
    copy_src = copy_dst = None
    # bit-for-bit: every setting's states after one step from the same start
    names = ("m", "m_scale", "v", "v_scale", "master", "master_scale", "work")
    # host memory (large models), as raw bytes (torch.equal has no CPU FP8 kernel)
    start = {(i, k): getattr(fg, k).view(torch.uint8).cpu()
             for i, fg in enumerate(groups) for k in names if getattr(fg, k) is not None}
    first, same, step0 = None, {}, opt._step_count
    for st in settings:
        for (i, k), t in start.items():
            getattr(groups[i], k).view(torch.uint8).copy_(t)
        opt._step_count = step0  # the stochastic rounding's noise depends on the step
        use(*st)
        step()
        out = {(i, k): getattr(groups[i], k).view(torch.uint8).cpu() for i, k in start}
        first = first or out
        same[st] = all(torch.equal(out[key], first[key]) for key in start)
    use(shipped[1], "auto", shipped[0])
    for fg in groups:
        fg.update_grad_table(fg.param_grads())
    auto_vec = [fg.grad_vec for fg in groups]
    rows = []
    copy = statistics.median(copy_ms) * (n * bpp / 2) / copy_bytes  # ms for the step's bytes at the copy's rate
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {n / 1e9:.2f}B parameters, "
          f"granularity {granularity}, ~{bpp:.0f} B/param; step_impl {getattr(opt, 'step_impl', '?')}; "
          f"gradient vector width per group (auto) {auto_vec}")
    print(f"copy of the same bytes: {copy:.2f} ms, {n * bpp / copy / 1e9:.2f} TB/s")
    for st in settings:
        w, v, r = st
        ms = statistics.median(times[st])
        rows.append({"num_warps": w, "grad_vec": v, "rows_per_program": r, "step_ms": ms, "runs_ms": times[st],
                     "tb_s": n * bpp / ms / 1e9, "same_bits_as_first": same[st]})
        print(f"num_warps {w}, grad_vec {v}, rows {r}: {ms:.2f} ms ({', '.join(f'{t:.2f}' for t in times[st])}), "
              f"{rows[-1]['tb_s']:.2f} TB/s, {copy / ms:.0%} of copy; same bits as the first: {same[st]}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "params": n, "granularity": granularity, "copy_ms": copy,
                                              "copy_runs_ms": copy_ms, "copy_bytes": copy_bytes, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
