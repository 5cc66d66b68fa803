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
"""

from __future__ import annotations

from fp8kit.config.schema import RunConfig


def resolve_optimizer(cfg: RunConfig, saved: str | None = None) -> tuple[RunConfig, str]:
    """``cfg`` with ``optim.name`` and ``train.param_dtype`` concrete (module docstring), and one line saying what
    was chosen and why (empty when both were given explicitly).

    Args:
        cfg: the run config.
        saved: ``"adamw"`` / ``"fp8_adamw"``: the optimizer whose states the checkpoint being resumed holds
            (``train.checkpoint.saved_optimizer``); ``auto`` keeps it, so a run resumes in another layout
            (e.g. an expert-parallel checkpoint in one process) without switching optimizers. A saved
            FP8AdamW where it cannot run falls through to the rules (and the resume refuses the mismatch).

    Returns:
        ``(config, note)``; ``config`` is ``cfg`` itself when nothing was ``auto``.
    """
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
            why = ("optim.name = auto -> fp8_adamw (scaled FP16 master, 7 bytes/param"
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
