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

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    Field,
    PrivateAttr,
    field_serializer,
    field_validator,
    model_validator,
)

from fp8kit.base.errors import ConfigError
from fp8kit.config.messages import FieldProblem
from fp8kit.config.section_base import ConfigModel
from fp8kit.config.sections_run import DataConfig, ModelConfig, TrainConfig
from fp8kit.fp8.recipes import GEMMS, RECIPE_NAMES
from fp8kit.selective.auto import DEFAULT_MIN_SPEEDUP
from fp8kit.selective.patterns import compile_patterns

#: A field's ``json_schema_extra`` key: the message ``config.load`` refuses a written none / null with (a field whose
#: unset default and an explicit "none" would read differently: ``--set fp8.fast_accum=none`` is not ``[]``).
NONE_REFUSED = "none_refused"

Recipe = Literal[RECIPE_NAMES]  # the one list of recipes: fp8kit.fp8.recipes
PositiveInt = Annotated[int, Field(gt=0)]
#: ``[selective] selective_fp8``: measure at start-up, a policy file, or every candidate in FP8.
SelectiveMode = Literal["auto", "policy", "off"]
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no")

__all__ = ["ConfigModel", "DataConfig", "ModelConfig", "TrainConfig"]


class FP8Config(ConfigModel):
    """``[fp8]``: the FP8 numerics: the recipe, which layers may run in FP8 (static rules) and when."""

    section: ClassVar[str] = "fp8"
    recipe: Recipe = Field(
        "tensorwise",
        description="FP8 scaling recipe (the table in fp8kit.fp8.recipes): tensorwise, rowwise, rowwise_with_gw_hp "
        "(torchao Float8Linear; E4M3 forward, E5M2 gradients), blockwise (fp8kit's own: 1x128 activation "
        "and gradient blocks, 128x128 weight blocks, E4M3 throughout, DeepSeek-V3; layers whose dims are "
        "not multiples of 128 stay BF16) or delayed (fp8kit's own: Transformer Engine's delayed scaling "
        "from an amax history, see amax_history_len; the fastest on Llama-3-8B layers: 1.31x bf16 on an H200 in "
        "session 38, 1.38-1.40x with output_head in sessions 39-41, 1.40-1.42x with it and the wgrad GEMM's fast "
        "accumulation, the default since session 42 (see fast_accum); but 0.76x in full FP8 on llama-125m, where selective_fp8 = auto keeps the layers bf16; speeds: docs/benchmarks.md "
        "section 6).",
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
    output_head: bool = Field(
        False,
        description="Let the output head (lm_head / output / classifier ...) run in FP8 too: it then follows the "
        "other rules (dims, the recipe's block multiple, include / exclude) and the FP8-or-BF16 decision "
        "(selective_fp8 = auto measures it; a policy has no rule for an output head, so with one the head stays "
        "BF16), and under train.compile it is compiled like a block. A head that stays BF16 although asked for is "
        "warned about, with the reason; a head tied to the input embedding always does. Off by default: "
        "DeepSeek-V3 (arXiv:2412.19437, section 3.3), torchtitan and torchao keep the head in BF16 for accuracy. "
        "Measured on an H200: Llama-3-8B layers x 8, delayed: 1.307x -> 1.342x BF16 (session 38; 1.380-1.401x in "
        "session 39's runs); llama-125m: validation loss "
        "+0.20% vs BF16, training loss +1.4% (session 39; +0.24% / +2.2% in session 38; docs/benchmarks.md section 6).",
    )
    fast_accum: list[Literal[GEMMS]] | None = Field(
        None,
        json_schema_extra={NONE_REFUSED: "none is ambiguous here: use [] for no fast accumulation in any GEMM, or "
                                         "leave the key out for the recipe's default"},
        description="Which GEMMs of each FP8 linear (fprop y = x w^T, dgrad dx, wgrad dw) run with the Hopper tensor "
        "cores' fast accumulation instead of promoting partial sums to FP32 (torch._scaled_mm use_fast_accum). Unset: "
        "the recipe table's default: fprop only for torchao's recipes (tensorwise, rowwise, rowwise_with_gw_hp), as "
        "Transformer Engine and torchao run them; fprop and wgrad for delayed. \"all\" = all three; [] runs every "
        "GEMM with FP32 promotion. Fast accumulation is faster but less exact (DeepSeek-V3, arXiv:2412.19437 "
        "section 3.3.2: about 2% on single outputs at K = 4096). Llama-3-8B layers x 8 with the delayed recipe and "
        "the FP8 head on an H200: [] 1.348x of BF16, fprop 1.374-1.396x, fprop + wgrad 1.404-1.418x, fprop + dgrad "
        "1.409x, \"all\" 1.423-1.433x; over 400 steps (two runs each) the settings with fast dgrad trained 1.3-2.4% "
        "above BF16's loss, fprop + wgrad +0.29% / -0.22% (BF16 varies 0.4% run to run; llama-125m, 1200 steps: "
        "validation loss -0.02% of BF16's); over 800 steps (two runs) fprop + wgrad ended at a validation loss +0.15% / "
        "+0.63% of BF16's and a train loss +0.53% / +0.65%, fprop only at -0.01% / +0.23% and +0.12% / +1.04% (which "
        "of the two ran closer to BF16's train loss changed between the runs; fprop only ended closer in validation "
        "loss in both). A run that sets dgrad is warned, and one that sets "
        "wgrad with another recipe than delayed (not measured there). Dense linears "
        "only: no effect with recipe = blockwise (cuBLAS's blockwise GEMMs take none) nor on rowwise_with_gw_hp's "
        "bf16 wgrad, each warned about; MoE experts accumulate as their kernels do, noted (docs/benchmarks.md "
        "section 6, sessions 39-44).",
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
        "instead of BF16 weights (half the bytes; torchao for tensorwise, fp8kit.fp8.delayed_all_gather for delayed: "
        "each shard cast with the weight's delayed scale, the same bytes as the whole weight's cast). Unset: on for "
        "the tensorwise recipe, off for the others (delayed: opt in, 0.91x of its BF16 all-gather's step on 2 H200s over "
        "NVLink, where the all-gather is hidden anyway: it pays only where the all-gather is exposed; blockwise: opt in, "
        "fp8kit.fp8.blockwise_all_gather, each shard's 128x128 blocks, for weights whose out_features is a multiple of "
        "128 x dp_shard (the others gather BF16, with a warning), not timed on GPUs yet; the rowwise recipes have "
        "none). Combined with tensor parallel it falls back "
        "to BF16 all-gather with a warning (see docs/distributed.md).",
    )
    grouped_kernel: Literal["auto", "torchao", "fused", "scaled_grouped_mm"] = Field(
        "auto",
        description="MoE experts in FP8 (not recipe = blockwise, whose experts always run a per-expert loop of "
        "blockwise GEMMs): auto (fused on Hopper), torchao (torchao's Triton casts around "
        "torch._scaled_grouped_mm, per weight), fused (fp8kit's whole expert MLP with the casts fused into the "
        "dispatch, the SwiGLU and the wgrad operands; moe/fused_experts.py) or scaled_grouped_mm (fp8kit's "
        "compiled casts, per weight; the reference). Speeds: docs/benchmarks.md section 4.",
    )
    grouped_wgrad: Literal["auto", "fp8", "bf16"] = Field(
        "auto",
        description="MoE experts on the fused kernel: precision of the weight-gradient GEMMs. fp8 (all three "
        "GEMMs in FP8), bf16 (fprop and dgrad in FP8, wgrad in bf16 without the per-(expert, column) casts of "
        "its operands; torchao's rowwise_with_gw_hp) or auto (bf16 for experts narrower than 1024, e.g. "
        "Qwen3-30B-A3B's 768: 1.18x vs 1.03x bf16 per layer on the H100; fp8 for wider ones, e.g. DeepSeek-V3, "
        "Mixtral; docs/benchmarks.md section 4). bf16 is refused with recipe = blockwise or another grouped_kernel.",
    )
    grouped_wgrad_input: Literal["auto", "saved", "gathered"] = Field(
        "auto",
        description="MoE experts on the fused kernel with a bf16 wgrad (grouped_wgrad): how gate_up_proj's wgrad gets "
        "the tokens in expert order. saved (the dispatch writes their rows, in the tokens' dtype, beside the FP8 copy "
        "in one read and keeps them: (routed rows x hidden) more per MoE layer until its backward, 0.5 GiB per "
        "layer at Qwen3-30B-A3B with 16K bf16 tokens), gathered (gathered again in the backward: 0.14 ms more per layer there on "
        "the H100) or auto (saved under train.activation_checkpointing, which holds one layer's saved tensors at a "
        "time; gathered otherwise). The same numerics either way.",
    )
    grouped_gemm: Literal["auto", "grouped", "loop"] = Field(
        "auto",
        description="MoE experts on the fused kernel: how its six GEMMs run. grouped (one "
        "torch._scaled_grouped_mm each), loop (one dense rowwise torch._scaled_mm per expert; the group sizes are "
        "copied to the host once per layer and the layer runs eagerly inside a compiled block) or auto (the loop "
        "where each expert's GEMM has at least 100 GFLOP, e.g. Mixtral-8x7B or DeepSeek-V3 under EP 32: expert "
        "layer 1.31x instead of 1.28x, 1.41x instead of 1.35x BF16 on the H100; grouped for many small experts, e.g. "
        "Qwen3-30B-A3B or DeepSeek-V3 with 128 experts on one GPU, where the loop is host-bound; "
        "docs/benchmarks.md section 4).",
    )
    blockwise_recompute: bool = Field(
        False,
        description="recipe = blockwise: keep no FP8 copies from a linear's forward to its backward; the backward "
        "quantizes the BF16 input and the weight again (eagerly the same bits; compiled, some E4M3 values round to a "
        "neighbour, as accurate against float64). The step holds those anyway, so blockwise "
        "then adds no activation memory (the per-tensor recipes' peak) at the price of one more cast of each "
        "linear's input and weight per backward. false: keep the FP8 x^T and w^T copies (1 byte per input and per "
        "weight element of every linear, from its forward to its backward; faster). Weights are always "
        "quantized again under FSDP2. The activation saving needs train.compile = true (eagerly the BF16 input is "
        "saved, which can cost more than its FP8 copy); with sequence parallel the column-parallel linears save "
        "their all-gathered BF16 input (a collective is never recomputed). Blockwise MoE experts cast their weight "
        "copies again too (their x^T copies are kept). Measured on Llama-3-8B layers x 8 (H100): peak 23.6 -> "
        "20.3 GiB (tensorwise's), 1.180x -> 1.150x BF16 (docs/benchmarks.md section 6).",
    )
    blockwise_wgrad_x: Literal["128x1", "128x128"] = Field(
        "128x1",
        description="recipe = blockwise: the blocks of the input copy the weight-gradient GEMM reads. 128x1 (one "
        "scale per 128 tokens of each input feature, DeepSeek-V3's recipe) or 128x128 (one scale per 128 tokens x "
        "128 features, as a weight; Transformer Engine's x_block_scaling_dim = 2 for this copy only): cuBLAS then "
        "runs the wgrad GEMM with its 1x128 x 128x128 kernel, 1.2x faster than the 1x128 x 1x128 one on the H100 "
        "(Llama-3-8B layers x 8: 1.18-1.20x -> 1.23-1.25x BF16; llama-125m final validation loss +0.36% vs BF16). The price: "
        "the features that share a 128x128 block with an outlier feature lose weight-gradient precision (1e5x "
        "outliers: 9 dB on those columns). Blockwise linears and blockwise MoE experts alike (docs/benchmarks.md "
        "section 6).",
    )
    blockwise_fused_mlp: bool = Field(
        False,
        description="recipe = blockwise: run the SwiGLU MLPs of HF Llama / Qwen2 / Qwen3 / Mistral models whose "
        "gate, up and down projections are all blockwise FP8 as one fused function: the SwiGLU writes the down "
        "projection's FP8 operands and its backward the gate / up projections' FP8 gradient operands directly, "
        "without the bf16 tensors in between (fp8kit.fp8.swiglu_mlp). Same GEMMs and scales; each SwiGLU value is "
        "rounded to bf16 before its cast as unfused. An MLP runs unfused, and the run says why, when a projection "
        "is BF16, tensor-parallel, hooked (fp8.stats_every) or has a bias, or with fp8.blockwise_recompute. Off by "
        "default: on the H100 its SwiGLU kernels are not yet faster than Inductor's SwiGLU plus the separate casts "
        "(one Llama-3-8B MLP, docs/benchmarks.md section 6).",
    )
    delayed_fused_mlp: bool = Field(
        True,
        description="recipe = delayed: run the SwiGLU MLPs of HF Llama / Qwen2 / Qwen3 / Mistral models whose gate, "
        "up and down projections are all delayed-scaling FP8 as one function (fp8kit.fp8.delayed_mlp): x is cast "
        "once for gate and up, and one kernel reads the SwiGLU backward's inputs once and writes every FP8 operand "
        "of the MLP's backward GEMMs (both layouts of dg and du, the down projection's wgrad input) and the amaxes "
        "for the histories. Same formats, scales and histories as the three linears. An MLP runs unfused, and the "
        "run says why, when a projection is BF16, tensor-parallel, hooked (fp8.stats_every) or has a bias; the "
        "first training step, evaluation and float32 activations (train.param_dtype = fp32) run the three linears. "
        "On the H100: 0.5-1.2% less GPU time per Llama-3-8B step, 0.4% on the wall clock, inside the run-to-run "
        "spread (docs/benchmarks.md section 6).",
    )
    amax_history_len: int = Field(
        16, ge=1, description="recipe = delayed: steps of amax history per operand (Transformer Engine's "
        "DelayedScaling; 16 as LLaMA-Factory sets it).",
    )
    amax_compute_algo: Literal["max", "most_recent"] = Field(
        "max", description="recipe = delayed: the amax a scale is computed from: the max over the history, or "
        "the most recent step's.",
    )
    margin: int = Field(
        0, ge=0, description="recipe = delayed: scales are divided by 2 ** margin (headroom against growth).",
    )
    delayed_fused_cast: Literal["all", "weight_grad", "grad_output", "none"] = Field(
        "none", description="recipe = delayed, on CUDA: which operands are cast by fp8kit's fused Triton "
        "cast-transpose kernel (one read writes both FP8 layouts and this step's amax) instead of by torch.compile: "
        "none (default: torch.compile generates every cast and fuses the inputs' casts into the kernels producing "
        "them, e.g. RMSNorm and SwiGLU), grad_output (output gradients), weight_grad (weights and output gradients) or "
        "all. Same bits either way. "
        "all trades memory for speed: under torch.compile the weights' and inputs' backward copies it writes in the "
        "forward are held until the backward (+2.5 GiB at Llama-3-8B x8 layers, seq 4096, micro-batch 2) where "
        "none casts them again in the backward. Measured on an H200 (sessions 50-51, one run each): one linear "
        "is faster with grad_output and all at every shape of the 18-shape grid (all: 1.10-1.24x of torchao "
        "tensorwise's speed; none: 0.98-1.11x), but not in a model: the 8B step 1.442x BF16 with all (23.1 GiB) vs "
        "1.403x with none (20.6 GiB), grad_output even with none (121.7 vs 121.6 ms, +0.2 GiB); llama3-1b alone "
        "(session 52, after the fused cast became a triton_op with one launch): all 1.10x, grad_output 1.09x vs "
        "1.21x with none: the fused casts leave the GPU the least work but cost host time; with train.cuda_graphs "
        "(no launch cost) all is the fastest: llama3-1b 1.29x vs 1.24x, and the 8B step 1.456x vs 1.406x (23.0 vs "
        "20.6 GiB, session 53): set all where the step is GPU-bound or graphed and memory allows "
        "(docs/benchmarks.md section 6, Sessions 50-53).",
    )
    weight_cache: bool = Field(
        True,
        description="With train.grad_accum > 1: cast each FP8 weight once per optimizer step and reuse the cast "
        "copies in the step's other micro-batches (blockwise linears, delayed linears, fused and blockwise MoE experts; not under "
        "FSDP2, whose all-gather frees the weight after each use, except the experts under expert parallelism, which "
        "FSDP2 leaves alone; for the delayed recipe not with train.cuda_graphs). The delayed recipe then holds each weight's scale for the step, as Transformer "
        "Engine's is_first_microbatch does. Costs 2 bytes per FP8 weight element from the step's first forward to "
        "the optimizer step. false: cast at every micro-batch (no memory held). No effect with grad_accum = 1. "
        "Measured at Llama-3-8B layers x 8, 2 micro-batches of 8192 tokens (H200): 0.6% faster per step for 3.4 GiB "
        "more peak, above BF16's (docs/benchmarks.md section 6, Session 51): worth more at smaller micro-batches, "
        "and a switch to turn off under memory pressure.",
    )
    stats_every: int = Field(
        0, ge=0,
        description="Every N steps record, per FP8 linear layer and operand (input, weight, output gradient), "
        "amax, scale, and the fractions of values that underflow to zero or saturate in FP8, in the metrics "
        "(fp8_health) and as the worst five layers in summary.md (fp8kit.train.health). 0: off (no hooks). "
        "One process only.",
    )

    @field_validator("fast_accum", mode="before")
    @classmethod
    def _all(cls, v):
        """``"all"`` (alone or as the only list item: what a ``--set`` override gives) -> the three GEMMs; one
        GEMM's name alone -> a list of it."""
        word = v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v
        if word == "all":
            return list(GEMMS)
        if isinstance(v, (list, tuple)) and "all" in v:
            raise ValueError('"all" stands alone (all three GEMMs); otherwise list names of fprop, dgrad, wgrad')
        return [v] if isinstance(v, str) else list(v) if isinstance(v, tuple) else v

    @field_validator("fast_accum")
    @classmethod
    def _gemms_once(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            twice = sorted({g for g in v if v.count(g) > 1})
            if twice:
                raise ValueError(f"lists {', '.join(twice)} more than once")
        return v

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
        if self.enable_fsdp_float8_all_gather and self.recipe not in ("tensorwise", "delayed", "blockwise"):
            raise FieldProblem(
                "fp8.enable_fsdp_float8_all_gather",
                f"FP8 all-gather runs with the tensorwise (torchao), delayed and blockwise (fp8kit) recipes only, "
                f"not {self.recipe!r}",
            )
        return self


class SelectiveConfig(ConfigModel):
    """``[selective]``: the measured per-module choice (LoongForge adaptive FP8): after the static [fp8]
    rules, a layer stays in FP8 only where a measurement says FP8 is faster at the run's token count:
    measured at start-up (``selective_fp8 = "auto"``, the default) or from a policy file of benchmark
    measurements (``selective_fp8 = true``). The keys keep LoongForge's names; under ``[fp8]`` they are still
    accepted and moved here."""

    section: ClassVar[str] = "selective"
    selective_fp8: SelectiveMode = Field(
        "auto",
        description="Which FP8 candidates (after the static rules) run in FP8. auto: on CUDA, `fp8kit train` "
        "times each distinct layer shape of the model at this run's token count in BF16 and in FP8 (fp8.recipe) "
        "at start-up, caches the timings under data.cache_dir (keyed by GPU, library versions, shape, recipe, "
        "tp/ep) and keeps FP8 only where it measured auto_min_speedup x faster; on the CPU or with fp8.emulate "
        "(no meaningful timings) the static rules decide, with a warning. policy (or true, LoongForge's "
        "spelling): the policy file's measurements (fp8_dynamic_policy_path). off (or false): every candidate "
        "in FP8 (warns where a cached measurement says FP8 is slower). Unset with a policy path given: policy.",
    )
    auto_min_speedup: float = Field(
        DEFAULT_MIN_SPEEDUP, ge=1.0,
        description="selective_fp8 = auto: a layer runs in FP8 only where BF16 time / FP8 time >= this (the margin "
        "above 1.0 covers timing noise and FP8 costs an isolated layer does not show; fp8kit.selective.auto).",
    )
    fp8_dynamic_policy_path: str | None = Field(
        None,
        description="Policy JSON for selective_fp8 = true (LoongForge adaptive-FP8 format): a path, or builtin:NAME "
        "for a policy shipped with fp8kit (see `fp8kit plan --list-policies`).",
    )
    fp8_dynamic_num_tokens: int | None = Field(
        None, gt=0, description="Token count for policy lookups and auto timings. Default: data.seq_length x "
        "train.micro_batch_size.",
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

    @model_validator(mode="before")
    @classmethod
    def _policy_path_implies_policy(cls, data: Any) -> Any:
        if isinstance(data, dict) and "selective_fp8" not in data and (
            data.get("fp8_dynamic_policy_path") or data.get("component_policy_paths")
        ):
            return {**data, "selective_fp8": "policy"}
        return data

    @field_validator("selective_fp8", mode="before")
    @classmethod
    def _loongforge_booleans(cls, v: Any) -> Any:
        """LoongForge's ``true`` / ``false`` (and ``--set`` words for them) -> ``policy`` / ``off``."""
        if isinstance(v, bool):
            return "policy" if v else "off"
        if isinstance(v, str) and v.strip().lower() in _TRUE_WORDS:
            return "policy"
        if isinstance(v, str) and v.strip().lower() in _FALSE_WORDS:
            return "off"
        return v

    @field_serializer("selective_fp8")
    def _write_booleans(self, v: str) -> bool | str:
        """Saved configs keep LoongForge's spelling: ``policy`` -> ``true``, ``off`` -> ``false``."""
        return {"policy": True, "off": False}.get(v, v)

    @model_validator(mode="after")
    def _needs_a_policy(self) -> "SelectiveConfig":
        has_policy = bool(self.fp8_dynamic_policy_path or self.component_policy_paths)
        if self.selective_fp8 == "policy" and not has_policy:
            raise FieldProblem(
                "selective.selective_fp8",
                "is true but no policy is given: set selective.fp8_dynamic_policy_path",
            )
        if self.selective_fp8 == "auto" and has_policy:
            raise FieldProblem(
                "selective.selective_fp8",
                "is \"auto\" (measure at start-up) but a policy file is given too: set selective_fp8 = true to "
                "use the policy, or drop fp8_dynamic_policy_path / component_policy_paths",
            )
        return self


class OptimConfig(ConfigModel):
    """``[optim]``: the optimizer. lr, betas, weight decay and clipping are in ``[train]``.

    The default (``name = "auto"`` with ``train.param_dtype = "auto"``) keeps a high-precision master: FP8AdamW's
    scaled FP16 master where it runs, else AdamW with FP32 master weights; bf16 weights updated in place only
    when asked (``name = "adamw"`` with ``train.param_dtype = "bf16"``), because they lose quality late in
    training. llama-125m, seq 1024 x 16, lr 1e-3, 1200 steps, FP8 tensorwise, H100 (train loss = mean of steps
    1101-1200; val loss at step 1200): AdamW with bf16 weights updated in place 1.569 / 2.623; AdamW with an
    FP32 master 1.352 / 2.632; FP8AdamW 1.329 / 2.618 (the bf16 run falls behind from step ~500). Step time and
    memory of each: docs/benchmarks.md section 3.
    """

    section: ClassVar[str] = "optim"
    name: Literal["adamw", "fp8_adamw", "auto"] = Field(
        "auto",
        description="auto (default): fp8_adamw where it runs (one process, FSDP2 / HSDP), else adamw with FP32 "
        "master weights (tensor / expert parallel, train.param_dtype = fp32); a resumed checkpoint keeps its "
        "optimizer. The choice is printed and recorded in resolved_config.toml (fp8kit.config.optim_choice). "
        "adamw: torch.optim.AdamW (fused on CUDA) with FP32 master weights (train.param_dtype = auto or fp32), or "
        "bf16 weights updated in place when train.param_dtype = bf16 is set (loses quality: see "
        "train.param_dtype). fp8_adamw: fp8kit.optim.FP8AdamW, FP8-LM's precision decoupling (arXiv:2310.18313): "
        "the states below.",
    )
    master: Literal["fp16", "fp32", "bf16_sr"] = Field(
        "fp16",
        description="fp8_adamw master weights: fp16 (with a scale), fp32, or bf16_sr (bf16 with stochastic "
        "rounding; with bf16 parameters the working weights are the master).",
    )
    grad: Literal["e5m2", "e4m3", "param"] = Field(
        "param",
        description="fp8_adamw gradients between backward and step: param (autograd's bf16 param.grad, read in "
        "place: 7 bytes/param, no hooks; step 0.83-0.89x fused fp32-master AdamW on the H100) or e5m2 / e4m3 "
        "(FP8 with a scale, quantized by per-parameter hooks as autograd produces them: FP8-LM's 6 bytes/param, "
        "but the hooks cost 10-15 ms a step; not under FSDP2).",
    )
    m: Literal["e4m3", "fp16", "bf16", "fp32"] = Field(
        "e4m3", description="fp8_adamw first moment: e4m3 (with a scale), fp16, bf16 or fp32."
    )
    v: Literal["fp16", "e4m3", "fp32"] = Field(
        "fp16",
        description="fp8_adamw second moment: fp16 (with a scale), e4m3 (underflows; for the FP8-LM "
        "ablation) or fp32.",
    )
    m_rounding: Literal["stochastic", "nearest"] = Field(
        "stochastic",
        description="fp8_adamw rounding of the stored first moment: stochastic (unbiased, deterministic hash-based "
        "random numbers; removes the E4M3 dead-band drift) or nearest (FP8-LM's layout; drifts +6-12% behind "
        "FP32 AdamW on a regression at 400 steps).",
    )
    m_expand: Literal["none", "coat"] = Field(
        "none",
        description="fp8_adamw dynamic range expansion of the first moment: none, or coat (COAT, "
        "arXiv:2410.19313: x -> sign(x)|x|^k per scale group; torch.compile path, not the Triton kernel).",
    )
    granularity: Literal["auto", "tensor", "block"] = Field(
        "auto", description="fp8_adamw scales: auto (default): block in one process, tensor under a torchrun "
        "launch of more than one process (FSDP2 / HSDP) or with m_expand = coat, or in one process what a resumed "
        "checkpoint was saved with (fp8kit.config.optim_choice). tensor: one per tensor (FP8-LM's layout; the "
        "only choice under FSDP2, two passes over the states). block: one per block_size elements (about 0.1 "
        "bytes/param of scales, one pass: on the H100 the step of 2.0B parameters takes 13.3 instead of 20.8 ms, "
        "and llama-125m converged as well; docs/benchmarks.md section 6).",
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
    must equal the world size. ``plan`` and the selective-FP8 decisions use tp/ep to look up the policy
    rules of the run's real per-rank shapes. Experts are whole on every rank (no expert tensor parallelism:
    the old key ``etp`` is accepted only as 1)."""

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
    ep: int = Field(
        1, gt=0,
        description="Expert-parallel size (MoE): experts are split over ep ranks, borrowed from data parallelism "
        "and, with tp > 1, tensor parallelism (ep divides dp_replicate x dp_shard x tp); each expert is whole on "
        "its rank.",
    )
    ep_fp8_dispatch: bool = Field(
        False,
        description="With ep > 1, send the tokens through the forward dispatch all-to-all in E4M3: to FP8 experts "
        "on the fused rowwise path as their own fprop cast (one power-of-two scale per token, 0.504x the bytes of "
        "bf16 at hidden 2048), gathered straight into their GEMM on arrival, with the same forward bits as a bf16 "
        "dispatch; to other experts as E4M3 plus one float32 scale per 128 elements (0.516x), dequantized on "
        "arrival. The hidden size must be a multiple of 128. The gradient returns in bf16 (straight-through), "
        "the combine stays bf16, as in DeepSeek-V3, and the gate_up weight gradient of FP8 experts reads the "
        "tokens as they arrived (E4M3), also with fp8.grouped_wgrad = bf16. Measured on 2 x H100 (NVLink): to "
        "fused FP8 experts the whole dispatch takes 0.49-0.51x the time of bf16's; the 1x128 payload pays only "
        "on slow links (1.5-1.8x bf16's time over NVLink, its casts cost more than the bytes save). On 2 x H200 "
        "the whole dispatch takes 0.56x (Qwen3-30B-A3B) / 0.41x (DeepSeek-V3) of bf16's (session 53), and the "
        "Qwen3 training step (4 layers, EP 2, FP8 experts) is 1.06x faster with it (four paired runs, "
        "0.975-1.149x; session 55). At those shapes full FP8 under EP is still slower than BF16 (0.79-0.91x: the "
        "step waits on the host; FP8 experts alone 1.06x, one run; docs/benchmarks.md section 6, Session 55). "
        "Off by default: the gate_up weight gradient then reads E4M3 tokens. No effect (a warning) with ep = 1.",
    )
    fp8_reduce_scatter: Literal["off", "e5m2", "e4m3"] = Field(
        "off",
        description="Under FSDP2 (dp_shard > 1), reduce-scatter the gradients in FP8 with FP8-LM's automatic "
        "scaling (fp8kit.comm.Fp8ReduceScatter: one all-to-all of FP8 payloads, summed in float32; a quarter "
        "of the bytes of FSDP2's float32 reduce-scatter, half of bf16's), in this format (e5m2: the gradient "
        "format of FP8-LM; e4m3: one more mantissa bit, less range). The auto-scale state is saved in "
        "checkpoints. Pays where the link is slow (the FP8 all-reduce measured 1.4-2x faster than bf16 over "
        "sockets, 1.0-1.6x the bf16 time on NVLink: docs/benchmarks.md); needs torch >= 2.9. No effect (a warning) without FSDP2; not with "
        "dp_replicate > 1 (HSDP).",
    )
    meta_init: bool | None = Field(
        None,
        description="Build the model on the meta device, shard it (TP / EP / FSDP2), then give each rank "
        "storage for its own shards only and initialise them there (model.pretrained: read them), so that a "
        "model larger than one GPU trains. The random initialisation then has the distribution of "
        "transformers' but other numbers, the same for every layout (see docs/distributed.md). Unset: on "
        "under torchrun, off in one process (today's initialisation on the device). false under torchrun: "
        "every rank builds the whole model first (the numbers of one process on the same device).",
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
        if f8.enable_fsdp_float8_all_gather and f8.recipe in ("delayed", "blockwise") and self.distributed.tp > 1:
            raise FieldProblem(
                "fp8.enable_fsdp_float8_all_gather",
                f"the {f8.recipe} recipe's E4M3 all-gather (fp8kit.fp8.{f8.recipe}_all_gather) runs without tensor "
                f"parallel only, not with distributed.tp = {self.distributed.tp} (its weights are TP shards there: not "
                f"built); set it false (BF16 all-gather) or distributed.tp = 1",
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
