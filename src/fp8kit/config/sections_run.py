"""The ``[model]``, ``[data]`` and ``[train]`` sections of the run config (``fp8kit.config.schema`` holds the
rest and :class:`~fp8kit.config.schema.RunConfig`)."""

import re
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from fp8kit.config.messages import FieldProblem
from fp8kit.config.section_base import ConfigModel
from fp8kit.models.presets import PRESET_NAMES

Preset = Literal[PRESET_NAMES]



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
    pretrained: str | None = Field(
        None,
        description="A local Hugging Face model directory (config.json, model.safetensors or a sharded "
        "model.safetensors.index.json, tokenizer files): the architecture comes from its config.json, the "
        "weights from its safetensors (never pickle), the tokenizer from its tokenizer files (unless "
        "data.tokenizer is set), and data.vocab_size from its vocab_size. Replaces preset; excludes hf_config. "
        "num_layers keeps the first N layers. See docs/fine-tuning.md.",
    )

    @model_validator(mode="after")
    def _one_architecture_source(self) -> "ModelConfig":
        if self.pretrained and self.hf_config:
            raise FieldProblem(
                "model.hf_config",
                "cannot be combined with model.pretrained (the architecture comes from its config.json)",
            )
        return self

    def describe(self) -> str:
        """The model as logs, summaries and ``fp8kit plan`` name it: ``pretrained DIR``, ``hf_config FILE`` or the
        preset, followed by `` (N layers)`` when ``num_layers`` is set."""
        if self.pretrained:
            name = f"pretrained {self.pretrained}"
        else:
            name = f"hf_config {self.hf_config}" if self.hf_config else self.preset
        return name + (f" ({self.num_layers} layers)" if self.num_layers is not None else "")


class DataConfig(ConfigModel):
    """``[data]``: corpus, tokenizer and sequence packing."""

    section: ClassVar[str] = "data"
    paths: list[str] = Field(
        default_factory=list,
        description="Text files or globs (.txt, .py, .md, ...), .jsonl / .json / .parquet records (text in "
        "text_field; chat records with format = chat) or pre-tokenized .bin files (token_dtype). Empty: the Python standard library's own "
        "source files of the running interpreter (about 12 MB of real text).",
    )
    seq_length: int = Field(256, ge=2, description="Tokens per packed training sequence.")
    vocab_size: int = Field(
        4096,
        description="Vocabulary size: of the byte-level BPE trained on the corpus, and of the model's "
        "embedding and output layers; at least 260 (256 byte tokens plus specials). For .bin files: must "
        "exceed the largest token id. With model.pretrained: the model's vocab_size (set from its config.json).",
    )
    tokenizer: str | None = Field(
        None,
        description="A tokenizer.json, or a Hugging Face model / tokenizer directory, to use instead of training "
        "one (its size must be <= vocab_size). With model.pretrained: that directory unless set.",
    )
    text_field: str = Field("text", description="Field (parquet: column) holding the text in .jsonl / .json / "
                            ".parquet files.")
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="Element type of .bin token files.")
    val_fraction: float = Field(
        0.02, gt=0, le=0.5,
        description="Fraction of packed sequences held out for validation (every k-th sequence; format = chat: "
        "every k-th sample).",
    )
    cache_dir: str | None = Field(
        None,
        description="Where trained tokenizers and tokenized corpora are cached. Default: $XDG_CACHE_HOME/fp8kit "
        "or ~/.cache/fp8kit.",
    )
    format: Literal["text", "chat"] = Field(
        "text",
        description="text: pretraining on documents (paths as above; EOS-joined and packed). chat: fine-tuning on "
        "chat / instruction records in .jsonl, .json or .parquet files (messages_field, or alpaca "
        "instruction/input/output), rendered with chat_template, loss on the assistant tokens only "
        "(docs/fine-tuning.md).",
    )
    messages_field: str = Field(
        "messages",
        description="format = chat: the field (parquet: column) holding [{role, content}, ...] (sharegpt "
        "{from, value} accepted). At the default, records without 'messages' are read from ShareGPT's "
        "'conversations'. Records without either but with 'instruction' are read as alpaca records.",
    )
    chat_template: str | None = Field(
        None,
        description="format = chat: unset: the tokenizer's chat template (chat_template.jinja or "
        "tokenizer_config.json next to data.tokenizer), else the default <|role|> template; \"default\": always the "
        "default; or a path to a Jinja template file.",
    )
    pack: bool = Field(
        True,
        description="format = chat: pack several samples into one sequence, kept apart by position ids that "
        "restart per sample (transformers masks attention per sample from them); false: one sample per "
        "sequence, padded.",
    )

    @model_validator(mode="after")
    def _chat_needs_paths(self) -> "DataConfig":
        if self.format == "chat" and not self.paths:
            raise FieldProblem("data.format", "\"chat\" needs data.paths: .jsonl / .json / .parquet chat records")
        return self

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
    grad_accum: int = Field(
        1, gt=0, description="Micro-batches accumulated per optimizer step. Above 1, FP8 weights are cast once per "
        "optimizer step and reused by its micro-batches unless fp8.weight_cache = false (see there: where it "
        "applies, and its memory).",
    )
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
    param_dtype: Literal["bf16", "fp32", "auto"] = Field(
        "auto",
        description="dtype of the model's parameters. auto (default): bf16 with fp8_adamw (its scaled FP16 master "
        "is the high-precision copy), fp32 with adamw. fp32: FP32 master weights, gradients and AdamW states, the "
        "forward in bf16 through torch.autocast (standard mixed precision, 16 bytes/param of training state). "
        "bf16: bf16 weights; with optim.name = adamw they and AdamW's states are updated in place in bf16, which "
        "loses quality late in training (llama-125m, 1200 steps on the H100, mean train loss of the last 100 "
        "steps: 1.569 vs 1.352 with an FP32 master and 1.329 with fp8_adamw; the [optim] section).",
    )
    compile: bool = Field(False, description="torch.compile each transformer block (as torchtitan does).")
    cuda_graphs: bool = Field(
        False,
        description="With train.compile on CUDA: compile each block with mode=\"reduce-overhead\" (CUDA graph trees), "
        "so its forward and backward replay as CUDA graphs instead of launching kernels one by one from the host. "
        "For small models whose step waits on the host (llama-125m on the H100: BF16 1.14x, full FP8 1.3-1.5x "
        "faster; docs/benchmarks.md section 6, session 36). One process only (not with FSDP2, TP or EP). With "
        "train.grad_accum > 1 each weight gradient is copied out of the graphs' memory after the micro-batch that "
        "first makes it (one copy of the gradients per optimizer step), since the next replay would overwrite it. "
        "The graphs hold a private memory pool, and each new input shape records new ones. Code "
        "that cannot be captured (a host sync or graph break inside a block, as in MoE experts' loop kernels) runs "
        "without graphs: the run warns and its summary counts it.",
    )
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
    async_loss: bool = Field(
        False,
        description="Read a step's loss and gradient norm on the host only after the next step is queued on the "
        "device (not on evaluation, checkpoint, FP8-stats or last steps, which are read at once), so the GPU "
        "does not idle while the host fetches the next batch. The metrics are the same; a non-finite loss or a "
        "spike is then seen one step late: the next step has run too (a stopped run ends without saving; "
        "train.on_divergence = recover rolls both back and also skips the next step's batches). Off by default: "
        "measured on Llama-3-8B layers x 8 (H100) it gave no speed-up (bf16 191.0 vs 187.5 ms, tensorwise 149.5 "
        "vs 147.9 ms with it on vs off, one run each, inside the run-to-run spread), and again on an H200 after "
        "session 40 removed the step's other host syncs (delayed with the FP8 head 126.5 vs 126.2 ms, bf16 173.1 "
        "vs 175.3 ms; llama-125m bf16 33.6 vs 33.8 ms). false: read every step at its end.",
    )
    device: str = Field("auto", description="auto (cuda if available, else cpu), cpu, cuda or cuda:N.")
    log_to: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="Where the metrics go (a list, or one name): jsonl (metrics.jsonl, always written), "
        "tensorboard (event files in <run>/tensorboard, through torch.utils.tensorboard), wandb (W&B in offline "
        "mode under <run>/wandb, if the wandb package is installed; `wandb sync` uploads it).",
    )
    resume: str = Field(
        "",
        description="Where the run starts (the --resume flag wins): \"\" (from step 0), \"auto\" (continue from the "
        "latest complete checkpoint of --out if it holds one, else start there from step 0: the same command "
        "line then works after any restart, torchrun --max-restarts or a SLURM requeue; see "
        "docs/resilience.md), or a run / checkpoint directory.",
    )
    async_checkpoint: bool = Field(
        False,
        description="Write checkpoints in the background (torch.distributed.checkpoint.async_save; DCP files "
        "in one process too): the step loop waits only for the copy to host memory (pinned, on a side "
        "stream on CUDA); the next save and the end of the run wait for the write.",
    )
    on_divergence: Literal["stop", "recover"] = Field(
        "stop",
        description="stop: a non-finite loss or gradient norm ends the run (exit status 1). recover: on a "
        "non-finite loss or gradient norm, or a loss above spike_factor x the mean of the last 100 steps, roll "
        "back to the last checkpoint step (kept in host memory), skip the batches since, move FP8 layers "
        "(recover_layers) to BF16 for recover_bf16_steps steps and continue, at most max_recoveries times; each "
        "event goes into the metrics and the summary (fp8kit.train.guard). Needs checkpoint_every > 0 and one "
        "process.",
    )
    spike_factor: float = Field(
        3.0, gt=1, description="on_divergence = recover: a loss above this factor x the running mean of the last "
        "100 steps is a spike.",
    )
    recover_bf16_steps: int = Field(
        50, ge=0, description="on_divergence = recover: steps the moved FP8 layers run in BF16 after a rollback, "
        "counted from the rollback step (0: roll back and skip only).",
    )
    max_recoveries: int = Field(
        3, ge=0, description="on_divergence = recover: recoveries allowed in one run; the next event stops it.",
    )
    recover_layers: Literal["worst", "all"] = Field(
        "worst",
        description="on_divergence = recover: which FP8 linear layers move to BF16. worst: those whose latest "
        "FP8 health stats (fp8.stats_every) show non-finite values plus the five with the highest underflow / "
        "saturation fraction (all of them when no stats were taken or none is unhealthy); all: every one.",
    )

    @field_validator("log_to", mode="before")
    @classmethod
    def _one_or_many_loggers(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @model_validator(mode="after")
    def _cuda_graphs_need_compile(self) -> "TrainConfig":
        if self.cuda_graphs and not self.compile:
            raise FieldProblem("train.cuda_graphs", "captures the compiled blocks, so it needs train.compile = true")
        return self

    @model_validator(mode="after")
    def _recover_needs_rollback_points(self) -> "TrainConfig":
        if self.on_divergence == "recover" and not self.checkpoint_every:
            raise FieldProblem(
                "train.on_divergence",
                "\"recover\" rolls back to the last checkpoint step, so it needs train.checkpoint_every > 0",
            )
        return self

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda|cuda:\d+", v):
            raise ValueError(f"unknown device {v!r}; use auto, cpu, cuda or cuda:N")
        return v
