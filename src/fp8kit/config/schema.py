"""The run config's schema: one pydantic model per section, each key's ``Field(description=...)`` its docs.

Every section is strict (``"3"`` is not an integer, ``1.5`` is not an integer, ``true`` is never an
integer; an integer is widened to a float), forbids unknown keys, and re-validates on assignment. The
checks of a section sit on its model (ranges as ``Field`` bounds, choices as ``Literal``, validators for
the rest); rules that span sections sit on :class:`RunConfig`. Loading files and ``--set`` overrides is
``fp8kit.config.load``; ``docs/config.md`` is generated from these models by ``fp8kit.config.docs``.

Constructing a section directly raises :class:`~fp8kit.base.errors.ConfigError` (one line), never
pydantic's ``ValidationError``::

    FP8Config(recipe="rowwise", exclude=["layers.0"])
    cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": 10})})
"""

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from fp8kit.base.errors import ConfigError
from fp8kit.config.messages import FieldProblem, ModelConfigError, error_line
from fp8kit.fp8.recipes import RECIPE_NAMES
from fp8kit.models.presets import PRESET_NAMES
from fp8kit.selective.patterns import compile_patterns

Recipe = Literal[RECIPE_NAMES]  # the one list of recipes: fp8kit.fp8.recipes
Preset = Literal[PRESET_NAMES]
PositiveInt = Annotated[int, Field(gt=0)]


class ConfigModel(BaseModel):
    """Base of every config model: strict types, no unknown keys, one-line :class:`ConfigError`."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)
    section: ClassVar[str | None] = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise self._error(e, data) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise self._error(e, {name: value}) from None

    @classmethod
    def _error(cls, e: ValidationError, data: dict[str, Any]) -> ModelConfigError:
        root = (cls.section,) if cls.section else ()
        line = error_line(e, cls, data, default_where=cls.__name__, root=root, run_model=RunConfig)
        return ModelConfigError(line, e, cls, data, root)


class ModelConfig(ConfigModel):
    """``[model]``: which architecture to build (random initialisation, never downloaded)."""

    section: ClassVar[str] = "model"
    preset: Preset = Field(
        "tiny",
        description="Named preset with real shapes: tiny (about 5M parameters, trains on a CPU in minutes), "
        "llama-125m, llama3-1b, llama3-8b, qwen2.5-72b; MoE: tiny-moe (CPU, minutes), qwen3-30b-a3b, "
        "deepseek-v3. Ignored when hf_config is set.",
    )
    num_layers: int | None = Field(
        None, ge=1, description="Override the number of transformer layers (so that large presets fit one GPU)."
    )
    hf_config: str | None = Field(
        None,
        description="Path to a Hugging Face config.json of any causal LM; replaces the preset. Its vocab_size "
        "is replaced by data.vocab_size.",
    )
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="Attention kernel of the HF model.")


class DataConfig(ConfigModel):
    """``[data]``: corpus, tokenizer and sequence packing."""

    section: ClassVar[str] = "data"
    paths: list[str] = Field(
        default_factory=list,
        description="Text files or globs (.txt, .py, .md, ...), .jsonl files (one JSON object a line, text in "
        "text_field) or pre-tokenized .bin files (token_dtype). Empty: the Python standard library's own "
        "source files of the running interpreter (about 12 MB of real text).",
    )
    seq_length: int = Field(256, ge=2, description="Tokens per packed training sequence.")
    vocab_size: int = Field(
        4096,
        description="Vocabulary size: of the byte-level BPE trained on the corpus, and of the model's "
        "embedding and output layers; at least 260 (256 byte tokens plus specials). For .bin files: must "
        "exceed the largest token id.",
    )
    tokenizer: str | None = Field(
        None,
        description="Path to a tokenizer.json to use instead of training one (its size must be <= vocab_size).",
    )
    text_field: str = Field("text", description="Field holding the text in .jsonl files.")
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="Element type of .bin token files.")
    val_fraction: float = Field(
        0.02, gt=0, le=0.5,
        description="Fraction of packed sequences held out for validation (every k-th sequence).",
    )
    cache_dir: str | None = Field(
        None,
        description="Where trained tokenizers and tokenized corpora are cached. Default: $XDG_CACHE_HOME/fp8kit "
        "or ~/.cache/fp8kit.",
    )

    @field_validator("vocab_size")
    @classmethod
    def _vocab_holds_bytes(cls, v: int) -> int:
        if v < 260:
            raise ValueError(f"must be >= 260 (256 byte tokens plus specials), got {v}")
        return v


class TrainConfig(ConfigModel):
    """``[train]``: the training loop."""

    section: ClassVar[str] = "train"
    steps: int = Field(100, gt=0, description="Optimizer steps to train.")
    micro_batch_size: int = Field(4, gt=0, description="Sequences per micro-batch (per forward/backward).")
    grad_accum: int = Field(1, gt=0, description="Micro-batches accumulated per optimizer step.")
    lr: float = Field(2e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="Final learning rate of the cosine decay, as a fraction of lr."
    )
    warmup_steps: int = Field(10, ge=0, description="Steps of linear learning-rate warmup before the cosine decay.")
    weight_decay: float = Field(0.1, ge=0, description="Decoupled weight decay of AdamW, on weight matrices only.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    grad_clip: float = Field(
        1.0, ge=0, description="Clip the global gradient norm to this value (0 disables clipping)."
    )
    mixed_precision: Literal["bf16", "fp8"] = Field(
        "fp8",
        description="bf16: bf16 weights and matmuls. fp8: bf16 master weights, FP8 matmuls (E4M3 forward, E5M2 "
        "gradients) in the layers the [fp8] rules select.",
    )
    param_dtype: Literal["bf16", "fp32"] = Field(
        "bf16",
        description="dtype of the model's parameters. bf16: bf16 weights updated in place (with optim.name = "
        "adamw its states are bf16 too). fp32: FP32 master weights, gradients and AdamW states, the forward in "
        "bf16 through torch.autocast (standard mixed precision, 16 bytes/param of training state).",
    )
    compile: bool = Field(False, description="torch.compile each transformer block (as torchtitan does).")
    activation_checkpointing: bool = Field(
        False, description="Recompute each transformer block in backward instead of keeping its activations."
    )
    seed: int = Field(0, ge=0, description="Seed of initialisation and data order.")
    eval_every: int = Field(
        50, ge=0, description="Evaluate on the validation split every N steps (0: only at the end)."
    )
    eval_batches: int = Field(8, gt=0, description="Micro-batches of the validation split per evaluation.")
    checkpoint_every: int = Field(50, ge=0, description="Save a checkpoint every N steps (0: none on the way).")
    final_checkpoint: bool = Field(True, description="Save a checkpoint after the last step.")
    log_every: int = Field(10, gt=0, description="Print a metrics line every N steps.")
    device: str = Field("auto", description="auto (cuda if available, else cpu), cpu, cuda or cuda:N.")

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda|cuda:\d+", v):
            raise ValueError(f"unknown device {v!r}; use auto, cpu, cuda or cuda:N")
        return v


class FP8Config(ConfigModel):
    """``[fp8]``: the FP8 numerics: the recipe, which layers may run in FP8 (static rules) and when."""

    section: ClassVar[str] = "fp8"
    recipe: Recipe = Field(
        "tensorwise", description="Scaling recipe of torchao's Float8Linear (see fp8kit.fp8.recipes)."
    )
    include: list[str] = Field(
        default_factory=list,
        description="If set, only modules matching one of these patterns may run in FP8. A pattern matches "
        "whole dotted parts of the module name: glob per part ('layers.*.mlp'), or a regex with the prefix "
        "'re:' ('re:layers\\.(1|2)\\.mlp'); 'layers.2' never matches 'layers.20'.",
    )
    exclude: list[str] = Field(
        default_factory=list,
        description="Modules matching one of these patterns stay in BF16 (same syntax as include).",
    )
    emulate: bool = Field(
        False,
        description="Emulate FP8 matmuls in high precision (numerically FP8, no speed-up) so that fp8 runs on "
        "GPUs without FP8 tensor cores (compute capability < 8.9).",
    )
    bf16_warmup_steps: int = Field(
        0, ge=0, description="Train the first N steps in BF16, then switch the selected layers to FP8."
    )
    bf16_cooldown_steps: int = Field(0, ge=0, description="Switch the FP8 layers back to BF16 for the last M steps.")
    enable_fsdp_float8_all_gather: bool | None = Field(
        None,
        description="Under FSDP2 (distributed.dp_shard > 1), all-gather the FP8 weights plus their scales "
        "instead of BF16 weights (half the bytes; torchao). Unset: on for the tensorwise recipe, off for the "
        "rowwise ones (torchao supports it for tensorwise only). Combined with tensor parallel it falls back "
        "to BF16 all-gather with a warning (see docs/distributed.md).",
    )

    @field_validator("include", "exclude")
    @classmethod
    def _patterns_compile(cls, v: list[str], info) -> list[str]:
        try:
            compile_patterns(v, f"fp8.{info.field_name}")
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _all_gather_needs_tensorwise(self) -> "FP8Config":
        if self.enable_fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise FieldProblem(
                "fp8.enable_fsdp_float8_all_gather",
                f"FP8 all-gather is supported by torchao for the tensorwise recipe only, not {self.recipe!r}",
            )
        return self


class SelectiveConfig(ConfigModel):
    """``[selective]``: the measured per-module choice (LoongForge adaptive FP8): after the static [fp8]
    rules, a layer stays in FP8 only where a policy of benchmark measurements says FP8 is faster at the
    run's token count. The keys keep LoongForge's names; under ``[fp8]`` they are still accepted and
    moved here."""

    section: ClassVar[str] = "selective"
    selective_fp8: bool = Field(
        False,
        description="Selective FP8: after the static rules, keep a layer in FP8 only where the policy's "
        "measurements say FP8 is faster at this run's token count.",
    )
    fp8_dynamic_policy_path: str | None = Field(
        None,
        description="Policy JSON for selective_fp8 (LoongForge adaptive-FP8 format): a path, or builtin:NAME "
        "for a policy shipped with fp8kit (see `fp8kit plan --list-policies`).",
    )
    fp8_dynamic_num_tokens: int | None = Field(
        None, gt=0, description="Token count for policy lookups. Default: data.seq_length x train.micro_batch_size."
    )
    component_policy_paths: dict[str, str] = Field(
        default_factory=dict,
        description="Per-component policies of multi-component models, e.g. {vision = \"vit_policy.json\"}. "
        "Components without an entry use fp8_dynamic_policy_path.",
    )
    component_num_tokens: dict[str, PositiveInt] = Field(
        default_factory=dict,
        description="Per-component token counts (each > 0), e.g. {vision = 4096} (a vision encoder sees its "
        "patch count, not the text sequence length).",
    )

    @model_validator(mode="after")
    def _needs_a_policy(self) -> "SelectiveConfig":
        if self.selective_fp8 and not self.fp8_dynamic_policy_path and not self.component_policy_paths:
            raise FieldProblem(
                "selective.selective_fp8",
                "is true but no policy is given: set selective.fp8_dynamic_policy_path",
            )
        return self


class OptimConfig(ConfigModel):
    """``[optim]``: the optimizer. lr, betas, weight decay and clipping are in ``[train]``."""

    section: ClassVar[str] = "optim"
    name: Literal["adamw", "fp8_adamw"] = Field(
        "adamw",
        description="adamw: torch.optim.AdamW (fused on CUDA). fp8_adamw: fp8kit.optim.FP8AdamW, FP8-LM's "
        "precision decoupling (arXiv:2310.18313): the states below.",
    )
    master: Literal["fp16", "fp32", "bf16_sr"] = Field(
        "fp16",
        description="fp8_adamw master weights: fp16 (with a scale), fp32, or bf16_sr (bf16 with stochastic "
        "rounding; with bf16 parameters the working weights are the master).",
    )
    grad: Literal["e5m2", "e4m3", "param"] = Field(
        "e5m2",
        description="fp8_adamw gradients between backward and step: e5m2 / e4m3 (FP8 with a scale, quantized "
        "as autograd produces them) or param (keep param.grad).",
    )
    m: Literal["e4m3", "fp16", "bf16", "fp32"] = Field(
        "e4m3", description="fp8_adamw first moment: e4m3 (with a scale), fp16, bf16 or fp32."
    )
    v: Literal["fp16", "e4m3", "fp32"] = Field(
        "fp16",
        description="fp8_adamw second moment: fp16 (with a scale), e4m3 (underflows; for the FP8-LM "
        "ablation) or fp32.",
    )
    granularity: Literal["tensor", "block"] = Field(
        "tensor", description="fp8_adamw scales: one per tensor (FP8-LM) or one per block."
    )
    block_size: int = Field(128, description="fp8_adamw elements per scale when granularity = block (multiple of 16).")

    @field_validator("block_size")
    @classmethod
    def _multiple_of_16(cls, v: int) -> int:
        if v < 16 or v % 16:
            raise ValueError(f"must be a positive multiple of 16, got {v}")
        return v


class DistributedConfig(ConfigModel):
    """``[distributed]``: parallel sizes of a ``torchrun`` launch (``torchrun --nproc_per_node N -m fp8kit
    train``). The device mesh is ``dp_replicate x dp_shard x tp`` (outer to inner, torchtitan's order) and
    must equal the world size. ``plan`` and the selective-FP8 decisions use tp/ep/etp to look up the policy
    rules of the run's real per-rank shapes."""

    section: ClassVar[str] = "distributed"
    dp_shard: int = Field(
        -1,
        description="FSDP2 (fully_shard) data-parallel size: parameters, gradients and optimizer states are "
        "sharded over these ranks. -1: fill the mesh (world size / (dp_replicate x tp)).",
    )
    dp_replicate: int = Field(
        1, gt=0,
        description="Replicated data-parallel size (HSDP: parameters sharded within each dp_shard group and "
        "replicated across dp_replicate groups).",
    )
    tp: int = Field(1, gt=0, description="Tensor-parallel size.")
    sequence_parallel: bool = Field(
        False,
        description="With tp > 1, split the norms and the residual stream over tokens between the "
        "tensor-parallel linears (Megatron sequence parallel): reduce-scatter + all-gather instead of "
        "all-reduce, and 1/tp of the norm activations per rank; its communication is BF16 (see "
        "docs/distributed.md).",
    )
    ep: int = Field(1, gt=0, description="Expert-parallel size (MoE): experts are split over ep ranks.")
    etp: int = Field(
        1, gt=0,
        description="Expert tensor-parallel size (MoE) for the policy lookup of `fp8kit plan`; `train` runs "
        "whole experts per rank and refuses etp > 1.",
    )

    @field_validator("dp_shard")
    @classmethod
    def _fill_or_positive(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"must be -1 (fill the mesh) or > 0, got {v}")
        return v


class RunConfig(ConfigModel):
    """The whole run config: one attribute per section.

    ``notes`` are one-line remarks of the loader for the user (e.g. an old ``[fp8]`` key moved to
    ``[selective]``); they are not part of the config (not saved, not compared by ``==``).
    """

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    fp8: FP8Config = Field(default_factory=FP8Config)
    selective: SelectiveConfig = Field(default_factory=SelectiveConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    _notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def notes(self) -> list[str]:
        """The loader's remarks for the user (one line each); the caller decides whether to print them."""
        return self._notes

    @model_validator(mode="after")
    def _cross_section_rules(self) -> "RunConfig":
        f8, steps = self.fp8, self.train.steps
        if f8.bf16_warmup_steps + f8.bf16_cooldown_steps > steps:
            raise FieldProblem(
                "fp8.bf16_cooldown_steps" if f8.bf16_cooldown_steps else "fp8.bf16_warmup_steps",
                f"bf16_warmup_steps ({f8.bf16_warmup_steps}) + bf16_cooldown_steps ({f8.bf16_cooldown_steps}) "
                f"exceed train.steps ({steps})",
            )
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RunConfig):
            return NotImplemented
        return all(getattr(self, s) == getattr(other, s) for s in section_names())

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Sections as plain dicts, ``None`` values left out (TOML has no null)."""
        return {name: getattr(self, name).model_dump(exclude_none=True) for name in section_names()}


def section_names() -> list[str]:
    """The config's sections in file order: model, data, train, fp8, selective, optim, distributed."""
    return list(RunConfig.model_fields)


def section_class(name: str) -> type[ConfigModel]:
    """The model class of section ``name`` (``"fp8"`` -> :class:`FP8Config`)."""
    return RunConfig.model_fields[name].annotation
