"""``train.cuda_graphs``: the training loop's watch on compiled graphs that Inductor ran without CUDA graphs.

With ``mode="reduce-overhead"`` Inductor captures a compiled graph only where it can replay it safely; it skips the
others (a CPU tensor or a host sync inside the graph, an input mutated in place that is not a static address, an op
tagged ``cudagraph_unsafe``) and counts each skip in ``torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]``,
saying why only through the ``perf_hints`` log. Those blocks then launch their kernels one by one, which is what the
user turned the option on to avoid, so the loop reports every new skip as a warning and the summary keeps the count.
"""

from __future__ import annotations

_KEY = "cuda_graphs"


def _inductor_skips() -> int:
    from torch._dynamo.utils import counters  # imported when a run asks for CUDA graphs, not by the summary

    return int(counters["inductor"]["cudagraph_skips"])


def start_watch(info: dict) -> None:
    """Start counting (once per run: a divergence-guard rollback's second loop keeps the count): records
    ``info["cuda_graphs"] = {"graphs_skipped": 0, "inductor_skips_before": N}`` (N: the process's count so far)."""
    info.setdefault(_KEY, {"graphs_skipped": 0, "inductor_skips_before": _inductor_skips()})


def poll_skips(info: dict) -> str | None:
    """The warning for graphs skipped since the last poll (None if none); updates ``info["cuda_graphs"]``.

    Raises:
        KeyError: :func:`start_watch` was not called for ``info``.
    """
    w = info[_KEY]
    total = _inductor_skips() - w["inductor_skips_before"]
    new = total - w["graphs_skipped"]
    if new <= 0:
        return None
    w["graphs_skipped"] = total
    return (f"train.cuda_graphs: Inductor ran {new} compiled graph(s) without CUDA graphs ({total} in this run), "
            "so their kernels launch one by one from the host; TORCH_LOGS=perf_hints names the reason (a host sync, "
            "a CPU tensor or an op unsafe to capture inside a block)")


def summary_row(w: dict | None) -> str | None:
    """The summary's ``CUDA graphs`` line, or None when the run did not ask for them."""
    if w is None:
        return None
    n = w["graphs_skipped"]
    return "on; none skipped by Inductor" if n == 0 else f"on; {n} compiled graph(s) ran without (see the warnings)"
