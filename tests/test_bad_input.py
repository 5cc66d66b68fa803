"""Every bad input of the foundation issue: one clear line on stderr, exit 2, nothing written."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from fp8kit.base.errors import CapabilityError
from fp8kit.cli.main import main
from fp8kit.config import load_config
from fp8kit.train import setup as setup_mod
from fp8kit.train.trainer import train


def _fails(capsys, argv, expected: str):
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, f"exit {code}, stderr: {err}"
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "sets, expected",
    [
        (["train.mixed_precison=fp8"], "did you mean 'train.mixed_precision'?"),
        (["train.steps=1.5"], "train.steps=1.5: expected an integer, got '1.5'"),
        (["model.preset=llama9"], "--set model.preset=llama9: unknown value 'llama9'"),
        (["fp8.recipe=rowwize"], "unknown value 'rowwize' (did you mean 'rowwise'?); choose one of tensorwise, rowwise, rowwise_with_gw_hp, blockwise, delayed"),
        (["data.paths=/nonexistent/corpus/*.txt"], "data.paths[0] '/nonexistent/corpus/*.txt' matches no file"),
        (["data.paths=/nonexistent/file.txt"], "data.paths[0] '/nonexistent/file.txt' does not exist"),
        (["train.device=cuda"], "train.device = 'cuda', but CUDA is not available"),
        (["model.hf_config=/nope/config.json"], "model.hf_config: '/nope/config.json' does not exist"),
        (["distributed.tp=2"], "dp_replicate = 1 x tp = 2 = 2 does not divide the world size 1"),
        # blamed on where data.format was set, not on "defaults" (data.paths was never set)
        (["data.format=chat"], "error: --set data.format=chat: \"chat\" needs data.paths"),
        # etp was removed from the config (experts are whole per rank): only its old value 1 still loads
        (["distributed.etp=2"], "distributed.etp = 2: expert tensor parallelism is not supported, every rank holds "
                                "whole experts"),
    ],
)
def test_bad_config_and_data(capsys, tmp_path, sets, expected):
    out = tmp_path / "run"
    argv = ["train", "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    _fails(capsys, argv, expected)
    assert not out.exists()


def test_ep_that_does_not_divide_the_experts_names_the_module(capsys):
    """The MoE issue's bad input: expert parallelism over a number of ranks that does not divide a layer's
    experts is one line naming the key, the expert count and the module (``fp8kit plan`` decides the sites
    without starting the ranks; ``train`` decides them the same way)."""
    _fails(capsys, ["plan", "--set", "model.preset=tiny-moe", "--set", "distributed.ep=3"],
           "distributed.ep = 3 does not divide the 8 experts of model.layers.0.mlp.experts.gate_up_proj")


def test_empty_data_file(capsys, tmp_path, cache_dir):
    (tmp_path / "empty.txt").write_text("\n\n")
    out = tmp_path / "run"
    _fails(capsys, ["train", "--out", str(out), "--set", f"data.paths={tmp_path / 'empty.txt'}",
                    "--set", f"data.cache_dir={cache_dir}"], "is empty")
    assert not out.exists()


def test_sequence_longer_than_corpus(capsys, tmp_path):
    (tmp_path / "small.txt").write_text("print('hello')\n" * 40)
    out = tmp_path / "run"
    _fails(capsys, ["train", "--out", str(out), "--set", f"data.paths={tmp_path / 'small.txt'}",
                    "--set", "data.vocab_size=300", "--set", "data.seq_length=2048",
                    "--set", f"data.cache_dir={tmp_path / 'cache'}"],
           "data.seq_length = 2048 is too long for the corpus")
    assert not out.exists()


def test_unwritable_output_directory(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    _fails(capsys, ["train", "--out", str(blocker / "run")], "cannot be written")
    _fails(capsys, ["train", "--out", str(blocker)], "is a file, not a directory")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_output_directory_the_file_system_refuses(capsys):
    """/proc passes permission checks for root but refuses mkdir: one line before setup, no traceback."""
    _fails(capsys, ["train", "--out", "/proc/fp8kit-run", "--set", "train.steps=1"],
           "--out '/proc/fp8kit-run' cannot be written")


def test_export_without_checkpoints_names_export(capsys, tmp_path):
    line = _fails(capsys, ["export", str(tmp_path), str(tmp_path / "hf")],
                  f"export {str(tmp_path)!r}: no checkpoint found")
    assert "--resume" not in line, line
    assert not (tmp_path / "hf").exists()


def test_config_file_errors(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nmixed_precison = 'fp8'\n")
    _fails(capsys, ["train", str(bad), "--out", str(tmp_path / "r")], f"{bad}: unknown key 'train.mixed_precison'")
    _fails(capsys, ["train", str(tmp_path / "nope.yaml")], "does not exist")
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("ck") / "run"
    cfg = load_config(None, ["model.num_layers=2", "data.seq_length=32", "data.vocab_size=1024",
                             f"data.cache_dir={cache_dir}", "train.steps=1", "train.micro_batch_size=2",
                             "train.eval_batches=1"])
    train(cfg, out)
    return out


def test_resume_from_a_different_model_shape(capsys, tmp_path, one_step_run, cache_dir):
    out = tmp_path / "r"
    line = _fails(capsys, ["train", "--resume", str(one_step_run), "--out", str(out),
                           "--set", "model.num_layers=3"],
                  "which the checkpoint lacks (different architecture or depth)")
    assert "model.layers.2." in line
    _fails(capsys, ["train", "--resume", str(one_step_run), "--out", str(out), "--set", "data.vocab_size=2048"],
           "has shape [1024, 256] in the checkpoint but [2048, 256] in the configured model")
    assert not out.exists()
    _fails(capsys, ["train", "--resume", str(tmp_path / "missing")],
           f"--resume {str(tmp_path / 'missing')!r}: does not exist (give a run directory or a checkpoint directory)")
    (tmp_path / "notes.md").write_text("keep me")
    _fails(capsys, ["train", "--resume", str(tmp_path / "notes.md")],
           f"--resume {str(tmp_path / 'notes.md')!r}: is a file (give a run directory or a checkpoint directory)")
    assert (tmp_path / "notes.md").read_text() == "keep me"


def test_checkpoint_is_loaded_with_weights_only(capsys, tmp_path, one_step_run):
    """A train_state.pt holding a pickled object is refused, not unpickled."""
    import shutil

    ck = tmp_path / "evil"
    shutil.copytree(one_step_run / "checkpoints" / "step_000001", ck)

    class Boom:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    with open(ck / "train_state.pt", "wb") as f:
        pickle.dump({"step": 1, "param_shapes": {}, "x": Boom()}, f)
    _fails(capsys, ["train", "--resume", str(ck), "--out", str(tmp_path / "r")], "refused by torch.load(weights_only=True)")
    assert not (tmp_path / "pwned").exists()


def test_existing_run_is_not_overwritten(capsys, one_step_run):
    _fails(capsys, ["train", "--out", str(one_step_run)], "already holds a run")


def test_fp8_on_a_gpu_without_fp8(monkeypatch):
    """Capability < 8.9: a clear error naming the GPU and the fix, unless fp8.emulate.

    No pre-Ada GPU exists here, so the CUDA queries are replaced by an A100's answers.
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    cfg = load_config(None, ["train.mixed_precision=fp8"])
    with pytest.raises(CapabilityError) as e:
        setup_mod.check_fp8_capability(cfg, torch.device("cuda"))
    msg = str(e.value)
    assert "NVIDIA A100-SXM4-80GB" in msg and "8.0" in msg and "fp8.emulate = true" in msg
    ok = setup_mod.check_fp8_capability(load_config(None, ["fp8.emulate=true"]), torch.device("cuda"))
    assert "emulating FP8" in ok
    assert "8.0" in setup_mod.check_fp8_capability(load_config(None, ["train.mixed_precision=bf16"]), torch.device("cuda"))


def test_resuming_a_finished_run_trains_nothing_and_changes_nothing(capsys, one_step_run):
    """A job requeued after its run finished (``--resume`` of a checkpoint at ``train.steps``) ends at once with
    exit status 0, says so, and leaves every file of the run as it was (summary.md kept its wall time)."""
    from fp8kit.cli.main import main

    files = sorted(p for p in one_step_run.rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    assert main(["train", str(one_step_run / "resolved_config.toml"), "--resume", str(one_step_run)]) == 0
    out = capsys.readouterr().out
    assert "nothing to train:" in out and "is at step 1 and train.steps = 1" in out, out
    assert f"the run directory {one_step_run} is left as it is" in " ".join(out.split()), out
    assert sorted(p for p in one_step_run.rglob("*") if p.is_file()) == files
    changed = [p.name for p in files if p.read_bytes() != before[p]]
    assert not changed, changed


def test_resuming_on_another_corpus_is_refused_and_changes_nothing(capsys, tmp_path, one_step_run):
    """``--resume`` with ``data.paths`` naming other data than the run trained on would continue the checkpoint at a
    data position of another corpus, with a BPE tokenizer trained on the new one (other token ids): refused with
    one line naming both corpora, before anything in the run directory is rewritten."""
    import shutil

    src = Path(json.__file__).parent
    data = tmp_path / "data"
    data.mkdir()
    for f in sorted(src.glob("*.py")):
        shutil.copy(f, data / f.name)
    files = sorted(p for p in one_step_run.rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    line = _fails(capsys, ["train", str(one_step_run / "resolved_config.toml"), "--resume", str(one_step_run),
                           "--set", f"data.paths=[\"{data}/*.py\"]", "--set", "train.steps=3"],
                  "the checkpoint was trained on another corpus")
    assert "file(s) from data.paths" in line and "fp8kit export" in line, line
    assert [p.name for p in files if p.read_bytes() != before[p]] == []
    assert sorted(p for p in one_step_run.rglob("*") if p.is_file()) == files


def test_the_corpus_check_compares_contents_not_paths(tmp_path, monkeypatch, capsys, cache_dir):
    """The same files under another path (relative at the start, absolute at the resume, as from another working
    directory or a staged copy) resume; checkpoints without the record, and pre-tokenized data, are not checked."""
    import shutil

    from fp8kit.base.errors import CheckpointError
    from fp8kit.data.prepare import PreparedData
    from fp8kit.train.setup import check_resume_data

    data = tmp_path / "data"
    data.mkdir()
    for f in sorted(Path(json.__file__).parent.glob("*.py")):
        shutil.copy(f, data / f.name)
    monkeypatch.chdir(tmp_path)
    sets = ["model.num_layers=2", "data.seq_length=32", "data.vocab_size=1024", f"data.cache_dir={cache_dir}",
            "train.micro_batch_size=2", "train.eval_batches=1"]
    args = [a for s in [*sets, 'data.paths=["data/*.py"]', "train.steps=1"] for a in ("--set", s)]
    assert main(["train", "--out", "run", *args]) == 0
    staged = tmp_path / "staged"
    shutil.copytree(data, staged)
    args = [a for s in [*sets, f'data.paths=["{staged}/*.py"]', "train.steps=2"] for a in ("--set", s)]
    assert main(["train", "--resume", str(tmp_path / "run"), "--out", str(tmp_path / "run2"), *args]) == 0, \
        capsys.readouterr().err

    ck = tmp_path / "run" / "checkpoints" / "step_000001"
    prep = PreparedData(None, 0, "1 file(s) from data.paths", "f" * 64, "bpe", tokenizer_obj=object(),
                        content_fingerprint="b" * 64)
    check_resume_data(ck, {}, prep)  # a checkpoint without the record: not checked
    check_resume_data(ck, {"corpus_content": "b" * 64}, prep)
    with pytest.raises(CheckpointError, match="trained on another corpus .content aaaaaaaaaaaa; data.paths now gives 1"):
        check_resume_data(ck, {"corpus_content": "a" * 64}, prep)
    check_resume_data(ck, {"corpus_content": "a" * 64}, PreparedData(None, 0, "2 token file(s)", "c" * 64, "bin"))


@pytest.mark.parametrize("rank, local_rank, waits", [("0", "0", False), ("1", "1", True), ("8", "0", False)])
def test_a_config_error_under_torchrun_is_printed_once_per_node(capsys, monkeypatch, tmp_path, rank, local_rank,
                                                                 waits):
    """Every rank of a node parses the same arguments and reads the same files, so a config error is the same on
    each: the node's local rank 0 prints it at once and fails (with 8 ranks and ``--max-restarts 3`` every rank used
    to print it: 32 times); the others first wait ``CONFIG_ERROR_WAIT_S`` for torchrun to end them (once local rank 0
    failed), so that none exits first and has torchrun stop local rank 0 before it printed; one still alive after
    the wait prints it too (here, with the wait patched out). Another node (rank 8, local rank 0) says its own."""
    from fp8kit.cli import main as cli_main

    slept: list[float] = []
    monkeypatch.setattr(cli_main.time, "sleep", slept.append)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert main(["train", "--out", str(tmp_path / "run"), "--set", "train.steps=1.5"]) == 2
    err = capsys.readouterr().err
    assert "train.steps=1.5: expected an integer" in err, (rank, err)
    assert slept == ([cli_main.CONFIG_ERROR_WAIT_S] if waits else []), (rank, slept)


def test_a_resume_with_another_global_batch_says_so(capsys, tmp_path, one_step_run):
    """Resuming with another number of sequences per optimizer step (another micro-batch, accumulation or
    data-parallel size) continues, and the run says how the steps differ from the checkpoint's."""
    out = tmp_path / "more"
    assert main(["train", str(one_step_run / "resolved_config.toml"), "--resume", str(one_step_run), "--out", str(out),
                 "--set", "train.steps=2", "--set", "train.micro_batch_size=4"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "the checkpoint was trained with 2 sequences per optimizer step, this run takes 4" in text, text
    assert "train.micro_batch_size 4 x train.grad_accum 1 x data-parallel size 1" in text, text
