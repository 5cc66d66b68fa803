"""The run config: typed dataclasses, loading (TOML / YAML), ``--set`` overrides and validation.

One config drives every command. It is built in three steps, each with its own error messages:

1. read the file (TOML through ``tomllib``, YAML through ``yaml.safe_load``: no object construction),
2. apply ``--set section.key=value`` overrides (values parsed by the key's declared type),
3. check every section and key against the dataclasses below (unknown keys get the closest valid key),
   then check values (choices, ranges, cross-field rules).

Each field's ``metadata["help"]`` is its documentation: ``docs/config.md`` is generated from it by
:func:`config_reference_markdown` (a test keeps the two equal), and the CLI shows it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8kit.errors import ConfigError
from fp8kit.fp8.recipes import RECIPE_NAMES
from fp8kit.models.presets import PRESET_NAMES

MIXED_PRECISIONS = ("bf16", "fp8")
PARAM_DTYPES = ("bf16", "fp32")
OPTIMIZERS = ("adamw", "fp8_adamw")


def _f(default: Any, help: str, *, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field with its documentation (and allowed values) in the metadata."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, dict):
        return field(default_factory=lambda d=default: dict(d), metadata=meta)
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    """``[model]``: which architecture to build (random initialisation, never downloaded)."""

    preset: str = _f(
        "tiny",
        "Named preset with real shapes: tiny (about 5M parameters, trains on a CPU in minutes), "
        "llama-125m, llama3-1b, llama3-8b, qwen2.5-72b; MoE: tiny-moe (CPU, minutes), qwen3-30b-a3b, "
        "deepseek-v3. Ignored when hf_config is set.",
        choices=PRESET_NAMES,
    )
    num_layers: int | None = _f(
        None, "Override the number of transformer layers (so that large presets fit one GPU)."
    )
    hf_config: str | None = _f(
        None,
        "Path to a Hugging Face config.json of any causal LM; replaces the preset. Its vocab_size is "
        "replaced by data.vocab_size.",
    )
    attn_implementation: str = _f(
        "sdpa", "Attention kernel of the HF model.", choices=("sdpa", "eager")
    )


@dataclass
class DataConfig:
    """``[data]``: corpus, tokenizer and sequence packing."""

    paths: list[str] = _f(
        [],
        "Text files or globs (.txt, .py, .md, ...), .jsonl files (one JSON object a line, text in "
        "text_field) or pre-tokenized .bin files (token_dtype). Empty: the Python standard library's "
        "own source files of the running interpreter (about 12 MB of real text).",
    )
    seq_length: int = _f(256, "Tokens per packed training sequence.")
    vocab_size: int = _f(
        4096,
        "Vocabulary size: of the byte-level BPE trained on the corpus, and of the model's embedding "
        "and output layers. For .bin files: must exceed the largest token id.",
    )
    tokenizer: str | None = _f(
        None, "Path to a tokenizer.json to use instead of training one (its size must be <= vocab_size)."
    )
    text_field: str = _f("text", "Field holding the text in .jsonl files.")
    token_dtype: str = _f("uint16", "Element type of .bin token files.", choices=("uint16", "uint32"))
    val_fraction: float = _f(
        0.02, "Fraction of packed sequences held out for validation (every k-th sequence)."
    )
    cache_dir: str | None = _f(
        None,
        "Where trained tokenizers and tokenized corpora are cached. Default: $XDG_CACHE_HOME/fp8kit "
        "or ~/.cache/fp8kit.",
    )


@dataclass
class TrainConfig:
    """``[train]``: the training loop."""

    steps: int = _f(100, "Optimizer steps to train.")
    micro_batch_size: int = _f(4, "Sequences per micro-batch (per forward/backward).")
    grad_accum: int = _f(1, "Micro-batches accumulated per optimizer step.")
    lr: float = _f(2e-3, "Peak learning rate (AdamW).")
    min_lr_ratio: float = _f(0.1, "Final learning rate of the cosine decay, as a fraction of lr.")
    warmup_steps: int = _f(10, "Steps of linear learning-rate warmup before the cosine decay.")
    weight_decay: float = _f(0.1, "Decoupled weight decay of AdamW, on weight matrices only.")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.95, "AdamW beta2.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value (0 disables clipping).")
    mixed_precision: str = _f(
        "fp8",
        "bf16: bf16 weights and matmuls. fp8: bf16 master weights, FP8 matmuls (E4M3 forward, E5M2 "
        "gradients) in the layers the [fp8] rules select.",
        choices=MIXED_PRECISIONS,
    )
    param_dtype: str = _f(
        "bf16",
        "dtype of the model's parameters. bf16: bf16 weights updated in place (with optim.name = adamw its "
        "states are bf16 too). fp32: FP32 master weights, gradients and AdamW states, the forward in bf16 "
        "through torch.autocast (standard mixed precision, 16 bytes/param of training state).",
        choices=PARAM_DTYPES,
    )
    compile: bool = _f(False, "torch.compile each transformer block (as torchtitan does).")
    activation_checkpointing: bool = _f(
        False, "Recompute each transformer block in backward instead of keeping its activations."
    )
    seed: int = _f(0, "Seed of initialisation and data order.")
    eval_every: int = _f(50, "Evaluate on the validation split every N steps (0: only at the end).")
    eval_batches: int = _f(8, "Micro-batches of the validation split per evaluation.")
    checkpoint_every: int = _f(50, "Save a checkpoint every N steps (0: none on the way).")
    final_checkpoint: bool = _f(True, "Save a checkpoint after the last step.")
    log_every: int = _f(10, "Print a metrics line every N steps.")
    device: str = _f("auto", "auto (cuda if available, else cpu), cpu, cuda or cuda:N.")


@dataclass
class FP8Config:
    """``[fp8]``: which layers run in FP8 and how."""

    recipe: str = _f(
        "tensorwise",
        "Scaling recipe of torchao's Float8Linear: tensorwise, rowwise or rowwise_with_gw_hp.",
        choices=RECIPE_NAMES,
    )
    include: list[str] = _f(
        [],
        "If set, only modules matching one of these patterns may run in FP8. A pattern matches whole "
        "dotted parts of the module name: glob per part ('layers.*.mlp'), or a regex with the prefix "
        "'re:' ('re:layers\\.(1|2)\\.mlp'); 'layers.2' never matches 'layers.20'.",
    )
    exclude: list[str] = _f([], "Modules matching one of these patterns stay in BF16 (same syntax as include).")
    emulate: bool = _f(
        False,
        "Emulate FP8 matmuls in high precision (numerically FP8, no speed-up) so that fp8 runs on GPUs "
        "without FP8 tensor cores (compute capability < 8.9).",
    )
    bf16_warmup_steps: int = _f(0, "Train the first N steps in BF16, then switch the selected layers to FP8.")
    bf16_cooldown_steps: int = _f(0, "Switch the FP8 layers back to BF16 for the last M steps.")
    selective_fp8: bool = _f(
        False,
        "Adaptive FP8: after the static rules, keep a layer in FP8 only where the policy's measurements "
        "say FP8 is faster at this run's token count (seed 000).",
    )
    fp8_dynamic_policy_path: str | None = _f(
        None,
        "Policy JSON for selective_fp8 (seed format): a path, or builtin:NAME for a policy shipped with "
        "fp8kit (see `fp8kit plan --list-policies`).",
    )
    fp8_dynamic_num_tokens: int | None = _f(
        None, "Token count for policy lookups. Default: data.seq_length x train.micro_batch_size."
    )
    component_policy_paths: dict[str, str] = _f(
        {},
        "Per-component policies of multi-component models, e.g. {vision = \"vit_policy.json\"}. "
        "Components without an entry use fp8_dynamic_policy_path.",
    )
    component_num_tokens: dict[str, int] = _f(
        {},
        "Per-component token counts, e.g. {vision = 4096} (a vision encoder sees its patch count, not "
        "the text sequence length).",
    )
    enable_fsdp_float8_all_gather: bool | None = _f(
        None,
        "Under FSDP2 (distributed.dp_shard > 1), all-gather the FP8 weights plus their scales instead of "
        "BF16 weights (half the bytes; torchao). Unset: on for the tensorwise recipe, off for the rowwise "
        "ones (torchao supports it for tensorwise only). Combined with tensor parallel it falls back to "
        "BF16 all-gather with a warning (see docs/distributed.md).",
    )


@dataclass
class OptimConfig:
    """``[optim]``: the optimizer. lr, betas, weight decay and clipping are in ``[train]``."""

    name: str = _f(
        "adamw",
        "adamw: torch.optim.AdamW (fused on CUDA). fp8_adamw: fp8kit.optim.FP8AdamW, FP8-LM's precision "
        "decoupling (arXiv:2310.18313): the states below.",
        choices=OPTIMIZERS,
    )
    master: str = _f(
        "fp16",
        "fp8_adamw master weights: fp16 (with a scale), fp32, or bf16_sr (bf16 with stochastic rounding; "
        "with bf16 parameters the working weights are the master).",
        choices=("fp16", "fp32", "bf16_sr"),
    )
    grad: str = _f(
        "e5m2",
        "fp8_adamw gradients between backward and step: e5m2 / e4m3 (FP8 with a scale, quantized as "
        "autograd produces them) or param (keep param.grad).",
        choices=("e5m2", "e4m3", "param"),
    )
    m: str = _f("e4m3", "fp8_adamw first moment: e4m3 (with a scale), fp16, bf16 or fp32.",
                choices=("e4m3", "fp16", "bf16", "fp32"))
    v: str = _f(
        "fp16",
        "fp8_adamw second moment: fp16 (with a scale), e4m3 (underflows; for the paper's ablation) or fp32.",
        choices=("fp16", "e4m3", "fp32"),
    )
    granularity: str = _f("tensor", "fp8_adamw scales: one per tensor (the paper) or one per block.",
                          choices=("tensor", "block"))
    block_size: int = _f(128, "fp8_adamw elements per scale when granularity = block (multiple of 16).")


@dataclass
class DistributedConfig:
    """``[distributed]``: parallel sizes of a ``torchrun`` launch (``torchrun --nproc_per_node N -m fp8kit
    train``). The device mesh is ``dp_replicate x dp_shard x tp`` and must equal the world size.
    ``plan`` and the adaptive-FP8 decisions use tp/ep/etp to look up the policy rules of the run's real
    per-rank shapes."""

    dp_shard: int = _f(
        -1,
        "FSDP2 (fully_shard) data-parallel size: parameters, gradients and optimizer states are sharded "
        "over these ranks. -1: fill the mesh (world size / (dp_replicate x tp)).",
    )
    dp_replicate: int = _f(
        1,
        "Replicated data-parallel size (HSDP: parameters sharded within each dp_shard group and "
        "replicated across dp_replicate groups).",
    )
    tp: int = _f(1, "Tensor-parallel size.")
    sequence_parallel: bool = _f(
        False,
        "With tp > 1, split the norms and the residual stream over tokens between the tensor-parallel "
        "linears (Megatron sequence parallel): reduce-scatter + all-gather instead of all-reduce, and 1/tp "
        "of the norm activations per rank; its communication is BF16 (see docs/distributed.md).",
    )
    ep: int = _f(1, "Expert-parallel size (MoE): experts are split over ep ranks.")
    etp: int = _f(1, "Expert tensor-parallel size (MoE) for the policy lookup of `fp8kit plan`; `train` runs "
                     "whole experts per rank and refuses etp > 1.")


@dataclass
class RunConfig:
    """The whole run config: one attribute per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Sections as plain dicts, ``None`` values left out (TOML has no null)."""
        return {
            name: {k: v for k, v in dataclasses.asdict(getattr(self, name)).items() if v is not None}
            for name in section_names()
        }


# ----------------------------------------------------------------------------------------------
# Schema helpers


def section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(RunConfig)]


def _section_class(name: str) -> type:
    return typing.get_type_hints(RunConfig)[name]


def _section_fields(name: str) -> dict[str, tuple[Any, dataclasses.Field]]:
    cls = _section_class(name)
    hints = typing.get_type_hints(cls)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(cls)}


def _all_keys() -> list[str]:
    return [f"{s}.{k}" for s in section_names() for k in _section_fields(s)]


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _expected(tp: Any) -> str:
    name = _type_name(tp)
    return f"expected {'an' if name[0] in 'aeiou' else 'a'} {name}"


def _type_name(tp: Any) -> str:
    base, optional = _unwrap_optional(tp)
    if typing.get_origin(base) is list:
        name = "list of strings"
    elif typing.get_origin(base) is dict:
        vt = typing.get_args(base)[1]
        name = "table of " + {int: "integers", str: "strings"}[vt]
    else:
        name = {int: "integer", float: "float", bool: "boolean", str: "string"}.get(base, str(base))
    return f"{name} or none" if optional else name


# ----------------------------------------------------------------------------------------------
# Value checking and parsing


def _check_value(value: Any, tp: Any, where: str) -> Any:
    """Check a value read from a file against the field type; return it (int -> float widened)."""
    base, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: {_expected(tp)}, got none")
    ok = False
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif base is str:
        ok = isinstance(value, str)
    elif typing.get_origin(base) is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        if ok:
            value = list(value)
    elif typing.get_origin(base) is dict:
        vt = typing.get_args(base)[1]
        ok = isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, vt) and not isinstance(v, bool) for k, v in value.items()
        )
        if ok:
            value = dict(value)
    if not ok:
        raise ConfigError(
            f"{where}: {_expected(tp)}, got {value!r} ({type(value).__name__})"
        )
    return value


def _parse_override_value(text: str, tp: Any, where: str) -> Any:
    """Parse the text of ``--set key=TEXT`` into the field's type."""
    base, optional = _unwrap_optional(tp)
    raw = text.strip()
    if optional and raw.lower() in ("none", "null"):
        return None
    try:
        if base is bool:
            low = raw.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if base is int:
            return int(raw.replace("_", ""))
        if base is float:
            value = float(raw)
            return value
        if base is str:
            if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
                return raw[1:-1]
            return raw
        if typing.get_origin(base) is list:
            if raw.startswith("["):
                parsed = tomllib.loads(f"v = {raw}")["v"]
                return _check_value(parsed, tp, where)
            return [part.strip() for part in raw.split(",") if part.strip()]
        if typing.get_origin(base) is dict:
            parsed = tomllib.loads(f"v = {raw}")["v"] if raw.startswith("{") else None
            if parsed is not None:
                return _check_value(parsed, tp, where)
            raise ValueError
    except (ValueError, tomllib.TOMLDecodeError):
        pass
    raise ConfigError(f"{where}: {_expected(tp)}, got {text!r}")


def _unknown_key_message(section: str, key: str, where: str) -> str:
    dotted = f"{section}.{key}"
    other = [k for k in _all_keys() if k.split(".", 1)[1] == key]
    if other:
        return f"{where}: unknown key {dotted!r}; did you mean {other[0]!r}?"
    close = difflib.get_close_matches(dotted, _all_keys(), n=1, cutoff=0.6)
    if not close:
        keys_here = [f"{section}.{k}" for k in _section_fields(section)]
        close = difflib.get_close_matches(dotted, keys_here, n=1, cutoff=0.0)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: unknown key {dotted!r}{hint}"


def _unknown_section_message(section: str, where: str) -> str:
    close = difflib.get_close_matches(section, section_names(), n=1, cutoff=0.5)
    hint = f"; did you mean [{close[0]}]?" if close else f"; sections are {', '.join(section_names())}"
    return f"{where}: unknown section [{section}]{hint}"


# ----------------------------------------------------------------------------------------------
# Loading


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML or YAML config file into a dict of sections (no validation yet).

    Raises:
        ConfigError: the file is missing, unreadable, of an unknown extension, or not valid TOML/YAML.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e}") from None
    if suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    elif suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            msg = " ".join(str(e).split())
            raise ConfigError(f"{p}: invalid YAML: {msg}") from None
        data = {} if data is None else data
    else:
        raise ConfigError(f"config file {str(p)!r}: unknown extension {suffix!r}; use .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a table of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, str, str]:
    """Split ``section.key=value`` into its three parts.

    Raises:
        ConfigError: the override has no ``=`` or no ``section.`` prefix.
    """
    where = f"--set {text}"
    if "=" not in text:
        raise ConfigError(f"{where}: expected section.key=value")
    dotted, value = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"{where}: the key must be section.key (for example train.lr)")
    return parts[0], parts[1], value


def build_config(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), *, source: str = "config"
) -> RunConfig:
    """Build and validate a :class:`RunConfig` from parsed sections plus ``--set`` overrides.

    Raises:
        ConfigError: an unknown section or key (with the closest valid key), a value of the wrong
            type, or a value out of range; the message names the file or the ``--set`` argument.
    """
    sections: dict[str, dict[str, tuple[Any, str]]] = {}
    for section, body in data.items():
        where = f"{source}: [{section}]"
        if section not in section_names():
            raise ConfigError(_unknown_section_message(section, source))
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: expected a table of keys, got {type(body).__name__}")
        fields_ = _section_fields(section)
        for key, value in body.items():
            if key not in fields_:
                raise ConfigError(_unknown_key_message(section, key, source))
            tp = fields_[key][0]
            sections.setdefault(section, {})[key] = (
                _check_value(value, tp, f"{source}: {section}.{key}"),
                source,
            )
    for text in overrides:
        section, key, value = parse_override(text)
        where = f"--set {text}"
        if section not in section_names():
            raise ConfigError(_unknown_section_message(section, where))
        fields_ = _section_fields(section)
        if key not in fields_:
            raise ConfigError(_unknown_key_message(section, key, where))
        sections.setdefault(section, {})[key] = (
            _parse_override_value(value, fields_[key][0], where),
            where,
        )
    kwargs = {}
    origins: dict[str, str] = {}
    for section in section_names():
        values = sections.get(section, {})
        kwargs[section] = _section_class(section)(**{k: v for k, (v, _) in values.items()})
        for k, (_, origin) in values.items():
            origins[f"{section}.{k}"] = origin
    cfg = RunConfig(**kwargs)
    validate(cfg, origins)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load a config file (or the defaults when ``path`` is None) and apply ``--set`` overrides."""
    data = read_config_file(path) if path is not None else {}
    return build_config(data, overrides, source=str(path) if path is not None else "defaults")


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as TOML (``None`` values omitted, so they load back as defaults)."""
    import tomli_w

    Path(path).write_text(tomli_w.dumps(cfg.to_dict()), encoding="utf-8")


# ----------------------------------------------------------------------------------------------
# Validation of values


def validate(cfg: RunConfig, origins: dict[str, str] | None = None) -> None:
    """Check choices, ranges and cross-field rules.

    Raises:
        ConfigError: naming the key and where its value came from.
    """
    origins = origins or {}

    def fail(key: str, msg: str) -> None:
        where = origins.get(key, "defaults")
        prefix = where if where.startswith("--set") else f"{where}: {key}"
        raise ConfigError(f"{prefix}: {msg}")

    for section in section_names():
        obj = getattr(cfg, section)
        for name, (_tp, f) in _section_fields(section).items():
            value = getattr(obj, name)
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                close = difflib.get_close_matches(str(value), choices, n=1, cutoff=0.5)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                fail(f"{section}.{name}", f"unknown value {value!r}{hint}; choose one of {', '.join(choices)}")
            if isinstance(value, float) and not math.isfinite(value):
                fail(f"{section}.{name}", f"must be a finite number, got {value}")

    def positive(key: str, value: int | float) -> None:
        if value <= 0:
            fail(key, f"must be > 0, got {value}")

    def non_negative(key: str, value: int | float) -> None:
        if value < 0:
            fail(key, f"must be >= 0, got {value}")

    t, d, m, f8 = cfg.train, cfg.data, cfg.model, cfg.fp8
    for key in ("steps", "micro_batch_size", "grad_accum", "log_every", "eval_batches"):
        positive(f"train.{key}", getattr(t, key))
    positive("train.lr", t.lr)
    for key in ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "checkpoint_every", "seed"):
        non_negative(f"train.{key}", getattr(t, key))
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        fail("train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            fail(f"train.{key}", f"must be in [0, 1), got {getattr(t, key)}")
    dev = t.device
    if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
        fail("train.device", f"unknown device {dev!r}; use auto, cpu, cuda or cuda:N")
    if d.seq_length < 2:
        fail("data.seq_length", f"must be >= 2, got {d.seq_length}")
    if d.vocab_size < 260:
        fail("data.vocab_size", f"must be >= 260 (256 byte tokens plus specials), got {d.vocab_size}")
    if not 0.0 < d.val_fraction <= 0.5:
        fail("data.val_fraction", f"must be in (0, 0.5], got {d.val_fraction}")
    if m.num_layers is not None and m.num_layers < 1:
        fail("model.num_layers", f"must be >= 1, got {m.num_layers}")
    non_negative("fp8.bf16_warmup_steps", f8.bf16_warmup_steps)
    non_negative("fp8.bf16_cooldown_steps", f8.bf16_cooldown_steps)
    if f8.bf16_warmup_steps + f8.bf16_cooldown_steps > t.steps:
        fail(
            "fp8.bf16_cooldown_steps" if f8.bf16_cooldown_steps else "fp8.bf16_warmup_steps",
            f"bf16_warmup_steps ({f8.bf16_warmup_steps}) + bf16_cooldown_steps ({f8.bf16_cooldown_steps}) "
            f"exceed train.steps ({t.steps})",
        )
    for key in ("tp", "ep", "etp", "dp_replicate"):
        positive(f"distributed.{key}", getattr(cfg.distributed, key))
    if cfg.distributed.dp_shard == 0 or cfg.distributed.dp_shard < -1:
        fail("distributed.dp_shard", f"must be -1 (fill the mesh) or > 0, got {cfg.distributed.dp_shard}")
    if f8.enable_fsdp_float8_all_gather and f8.recipe != "tensorwise":
        fail(
            "fp8.enable_fsdp_float8_all_gather",
            f"FP8 all-gather is supported by torchao for the tensorwise recipe only, not {f8.recipe!r}",
        )
    if cfg.optim.block_size < 16 or cfg.optim.block_size % 16:
        fail("optim.block_size", f"must be a positive multiple of 16, got {cfg.optim.block_size}")
    if f8.fp8_dynamic_num_tokens is not None:
        positive("fp8.fp8_dynamic_num_tokens", f8.fp8_dynamic_num_tokens)
    for comp, n in f8.component_num_tokens.items():
        positive(f"fp8.component_num_tokens.{comp}", n)
    if f8.selective_fp8 and not f8.fp8_dynamic_policy_path and not f8.component_policy_paths:
        fail("fp8.selective_fp8", "is true but no policy is given: set fp8.fp8_dynamic_policy_path")
    from fp8kit.fp8.patterns import compile_patterns

    for key in ("include", "exclude"):
        try:
            compile_patterns(getattr(f8, key), f"fp8.{key}")
        except ConfigError as e:
            where = origins.get(f"fp8.{key}", "defaults")
            raise ConfigError(f"{where}: {e}") from None


# ----------------------------------------------------------------------------------------------
# Documentation


def config_reference_markdown() -> str:
    """The reference of every config key (type, default, meaning), generated from the dataclasses."""
    lines = [
        "# Config reference",
        "",
        "Generated from the dataclasses in `src/fp8kit/config.py` by `fp8kit config-docs`; do not edit by",
        "hand (a test checks that this file is current). Every key can be set in a TOML or YAML file",
        "(`[section]` then `key = value`) or on the command line with `--set section.key=value`.",
        "",
    ]
    for section in section_names():
        cls = _section_class(section)
        lines += [f"## `[{section}]`", "", (cls.__doc__ or "").strip(), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for name, (tp, f) in _section_fields(section).items():
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            default_s = "none" if default is None else repr(default).replace("'", '"')
            if isinstance(default, bool):
                default_s = str(default).lower()
            help_ = f.metadata.get("help", "").replace("|", "\\|")
            choices = f.metadata.get("choices")
            if choices:
                help_ += f" One of: {', '.join(f'`{c}`' for c in choices)}."
            lines.append(f"| `{name}` | {_type_name(tp)} | `{default_s}` | {help_} |")
        lines.append("")
    return "\n".join(lines)
