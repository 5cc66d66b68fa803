"""The ``fp8kit`` command line.

Every user error is one line on stderr (``error: ...``) and exit status 2, with nothing written; a
diverged training run exits with status 1 after writing its metrics and summary; a training run stopped
by SIGTERM / SIGINT / SIGUSR1 (preemption, ``fp8kit.train.preempt``) exits with 128 + the signal number
after its checkpoint, metrics and summary.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fp8kit.base.errors import ConfigError, Fp8kitError
from fp8kit.cli.config_load import load_cli_config

#: seconds a torchrun rank other than its node's local rank 0 waits, after a config error, for torchrun to end it
#: (``main``): local rank 0 prints the error and fails, and torchrun then stops the other ranks
CONFIG_ERROR_WAIT_S = 30.0


def _add_config_args(p: argparse.ArgumentParser, *, config_required: bool) -> None:
    if config_required:
        p.add_argument("config", help="run config file (.toml, .yaml)")
    else:
        p.add_argument("config", nargs="?", help="run config file (.toml, .yaml); default: the embedded default")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config key (repeatable), e.g. --set train.steps=50",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp8kit", description="FP8 training for PyTorch that is never slower than BF16.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a decoder-only LLM (default: tiny preset on the stdlib corpus, fp8)")
    _add_config_args(p, config_required=False)
    p.add_argument("--out", help="run directory (default: runs/<time>-<preset>-<precision>)")
    p.add_argument(
        "--resume",
        help="continue from a run directory (its latest checkpoint) or a checkpoint directory; 'auto': continue "
        "from --out's latest complete checkpoint if it has one, else start there (torchrun --max-restarts, "
        "SLURM requeue); default: train.resume",
    )

    p = sub.add_parser("compare", help="run a config in bf16 and in fp8 and plot both loss curves")
    _add_config_args(p, config_required=True)
    p.add_argument("--out", help="output directory (default: runs/<time>-compare)")

    from fp8kit.cli.selective import add_parsers

    add_parsers(sub)

    p = sub.add_parser("export", help="write a checkpoint (any layout) as a Hugging Face model directory (bf16)")
    p.add_argument("checkpoint", help="a run directory (its latest checkpoint) or a checkpoint directory")
    p.add_argument("out_dir", help="output directory: safetensors, config.json, tokenizer files, generation "
                   "config (AutoModelForCausalLM / AutoTokenizer.from_pretrained load it)")
    p.add_argument("--config", help="the run config (default: the run's resolved_config.toml)")

    def max_shard_size(text: str) -> int:  # checked here: a bad size is refused before anything is read or written
        from fp8kit.train.export import parse_max_shard_size

        try:
            return parse_max_shard_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    p.add_argument("--max-shard-size", default="5GB", type=max_shard_size,
                   help="largest safetensors file: bytes, or a whole number with GB, MB, KB or GiB, MiB, KiB (e.g. 500MB); larger "
                   "models are sharded with an index (default 5GB)")

    p = sub.add_parser("config-docs", help="print the config reference (Markdown) generated from the dataclasses")
    p.add_argument("--output", help="write to this file instead of stdout")
    return parser


def _run(args) -> int:
    if args.command == "config-docs":
        from fp8kit.config import config_reference_markdown

        text = config_reference_markdown()
        if args.output:
            Path(args.output).write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
        return 0
    if args.command == "train":
        from fp8kit.base import cpu_bf16_gemm
        from fp8kit.train.trainer import train

        cpu_bf16_gemm.install()  # this process is the run's: bf16 matmuls of a CPU without AVX-512 as float32 GEMMs
        result = train(load_cli_config(args), args.out, resume=args.resume)
        return 128 + result.interrupted if result.interrupted else 0  # stopped by a signal: as the shell reports it
    if args.command == "export":
        from fp8kit.train.export import export_checkpoint, exported_files

        out = export_checkpoint(Path(args.checkpoint), Path(args.out_dir), config=args.config,
                                max_shard_size=args.max_shard_size)
        f = exported_files(out)
        weights = f"{len(f['weights'])} shards + index" if f["sharded"] else "model.safetensors"
        extras = ", tokenizer" if f["tokenizer"] else ", no tokenizer (pre-tokenized data)"
        extras += ", generation_config.json" if f["generation_config"] else ""
        print(f"exported {args.checkpoint} -> {out} (bf16 safetensors, {weights}, config.json{extras}); "
              f"AutoModelForCausalLM / AutoTokenizer.from_pretrained load it")
        return 0
    if args.command == "compare":
        from fp8kit.base.errors import ConfigError
        from fp8kit.base.runtime import launched_world_size

        if launched_world_size() > 1:
            raise ConfigError(
                "fp8kit compare runs in one process; under torchrun, run `fp8kit train` twice with "
                "--set train.mixed_precision=bf16 and =fp8 and compare their metrics.jsonl"
            )
        from fp8kit.train.compare import compare

        compare(load_cli_config(args), args.out)
        return 0
    from fp8kit.cli import selective as selective_cli

    return selective_cli.run(args)


def _run_and_end(args) -> int:
    """:func:`_run`, then the end of the process group a torchrun launch started (``train``, ``bench-layers --tp``):
    after a barrier when the command returned (on every rank: ``train``'s halt by a signal is agreed by all), without
    one when it raised (``parallel.mesh.end_distributed``). Commands that never imported ``torch.distributed`` started
    no group, and do not import torch for it."""
    try:
        status = _run(args)
    except BaseException:
        _end_process_group(completed=False)
        raise
    _end_process_group(completed=True)
    return status


def _end_process_group(*, completed: bool) -> None:
    if "torch.distributed" in sys.modules:
        from fp8kit.parallel.mesh import end_distributed

        end_distributed(completed=completed)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fp8kit`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return _run_and_end(args)
    except Fp8kitError as e:
        # imported here, as TrainingDiverged: both import torch, which `fp8kit --help` should not wait for
        from fp8kit.base.runtime import launched_local_rank
        from fp8kit.train.loop import TrainingDiverged

        # A config error comes from the same arguments on every rank of a node (some read the node's files, such as
        # model.pretrained): each node's local rank 0 says it once. The other local ranks first wait for torchrun to
        # end them (it does once local rank 0 has failed): a rank that exited first would have torchrun stop local
        # rank 0 before it printed, and the user would see no error. One still alive after the wait says it too.
        # Other errors (a GPU, a checkpoint shard) can be one rank's own: every rank prints its own.
        if isinstance(e, ConfigError) and launched_local_rank() != 0:
            try:
                time.sleep(CONFIG_ERROR_WAIT_S)
            except KeyboardInterrupt:  # Ctrl-C of the launch: local rank 0 says the error
                return 2
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 1 if isinstance(e, TrainingDiverged) else 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
