"""Launch setting of the FP8AdamW Triton step: time ``opt.step()`` per ``num_warps`` (run on a GPU).

The optimizer is the one ``fp8kit train`` builds (``train.setup.build_optimizer``, ``optim.name = "fp8_adamw"``
with the ``[optim]`` defaults) on the real parameters of a preset (default: Llama-3-8B layer shapes x 8 and
a 32000 vocabulary, 2.0B parameters, bf16), with ``randn * 1e-3`` gradients handed over as autograd does.
For each value of ``--num-warps`` (``fp8kit.optim.triton_step.NUM_WARPS``, a launch setting: the states are
the same bits for any value; ``tests/test_fp8_adamw_gpu.py`` checks the kernel against the reference) it
times ``--iters`` back-to-back steps with CUDA events after ``--warmup``, interleaving the settings over
``--repeats`` rounds, and reports the median, the bytes per parameter the kernels move and the bandwidth.

    python benchmarks/fp8_adamw_launch.py --num-warps 1,2,4,8 --out /tmp/fp8_adamw_launch.json
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
from fp8kit.train.setup import build_optimizer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-warps", default="1,2,4,8")
    ap.add_argument("--set", dest="sets", action="append", default=[],
                    help="config override (default model: llama3-8b, 8 layers, vocab 32000)")
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

    def step() -> None:
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr
        opt.step()

    settings = [int(w) for w in args.num_warps.split(",")]
    times: dict[int, list[float]] = {w: [] for w in settings}
    for _ in range(args.repeats):
        for w in settings:
            triton_step.NUM_WARPS = w
            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.iters):
                step()
            b.record()
            torch.cuda.synchronize()
            times[w].append(a.elapsed_time(b) / args.iters)
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {n / 1e9:.2f}B parameters, "
          f"granularity {granularity}, ~{bpp:.0f} B/param; step_impl {getattr(opt, 'step_impl', '?')}")
    for w in settings:
        ms = statistics.median(times[w])
        rows.append({"num_warps": w, "step_ms": ms, "runs_ms": times[w], "tb_s": n * bpp / ms / 1e9})
        print(f"num_warps {w}: {ms:.2f} ms ({', '.join(f'{t:.2f}' for t in times[w])}), {rows[-1]['tb_s']:.2f} TB/s")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                              "params": n, "granularity": granularity, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
