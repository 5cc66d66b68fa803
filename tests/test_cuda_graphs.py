"""``train.cuda_graphs`` on the CPU: what it refuses, each as one clear error before anything is written.

The option itself (the blocks replayed as CUDA graphs, the same losses bit for bit) runs on the GPU:
``tests/test_cuda_graphs_gpu.py``.
"""

from __future__ import annotations

import pytest

from fp8kit.base.errors import ConfigError
from fp8kit.cli.main import main
from fp8kit.config import load_config
from fp8kit.parallel.prepare import PrepareOptions
from fp8kit.train.setup import build_setup


def _one_error(capsys, out, sets: list[str]) -> str:
    code = main(["train", "--out", str(out), *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"exit {code}, stderr: {err}"
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    assert not out.exists(), "a refused run wrote its directory"
    return lines[0]


@pytest.mark.parametrize(
    "sets, expected",
    [
        (["train.cuda_graphs=true"], "captures the compiled blocks, so it needs train.compile = true"),
    ],
)
def test_config_errors(capsys, tmp_path, sets, expected):
    line = _one_error(capsys, tmp_path / "run", sets)
    assert "train.cuda_graphs" in line and expected in line, line


def test_on_the_cpu_it_is_refused_not_dropped(capsys, tmp_path, small_run):
    line = _one_error(capsys, tmp_path / "run", [*small_run, "train.compile=true", "train.cuda_graphs=true",
                                                  "train.device=cpu"])
    assert "train.cuda_graphs = true on cpu: CUDA graphs need a CUDA device" in line, line


def test_a_distributed_run_is_refused(monkeypatch, small_run):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"train.cuda_graphs = true in a distributed run \(2 ranks\)"):
        build_setup(load_config(None, [*small_run, "train.compile=true", "train.cuda_graphs=true",
                                       "distributed.dp_shard=2"]))


def test_the_option_reaches_the_preparation():
    from fp8kit.config.prepare_options import prepare_options

    cfg = load_config(None, ["train.compile=true", "train.cuda_graphs=true"])
    opts = prepare_options(cfg, fp8_now=True, emulate=False)
    assert isinstance(opts, PrepareOptions) and opts.compile and opts.cuda_graphs
    assert not prepare_options(load_config(None, ["train.compile=true"]), fp8_now=True, emulate=False).cuda_graphs


def test_skipped_graphs_and_graph_breaks_are_warned_once_each_and_counted_for_the_summary():
    """The loop's watch (``train/cuda_graphs.py``) against Inductor's and Dynamo's own counters. On the CPU Inductor
    never tries CUDA graphs, so skips are added to its counter here as ``log_cudagraph_skip`` adds them (and a graph
    break as Dynamo counts one, by reason); the GPU twin (``tests/test_cuda_graphs_gpu.py``, ``tiny-moe``) compares
    the summary's counts with a real run's."""
    from torch._dynamo.utils import counters

    from fp8kit.train.cuda_graphs import poll_skips, start_watch
    from fp8kit.train.summary import summarize_run, summary_rows

    def summary_row(info: dict) -> str | None:
        """The run summary's "CUDA graphs" row for a run whose set-up info is ``info``."""
        desc = {"model": "tiny", "params_m": 1.0, "precision": "bf16", "fp8_sites": "0 of 0", "wall_s": 1.0}
        rows = dict(summary_rows(summarize_run([], switches=[], info=info, setup_desc=desc)))
        return rows.get("CUDA graphs")

    counters["inductor"]["cudagraph_skips"] += 3  # skips of earlier runs in this process: not this run's
    counters["graph_break"]["an earlier run's break"] += 1
    info: dict = {}
    start_watch(info)
    assert poll_skips(info) == []
    assert summary_row(info) == "on; no graph skipped by Inductor, no graph break"
    counters["inductor"]["cudagraph_skips"] += 2
    (msg,) = poll_skips(info)
    assert "Inductor ran 2 compiled graph(s) without CUDA graphs (2 in this run)" in msg, msg
    assert poll_skips(info) == [], "the same skips warned twice"
    start_watch(info)  # a divergence-guard rollback starts the loop again: the counts go on
    counters["inductor"]["cudagraph_skips"] += 1
    counters["graph_break"]["Tensor.tolist"] += 2
    skipped, broken = poll_skips(info)
    assert "ran 1 compiled graph(s) without CUDA graphs (3 in this run)" in skipped, skipped
    assert "split the compiled code at 2 graph break(s) (2 in this run)" in broken, broken
    assert (info["cuda_graphs"]["graphs_skipped"], info["cuda_graphs"]["graph_breaks"]) == (3, 2)
    assert summary_row(info) == "on; 3 compiled graph(s) ran without them, 2 graph break(s) (see the warnings)"
    assert summary_row({}) is None, "a run without train.cuda_graphs has no CUDA graphs row"


def test_gradient_accumulation_is_accepted():
    cfg = load_config(None, ["train.compile=true", "train.cuda_graphs=true", "train.grad_accum=4"])
    assert cfg.train.cuda_graphs and cfg.train.grad_accum == 4


def test_keep_gradients_gives_each_gradient_memory_of_its_own():
    import torch

    from fp8kit.train.cuda_graphs import keep_gradients

    a, b = torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(3))
    (a.sum() * 2).backward()
    before, kept = a.grad, set()
    assert keep_gradients([a, b], kept) == 1
    assert b.grad is None
    assert a.grad.data_ptr() != before.data_ptr() and torch.equal(a.grad, before)
    copy = a.grad
    (a.sum() * 3 + b.sum()).backward()  # AccumulateGrad adds in place into the copy
    assert a.grad is copy and torch.equal(a.grad, torch.full((4, 8), 5.0)), a.grad
    # the next micro-batch: only the gradient that first appeared in this one (b's) is copied
    b_first = b.grad
    assert keep_gradients([a, b], kept) == 1 and a.grad is copy
    assert b.grad.data_ptr() != b_first.data_ptr() and torch.equal(b.grad, b_first)
