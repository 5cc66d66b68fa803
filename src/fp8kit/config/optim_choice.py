"""``optim.name = "auto"`` and ``train.param_dtype = "auto"`` (the defaults): a high-precision master for the run.

Updating bf16 weights in place loses the small updates of late training (llama-125m, 1200 steps on the H100,
mean train loss of steps 1101-1200: 1.569 with bf16 weights updated in place vs 1.352 with an FP32 master and
1.329 with FP8AdamW; ``shared/anchors.md``). The defaults keep a high-precision master:

- ``fp8_adamw`` (FP8-LM's scaled FP16 master, E4M3 first moment, FP16 second moment, bf16 gradients read in
  place: 7 bytes/param; on the H100 its whole train step is 0.76x / 0.92x the step of fused AdamW with an FP32
  master at llama-125m / Llama-3-8B layers, and llama-125m ends within 0.16% of AdamW's validation loss:
  docs/benchmarks.md section 3), with bf16 working weights;
- except where FP8AdamW does not run (tensor or expert parallelism: it steps dim-0 shards only) or where the
  user asked for FP32 parameters (``train.param_dtype = "fp32"``): there ``adamw`` with FP32 master weights
  (standard mixed precision, 16 bytes/param), unless ``train.param_dtype = "bf16"`` was set explicitly;
- a run resuming a checkpoint keeps the optimizer whose states it holds (an AdamW checkpoint of an
  expert-parallel run resumed in one process stays AdamW), so ``--resume`` never switches optimizers.

bf16 weights updated in place by AdamW only when asked: ``optim.name = "adamw"`` with
``train.param_dtype = "bf16"``. The resolved names are what the run prints and what its
``resolved_config.toml`` records.

``optim.granularity = "auto"`` (the default; FP8AdamW's scales): ``block`` in one process, ``tensor`` under a
``torchrun`` launch of more than one process. Per-block scales make the step one pass over the states instead of
two (on the H100 the step of 2.0B parameters takes 13.3 instead of 20.8 ms; Qwen3-30B-A3B's 4-layer step 10 ms
less) for about 0.1 bytes/param of scales (three float32 scales per 128 elements), and llama-125m converged as
well as with per-tensor scales (validation loss 2.6226 vs 2.6335, FP32 AdamW 2.6241; docs/benchmarks.md
section 6). Under FSDP2 / HSDP a block could straddle two ranks' shards, so there the step keeps FP8-LM's
per-tensor scales, reduced over the shards (a one-process checkpoint's per-block states, safetensors or
asynchronous DCP, are recast per tensor when it is resumed there, with a warning). A resumed FP8AdamW checkpoint in
one process keeps the granularity its states were saved with; ``resolved_config.toml`` records ``auto`` (the run
prints and summarises the choice), so that a resume under torchrun resolves again. COAT's
``m`` expansion (``optim.m_expand = "coat"``) keeps per-tensor scales (its exponents are not recast). The library's
``FP8AdamWPrecision`` keeps ``granularity = "tensor"`` as its default (FP8-LM's layout); ``auto`` is the trainer's.
"""

from __future__ import annotations

from fp8kit.config.schema import RunConfig


def resolve_optimizer(cfg: RunConfig, saved: str | None = None, *, distributed: bool = False,
                      saved_granularity: str | None = None) -> tuple[RunConfig, str]:
    """``cfg`` with ``optim.name``, ``train.param_dtype`` and ``optim.granularity`` concrete (module docstring),
    and one line saying what was chosen and why (empty when all were given explicitly).

    Args:
        cfg: the run config.
        saved: ``"adamw"`` / ``"fp8_adamw"``: the optimizer whose states the checkpoint being resumed holds
            (``train.checkpoint.saved_optimizer``); ``auto`` keeps it, so a run resumes in another layout
            (e.g. an expert-parallel checkpoint in one process) without switching optimizers. A saved
            FP8AdamW where it cannot run falls through to the rules (and the resume refuses the mismatch).
        distributed: a launch of more than one process (FP8AdamW then steps FSDP2 / HSDP shards).
        saved_granularity: ``"tensor"`` / ``"block"``: the scales of the FP8AdamW states being resumed
            (``train.checkpoint.saved_fp8adamw_precision``); ``auto`` keeps them.

    Returns:
        ``(config, note)``; ``config`` is ``cfg`` itself when nothing was ``auto``.
    """
    cfg, why = _resolve_name_dtype(cfg, saved)
    o = cfg.optim
    if o.granularity != "auto":
        return cfg, why
    if distributed:  # a one-process checkpoint's per-block states are recast at load (FP8AdamW.adapt_full_state)
        gran, reason = "tensor", "FSDP2 / HSDP shards: per-tensor scales reduced over the shards"
    elif o.m_expand == "coat":  # COAT's per-scale exponents cannot be recast: keep the layout FSDP2 can load
        gran, reason = "tensor", "COAT's m expansion: its states could not move to FSDP2 per block"
    elif saved == "fp8_adamw" and saved_granularity in ("tensor", "block"):
        gran, reason = saved_granularity, "the FP8AdamW states being resumed"
    else:
        gran, reason = "block", "one process: the step in one pass"
    if o.name == "fp8_adamw":
        note = f"optim.granularity = auto -> {gran} ({reason})"
        why = f"{why}; {note}" if why else note
    return cfg.model_copy(update={"optim": o.model_copy(update={"granularity": gran})}), why


def _resolve_name_dtype(cfg: RunConfig, saved: str | None) -> tuple[RunConfig, str]:
    """``optim.name`` and ``train.param_dtype`` of :func:`resolve_optimizer`."""
    o, t, d = cfg.optim, cfg.train, cfg.distributed
    name, dtype, why = o.name, t.param_dtype, ""
    if name == "auto" and saved == "adamw":
        name, why = "adamw", "optim.name = auto -> adamw (the checkpoint being resumed holds AdamW states)"
    if name == "auto":
        blockers = []
        if d.tp > 1 or d.ep > 1:
            blockers.append(f"tensor / expert parallel (tp = {d.tp}, ep = {d.ep}): FP8AdamW steps dim-0 shards only")
        if dtype == "fp32":
            blockers.append("train.param_dtype = \"fp32\" asks for FP32 parameters")
        name = "adamw" if blockers else "fp8_adamw"
        if not blockers:
            why = ("optim.name = auto -> fp8_adamw (scaled FP16 master, 7 bytes/param and scales"
                   + ("; the checkpoint being resumed holds FP8AdamW states)" if saved == "fp8_adamw" else ")"))
        elif dtype == "bf16":
            why = f"optim.name = auto -> adamw with bf16 weights updated in place ({'; '.join(blockers)}; " \
                  f"train.param_dtype = bf16)"
        else:
            why = f"optim.name = auto -> adamw with an FP32 master ({'; '.join(blockers)})"
    if dtype == "auto":
        dtype = "bf16" if name == "fp8_adamw" else "fp32"
        if not why:
            why = f"train.param_dtype = auto -> {dtype}"
        elif name == "adamw" and "FP32 master" not in why:
            why += ", FP32 master (train.param_dtype = auto)"
    if name == o.name and dtype == t.param_dtype:
        return cfg, why
    new = cfg.model_copy(update={"optim": o.model_copy(update={"name": name}),
                                 "train": t.model_copy(update={"param_dtype": dtype})})
    return new, why
