"""fp8kit inside other trainers: Hugging Face ``transformers.Trainer`` and Accelerate (LLaMA-Factory's route).

- :mod:`fp8kit.integrations.transformers`: ``prepare_for_trainer(model)`` converts a model with fp8kit's
  decisions (static rules, optional measured policy) before ``Trainer`` wraps it, prints the conversion
  report; ``FP8ReportCallback`` saves it into the Trainer's ``output_dir`` and logs the FP8 layer count.
- :mod:`fp8kit.integrations.accelerate`: ``fp8kit_module_filter(decisions)`` and ``ao_recipe_kwargs(model)``
  for ``Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(...)])``.

Neither patches transformers or Accelerate: they use the public hooks (a model passed in, a
``TrainerCallback``, Accelerate's ``module_filter_func``). See docs/fine-tuning.md.
"""
