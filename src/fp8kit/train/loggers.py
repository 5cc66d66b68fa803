"""Where a run's metrics go (``train.log_to``): metrics.jsonl, TensorBoard event files, W&B (offline).

``metrics.jsonl`` is always written (the summary and ``fp8kit compare`` read it). The others are the
libraries' own writers, fed the same record per step:

- ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package) into
  ``<run>/tensorboard``; scalars ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``,
  ... and ``val/loss``, with the optimizer step as the global step. On resume the events after the
  checkpoint's step are purged (``purge_step``), as the JSONL records are.
- ``wandb``: ``wandb.init(mode="offline", dir=<run>)`` (nothing leaves the machine; ``wandb sync
  <run>/wandb/offline-run-*`` uploads it), the run config as the W&B config, ``wandb.log(..., step=step)``.
"""

from __future__ import annotations

import math
from pathlib import Path

from fp8kit.base.errors import ConfigError
from fp8kit.train.metrics import MetricsWriter

#: record key -> TensorBoard / W&B tag (other numeric keys go under ``train/``).
_TAGS = {"val_loss": "val/loss"}


def check_loggers(kinds: list[str]) -> None:
    """Fail before anything is written when a requested logger's library is missing.

    Raises:
        ConfigError: ``train.log_to`` names ``tensorboard`` or ``wandb`` and that package is not installed.
    """
    if "tensorboard" in kinds:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(
                "train.log_to includes 'tensorboard' but the tensorboard package is not installed "
                "(pip install tensorboard)"
            ) from None
    if "wandb" in kinds:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(
                "train.log_to includes 'wandb' but the wandb package is not installed (pip install wandb)"
            ) from None


def scalars(record: dict) -> dict[str, float]:
    """The numeric, finite entries of a metrics record as ``{tag: value}`` (``step`` itself excluded), and
    the FP8 health rows of a stats step (``fp8_health/<layer>/<operand>/<amax|scale|underflow|saturation>``)."""
    out = {}
    for row in record.get("fp8_health") or ():  # fp8.stats_every: fp8_health/<layer>/<operand>/<stat>
        for stat in ("amax", "scale", "underflow", "saturation"):
            if row.get(stat) is not None:
                out[f"fp8_health/{row['layer']}/{row['operand']}/{stat}"] = float(row[stat])
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        out[_TAGS.get(key, f"train/{key}")] = float(value)
    return out


class RunLoggers:
    """One ``write(record)`` / ``close()`` for every logger of ``train.log_to`` (the loop's writer).

    Args:
        out_dir: the run directory.
        kinds: ``train.log_to``.
        truncate_after_step: on resume into the same directory, the checkpoint's step (records and events
            after it are dropped); None for a new run.
        run_name: the W&B run name.
        config: the run config as a dict (W&B config, TensorBoard text).
    """

    def __init__(self, out_dir: Path, kinds: list[str], *, truncate_after_step: int | None = None,
                 run_name: str | None = None, config: dict | None = None):
        check_loggers(kinds)
        out_dir = Path(out_dir)
        self.jsonl = MetricsWriter(out_dir / "metrics.jsonl", truncate_after_step=truncate_after_step)
        self.tb = None
        self.wandb_run = None
        if "tensorboard" in kinds:
            from torch.utils.tensorboard import SummaryWriter

            purge = truncate_after_step + 1 if truncate_after_step is not None else None
            self.tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"), purge_step=purge, flush_secs=30)
            if config is not None and purge is None:
                import json

                self.tb.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", global_step=0)
        if "wandb" in kinds:
            import wandb

            self.wandb_run = wandb.init(
                project="fp8kit", name=run_name or out_dir.name, dir=str(out_dir), mode="offline",
                config=config or {},
            )

    def write(self, record: dict) -> None:
        """Write one step's record to every logger."""
        self.jsonl.write(record)
        if self.tb is None and self.wandb_run is None:
            return
        step = int(record.get("step", 0))
        values = scalars(record)
        if self.tb is not None:
            for tag, value in values.items():
                self.tb.add_scalar(tag, value, global_step=step)
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)

    def close(self) -> None:
        """Flush and close every logger."""
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
