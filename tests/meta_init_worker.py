"""Run under ``torchrun --nproc_per_node 2`` by tests/test_meta_init.py: meta-device initialisation per layout.

For each layout (``fsdp``: dp_shard 2 with FP8 all-gather, activation checkpointing and tied embeddings;
``replicate``: dp_replicate 2; ``tp``: tp 2; ``ep``: tiny-moe with ep 2), the model is built on ``meta``
(``fp8kit.models.init.build_model_on_meta``), prepared (``prepare_model``), materialised and initialised
shard by shard (``initialize_shards``) while a dispatch mode logs every tensor allocated off ``meta``.
Rank 0 writes one JSON record per layout:

- ``alloc``: the largest single floating-point allocation (elements) and the largest parameter (elements,
  and the largest local shard);
- ``params``: per parameter, the statistics (mean, std, min, max) of the whole tensor after meta init and
  of transformers' unsharded initialisation (``build_model`` on CPU, the single-process path), whether
  the whole tensor equals a single-process meta init bit for bit, and how the ranks' local parts relate
  (``same_box_equal``: ranks holding the same part hold equal values; ``distinct_boxes_differ``);
- ``tied``, ``buffers_equal`` (rotary ``inv_freq`` against the CPU build), ``logits_finite``.

On CUDA (``--device cuda``: NCCL, one GPU per rank) the record also holds ``peak_bytes``
(``torch.cuda.max_memory_allocated`` over prepare + init) and ``local_bytes`` (this rank's parameters and
buffers), the largest over the ranks.

Usage: ``torchrun --nproc_per_node 2 tests/meta_init_worker.py OUT.json [--device cuda] LAYOUT...``
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

VOCAB = 8192  # embeddings of 8192 x 256 = 2^21 elements: twice the 2^20-element random chunk
LAYOUTS = {
    "fsdp": ["distributed.dp_shard=2", "train.mixed_precision=fp8", "fp8.enable_fsdp_float8_all_gather=true",
             "train.activation_checkpointing=true", "model.hf_config={tied}"],
    "replicate": ["distributed.dp_replicate=2", "distributed.dp_shard=1", "train.mixed_precision=bf16"],
    "tp": ["distributed.tp=2", "train.mixed_precision=bf16"],
    "ep": ["distributed.ep=2", "model.preset=tiny-moe", "train.mixed_precision=bf16"],
}


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a tensor's data (a DTensor's local shard, a wrapper subclass's inner tensors)."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return [t]
    inner = [getattr(t, n) for n in t.__tensor_flatten__()[0]]
    return [x for i in inner if isinstance(i, torch.Tensor) for x in _inner(i)]


class AllocationLog(TorchDispatchMode):
    """The largest floating-point tensor (elements) any op outputs off the meta device."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.max_shape = 0, ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor):
                for t in _inner(o):
                    if not t.is_meta and t.is_floating_point() and t.numel() > self.max_numel:
                        self.max_numel, self.max_shape = t.numel(), tuple(t.shape)
        return out


def stats(t: torch.Tensor) -> dict:
    t = t.detach().cpu().double()
    return {"mean": t.mean().item(), "std": t.std().item() if t.numel() > 1 else 0.0, "min": t.min().item(),
            "max": t.max().item(), "numel": t.numel()}


def local_part(p: torch.Tensor) -> tuple[torch.Tensor, list]:
    from fp8kit.models.init import _local

    local, box = _local(p)
    return local.detach().clone(), [list(b) for b in box]


def full(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor: every rank's local part placed at its box (gathered with all_gather_object)."""
    from torch.distributed.tensor import DTensor

    local, box = local_part(p)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (local.cpu(), box))
    if not isinstance(p, DTensor):
        return local.cpu()
    out = torch.empty(p.shape, dtype=local.dtype)
    for t, b in parts:
        out[tuple(slice(lo, hi) for lo, hi in b)] = t
    return out


def run_layout(name: str, tied_config: str, device: torch.device) -> dict:
    from fp8kit.config import load_config
    from fp8kit.config.options import options_from_config
    from fp8kit.config.prepare_options import prepare_options
    from fp8kit.models.build import build_hf_config, build_model
    from fp8kit.models.init import CHUNK_NUMEL, build_model_on_meta, initialize_shards
    from fp8kit.parallel.mesh import init_distributed, resolve_dims
    from fp8kit.parallel.prepare import prepare_model
    from fp8kit.selective.decide import decide
    from fp8kit.selective.sites import find_sites

    sets = ["model.preset=tiny", "model.num_layers=2", f"data.vocab_size={VOCAB}"] + [
        s.format(tied=tied_config) for s in LAYOUTS[name]]
    cfg = load_config(None, sets)
    d = cfg.distributed
    dims = resolve_dims(d.dp_shard, d.dp_replicate, d.tp, d.ep, int(os.environ["WORLD_SIZE"]))
    mesh, device = init_distributed(dims, device)
    hf_cfg = build_hf_config(cfg.model, VOCAB)
    model, program = build_model_on_meta(cfg.model, VOCAB, seed=0)
    decisions = decide(find_sites(model), options_from_config(cfg, hf_cfg, "cpu"))
    log = AllocationLog()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with log:
        prepared = prepare_model(model, decisions, prepare_options(cfg, fp8_now=cfg.train.mixed_precision == "fp8",
                                                                   emulate=False), mesh, hf_cfg=hf_cfg)
        initialize_shards(model, program, device)
    memory = {}
    if device.type == "cuda":
        local_bytes = sum(t.numel() * t.element_size() for t in [local_part(p)[0] for p in model.parameters()]
                          + list(model.buffers()))
        memory = {"peak_bytes": torch.cuda.max_memory_allocated() - base, "local_bytes": local_bytes}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, memory)
        memory = {k: max(m[k] for m in gathered) for k in memory}

    rank0 = dist.get_rank() == 0
    reference = build_model(cfg.model, VOCAB, device="cpu", seed=0) if rank0 else None  # today's init
    single, single_program = build_model_on_meta(cfg.model, VOCAB, seed=0)
    initialize_shards(single, single_program, device)  # the same generators as the ranks'
    single_params = {n: p.detach().cpu() for n, p in single.named_parameters()}

    from fp8kit.models.init import _plain_name

    record = {"steps": prepared.steps, "params": {}, "alloc": {"max_numel": log.max_numel,
                                                               "max_shape": list(log.max_shape),
                                                               "chunk_numel": CHUNK_NUMEL, **memory}}
    largest = largest_local = 0
    ref_params = dict(reference.named_parameters()) if rank0 else {}
    for raw, p in model.named_parameters():
        pname = _plain_name(raw)
        local, box = local_part(p)
        largest, largest_local = max(largest, p.numel()), max(largest_local, local.numel())
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (local.cpu(), box))
        whole = full(p)
        if not rank0:
            continue
        same = [torch.equal(a, b) for i, (a, ba) in enumerate(parts) for (b, bb) in parts[i + 1:] if ba == bb]
        differ = [not torch.equal(a, b) for i, (a, ba) in enumerate(parts) for (b, bb) in parts[i + 1:]
                  if ba != bb and a.shape == b.shape]
        record["params"][pname] = {
            "meta": stats(whole), "reference": stats(ref_params[pname]),
            "equals_single_process_meta_init": torch.equal(whole.cpu(), single_params[pname]),
            "same_box_equal": all(same), "n_same_box": len(same),
            "distinct_boxes_differ": all(differ), "n_distinct_boxes": len(differ),
            "dtensor": type(p).__name__ == "DTensor",
        }
    record["alloc"].update(largest_param=largest, largest_local=largest_local)
    heads = (model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    record["tied"] = heads[0] is heads[1]
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    record["logits_finite"] = bool(torch.isfinite(logits.float()).all())
    if rank0:
        ref_buffers = dict(reference.named_buffers())
        # buffers that hold no model state (the fused MoE experts' scale hints) have no counterpart there
        scratch = {id(getattr(m, name)) for m in model.modules() for name in getattr(m, "scratch_buffers", ())}
        record["buffers_equal"] = {_plain_name(n): torch.equal(b.cpu(), ref_buffers[_plain_name(n)])
                                   for n, b in model.named_buffers() if id(b) not in scratch}
    return record


def main() -> None:
    out, layouts = sys.argv[1], sys.argv[2:]
    device = torch.device("cpu")
    if layouts[:1] == ["--device"]:
        device, layouts = torch.device(layouts[1]), layouts[2:]
    torch.set_num_threads(1)
    import tempfile
    from pathlib import Path

    from fp8kit.models.presets import PRESETS

    tied = Path(tempfile.mkdtemp()) / "config.json"  # tiny with tied embeddings and a padding row
    tied.write_text(json.dumps({**PRESETS["tiny"], "tie_word_embeddings": True, "pad_token_id": 3}))
    records = {name: run_layout(name, str(tied), device) for name in layouts}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(records, indent=1))
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


if __name__ == "__main__":
    main()
