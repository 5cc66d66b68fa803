"""``model.pretrained``: the data keys a pretrained directory decides (vocabulary size, tokenizer).

A pretrained model fixes its vocabulary: ``data.vocab_size`` becomes the ``vocab_size`` of the directory's
``config.json`` and ``data.tokenizer`` the directory itself (its tokenizer files), unless the user set
``data.tokenizer`` to another tokenizer. :func:`resolve_pretrained` is applied by ``load_config`` and again
(idempotent) by ``fp8kit.train.setup.build_setup``, so ``resolved_config.toml`` records the values a run
used and a resumed or exported run rebuilds the same model.
"""

from __future__ import annotations

from fp8kit.base.errors import ConfigError
from fp8kit.config.schema import DataConfig, RunConfig


def resolve_pretrained(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``data.vocab_size`` / ``data.tokenizer`` taken from ``model.pretrained`` (a new config;
    ``cfg`` itself when nothing changes or no pretrained directory is set).

    Raises:
        ConfigError: the directory is not a usable pretrained model (``fp8kit.models.pretrained``), or
            ``data.vocab_size`` was set explicitly to another size than the model's.
    """
    if not cfg.model.pretrained:
        return cfg
    from fp8kit.models.pretrained import CONFIG_FILE, inspect_pretrained

    pd = inspect_pretrained(cfg.model.pretrained)
    vocab = pd.config["vocab_size"]
    data = cfg.data
    if "vocab_size" in data.model_fields_set and data.vocab_size != vocab:
        raise ConfigError(
            f"data.vocab_size = {data.vocab_size}, but {pd.where} has vocab_size = {vocab} in its {CONFIG_FILE}: "
            f"leave data.vocab_size unset (a pretrained model's vocabulary comes from the model)"
        )
    updates = {}
    if data.vocab_size != vocab or "vocab_size" not in data.model_fields_set:
        updates["vocab_size"] = vocab
    if not data.tokenizer:
        updates["tokenizer"] = cfg.model.pretrained
    if not updates:
        return cfg
    new = cfg.model_copy(update={"data": DataConfig(**{**data.model_dump(exclude_none=True), **updates})})
    new._notes = list(cfg.notes)
    return new
