"""fp8kit's FP8 in a Hugging Face ``transformers.Trainer``: two lines, no patching.

::

    from fp8kit.integrations.transformers import prepare_for_trainer
    model = prepare_for_trainer(model)          # FP8 linears where fp8kit's rules say so; prints the report
    trainer = Trainer(model=model, args=args, ...)   # unchanged; add callbacks=[FP8ReportCallback(model)]
                                                     # to save the report and record the FP8 layer count

The model is converted in place before the Trainer (and Accelerate under it) wraps it, exactly as
``fp8kit train`` converts: sites -> static rules (``fp8.include`` / ``exclude``, embeddings, heads,
routers, dims % 16) -> optional measured selective-FP8 policy -> the module swapper (torchao
``Float8Linear`` with BF16 master weights, fp8kit's FP8 grouped experts for MoE). Parameters keep their
identity and state-dict names, so the Trainer's optimizer, its checkpoints and ``save_pretrained`` see an
ordinary model (the saved weights load in plain transformers). With ``TrainingArguments(bf16=True)``
the non-FP8 layers run under BF16 autocast as usual.
"""

from __future__ import annotations

import weakref
from pathlib import Path

from torch import nn
from transformers import TrainerCallback

from fp8kit.config.options import conversion_options_for, decide_for_library
from fp8kit.config.schema import FP8Config, SelectiveConfig
from fp8kit.parallel.convert import apply_fp8, count_fp8_modules
from fp8kit.selective.decide import Decision, summarize
from fp8kit.selective.report import print_report, save_report

_DECISIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_for_trainer(model: nn.Module, fp8: bool = True, *, config: FP8Config | None = None,
                        selective: SelectiveConfig | None = None, num_tokens: int | None = None,
                        report: bool = True, console=None) -> nn.Module:
    """Convert ``model`` to FP8 in place (fp8kit's decisions) and return it, ready for ``Trainer(model=...)``.

    Args:
        model: the causal LM (any ``nn.Module``), on its training device, before the Trainer wraps it.
        fp8: False decides only (every site BF16: the report still says why), so one script runs both.
        config: fp8kit's ``[fp8]`` section (recipe, include / exclude, emulate); default tensorwise.
        selective: ``[selective]`` (a measured policy: FP8 only where it was faster at ``num_tokens``).
        num_tokens: tokens per micro-batch (``per_device_train_batch_size x sequence length``) for the
            policy lookup.
        report: print the conversion report (every site, its precision and the reason).
        console: a ``rich`` console for the report (default: fp8kit's).

    Returns:
        ``model`` itself; its decisions are :func:`decisions_of` ``(model)``.

    Raises:
        ConfigError / PolicyError: invalid config or policy (one line).
    """
    config = config or FP8Config()
    decisions = decide_for_library(model, config, selective, mixed_precision="fp8" if fp8 else "bf16",
                                   num_tokens=num_tokens)
    if fp8:
        apply_fp8(model, decisions, conversion_options_for(config))
    _DECISIONS[model] = decisions
    if report:
        print_report(decisions, console)
    return model


def decisions_of(model: nn.Module) -> list[Decision]:
    """The decisions :func:`prepare_for_trainer` made for ``model`` (empty if it was not prepared)."""
    return list(_DECISIONS.get(model, []))


def fp8_layer_count(model: nn.Module) -> int:
    """How many modules of ``model`` run FP8 matmuls now (FP8 linears and FP8 grouped experts)."""
    return count_fp8_modules(model)


class FP8ReportCallback(TrainerCallback):
    """A ``TrainerCallback``: writes ``conversion_report.md`` / ``.json`` into ``args.output_dir`` when
    training begins (main process only) and adds ``fp8_modules`` to every log record (``state.log_history``
    and the printed logs; the Trainer's ``report_to`` loggers run before user callbacks and do not see it).

    Args:
        model: the model :func:`prepare_for_trainer` returned.
    """

    def __init__(self, model: nn.Module):
        self._model = weakref.ref(model)

    def on_train_begin(self, args, state, control, **kwargs):
        model = self._model()
        if model is None or not state.is_world_process_zero:
            return
        decisions = decisions_of(model)
        if decisions:
            s = summarize(decisions)
            save_report(decisions, Path(args.output_dir), {
                "trainer": "transformers.Trainer + fp8kit.integrations.transformers",
                "fp8_sites": f"{s['fp8_sites']} of {s['sites']}",
            })

    def on_log(self, args, state, control, logs=None, **kwargs):
        model = self._model()
        if logs is not None and model is not None:
            logs["fp8_modules"] = fp8_layer_count(model)
