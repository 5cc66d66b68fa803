"""Supervised fine-tuning from a "pretrained" checkpoint: BF16 vs FP8 through ``fp8kit train`` and through
``transformers.Trainer`` (examples/hf_trainer.py), and the FSDP2 load of a sharded checkpoint.

Two subcommands, one command each (a GPU machine; ``--device cpu --tiny`` is the CPU smoke test)::

    python benchmarks/sft_throughput.py sft --out /tmp/sft.json                   # 1 x H100
    python benchmarks/sft_throughput.py fsdp-load --nproc 2 --out /tmp/load.json  # 2 x H200

``sft``: for each model, a checkpoint is written on the fly the way ``fp8kit export`` writes one
(``save_pretrained`` in bf16, sharded above 2GB, config.json, the tokenizer files of a byte-level BPE
trained on the Python standard library): ``llama-125m`` (vocab 32000) and ``llama3-8b-8layers`` (Llama-3-8B
layers, 8 of them, vocab 128256). Chat data is generated locally (``chat.jsonl``: questions about stdlib
functions, answered with their docstring and source). Each variant is a separate process:

- ``fp8kit train`` with ``model.pretrained`` = the checkpoint, ``data.format = "chat"`` (loss on the
  assistant tokens; plain text if this fp8kit has no chat format), per-block ``torch.compile``:
  ``bf16``, ``fp8`` (tensorwise, every eligible layer: ``selective.selective_fp8 = false``) and ``fp8-auto``
  (``selective.selective_fp8 = "auto"``, the default: each site shape timed at start-up, FP8 only where it
  measured faster);
- ``examples/hf_trainer.py`` (the Trainer, whole-model ``torch_compile``): ``bf16`` (the Trainer alone) and
  ``fp8`` / ``fp8-auto`` (the two fp8kit lines; the Trainer's ``fp8-auto`` uses a policy: the shipped H100
  policy of the preset when there is one, else one measured here with ``fp8kit bench-layers`` +
  ``merge-policy``). The Trainer path packs the rendered chats as plain causal-LM
  text (no prompt masking).

Printed: one table (tokens/s, speed-up over the same path's bf16, ms/step, peak GiB, FP8 layers, final
loss); ``--out`` gets the JSON.

``fsdp-load``: writes a sharded checkpoint (default ``llama3-8b``, all 32 layers, 5GB shards) and launches
``torchrun --nproc_per_node N`` of this script; each rank runs ``fp8kit.train.setup.build_setup`` with
``model.pretrained`` under FSDP2 (built on meta, sharded, each rank reading its own slices) and reports the
load time and its peak host memory (``ru_maxrss``) against the checkpoint's size.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = {  # name -> (preset, num_layers, model vocab)
    "llama-125m": ("llama-125m", None, 32000),
    "llama3-8b-8layers": ("llama3-8b", 8, 128256),
}
TINY = {"llama-125m": ("tiny", 2, 1024), "llama3-8b-8layers": ("tiny", 4, 2048)}
BUILTIN_POLICIES = {"llama3-8b": "builtin:llama3-8b_tensorwise_h100", "llama3-1b": "builtin:llama3-1b_tensorwise_h100"}


def make_tokenizer(work: Path, vocab: int) -> Path:
    """A byte-level BPE (fp8kit's) trained on the standard library, saved in the Hugging Face layout."""
    out = work / f"tokenizer-{vocab}"
    if (out / "tokenizer.json").is_file():
        return out
    from fp8kit.data.corpus import load_corpus
    from fp8kit.data.tokenizer import train_bpe
    from fp8kit.train.export import save_run_tokenizer

    save_run_tokenizer(train_bpe(load_corpus([], "text").texts, vocab), None, out)
    return out


def make_pretrained(work: Path, name: str, spec: tuple, tok_dir: Path, device: str, shard: str) -> dict:
    """Write a bf16 checkpoint of ``spec`` (preset, layers, vocab) with the tokenizer; returns its facts."""
    import torch
    from tokenizers import Tokenizer

    from fp8kit.config import ModelConfig
    from fp8kit.models.build import build_model

    out = work / f"pretrained-{name}"
    if (out / "config.json").is_file():
        return {"dir": str(out), "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")), "write_s": 0.0}
    preset, layers, vocab = spec
    t0 = time.perf_counter()
    model = build_model(ModelConfig(preset=preset, num_layers=layers), vocab, device=device, dtype=torch.bfloat16)
    eos = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).token_to_id("<|endoftext|>")
    for c in (model.config, model.generation_config):
        c.eos_token_id, c.bos_token_id, c.pad_token_id = eos, None, None
    model.config.use_cache = True
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), max_shard_size=shard)
    for f in tok_dir.iterdir():
        shutil.copy2(f, tmp / f.name)
    os.replace(tmp, out)
    del model
    return {"dir": str(out), "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
            "write_s": time.perf_counter() - t0}


def make_chat_data(path: Path, n: int) -> Path:
    """``n`` chat records: "what does module.function do?" -> its docstring and source (standard library)."""
    if path.is_file():
        return path
    import sysconfig

    records = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in f.parts or "site-packages" in f.parts:
            continue
        try:
            src = f.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and len(records) < n:
                code = (ast.get_source_segment(src, node) or "")[:3000]
                records.append({"messages": [
                    {"role": "system", "content": "You explain Python standard library code."},
                    {"role": "user", "content": f"What does `{node.name}` in {f.stem} do? Show the code."},
                    {"role": "assistant", "content": f"{ast.get_docstring(node)}\n\n```python\n{code}\n```"},
                ]})
        if len(records) >= n:
            break
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _chat_supported() -> bool:
    from fp8kit.config import DataConfig

    return "format" in DataConfig.model_fields


def auto_policy(work: Path, preset: str, pretrained: str, sets: list[str], device: str, tiny: bool) -> str:
    """The selective-FP8 policy of ``fp8-auto``: the shipped one for the preset, else measured here."""
    if preset in BUILTIN_POLICIES and device == "cuda":
        return BUILTIN_POLICIES[preset]
    policy = work / f"policy-{Path(pretrained).name}.json"
    if not policy.is_file():
        report = work / f"report-{Path(pretrained).name}.json"
        bench = [sys.executable, "-m", "fp8kit", "bench-layers", "--set", f"model.pretrained={pretrained}",
                 "--report", str(report), "--device", device]
        tokens = 1
        for s in sets:
            if s.startswith(("data.seq_length", "train.micro_batch_size")):
                bench += ["--set", s]
                tokens *= int(s.split("=", 1)[1])
        # the sweep up to twice the run's tokens per micro-batch (the lookup point), not the default 32768
        bench += ["--max-tokens", "256", "--warmup", "1", "--iters", "2"] if tiny else ["--max-tokens", str(2 * tokens)]
        _run(bench, work / f"bench-{Path(pretrained).name}.log")
        _run([sys.executable, "-m", "fp8kit", "merge-policy", "--reports", str(report), "--output", str(policy),
              "--speedup-threshold", "1.0"], work / f"merge-{Path(pretrained).name}.log")
    return str(policy)


def _run(cmd: list[str], log: Path) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, text=True, capture_output=True, env=env)
    log.write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["failed"]
        raise RuntimeError(f"{cmd[2] if len(cmd) > 2 else cmd[0]} failed: {tail[0]} (log {log})")
    return proc


def fp8kit_variant(work: Path, model: str, variant: str, pretrained: str, sets: list[str], policy: str | None) -> dict:
    run_dir = work / "runs" / f"fp8kit-{model}-{variant}"
    shutil.rmtree(run_dir, ignore_errors=True)
    extra = {"bf16": ["train.mixed_precision=bf16"],
             "fp8": ["train.mixed_precision=fp8", "selective.selective_fp8=false"],
             "fp8-auto": ["train.mixed_precision=fp8", "selective.selective_fp8=auto"]}[variant]
    cmd = [sys.executable, "-m", "fp8kit", "train", "--out", str(run_dir)]
    for s in [f"model.pretrained={pretrained}", *sets, *extra]:
        cmd += ["--set", s]
    _run(cmd, run_dir.with_suffix(".log"))
    s = json.loads((run_dir / "summary.json").read_text())
    fp8 = s.get("setup", {}).get("fp8_sites") or s.get("fp8_sites")
    return {"path": "fp8kit train", "tokens_per_s": s["tokens_per_s"], "step_ms": s["step_ms"],
            "peak_mem_gib": s["peak_mem_gib"], "final_loss": s["final_loss"], "fp8_layers": fp8}


def trainer_variant(work: Path, model: str, variant: str, pretrained: str, args, policy: str | None,
                    data: Path) -> dict:
    out = work / "runs" / f"trainer-{model}-{variant}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "examples" / "hf_trainer.py"), "--model", pretrained, "--data", str(data),
           "--output_dir", str(out), "--max_steps", str(args.steps), "--seq_len", str(args.seq_len),
           "--batch_size", str(args.mbs), "--lr", "1e-5", "--device", args.device, "--no_save"]
    if args.device == "cuda":
        cmd += ["--compile"]
    if variant != "bf16":
        cmd += ["--fp8"] + (["--policy", policy] if variant == "fp8-auto" else [])
    out.mkdir(parents=True)
    _run(cmd, out / "log.txt")
    r = json.loads((out / "hf_trainer_result.json").read_text())
    return {"path": "Trainer", "tokens_per_s": r["tokens_per_s"], "step_ms": r["step_ms_median"],
            "peak_mem_gib": r["peak_mem_gib"], "final_loss": r["losses"][-1] if r["losses"] else None,
            "fp8_layers": f"{r['fp8_layers']} of {r['linear_layers']}"}


def cmd_sft(args) -> int:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    models = TINY if args.tiny else MODELS
    chat = make_chat_data(work / "chat.jsonl", 400 if args.tiny else 6000)
    chat_ok = _chat_supported()
    sets = [f"data.seq_length={args.seq_len}", f"train.micro_batch_size={args.mbs}", f"train.steps={args.steps}",
            f"data.cache_dir={work / 'cache'}", "train.eval_every=0", "train.checkpoint_every=0",
            "train.final_checkpoint=false", "train.warmup_steps=2", "train.lr=1e-5", "train.log_every=10",
            f"train.device={args.device}", f"train.compile={'true' if args.device == 'cuda' else 'false'}"]
    sets += [f'data.paths=["{chat}"]'] + (["data.format=chat"] if chat_ok else [])
    results = []
    for name in args.models.split(","):
        spec = models[name]
        tok = make_tokenizer(work, min(spec[2], 32000))
        ck = make_pretrained(work, name, spec, tok, args.device, "2GB")
        pretrained = ck["dir"]
        try:
            policy = (auto_policy(work, spec[0], pretrained, sets, args.device, args.tiny)
                      if "fp8-auto" in args.variants and "trainer" in args.paths else None)
        except RuntimeError as e:
            print(f"fp8-auto skipped for {name}: {e}", flush=True)
            policy = None
        for path in args.paths.split(","):
            for variant in args.variants.split(","):
                if variant == "fp8-auto" and policy is None and path == "trainer":
                    continue
                row = {"model": name, "variant": variant, "checkpoint_bytes": ck["bytes"]}
                try:
                    if path == "fp8kit":
                        row.update(fp8kit_variant(work, name, variant, pretrained, sets, policy))
                    else:
                        row.update(trainer_variant(work, name, variant, pretrained, args, policy, chat))
                except RuntimeError as e:
                    row.update(path="fp8kit train" if path == "fp8kit" else "Trainer", error=str(e))
                print(json.dumps(row), flush=True)
                results.append(row)
                if args.out:  # rewritten after every row: a time limit loses at most the running variant
                    _write_sft(args.out, results, args, chat_ok)
    _print_sft(results, chat_ok, args)
    if args.out:
        _write_sft(args.out, results, args, chat_ok)
    return 0 if all("error" not in r for r in results) else 1


def _write_sft(out: str, rows: list[dict], args, chat_ok: bool) -> None:
    import datetime

    Path(out).write_text(json.dumps({"rows": rows, "args": vars(args), "chat_format": chat_ok,
                                     "date": datetime.date.today().isoformat(), "versions": _versions()},
                                    indent=1) + "\n")


def _print_sft(rows: list[dict], chat_ok: bool, args) -> None:
    print(f"\nSFT from a pretrained checkpoint: seq {args.seq_len} x micro-batch {args.mbs}, {args.steps} steps, "
          f"device {args.device}; data: {'chat (fp8kit: assistant-token loss)' if chat_ok else 'plain text'}")
    print("| model | path | precision | tokens/s | vs bf16 | ms/step | peak GiB | FP8 layers | final loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['path']} | {r['variant']} | error: {r['error']} | | | | | |")
            continue
        base = next((b for b in rows if b["model"] == r["model"] and b["path"] == r["path"]
                     and b["variant"] == "bf16" and "error" not in b), None)
        sp = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
        loss = f"{r['final_loss']:.3f}" if r.get("final_loss") is not None else "-"
        print(f"| {r['model']} | {r['path']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {sp} | {r['step_ms']:.1f} "
              f"| {mem} | {r['fp8_layers']} | {loss} |")


def _versions() -> dict:
    from fp8kit.base.runtime import versions

    return versions()


def cmd_fsdp_load(args) -> int:
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    spec = ("tiny", 4, 2048) if args.tiny else (args.preset, args.num_layers, 128256)
    tok = make_tokenizer(work, min(spec[2], 32000))
    ck = make_pretrained(work, f"fsdp-{spec[0]}-{spec[1] or 'all'}", spec, tok, args.device,
                         "2MB" if args.tiny else "5GB")
    ranks = work / "fsdp_ranks"
    shutil.rmtree(ranks, ignore_errors=True)
    ranks.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           str(Path(__file__).resolve()), "_fsdp_rank", "--pretrained", ck["dir"], "--ranks", str(ranks),
           "--device", args.device, "--workdir", str(work)]
    _run(cmd, work / "fsdp_load.log")
    per_rank = [json.loads(p.read_text()) for p in sorted(ranks.glob("rank*.json"))]
    gib = ck["bytes"] / 2**30
    print(f"\nFSDP2 load of {ck['dir']} ({gib:.1f} GiB of safetensors, {len(list(Path(ck['dir']).glob('*.safetensors')))}"
          f" files) on {args.nproc} ranks ({args.device})")
    print("| rank | load s | setup s | peak host GiB | host GiB before load | GPU GiB after load |")
    print("|---|---|---|---|---|---|")
    for r in per_rank:
        gpu = f"{r['gpu_gib']:.1f}" if r.get("gpu_gib") is not None else "-"
        print(f"| {r['rank']} | {r['load_s']:.1f} | {r['setup_s']:.1f} | {r['peak_rss_gib']:.2f} | "
              f"{r['rss_before_load_gib']:.2f} | {gpu} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"checkpoint": ck, "ranks": per_rank, "nproc": args.nproc,
                                              "versions": _versions()}, indent=1) + "\n")
    return 0


def cmd_fsdp_rank(args) -> int:
    """One torchrun rank: build_setup with model.pretrained under FSDP2; times the load, measures host memory."""
    import torch

    from fp8kit.base.runtime import is_main
    from fp8kit.config import load_config
    from fp8kit.train.setup import build_setup

    def rss_gib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    marks: dict[str, float] = {}

    def status(msg: str) -> None:
        marks.setdefault(msg.split(" ")[0], time.perf_counter())
        if msg.startswith("loading"):
            marks["rss_before_load"] = rss_gib()

    import email

    corpus = os.path.join(os.path.dirname(email.__file__), "*.py")
    cfg = load_config(None, [f"model.pretrained={args.pretrained}", f'data.paths=["{corpus}"]', "data.seq_length=256",
                             "train.micro_batch_size=1", "train.steps=1", f"train.device={args.device}",
                             f"data.cache_dir={Path(args.workdir) / 'cache'}", "train.mixed_precision=bf16"])
    t0 = time.perf_counter()
    setup = build_setup(cfg, status=status)
    t1 = time.perf_counter()
    import torch.distributed as dist

    rank = dist.get_rank()
    row = {"rank": rank, "setup_s": t1 - t0, "load_s": t1 - marks.get("loading", t1), "peak_rss_gib": rss_gib(),
           "rss_before_load_gib": marks.get("rss_before_load", 0.0),
           "gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if setup.device.type == "cuda" else None}
    (Path(args.ranks) / f"rank{rank}.json").write_text(json.dumps(row))
    if is_main():
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("sft", help="bf16 vs fp8 SFT through fp8kit train and the HF Trainer")
    p.add_argument("--models", default="llama-125m,llama3-8b-8layers")
    p.add_argument("--paths", default="fp8kit,trainer")
    p.add_argument("--variants", default="bf16,fp8,fp8-auto")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--mbs", type=int, default=2)
    for q in (p, sub.add_parser("fsdp-load", help="FSDP2 load of a sharded checkpoint (torchrun)")):
        q.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
        q.add_argument("--tiny", action="store_true", help="CPU smoke sizes (tiny preset, few steps)")
        q.add_argument("--workdir", default="runs/bench-sft")
        q.add_argument("--out", default=None, help="write the results as JSON here")
    q.add_argument("--nproc", type=int, default=2)
    q.add_argument("--preset", default="llama3-8b")
    q.add_argument("--num-layers", type=int, default=None, help="default: all layers of the preset")
    r = sub.add_parser("_fsdp_rank")
    for a in ("--pretrained", "--ranks", "--device", "--workdir"):
        r.add_argument(a, required=True)
    args = ap.parse_args()
    if args.cmd == "sft":
        if args.tiny:
            args.steps, args.seq_len, args.mbs = min(args.steps, 3), min(args.seq_len, 64), min(args.mbs, 2)
        return cmd_sft(args)
    if args.cmd == "fsdp-load":
        return cmd_fsdp_load(args)
    return cmd_fsdp_rank(args)


if __name__ == "__main__":
    raise SystemExit(main())
