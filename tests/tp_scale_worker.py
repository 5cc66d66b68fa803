"""Run under ``torchrun --nproc_per_node 2`` by tests/test_distributed.py: do FP8 scales under tensor
parallel come from the amax of the *whole* tensor (reduced over the tp group), as in one process?

A column-parallel then a row-parallel Float8Linear (torchao tensorwise, fp8kit's TP styles) whose weight
shards differ 100x in magnitude, and an input whose feature halves do too: per-shard amaxes would give
per-shard scales. Rank 0 writes a JSON with the relative max differences of the output and the gradients
against the same two layers in one process, and (to show the check can fail) of a per-shard-scaled
emulation against that reference.

Usage: ``torchrun --nproc_per_node 2 tests/tp_scale_worker.py OUT.json``
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def fp8_tensorwise(t: torch.Tensor, dtype) -> torch.Tensor:
    """Quantize-dequantize with one scale from this tensor's amax (what a per-shard amax would do)."""
    scale = torch.finfo(dtype).max / t.abs().amax().clamp(min=1e-12)
    return (t * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() / scale


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from fp8kit.fp8.recipes import float8_linear_config

    torch.manual_seed(0)
    h, f = 64, 128
    model = nn.Sequential(nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False))
    with torch.no_grad():
        model[0].weight[: f // 2] *= 100.0  # rank 0's column shard (output features)
        model[1].weight[:, : f // 2] *= 100.0  # rank 0's row shard (input features)
    x = torch.randn(4, 16, h)
    x[..., : h // 2] *= 100.0
    config = float8_linear_config("tensorwise")
    ref = convert_to_float8_training(copy.deepcopy(model), config=config)
    tp = convert_to_float8_training(copy.deepcopy(model), config=config)

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(tp, mesh, {"0": Float8ColwiseParallel(), "1": Float8RowwiseParallel()})

    y_ref = ref(x)
    y_ref.square().mean().backward()
    y_tp = tp(x)
    y_tp.square().mean().backward()
    out = {
        "output": rel(y_tp, y_ref),
        "grad_col_weight": rel(tp[0].weight.grad.full_tensor(), ref[0].weight.grad),
        "grad_row_weight": rel(tp[1].weight.grad.full_tensor(), ref[1].weight.grad),
    }
    # The same forward with per-shard scales of the column-parallel weight (the bug this guards against).
    w = model[0].weight.detach()
    e4m3 = torch.float8_e4m3fn
    w_shards = torch.cat([fp8_tensorwise(s, e4m3) for s in w.chunk(2, 0)])
    h_bad = fp8_tensorwise(x, e4m3) @ w_shards.t()
    h_good = fp8_tensorwise(x, e4m3) @ fp8_tensorwise(w, e4m3).t()
    out["per_shard_scale_hidden"] = rel(h_bad, h_good)
    h_ref = ref[0](x)
    out["global_scale_hidden_vs_torchao"] = rel(h_good, h_ref)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            json.dump(out, fh)
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


if __name__ == "__main__":
    main()
