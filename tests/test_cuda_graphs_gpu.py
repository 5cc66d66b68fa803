"""``train.cuda_graphs`` on a CUDA GPU (marker ``gpu``; skipped without an FP8 GPU): each recipe's compiled blocks
replay as CUDA graphs (graphs captured, none skipped), and the run's losses are those of the same run without them.

Run on the H100: ``pytest -m gpu -s tests/test_cuda_graphs_gpu.py`` (``-s`` prints the measured differences). The
CPU side (the config check and the errors) is in ``tests/test_cuda_graphs.py``.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch._dynamo.utils import counters

from fp8kit.config import load_config
from fp8kit.train.trainer import train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA GPU with FP8 tensor cores (sm89+)"),
]

#: Relative loss difference allowed per step between the run with CUDA graphs and without. The graphs replay the
#: kernels Inductor generated for the run without them, on the same inputs, so the losses are expected to agree to
#: the last bit; the margin only admits kernels whose reduction order is not fixed between launches.
MAX_REL_DIFF = 1e-3
STEPS = 6


def _run(tmp_path, cache, recipe: str, graphs: bool, preset: str = "tiny",
         extra: tuple[str, ...] = ()) -> tuple[list[float], int, int, dict]:
    """Train ``preset`` ``STEPS`` steps, compiled (with the config overrides ``extra``); returns the losses, the CUDA
    graphs captured, Inductor's count of graphs it refused to capture (``cudagraph_skips``) and the run's summary.
    The losses: each step's training loss, then the validation losses (evaluation runs graphs of its own)."""
    torch._dynamo.reset()
    counters.clear()
    captured = [0]
    begin = torch.cuda.CUDAGraph.capture_begin

    def counting(self, *args, **kwargs):
        captured[0] += 1
        return begin(self, *args, **kwargs)

    prec = ["train.mixed_precision=bf16"] if recipe == "bf16" else [
        "train.mixed_precision=fp8", f"fp8.recipe={recipe}", "selective.selective_fp8=false"]
    cfg = load_config(None, [
        f"model.preset={preset}", "data.vocab_size=4096", "data.seq_length=256", "train.micro_batch_size=8",
        f"train.steps={STEPS}", "train.compile=true", f"train.cuda_graphs={str(graphs).lower()}", "train.eval_every=3",
        "train.eval_batches=2", "train.checkpoint_every=0", "train.final_checkpoint=false",
        f"data.cache_dir={cache}", *prec, *extra,
    ])
    torch.cuda.CUDAGraph.capture_begin = counting
    try:
        run = train(cfg, tmp_path / f"{preset}-{recipe}-{graphs}-{len(extra)}")
    finally:
        torch.cuda.CUDAGraph.capture_begin = begin
    losses = [r["loss"] for r in run.metrics if "loss" in r] + [r["val_loss"] for r in run.metrics
                                                                  if r.get("val_loss") is not None]
    summary = json.loads((run.out_dir / "summary.json").read_text())
    return losses, captured[0], counters["inductor"]["cudagraph_skips"], summary


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise", "delayed", "blockwise"])
def test_cuda_graphs_replay_the_blocks_and_train_to_the_same_losses(tmp_path, recipe):
    cache = tmp_path / "cache"
    ref, ref_graphs, _, ref_summary = _run(tmp_path, cache, recipe, graphs=False)
    got, graphs, skips, summary = _run(tmp_path, cache, recipe, graphs=True)
    diffs = [abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True)]
    print(f"\n{recipe}: {graphs} CUDA graphs captured ({ref_graphs} without the option), {skips} skipped; "
          f"max relative loss difference {max(diffs):.2e} over {len(diffs)} steps; bit-equal: {ref == got}")
    assert ref_graphs == 0, f"{ref_graphs} CUDA graphs captured with train.cuda_graphs = false"
    assert skips == 0, f"Inductor skipped {skips} graph(s) for CUDA graphs (TORCH_LOGS=perf_hints names why)"
    # 4 blocks, forward and backward, in training and in evaluation: at least one graph per block and pass
    assert graphs >= 8, f"only {graphs} CUDA graphs captured"
    assert max(diffs) <= MAX_REL_DIFF, f"losses differ by up to {max(diffs):.2e} (relative): {ref} vs {got}"
    assert ref_summary.get("cuda_graphs") is None, ref_summary
    assert (summary["cuda_graphs"]["graphs_skipped"], summary["cuda_graphs"]["graph_breaks"]) == (0, 0), summary


@pytest.mark.parametrize("recipe", ["bf16", "tensorwise"])
def test_an_moe_run_reports_the_graphs_inductor_skipped(tmp_path, capfd, recipe):
    """``tiny-moe`` (8 experts, top-2): whatever does not replay as CUDA graphs in the expert blocks (graph breaks at
    host syncs for the group sizes, graphs Inductor declines) is warned about and counted in the summary, never
    dropped in silence; the losses are those of the run without graphs."""
    cache = tmp_path / "cache"
    ref, _, _, _ = _run(tmp_path, cache, recipe, graphs=False, preset="tiny-moe")
    capfd.readouterr()
    got, graphs, skips, summary = _run(tmp_path, cache, recipe, graphs=True, preset="tiny-moe")
    out = capfd.readouterr().out
    diffs = [abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True)]
    print(f"\ntiny-moe {recipe}: {graphs} CUDA graphs captured, {skips} skipped; summary "
          f"{summary['cuda_graphs']}; max relative loss difference {max(diffs):.2e}")
    w = summary["cuda_graphs"]
    assert w["graphs_skipped"] == skips, (w, skips)
    assert (skips > 0) == ("without CUDA graphs (" in out), out[-3000:]
    assert (w["graph_breaks"] > 0) == ("split the compiled code at" in out), out[-3000:]
    assert max(diffs) <= MAX_REL_DIFF, f"losses differ by up to {max(diffs):.2e} (relative): {ref} vs {got}"


@pytest.mark.parametrize("recipe, extra", [
    # the first micro-batch's weight gradients copied out of the graph pool (fp8kit.train.cuda_graphs.keep_gradients)
    ("bf16", ("train.grad_accum=2",)),
    ("tensorwise", ("train.grad_accum=2",)),
    ("delayed", ("train.grad_accum=2",)),
    # with grad_accum > 1 the blockwise weight cache's op (tagged cudagraph_unsafe) runs between graph partitions
    ("blockwise", ("train.grad_accum=2",)),
    ("delayed", ("train.activation_checkpointing=true",)),
    # the precision switch at step 2 resets the compiled code: the FP8 blocks are compiled and recorded again
    ("tensorwise", ("fp8.bf16_warmup_steps=2",)),
    # the FP8 health hooks on the stats steps
    ("delayed", ("fp8.stats_every=2",)),
    ("tensorwise", ("train.async_loss=true",)),
    # the FP8 output head, compiled (and recorded) outside the blocks; with accumulation its weight gradient too
    ("delayed", ("fp8.output_head=true",)),
    ("tensorwise", ("fp8.output_head=true", "train.grad_accum=2")),
], ids=lambda v: v if isinstance(v, str) else "+".join(v))
def test_cuda_graphs_with_the_loops_other_options(tmp_path, capfd, recipe, extra):
    """The options the loop combines with ``train.cuda_graphs``: the losses are those of the same run without
    graphs, graphs are captured, and whatever runs without them is warned about and counted (never silent)."""
    cache = tmp_path / "cache"
    ref, _, _, _ = _run(tmp_path, cache, recipe, graphs=False, extra=extra)
    capfd.readouterr()
    got, graphs, skips, summary = _run(tmp_path, cache, recipe, graphs=True, extra=extra)
    out = capfd.readouterr().out
    diffs = [abs(a - b) / abs(a) for a, b in zip(ref, got, strict=True)]
    w = summary["cuda_graphs"]
    print(f"\n{recipe} {' '.join(extra)}: {graphs} CUDA graphs captured, {w['graphs_skipped']} skipped, "
          f"{w['graph_breaks']} graph breaks; max relative loss difference {max(diffs):.2e}; bit-equal: {ref == got}")
    assert graphs >= 8, f"only {graphs} CUDA graphs captured"
    assert w["graphs_skipped"] == skips, (w, skips)
    assert (skips > 0) == ("without CUDA graphs (" in out), out[-3000:]
    assert (w["graph_breaks"] > 0) == ("split the compiled code at" in out), out[-3000:]
    assert max(diffs) <= MAX_REL_DIFF, f"losses differ by up to {max(diffs):.2e} (relative): {ref} vs {got}"
