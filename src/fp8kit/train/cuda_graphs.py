"""``train.cuda_graphs``: the training loop's watch on compiled code that runs without CUDA graphs, and the
gradients kept across gradient-accumulation micro-batches.

Two things keep a block's kernels from replaying as CUDA graphs, both silent unless a ``TORCH_LOGS`` log is on:
Inductor declines to capture a compiled graph it cannot replay safely (a CPU tensor inside it, an input mutated in
place that is not a fixed address, an op tagged ``cudagraph_unsafe``), counted in
``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]`` (reason in the ``perf_hints`` log); and Dynamo splits a
block at a graph break (a host sync such as ``.tolist()``, a ``torch.compiler.disable`` region, as in the MoE experts'
loop kernels), whose eager code between the graphs launches kernel by kernel, counted in ``counters["graph_break"]``
(reasons in the ``graph_breaks`` log). Either loses what the user turned the option on for, so the loop warns about
each new one and the summary keeps the counts (``fp8kit.train.summary``'s "CUDA graphs" row).

Gradient accumulation (:func:`keep_gradients`): the weight gradients of a block are outputs of its backward's CUDA
graph, in the graph trees' private memory pool. A parameter without a gradient takes that output as its ``.grad``
(AccumulateGrad steals it), and the next micro-batch's replay writes the same memory, so the gradient would be
overwritten before it is accumulated (torch raises "accessing tensor output of CUDAGraphs that has been
overwritten"). Copying each gradient out of the pool after the micro-batch that made it makes every later
micro-batch add into memory of its own (AccumulateGrad adds in place into an existing ``.grad``).
"""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

_KEY = "cuda_graphs"


def _counts() -> tuple[int, int]:
    """(Inductor's CUDA graph skips, Dynamo's graph breaks) of this process so far."""
    return int(counters["inductor"]["cudagraph_skips"]), int(sum(counters["graph_break"].values()))


def start_watch(info: dict) -> None:
    """Start counting (once per run: a divergence-guard rollback's second loop keeps the counts): records
    ``info["cuda_graphs"] = {"graphs_skipped": 0, "graph_breaks": 0, "before": [skips, breaks]}`` (the process's
    counts so far)."""
    info.setdefault(_KEY, {"graphs_skipped": 0, "graph_breaks": 0, "before": list(_counts())})


def poll_skips(info: dict) -> list[str]:
    """The warnings for graphs skipped and graph breaks since the last poll (empty if none); updates
    ``info["cuda_graphs"]``.

    Raises:
        KeyError: :func:`start_watch` was not called for ``info``.
    """
    w = info[_KEY]
    skips, breaks = (now - before for now, before in zip(_counts(), w["before"], strict=True))
    out = []
    if skips > w["graphs_skipped"]:
        out.append(f"train.cuda_graphs: Inductor ran {skips - w['graphs_skipped']} compiled graph(s) without CUDA "
                   f"graphs ({skips} in this run), so their kernels launch one by one from the host; "
                   "TORCH_LOGS=perf_hints names the reason (a CPU tensor or an op unsafe to capture inside a block)")
    if breaks > w["graph_breaks"]:
        out.append(f"train.cuda_graphs: torch.compile split the compiled code at {breaks - w['graph_breaks']} graph "
                   f"break(s) ({breaks} in this run); the eager code between the graphs runs without CUDA graphs "
                   "(a host sync or a torch.compiler.disable region inside a block, e.g. the MoE experts' loop "
                   "kernels); TORCH_LOGS=graph_breaks names them")
    w["graphs_skipped"], w["graph_breaks"] = skips, breaks
    return out


def keep_gradients(params: list[torch.Tensor], kept: set[int]) -> int:
    """Give each parameter's ``.grad`` memory of its own: ``p.grad = p.grad.clone()`` (module docstring), for the
    parameters not in ``kept`` (ids of those already copied this optimizer step; updated). Called after each
    micro-batch's backward but the last when ``train.grad_accum > 1``: a parameter whose first gradient of the step
    comes in a later micro-batch is copied then. Costs one copy of the gradients per optimizer step (a read and a
    write of their bytes). Returns how many gradients it copied (parameters without a gradient are left alone)."""
    n = 0
    for p in params:
        if p.grad is not None and id(p) not in kept:
            p.grad = p.grad.clone()
            kept.add(id(p))
            n += 1
    return n
