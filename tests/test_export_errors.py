"""``fp8kit export`` on bad input: one ``error: ...`` line naming what and where, exit status 2, and nothing
written (the export is built in a temporary sibling directory, renamed into place only when complete)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from fp8kit.base.errors import CheckpointError
from fp8kit.cli.main import main
from fp8kit.config import load_config
from fp8kit.train.export import export_checkpoint, parse_max_shard_size
from fp8kit.train.trainer import train
from tests.conftest import small_run_overrides


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, cache_dir):
    """A 1-step run with its final checkpoint (text data, fp8kit's BPE)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_config(None, [*small_run_overrides(cache_dir), "train.steps=1", "train.eval_every=0"])
        return train(cfg, tmp_path_factory.mktemp("export-errors") / "base").out_dir
    finally:
        torch.set_num_threads(before)


def _error_line(err: str) -> str:
    """The one ``error`` line of ``err``, the last one (transformers' progress bars may come before it)."""
    lines = err.strip().splitlines()
    assert [ln for ln in lines if "error" in ln.lower()] == lines[-1:] and "Traceback" not in err, err
    return lines[-1]


def _left(parent) -> list[str]:
    """Everything in ``parent`` (temporary export directories included)."""
    return sorted(p.name for p in parent.iterdir())


def test_max_shard_size_is_checked_when_parsed(base_run, tmp_path, capsys):
    out = tmp_path / "y"
    with pytest.raises(SystemExit) as e:
        main(["export", str(base_run), str(out), "--max-shard-size", "5XB"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    line = _error_line(err)
    assert "argument --max-shard-size: '5XB' is not a shard size" in line and "5GB or 500MB" in line, line
    assert _left(tmp_path) == [], _left(tmp_path)
    # the corrected retry works
    assert main(["export", str(base_run), str(out), "--max-shard-size", "500MB"]) == 0, capsys.readouterr().err
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file(), _left(out)
    assert _left(tmp_path) == ["y"], _left(tmp_path)


def test_max_shard_size_forms():
    """What transformers' ``save_pretrained`` accepts (its ``convert_file_size_to_int``), plain bytes and ints."""
    cases = {"5GB": 5 * 10**9, "500MB": 500 * 10**6, "5GiB": 5 * 2**30, "500MiB": 500 * 2**20, "2KB": 2000,
             "123456": 123456, 4096: 4096}
    got = {k: parse_max_shard_size(k) for k in cases}
    assert got == cases, got
    for bad in ("5XB", "0GB", "GB", "-1", "1.5", "1.5GB", "", "5 G", 0, True):
        with pytest.raises(ValueError, match="is not a shard size: give bytes, or a whole number with GB, MB, KB"):
            parse_max_shard_size(bad)


def test_library_export_refuses_a_bad_shard_size_before_writing(base_run, tmp_path):
    with pytest.raises(CheckpointError, match=r"^export: max_shard_size '5XB' is not a shard size"):
        export_checkpoint(base_run, tmp_path / "out" / "y", max_shard_size="5XB")
    assert _left(tmp_path) == [], _left(tmp_path)


def test_unwritable_output_is_one_line_naming_it(base_run, tmp_path, capsys):
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc (a directory where nothing can be created)")
    assert main(["export", str(base_run), "/proc/x"]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == "error: export: cannot write the output directory '/proc/x': No such file or directory", line
    # a parent path through a file
    (tmp_path / "afile").write_text("keep me")
    assert main(["export", str(base_run), str(tmp_path / "afile" / "sub" / "y")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert f"error: export: cannot write the output directory {str(tmp_path / 'afile' / 'sub' / 'y')!r}: " in line
    assert _left(tmp_path) == ["afile"] and (tmp_path / "afile").read_text() == "keep me", _left(tmp_path)


def test_a_write_that_fails_midway_leaves_nothing(base_run, tmp_path):
    """A file-size limit below the weights' size makes their write fail (as a full disk does): one line naming
    the output, and neither the output, its new parent, nor a temporary directory is left."""
    pytest.importorskip("resource")
    out = tmp_path / "new" / "y"
    limit = 100_000  # bytes: above config.json, below model.safetensors (a few MB)
    code = (f"import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
            f"from fp8kit.cli.main import main; sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "export", str(base_run), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    line = _error_line(r.stderr)
    assert line.startswith(f"error: export: cannot write the output directory {str(out)!r}: ") and (
        "File too large" in line), line
    assert _left(tmp_path) == [], _left(tmp_path)


def test_a_run_file_that_cannot_be_read_is_named_as_a_read_error(base_run, tmp_path, capsys):
    """A file of the run the export copies (here a tokenizer file that is a dangling link) fails as a read of that
    file, not as a write of the output; nothing is left."""
    run = tmp_path / "run"
    shutil.copytree(base_run, run, symlinks=True)
    bad = run / "tokenizer" / "special_tokens_map.json"
    bad.unlink(missing_ok=True)
    bad.symlink_to(tmp_path / "gone.json")
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == f"error: export: cannot read {str(bad)!r}: No such file or directory", line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], list(tmp_path.iterdir())


def test_a_full_disk_while_copying_the_tokenizer_is_a_write_error(base_run, tmp_path, capsys, monkeypatch):
    """shutil.copy2's sendfile names the source file in the error of a failed write (ENOSPC): still a write error
    of the output, not a read error of the run's tokenizer file."""
    import errno
    import shutil as sh

    if not getattr(sh, "_USE_CP_SENDFILE", False):
        pytest.skip("shutil copies without os.sendfile here")

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "sendfile", full)
    assert main(["export", str(base_run), str(tmp_path / "out")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == f"error: export: cannot write the output directory {str(tmp_path / 'out')!r}: No space left on device", line
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_wording_of_a_missing_run_and_of_a_file_as_output(base_run, tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "z")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == (f"error: export {str(tmp_path / 'nope')!r}: the directory does not exist (give a run directory "
                    f"or a checkpoint directory)"), line
    (tmp_path / "afile").write_text("keep me")
    assert main(["export", str(base_run), str(tmp_path / "afile")]) == 2
    line = _error_line(capsys.readouterr().err)
    assert line == (f"error: export: the output path {str(tmp_path / 'afile')!r} is a file (give a new or empty "
                    f"directory)"), line
    assert _left(tmp_path) == ["afile"] and (tmp_path / "afile").read_text() == "keep me", _left(tmp_path)


def test_export_fills_an_existing_empty_directory_in_place(base_run, tmp_path, monkeypatch, capsys):
    """``fp8kit export RUN .`` in an empty directory (or into an empty mount point): written in place through a
    temporary directory inside it, the directory itself kept (its mode here), no temporary directory left."""
    out = tmp_path / "here"
    out.mkdir(mode=0o750)
    out.chmod(0o750)
    monkeypatch.chdir(out)
    assert main(["export", str(base_run), "."]) == 0, capsys.readouterr().err
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file(), _left(out)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], _left(out)
    assert (out.stat().st_mode & 0o777) == 0o750, oct(out.stat().st_mode)
