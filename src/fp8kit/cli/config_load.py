"""Reading a command's run config the one way every ``fp8kit`` command does (``load_cli_config``)."""

from __future__ import annotations

import sys
from pathlib import Path


def load_cli_config(args) -> object:
    """The run config of a command (``train``, ``compare``, ``plan``, ``bench-layers``) from its ``config`` file and
    ``--set`` overrides, as every command reads it: a resume's own saved config (``--resume``), the
    pretrained directory's vocabulary and tokenizer (``model.pretrained``), and the config's notes printed to
    stderr (e.g. an old key read from its former place; under torchrun by each node's local rank 0 only).

    Raises:
        ConfigError: a bad config or override, a resume without a checkpoint, or an unusable pretrained directory.
    """
    from fp8kit.base.runtime import launched_local_rank
    from fp8kit.config import load_config

    say = launched_local_rank() == 0  # under torchrun: once per node, not once per rank
    config = args.config
    resume = getattr(args, "resume", None)
    run_dir = None  # the run a resume continues (a complete checkpoint in it), for from_run_files below
    if resume == "auto" and getattr(args, "out", None):
        from fp8kit.train.checkpoint import latest_checkpoint

        if latest_checkpoint(Path(args.out)) is not None:  # else a fresh start: model.pretrained is needed
            run_dir = Path(args.out)
    if resume and resume != "auto":
        # Continuing a run: its own resolved config, unless another one is given.
        from fp8kit.train.checkpoint import find_checkpoint

        run_dir = find_checkpoint(Path(resume)).parent.parent
        candidate = run_dir / "resolved_config.toml"
        if config is None and candidate.is_file():
            config = str(candidate)
    cfg = load_config(config, args.overrides, resolve=False)
    if run_dir is not None:  # a resume needs no pretrained directory: the run saved its config and tokenizer
        from fp8kit.train.export import from_run_files

        cfg, note = from_run_files(cfg, run_dir)
        if note and say:
            print(f"note: {note}", file=sys.stderr)
    from fp8kit.config.pretrained import resolve_pretrained

    cfg = resolve_pretrained(cfg)
    for note in cfg.notes if say else ():  # e.g. seed-compatible keys read from their old [fp8] place
        print(f"note: {note}", file=sys.stderr)
    return cfg
