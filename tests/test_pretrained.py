"""Pretrained checkpoints in and out: ``model.pretrained``, ``fp8kit export`` and transformers.

One source run (tiny, 2 layers, 20 steps in bf16 on a small corpus: the Python standard library's email
package) is exported with a 2MB shard limit (a sharded checkpoint with an index), then:

- the export loads in transformers (model and tokenizer) and gives fp8kit's logits exactly (same bf16
  weights and ops), the tokenizer encodes like the run's and round-trips text;
- a run with ``model.pretrained`` = the export starts from those weights: its first loss (bf16) equals the
  exported model's loss on the same batch (within 2e-3, measured 0) and lies far below a random-init
  loss; an FP8 fine-tune of it exports again, and transformers' logits equal fp8kit's eval logits of the
  fine-tuned weights;
- a 2-rank FSDP2 run (gloo) loads the sharded checkpoint on ``meta`` + per-rank slices and matches the
  single-process run (bf16 2e-3, fp8 1e-2, the tolerances of tests/test_distributed.py);
- bad pretrained directories fail with one line naming the file, and nothing is written.
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8kit.cli.main import main
from fp8kit.config import load_config
from fp8kit.train.metrics import read_metrics
from fp8kit.train.trainer import train
from tests.conftest import assert_hf_logits_equal_run

ROOT = Path(__file__).resolve().parent.parent
CORPUS = os.path.join(os.path.dirname(email.__file__), "*.py")


def _sets(cache_dir) -> list[str]:
    return [
        "data.seq_length=64", f"data.cache_dir={cache_dir}", f'data.paths=["{CORPUS}"]',
        "train.micro_batch_size=4", "train.log_every=1000", "train.eval_batches=2", "train.eval_every=0",
    ]


@pytest.fixture(scope="module")
def source(cache_dir, tmp_path_factory):
    """(source run dir, its sharded export, the overrides) of a 20-step bf16 tiny run."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("pretrained")
    sets = _sets(cache_dir)
    cfg = load_config(None, [*sets, "model.num_layers=2", "data.vocab_size=1024", "train.steps=20",
                             "train.mixed_precision=bf16"])
    run = train(cfg, root / "src").out_dir
    assert main(["export", str(run), str(root / "e1"), "--max-shard-size", "2MB"]) == 0
    yield run, root / "e1", sets
    torch.set_num_threads(before)


def _batch_loss(model, batch: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).item()


def _first_batch(run: Path) -> torch.Tensor:
    """The first training micro-batch of a run (same data, tokenizer and seed)."""
    from fp8kit.data.prepare import prepare_data

    cfg = load_config(str(run / "resolved_config.toml"), [])
    data = prepare_data(cfg.data, micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed)
    return data.packed.next_batch(cfg.train.micro_batch_size)


def test_export_loads_in_transformers(source):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer


    run, e1, _ = source
    files = sorted(p.name for p in e1.iterdir())
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) >= 2 and "model.safetensors.index.json" in files, files
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(files), files

    hf = AutoModelForCausalLM.from_pretrained(e1)
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    assert_hf_logits_equal_run(hf, run)

    # tokenizer: AutoTokenizer encodes as the run's tokenizer did, round-trips text, knows EOS
    tok = AutoTokenizer.from_pretrained(e1)
    theirs = Tokenizer.from_file(str(run / "tokenizer" / "tokenizer.json"))
    text = 'def f(x):\n    return {"a": x}  # ünïcode ✓\n'
    assert tok(text, add_special_tokens=False)["input_ids"] == theirs.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == "<|endoftext|>"
    gen = json.loads((e1 / "generation_config.json").read_text())
    assert gen.get("eos_token_id") == tok.eos_token_id, gen


def test_continue_from_pretrained_then_export_round_trip(source, tmp_path):
    from transformers import AutoModelForCausalLM

    from fp8kit.config.pretrained import resolve_pretrained
    from fp8kit.models.build import build_hf_config
    from fp8kit.models.pretrained import inspect_pretrained, load_pretrained
    from fp8kit.train import checkpoint as ckpt

    run, e1, sets = source
    random_init_loss = read_metrics(run / "metrics.jsonl")[0]["loss"]
    # bf16: the first loss is the exported model's loss on the same batch (not a random-init loss)
    cont = train(load_config(None, [*sets, f"model.pretrained={e1}", "train.steps=1", "train.mixed_precision=bf16",
                                    "train.final_checkpoint=false"]), tmp_path / "cont").out_dir
    first = read_metrics(cont / "metrics.jsonl")[0]["loss"]
    hf = AutoModelForCausalLM.from_pretrained(e1)
    want = _batch_loss(hf, _first_batch(cont))
    assert abs(first - want) <= 2e-3, f"first loss {first:.5f} vs exported model's {want:.5f}"
    assert first < random_init_loss - 0.5, f"first loss {first:.4f} is not below random init {random_init_loss:.4f}"
    cfg = load_config(str(cont / "resolved_config.toml"), [])
    assert cfg.data.vocab_size == 1024 and cfg.data.tokenizer == str(e1), cfg.data

    # FP8 fine-tune (3 steps) -> export -> transformers logits == fp8kit's eval logits of those weights
    ft = train(load_config(None, [*sets, f"model.pretrained={e1}", "train.steps=3"]), tmp_path / "ft").out_dir
    assert main(["export", str(ft), str(tmp_path / "e2")]) == 0
    assert (tmp_path / "e2" / "model.safetensors").is_file()  # under the 5GB default: one file
    hf2 = AutoModelForCausalLM.from_pretrained(tmp_path / "e2")
    fcfg = resolve_pretrained(load_config(str(ft / "resolved_config.toml"), []))
    ours = load_pretrained(inspect_pretrained(e1), build_hf_config(fcfg.model, fcfg.data.vocab_size),
                           device="cpu", dtype=torch.bfloat16)
    ckpt.load_model_weights(ckpt.find_checkpoint(ft), ours)
    ours.eval()
    x = _first_batch(ft)[:, :-1]
    with torch.no_grad():
        a, b = hf2(input_ids=x).logits.float(), ours(input_ids=x).logits.float()
    diff = (a - b).abs().max().item()
    assert diff <= 1e-2 * b.abs().max().item(), f"max |diff| {diff:.3e} (bf16 tolerance 1% of max |logit|)"
    w0 = hf.model.layers[0].mlp.up_proj.weight
    assert not torch.equal(hf2.model.layers[0].mlp.up_proj.weight, w0), "the fine-tune changed no weight"


def test_fsdp2_loads_sharded_pretrained_like_one_process(source, tmp_path):
    run, e1, sets = source
    base = [*sets, "train.steps=2", "train.final_checkpoint=false"]
    refs = {}
    for prec in ("bf16", "fp8"):
        cfg = load_config(None, [*base, f"model.pretrained={e1}", f"train.mixed_precision={prec}"])
        refs[prec] = [r["loss"] for r in train(cfg, tmp_path / f"ref_{prec}").metrics]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(ROOT / "tests" / "pretrained_worker.py"), str(tmp_path / "dist"), str(e1), "fsdp_bf16", "fsdp_fp8",
           "--", *base]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for prec, tol in (("bf16", 2e-3), ("fp8", 1e-2)):
        got = [r["loss"] for r in read_metrics(tmp_path / "dist" / f"fsdp_{prec}" / "metrics.jsonl")]
        diffs = [abs(a - b) for a, b in zip(got, refs[prec], strict=True)]
        assert max(diffs) <= tol, f"FSDP2 x2 {prec} vs 1 process: {got} vs {refs[prec]} (tol {tol})"
        rss = [json.loads((tmp_path / "dist" / f"fsdp_{prec}.rank{r}.json").read_text())["peak_rss_mib"]
               for r in (0, 1)]
        print(f"fsdp {prec}: losses {got}, peak host memory per rank {rss} MiB")


# ---------------------------------------------------------------------------------------------- bad input


def _copy(e1: Path, dst: Path, *, weights: bool = True) -> Path:
    dst.mkdir()
    for f in e1.iterdir():
        if weights or not f.name.startswith("model"):
            shutil.copy2(f, dst / f.name)
    return dst


def _fails(sets: list[str], out: Path, capsys, *needles: str) -> str:
    capsys.readouterr()  # drop what the test's own set-up printed
    argv = ["train", "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, f"{n!r} not in: {err}"
    assert not out.exists(), "something was written"
    return err


def test_bad_pretrained_dirs_fail_in_one_line(source, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    _, e1, sets = source
    no_weights = _copy(e1, tmp_path / "no_weights", weights=False)
    _fails([*sets, f"model.pretrained={no_weights}"], tmp_path / "o1", capsys, str(no_weights), "no weights")

    pickled = _copy(e1, tmp_path / "pickled", weights=False)
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    _fails([*sets, f"model.pretrained={pickled}"], tmp_path / "o2", capsys, "pytorch_model.bin", "safetensors only")

    shapes = _copy(e1, tmp_path / "shapes")
    c = json.loads((shapes / "config.json").read_text())
    c["intermediate_size"] = 704
    (shapes / "config.json").write_text(json.dumps(c))
    err = _fails([*sets, f"model.pretrained={shapes}"], tmp_path / "o3", capsys, str(shapes), "mlp.", "704")
    assert "model-0000" in err, err  # the shard file that holds the weight

    # a tokenizer larger than the model's vocabulary: a 512-token model with the run's 1024-token tokenizer
    small = tmp_path / "small_vocab"
    c = json.loads((e1 / "config.json").read_text())
    c.update(vocab_size=512, eos_token_id=None)
    cfg = AutoConfig.for_model(**{k: v for k, v in c.items() if k not in ("architectures", "transformers_version")})
    AutoModelForCausalLM.from_config(cfg).save_pretrained(small)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(e1 / f, small / f)
    _fails([*sets, f"model.pretrained={small}"], tmp_path / "o4", capsys, str(small / "tokenizer.json"),
           "1024 tokens", "512")

    _fails([*sets, f"model.pretrained={e1}", "data.vocab_size=2048"], tmp_path / "o5", capsys, "vocab_size = 1024")
    _fails([*sets, f"model.pretrained={tmp_path / 'nowhere'}"], tmp_path / "o6", capsys, "nowhere", "not a directory")


def test_a_resume_needs_no_pretrained_directory(source, tmp_path, capsys):
    """A run from ``model.pretrained`` resumes after that directory is gone (moved, deleted, another node): the
    resume loads its checkpoint's weights, and the model's config and the tokenizer come from the run's own
    ``model_config.json`` and ``tokenizer/``, with a note saying so; the run continues as if nothing had moved."""
    run, e1, sets = source
    base = _copy(e1, tmp_path / "base")
    out = tmp_path / "ft"
    argv = ["train", "--out", str(out)] + [a for s in [*sets, f"model.pretrained={base}", "train.steps=1",
                                                       "train.mixed_precision=bf16"] for a in ("--set", s)]
    assert main(argv) == 0
    shutil.rmtree(base)
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--set", "train.steps=2"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert f"model.pretrained '{base}' is gone: the resumed run is rebuilt from its own" in err, err
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2], steps
    cfg = load_config(str(out / "resolved_config.toml"), [])
    assert cfg.model.pretrained is None and cfg.model.hf_config == str(out / "model_config.json"), cfg.model
    assert cfg.data.tokenizer == str(out / "tokenizer"), cfg.data
    # --resume auto on a run killed before its first checkpoint starts fresh: that needs the pretrained weights,
    # so the missing directory is an error there, not a quiet start from random weights
    fresh = tmp_path / "fresh"
    shutil.copytree(out, fresh, ignore=shutil.ignore_patterns("checkpoints"))
    capsys.readouterr()
    argv = ["train", "--resume", "auto", "--out", str(fresh)] + [
        a for s in [*sets, f"model.pretrained={base}", "train.steps=2"] for a in ("--set", s)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"model.pretrained {str(base)!r}" in err and "is gone" not in err, err
