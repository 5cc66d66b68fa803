"""The run config: schema (pydantic models), loading (TOML / YAML, ``--set``), one-line errors, docs.

``schema`` holds the section models and :class:`RunConfig`, ``load`` reads files and overrides,
``messages`` turns validation problems into one line, ``docs`` generates ``docs/config.md``, and
``options`` hands the selective-FP8 decision options down to the run.
"""

from fp8kit.config.docs import config_reference_markdown
from fp8kit.config.load import build_config, load_config, parse_override, read_config_file, save_config
from fp8kit.config.schema import (
    DataConfig,
    DistributedConfig,
    FP8Config,
    ModelConfig,
    OptimConfig,
    RunConfig,
    SelectiveConfig,
    TrainConfig,
    section_names,
)

__all__ = [
    "DataConfig", "DistributedConfig", "FP8Config", "ModelConfig", "OptimConfig", "RunConfig", "SelectiveConfig",
    "TrainConfig", "build_config", "config_reference_markdown", "load_config", "parse_override",
    "read_config_file", "save_config", "section_names",
]
