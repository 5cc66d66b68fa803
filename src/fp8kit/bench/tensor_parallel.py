"""Real tensor-parallel sites for ``bench-layers --tp N`` under ``torchrun`` (PyTorch DTensor).

Megatron-style TP with sequence parallelism, as torchtitan applies it to Llama:

- column sites (qkv, fc1): the input arrives sharded over tokens (``Shard(0)``), is all-gathered once
  for the whole site (``PrepareModuleInput``), and each linear is ``ColwiseParallel``;
- row sites (proj, fc2): the input is sharded over features (``Shard(-1)``), each linear is
  ``RowwiseParallel`` and its output is reduce-scattered over tokens (``Shard(0)``);
- duplicated sites are not split.

In FP8 the linears use torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``; the site's input
all-gather stays in bf16 (see ``parallelize_site``).
"""

from __future__ import annotations

import os

import torch

from fp8kit.bench.sites import COLUMN_KINDS, ROW_KINDS, BenchSite


def init_tp_mesh(tp: int, device: torch.device):
    """Initialise the process group (NCCL on CUDA, gloo on CPU) and a 1-D ``("tp",)`` DeviceMesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (tp,), mesh_dim_names=("tp",))
    return mesh, device


def parallelize_site(module: torch.nn.Module, site: BenchSite, mesh, *, fp8: bool) -> None:
    """Apply the TP plan of the module docstring to a ``SiteModule`` in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    n = len(module.linears)
    # The sequence-parallel all-gather stays in bf16 also for FP8 sites: with torchao's
    # PrepareFloat8ModuleInput (FP8 all-gather) the compiled site failed in backward ("tensor subclass
    # where we guessed its metadata incorrectly"); see docs/benchmarks.md, "Real tensor parallelism".
    prepare = PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),))
    if fp8:
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        col, row = Float8ColwiseParallel, Float8RowwiseParallel
    else:
        col, row = ColwiseParallel, RowwiseParallel
    if site.module_kind in COLUMN_KINDS:
        parallelize_module(module, mesh, prepare)
        parallelize_module(module, mesh, {f"linears.{i}": col(input_layouts=Replicate()) for i in range(n)})
    elif site.module_kind in ROW_KINDS:
        plan = {f"linears.{i}": row(input_layouts=Shard(-1), output_layouts=Shard(0)) for i in range(n)}
        parallelize_module(module, mesh, plan)
