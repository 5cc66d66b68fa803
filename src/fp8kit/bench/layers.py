"""``fp8kit bench-layers``: time every linear site of one transformer layer in BF16 and FP8.

For each site (``bench/sites.py``), precision and token count it times forward + backward of the
site's linears (output, grad_input and grad_weight GEMMs plus, in FP8, every amax, scale and cast),
with the per-rank shapes of the given TP / EP / ETP, and writes a report JSON with every
measurement plus the device, library versions, the recipe and where the recipe and sizes came from.
``merge-policy`` (``selective/policy.py``) turns reports into a selective-FP8 policy (the workflow and
the policy format of LoongForge's adaptive FP8).

The FP8 linears are torchao ``Float8Linear`` modules built from :attr:`BenchLayersArgs.recipe` (the
config's ``fp8.recipe`` unless ``--recipe`` overrides it; resolved by ``fp8kit.cli.selective``); the
report's ``fp8_linear_scaling`` is read back from the modules that were timed.

Modules are compiled (``torch.compile``) for each token count's static shape, after a dynamo reset, as
``train.compile`` compiles one shape in training; on the CPU they run eagerly unless asked. (``--dynamic``: one
compilation with the token dimension dynamic serves the sweep; faster to run, but it times FP8's casts slower
than training runs them, see :attr:`BenchLayersArgs.dynamic`.)

Grouped (MoE expert) sites time the expert GEMMs as training runs them (``fp8kit.moe``): BF16 through
``torch._grouped_mm`` on the unpadded rows, FP8 through the FP8 grouped GEMM on rows padded to 16 per
expert (its quantization compiled). Their token count is the number of routed (token, expert) pairs,
``tokens x moe_router_topk`` (the unit of the policy's grouped ``min_tokens``), split evenly over the
``num_gemms`` local experts. As in training (``fp8kit.moe.grouped_mm``), the FP8 experts run the rowwise
grouped GEMM for the tensorwise, rowwise and delayed recipes, and the blockwise per-expert loop
(``moe/grouped_loop.py``) for ``blockwise``. Where the run's FP8 experts take the fused path
(``fp8.grouped_kernel`` resolving to ``fused``: the rowwise recipes on Hopper), a layer's ``gate_up_proj`` and
``down_proj`` sites are timed together as that MLP (dispatch + casts, both grouped GEMMs, SwiGLU, combine; on one
GPU the tokens routed top-k as the model routes them; ``bench/experts_timer.ExpertsMLPTimer``, the ``experts.mlp``
unit of ``selective_fp8 = "auto"``) and both sites
carry the unit's time, so a policy decides them together as training runs them (its records say
``"unit": "experts.mlp"``).

Three ways to run:

- one device, ``--tp 1``: the layer as it runs on one GPU;
- ``--tp N --simulate-tp`` on one device: the per-rank shard shapes, no communication (the report
  says ``simulated_tp: true``);
- ``--tp N`` under ``torchrun --nproc_per_node N``: the real tensor-parallel layer (DTensor, sequence
  parallel, torchao's FP8 parallel styles or, for blockwise and delayed, ``parallel/tp_own.py``'s),
  communication included; the slowest rank counts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from fp8kit.base.errors import CapabilityError, ConfigError
from fp8kit.base.runtime import device_name, launched_rank, launched_world_size, resolve_device, versions
from fp8kit.base.torchao_lib import torchao_float8
from fp8kit.bench.experts_timer import ExpertsMLPTimer, unit_config
from fp8kit.bench.sites import COLUMN_KINDS, ROW_KINDS, BenchSite, layer_sites
from fp8kit.bench.timing import suspect_points, time_ms, with_weight_cast_share
from fp8kit.config import ModelConfig
from fp8kit.fp8.delayed_weight_cache import weight_cast
from fp8kit.fp8.kernels import ops
from fp8kit.fp8.linear import Float8BlockwiseLinear
from fp8kit.fp8.recipes import RECIPE_NAMES, fast_accum_for, float8_linear_config, recipe_info
from fp8kit.moe.grouped_loop import group_bounds
from fp8kit.moe.grouped_mm import GroupedGemmConfig, bf16_grouped_mm, fp8_grouped_mm, resolve_grouped_kernel
from fp8kit.selective.auto import unit_topk

PRECISIONS = ("bf16", "fp8")
CPU_NOTE = "CPU timings: for testing the workflow only; not meant for a GPU policy"
# The values whose origin the report records (BenchLayersArgs.sources keys).
SOURCED = ("recipe", "tp", "ep")


@dataclass
class BenchLayersArgs:
    """What one layer benchmark measures, every value explicit.

    ``fp8kit.cli.selective`` resolves it from the run config and the flags (``--recipe`` over
    ``fp8.recipe``, ``--tp/--ep`` over ``[distributed]``); the measurement code reads no run config.

    Attributes:
        model: the ``[model]`` section (preset or HF ``config.json``, depth); its first layer's linears
            are timed (the model is built on ``meta`` to find them).
        vocab_size: ``data.vocab_size`` (the model is built with it; the embedding is not timed).
        recipe: FP8 recipe of the timed ``Float8Linear`` modules, one of ``fp8.recipes.RECIPE_NAMES``.
        tp / ep: tensor- and expert-parallel sizes whose per-rank shapes are timed (experts are whole per
            rank: grouped sites are keyed ``etp = 1`` in the report, LoongForge's policy key).
        sources: where each of ``recipe``, ``tp``, ``ep`` came from (e.g. ``"--recipe"``,
            ``"config file run.toml"``, ``"default"``); copied into the report and into error messages.
        precisions: subset of :data:`PRECISIONS`.
        warmup / iters: untimed and timed calls per measurement (median, ``bench/timing.py``).
        shape_sweep: ``(seq_length, micro_batch_size)`` points; tokens = their product.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        simulate_tp: time the per-rank shapes of ``tp > 1`` on one device, without communication.
        compile: ``torch.compile`` the modules; ``None``: on CUDA, eager on the CPU.
        dynamic: ``False`` (default): compile each token count for its static shape, after a dynamo reset, as
            training compiles its one shape (and as ``selective_fp8 = "auto"`` times). ``True``: mark the token
            dimension dynamic so one compilation serves the sweep: faster to run, but Inductor's FP8 casts and
            amax reductions compiled for a symbolic row count run slower than training's (measured on the H100:
            Qwen3-30B-A3B's FP8 ``qkv`` at 16384 tokens 2.08 ms dynamic vs 1.28 ms static, docs/benchmarks.md
            section 2), so a policy from such a report under-uses FP8. ``experts.mlp`` units always compile per
            point (static).
        retime: after each site's sweep, time the points that look like spikes again, up to this many more
            times each, and keep the fastest (``bench/timing.py``, ``suspect_points``); 0 turns it off.
        blockwise_wgrad_x: recipe ``blockwise``: the blocks of the wgrad copy of each linear's input
            (``fp8.blockwise_wgrad_x``; ``Float8BlockwiseLinear(wgrad_x=...)``).
        fast_accum: the dense linears' GEMMs with fast accumulation (``fp8.fast_accum``; None: the recipe table's).
        grouped: how the run's FP8 experts compute (``config.options.grouped_gemm_config``: ``fp8.grouped_kernel``,
            ``grouped_wgrad``, ``grouped_gemm``); None: ``GroupedGemmConfig.for_fp8_recipe(recipe)``'s defaults.
        accumulate: micro-batches per optimizer step that share their cast FP8 weights (``fp8.weight_cache`` with
            ``train.grad_accum``: ``config.prepare_options.dense_weight_cast_accumulation``). Above 1, the dense
            ``blockwise`` and ``delayed`` sites run with their weight cache, as training does, and are timed in that
            steady state: the step with the cached weights plus the weights' cast (timed alone) divided by
            ``accumulate``; so are the blockwise-loop experts of grouped sites. The torchao recipes, which cast every
            micro-batch, and the rowwise grouped GEMM ignore it (the fused experts' unit has its own timer).
        delayed_fused_cast: recipe ``delayed``: the operands cast by fp8kit's fused cast-transpose
            (``fp8.delayed_fused_cast``; ``DelayedScaling.fused_cast``), so a site is timed as the run casts it.
    """

    model: ModelConfig
    vocab_size: int
    recipe: str = "tensorwise"
    tp: int = 1
    ep: int = 1
    sources: dict[str, str] = field(default_factory=dict)
    precisions: tuple[str, ...] = PRECISIONS
    warmup: int = 5
    iters: int = 10
    shape_sweep: list[tuple[int, int]] = field(default_factory=list)
    device: str = "auto"
    simulate_tp: bool = False
    compile: bool | None = None
    dynamic: bool = False
    retime: int = 2
    blockwise_wgrad_x: str = "128x1"
    fast_accum: tuple[str, ...] | None = None
    grouped: GroupedGemmConfig | None = None
    accumulate: int = 1
    delayed_fused_cast: str = "none"

    def grouped_config(self) -> GroupedGemmConfig:
        """:attr:`grouped`, or the recipe's default experts config."""
        if self.grouped is not None:
            return self.grouped
        return GroupedGemmConfig.for_fp8_recipe(self.recipe, wgrad_x=self.blockwise_wgrad_x)

    def source(self, key: str) -> str:
        """Where ``key`` (one of :data:`SOURCED`) came from; ``"argument"`` when the caller did not say."""
        return self.sources.get(key, "argument")


def parse_shape_sweep(spec: str) -> list[tuple[int, int]]:
    """``"1024x1,4096x2"`` -> ``[(1024, 1), (4096, 2)]`` (seq_length x micro_batch_size).

    Raises:
        ConfigError: an entry is not two positive integers joined by ``x``.
    """
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        bits = part.lower().split("x")
        if len(bits) != 2 or not all(b.strip().isdigit() and int(b) > 0 for b in bits):
            raise ConfigError(f"--shape-sweep: {part!r} is not SEQxMBS (e.g. 4096x2)")
        out.append((int(bits[0]), int(bits[1])))
    if not out:
        raise ConfigError(f"--shape-sweep: no shapes in {spec!r}")
    return out


def auto_sweep(max_tokens: int, min_tokens: int = 256) -> list[tuple[int, int]]:
    """Powers of two from ``min_tokens`` to ``max_tokens`` as ``(tokens, 1)``."""
    if max_tokens < min_tokens:
        raise ConfigError(f"--max-tokens {max_tokens} is below the smallest sweep point {min_tokens}")
    out, t = [], min_tokens
    while t <= max_tokens:
        out.append((t, 1))
        t *= 2
    return out


class SiteModule(nn.Module):
    """The linears of one site applied to the same input (q/k/v, or gate/up, as in the HF layer)."""

    def __init__(self, gemms: list[tuple[int, int]]):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(k, n, bias=False) for k, n in gemms)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [lin(x) for lin in self.linears]


def build_site_module(
    site: BenchSite, precision: str, recipe: str, device: torch.device, mesh=None, *, wgrad_x: str = "128x1",
    fast_accum: tuple[str, ...] | None = None, cache_weights: bool = False, fused_cast: str = "none",
) -> SiteModule:
    """The bf16 :class:`SiteModule` of ``site``; for ``precision == "fp8"`` its linears become torchao
    ``Float8Linear`` modules with ``float8_linear_config(recipe)`` (``fp8/recipes.py``), or fp8kit's
    ``Float8BlockwiseLinear`` (``blockwise``) / ``Float8DelayedLinear`` (``delayed``, default
    ``DelayedScaling``: its first call scales from the current amax, later ones from the history).

    Without ``mesh`` the linears have the per-rank shapes ``site.gemms``; with a 1-D ``("tp",)`` mesh they
    have the whole shapes ``site.full_gemms`` and are parallelized in place (``bench/tensor_parallel.py``).
    Weights: ``nn.Linear`` initialisation with ``torch.manual_seed(0)``, bf16. ``wgrad_x``: the blockwise
    linears' ``wgrad_x`` (``fp8.blockwise_wgrad_x``); ``fast_accum``: the GEMMs with fast accumulation
    (``fp8.fast_accum``; None: the recipe table's); ``cache_weights``: the blockwise and delayed linears keep their
    cast weights (the weight cache of a run with gradient accumulation: :attr:`BenchLayersArgs.accumulate`);
    ``fused_cast``: the delayed linears' ``fp8.delayed_fused_cast``.

    Raises:
        ConfigError: ``recipe`` is not a recipe name (FP8 only).
        CapabilityError: the recipe cannot run the site's shape: a blockwise site whose K or N is not a
            multiple of 128, or (real tensor parallel) a per-rank shard the recipe cannot run (training
            keeps such a linear BF16; ``run_bench_layers`` notes the site as not timed in FP8).
    """
    torch.manual_seed(0)
    with torch.device(device):
        module = SiteModule(site.full_gemms if mesh is not None else site.gemms).to(torch.bfloat16)
    own = precision == "fp8" and recipe_info(recipe, "--recipe").engine == "fp8kit"
    if own:
        state = None
        if recipe == "delayed":
            from fp8kit.fp8.delayed import DelayedScaling, DelayedScalingState

            # under real TP one scale per whole tensor: amaxes MAX-reduced over the tp ranks (parallel/tp_own.py)
            state = DelayedScalingState(DelayedScaling(fast_accum=fast_accum_for(recipe, fast_accum),
                                                       cache_weights=cache_weights, fused_cast=fused_cast),
                                        group=mesh.get_group() if mesh is not None else None)
            # the timer rolls once, after a first step, then times steps on those history scales: in a model one
            # roll per step serves every module, a share of it per site too small to time
            state.manual = True
            module.delayed_state = state
        for i, lin in enumerate(module.linears):
            try:
                if state is not None:
                    from fp8kit.fp8.delayed import Float8DelayedLinear

                    module.linears[i] = Float8DelayedLinear.from_linear(lin, state, f"{site.name} gemm {i}")
                else:
                    # the timed steps run no optimizer step, so a cached weight hits on every step and leaves the
                    # weight's casts out: without cache_weights (one micro-batch per step) every step casts, as
                    # training does; with it _Timer adds the casts' share per micro-batch
                    module.linears[i] = Float8BlockwiseLinear.from_linear(lin, name=f"{site.name} gemm {i}",
                                                                          cache_weight=cache_weights, wgrad_x=wgrad_x)
            except ValueError as e:
                raise CapabilityError(f"bench-layers: {e}") from None
    elif precision == "fp8":
        torchao_float8().convert_to_float8_training(module, config=float8_linear_config(recipe, fast_accum=fast_accum))
    if mesh is not None and own:
        _parallelize_own_site(module, site, recipe, mesh)
    elif mesh is not None:
        from fp8kit.bench.tensor_parallel import parallelize_site

        parallelize_site(module, site, mesh, fp8=precision == "fp8")
    return module


def _parallelize_own_site(module: SiteModule, site: BenchSite, recipe: str, mesh) -> None:
    """``bench/tensor_parallel.parallelize_site``'s plan (bf16 sequence-parallel input all-gather for column
    sites, reduce-scatter of row sites' outputs) for fp8kit's own FP8 linears, with ``parallel/tp_own.py``'s
    styles.

    Raises:
        CapabilityError: a per-rank shard the recipe cannot run (``tp_own.check_shard``: blockwise needs whole
            128-blocks, delayed multiples of 16), naming the site's GEMM and its shapes.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    from fp8kit.parallel.tp_own import OwnColwiseParallel, OwnRowwiseParallel, check_shard

    kind = "column" if site.module_kind in COLUMN_KINDS else "row" if site.module_kind in ROW_KINDS else None
    if kind is None:  # duplicated sites are not split
        return
    for i, lin in enumerate(module.linears):
        try:
            check_shard(f"bench-layers site {site.name} gemm {i}", (lin.out_features, lin.in_features), recipe,
                        kind, mesh.size(), remedy="time its per-rank shapes with --simulate-tp, or choose another --tp")
        except ConfigError as e:  # the recipe cannot run this shard: noted by run_bench_layers, the sweep goes on
            raise CapabilityError(f"bench-layers: {e}") from None
    n = len(module.linears)
    if kind == "column":
        parallelize_module(module, mesh, PrepareModuleInput(input_layouts=(Shard(0),),
                                                            desired_input_layouts=(Replicate(),)))
        parallelize_module(module, mesh, {f"linears.{i}": OwnColwiseParallel(input_layouts=Replicate())
                                          for i in range(n)})
    else:
        parallelize_module(module, mesh, {f"linears.{i}": OwnRowwiseParallel(input_layouts=Shard(-1),
                                                                             output_layouts=Shard(0))
                                          for i in range(n)})


def float8_linear_scaling(module: nn.Module) -> dict[str, str] | None:
    """How the torchao ``Float8Linear`` modules inside ``module`` scale each cast, read from their configs.

    Returns ``{"recipe": "blockwise", ...}`` for fp8kit's ``Float8BlockwiseLinear``, ``None`` without an FP8
    linear; otherwise ``{cast: granularity}`` for torchao's six casts
    (``input``, ``weight``, ``grad_output`` and the ``*_for_grad_*`` casts of dgrad / wgrad), each
    ``"tensorwise"``, ``"axiswise"`` (torchao's name for rowwise) or ``"high precision"`` (cast disabled,
    e.g. wgrad of ``rowwise_with_gw_hp``), plus ``round_scales_to_power_of_2`` (``"true"``/``"false"``).

    Raises:
        ConfigError: the modules' configs differ (one report covers one recipe).
    """
    float8 = torchao_float8()
    found: dict[str, str] | None = None
    if any(type(m).__name__ == "Float8DelayedLinear" for m in module.modules()):
        return {"recipe": "delayed", "input": "tensorwise (amax history)", "weight": "tensorwise (amax history)",
                "grad_output": "tensorwise (amax history)"}
    own = [m for m in module.modules() if isinstance(m, Float8BlockwiseLinear)]
    if own:
        return {"recipe": "blockwise", "input": "1x128", "weight": "128x128", "grad_output": "1x128",
                "input_for_grad_weight": own[0].wgrad_x, "grad_output_for_grad_weight": "128x1"}
    for name, m in module.named_modules():
        if not isinstance(m, float8.Float8Linear):
            continue
        cfg = m.config
        out = {}
        for cast in ("input", "weight", "grad_output", "input_for_grad_weight", "weight_for_grad_input",
                     "grad_output_for_grad_weight"):
            cc = getattr(cfg, f"cast_config_{cast}")
            disabled = cc.scaling_type.value == "disabled"
            out[cast] = "high precision" if disabled else cc.scaling_granularity.value
        out["round_scales_to_power_of_2"] = str(bool(cfg.round_scales_to_power_of_2)).lower()
        if found is not None and out != found:
            raise ConfigError(f"bench-layers: Float8Linear {name} scales {out}, another linear {found}")
        found = out
    return found


class _Timer:
    """Builds a site's module once per precision and times it at each token count: compiled for each count's
    static shape (or once, token dimension dynamic, with ``BenchLayersArgs.dynamic``), eager without compile."""

    def __init__(
        self, site: BenchSite, precision: str, args: BenchLayersArgs, device: torch.device, mesh=None
    ):
        self.site, self.device, self.args, self.mesh = site, device, args, mesh
        self.tp = mesh.size() if mesh is not None else 1
        # the weight cache's steady state (BenchLayersArgs.accumulate): fp8kit's own recipes only
        own = precision == "fp8" and recipe_info(args.recipe, "--recipe").engine == "fp8kit"
        self.accumulate = max(1, args.accumulate) if own else 1
        self.module = build_site_module(site, precision, args.recipe, device, mesh, wgrad_x=args.blockwise_wgrad_x,
                                        fast_accum=args.fast_accum, cache_weights=self.accumulate > 1,
                                        fused_cast=args.delayed_fused_cast)
        self.parts: dict = {}
        self.scaling = float8_linear_scaling(self.module) if precision == "fp8" else None
        self.delayed = getattr(self.module, "delayed_state", None)  # rolled by the timer (build_site_module)
        self.fn, self._static_rows = self.module, None
        if _compile(args, device) and args.dynamic:
            # Every site compiles SiteModule.forward: drop earlier entries so dynamo's per-code-object
            # cache limit never silently sends a site back to eager.
            torch._dynamo.reset()
            self.fn = torch.compile(self.module)

    def _compile_for(self, rows: int) -> bool:
        """Point :attr:`fn` at the module compiled for ``rows`` input rows (static shapes; a fresh compile whenever
        the row count changes, after a dynamo reset, so no cache entry or automatic-dynamic mark carries over
        between points). Returns whether it compiles anew (on its first call)."""
        if self._static_rows == rows:
            return False
        torch._dynamo.reset()
        self.fn, self._static_rows = torch.compile(self.module, dynamic=False), rows
        return True

    def __call__(self, num_tokens: int) -> float:
        k = self.site.gemms[0][0]
        rows = num_tokens
        if self.mesh is not None and self.site.module_kind not in ("row", "row_grouped"):
            rows = num_tokens // self.tp  # sequence-parallel input shard, all-gathered by the layer
        x = torch.randn(rows, k, device=self.device, dtype=torch.bfloat16, requires_grad=True)
        fresh = False
        if _compile(self.args, self.device):
            if self.args.dynamic:
                torch._dynamo.mark_dynamic(x, 0)
            else:
                fresh = self._compile_for(rows)
        # Output shapes per rank: column sites give [tokens, N/tp]; row sites [tokens, N], reduce-scattered
        # to [tokens/tp, N] under real TP. (Computed, not probed: a probe would compile a second graph.)
        row_tp = self.mesh is not None and self.site.module_kind in ("row", "row_grouped")
        out_rows = num_tokens // self.tp if row_tp else num_tokens
        grads = [torch.randn(out_rows, n, device=self.device, dtype=torch.bfloat16)
                 for _, n in self.site.gemms]
        params = list(self.module.parameters())

        def reset() -> None:
            x.grad = None
            for p in params:
                p.grad = None

        def step() -> None:
            torch.autograd.backward(self.fn(x), grads)

        if self.delayed is not None and not all(e.started for e in self.delayed.entries.values()):
            reset()  # a first step on dynamic scales, rolled in: the timed steps cast with history scales
            step()
            self.delayed.roll(sync=True)
        if fresh:  # compile here, not in time_ms's untimed call, whose host time sizes the GPU hold (--warmup 0)
            reset()
            step()
        ms = time_ms(step, device=self.device, warmup=self.args.warmup, iters=self.args.iters, before=reset)
        ms, self.parts = with_weight_cast_share(ms, self._cast_weights, self.accumulate, device=self.device,
                                                warmup=self.args.warmup, iters=self.args.iters)
        return ms

    def _cast_weights(self) -> None:
        """The casts a weight-cache miss runs for every linear of the site (the same ops, uncached): blockwise
        ``ops.quantize_weight``, delayed ``delayed_weight_cache.weight_cast`` at the weight's history scale."""
        with torch.no_grad():
            for lin in self.module.linears:
                w = lin.weight.to_local() if hasattr(lin.weight, "to_local") else lin.weight  # a TP shard
                if isinstance(lin, Float8BlockwiseLinear):
                    ops.quantize_weight(w, cache=False)
                else:
                    weight_cast(w, lin.cast_scales()[1])


def balanced_offs(rows: int, experts: int, align: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """``(offs (E,) int32, total rows)`` for ``rows`` pairs split evenly over ``experts``, each group padded
    to a multiple of ``align`` rows (``align = 1``: no padding)."""
    base, extra = divmod(rows, experts)
    sizes = torch.tensor([base + (e < extra) for e in range(experts)], dtype=torch.long)
    sizes = (sizes + align - 1) // align * align
    offs = sizes.cumsum(0).to(torch.int32).to(device)
    return offs, int(sizes.sum())


class _GroupedTimer:
    """Times the expert GEMMs of a grouped site (forward + backward) at a number of routed pairs."""

    def __init__(self, site: BenchSite, precision: str, args: BenchLayersArgs, device: torch.device):
        self.site, self.device, self.args, self.precision = site, device, args, precision
        torch.manual_seed(0)
        e = site.num_gemms
        self.weights = [(torch.randn(e, n, k, device=device) * k ** -0.5).to(torch.bfloat16).requires_grad_()
                        for k, n in site.gemms]
        self.config = args.grouped_config()
        self.backend = resolve_grouped_kernel(self.config, device) if precision == "fp8" else None
        self.scaling = None  # rowwise grouped GEMM, or blockwise experts for the blockwise recipe (moe/grouped_mm.py)
        # the blockwise experts' weight cache (BenchLayersArgs.accumulate), as the dense _Timer
        self.accumulate = max(1, args.accumulate) if self.backend == "blockwise_loop" else 1
        self.parts: dict = {}

    def __call__(self, num_pairs: int) -> float:
        e, k = self.site.num_gemms, self.site.gemms[0][0]
        fp8 = self.precision == "fp8"
        offs, rows = balanced_offs(num_pairs, e, 16 if fp8 else 1, self.device)
        x = torch.randn(rows, k, device=self.device, dtype=torch.bfloat16, requires_grad=True)
        grads = [torch.randn(rows, n, device=self.device, dtype=torch.bfloat16) for _, n in self.site.gemms]

        def reset() -> None:
            x.grad = None
            for w in self.weights:
                w.grad = None

        def step() -> None:
            if fp8:
                outs = [fp8_grouped_mm(x, w, offs, self.backend, emulate=self.config.emulate,
                                       wgrad_x=self.config.blockwise_wgrad_x, cache_weight=self.accumulate > 1)
                        for w in self.weights]
            else:
                outs = [bf16_grouped_mm(x, w, offs) for w in self.weights]
            torch.autograd.backward(outs, grads)

        ms = time_ms(step, device=self.device, warmup=self.args.warmup, iters=self.args.iters, before=reset)
        live = [i for i, (a, b) in enumerate(group_bounds(offs)) if b > a]  # the loop casts experts with rows
        ms, self.parts = with_weight_cast_share(ms, lambda: self._cast_weights(live), self.accumulate,
                                                device=self.device, warmup=self.args.warmup, iters=self.args.iters)
        return ms

    def _cast_weights(self, experts: list[int]) -> None:
        """The blockwise weight casts cache misses run for ``experts`` of every weight of the site (uncached)."""
        with torch.no_grad():
            for w in self.weights:
                for i in experts:
                    ops.quantize_weight(w[i], cache=False)


class _ExpertsMLPSiteTimer:
    """Times one MoE layer's expert MLP as a unit at a number of routed pairs: ``gate_up`` (site ``up``) + SwiGLU +
    ``down`` (site ``down``), forward + backward, as the fused FP8 path runs it (``bench/experts_timer.py``; on one
    GPU the whole layer with its top-``topk`` routing, under expert parallelism the local experts + combine). Each
    point is its own static-shape compile (training compiles one shape).

    Raises:
        CapabilityError: FP8 on a device that cannot run the fused experts (at construction, so the run notes it).
    """

    scaling = None

    def __init__(self, up: BenchSite, down: BenchSite, precision: str, args: BenchLayersArgs, device: torch.device,
                 topk: int):
        self.up, self.down, self.precision, self.args, self.device = up, down, precision, args, device
        self.grouped = args.grouped_config()
        self.topk = unit_topk(topk, up.num_gemms, args.ep)
        if precision == "fp8":  # the config ExpertsMLPTimer runs
            resolve_grouped_kernel(unit_config(self.grouped.wgrad, self.grouped.gemm), device)

    def __call__(self, num_pairs: int) -> float:
        if _compile(self.args, self.device):
            # one static-shape compile per point, as training compiles its one shape: without the reset dynamo would
            # mark the rows dynamic from the second point on (slower routing kernels than any run compiles) and
            # reach its per-code-object cache limit (eager) within a sweep
            torch._dynamo.reset()
        timer = ExpertsMLPTimer((self.up.gemms[0], self.down.gemms[0]), self.up.num_gemms, num_pairs, self.precision,
                                device=self.device, wgrad=self.grouped.wgrad, gemm=self.grouped.gemm,
                                compile=_compile(self.args, self.device), whole_layer=self.args.ep == 1,
                                topk=self.topk)
        try:
            return timer(warmup=self.args.warmup, iters=self.args.iters)
        finally:
            timer.close()


def experts_mlp_pairs(sites: list[BenchSite]) -> dict[str, BenchSite]:
    """``{gate_up site name: down site}``: the grouped sites a fused FP8 expert MLP runs as one unit, a
    ``column_grouped`` site of one ``(H, 2I)`` weight and a ``row_grouped`` site of one ``(I, H)`` weight of the same
    experts module (their layer-0 FQNs share the parent) with the same local expert count (the gated MLP of
    ``ExpertsMLPTimer``). Sites that pair with none are left out (timed alone)."""
    ups = [s for s in sites if s.module_kind == "column_grouped" and len(s.gemms) == 1]
    downs = [s for s in sites if s.module_kind == "row_grouped" and len(s.gemms) == 1]
    out: dict[str, BenchSite] = {}
    for up in ups:
        (h, two_i), = up.gemms
        match = [d for d in downs if d.component == up.component and d.num_gemms == up.num_gemms
                 and d.gemms[0] == (two_i // 2, h) and two_i % 2 == 0 and d not in out.values()
                 and [f.rsplit(".", 1)[0] for f in d.fqns[:1]] == [f.rsplit(".", 1)[0] for f in up.fqns[:1]]]
        if match:
            out[up.name] = match[0]
    return out


def _fused_experts(args: BenchLayersArgs, device: torch.device) -> bool:
    """Whether the run's FP8 experts take the fused MLP path on ``device`` (``resolve_grouped_kernel``; a GPU that
    cannot run FP8 experts: False, the per-site timers then note why)."""
    try:
        return resolve_grouped_kernel(args.grouped_config(), device) == "fused"
    except CapabilityError:
        return False


def _compile(args: BenchLayersArgs, device: torch.device) -> bool:
    return args.compile if args.compile is not None else device.type == "cuda"


def _named(args: BenchLayersArgs, key: str) -> str:
    """``"--tp 2"`` when the value came from its flag, else ``"tp 2 (config file run.toml)"``."""
    src, value = args.source(key), getattr(args, key)
    return f"{src} {value}" if src == f"--{key}" else f"{key} {value} ({src})"


def _measure(timer, tokens: int, device: torch.device, mesh) -> tuple[float | None, str | None]:
    """One point: ``(ms, None)``, or ``(None, "out of memory")``; under real TP the slowest rank's time (a rank
    out of memory makes it out of memory on every rank)."""
    try:
        ms = timer(tokens)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        ms = math.inf  # every rank still joins the all-reduce below
    if mesh is not None:
        import torch.distributed as dist

        t = torch.tensor([ms], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = float(t.item())
    return (None, "out of memory") if math.isinf(ms) else (ms, None)


def _retime_spikes(recs: list[dict], timer, site: BenchSite, device: torch.device, mesh, attempts: int) -> None:
    """Time the sweep's suspect points (:func:`fp8kit.bench.timing.suspect_points`) again, keep the fastest.

    Up to ``attempts`` more timings per point, stopping once the sweep no longer flags it; a re-timed
    record lists every timing of the point under ``"timings"`` (the first is the sweep's) and keeps the fastest
    as ``"ms"``. Every rank of a real TP mesh sees the same (all-reduced) times, so all ranks re-time the same
    points.
    """
    for _ in range(attempts):
        suspects = suspect_points([r["num_tokens"] for r in recs], [r["ms"] for r in recs])
        if not suspects:
            return
        for i in suspects:
            rec = recs[i]
            ms, _err = _measure(timer, rec["num_tokens"], device, mesh)
            timings = rec.setdefault("timings", [rec["ms"]])
            if ms is None:
                continue
            timings.append(ms)
            rec["ms"] = min(timings)
            rec["tflops"] = site.flops(rec["num_tokens"]) / (rec["ms"] * 1e-3) / 1e12


def run_bench_layers(args: BenchLayersArgs, console=None) -> dict:
    """Run the benchmark and return the report (see the module docstring).

    Raises:
        ConfigError: bad sizes, precisions, recipe or sweep (the message names where the value came from);
            ``tp > 1`` without ``tp`` processes and without ``simulate_tp``.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from fp8kit.base.console import make_console

    console = console or make_console()
    for p in args.precisions:
        if p not in PRECISIONS:
            raise ConfigError(f"--precisions: unknown precision {p!r}; use bf16 and/or fp8")
    if args.recipe not in RECIPE_NAMES:
        raise ConfigError(f"{args.source('recipe')}: unknown recipe {args.recipe!r}; "
                          f"choose one of {', '.join(RECIPE_NAMES)}")
    for key in ("tp", "ep"):
        if getattr(args, key) < 1:
            raise ConfigError(f"{_named(args, key)}: must be >= 1")
    if args.warmup < 0:
        raise ConfigError(f"--warmup must be >= 0, got {args.warmup}")
    if args.iters < 1:
        raise ConfigError(f"--iters must be >= 1, got {args.iters}")
    if args.retime < 0:
        raise ConfigError(f"--retime must be >= 0, got {args.retime}")
    world, rank = launched_world_size(), launched_rank()
    real_tp = args.tp > 1 and not args.simulate_tp
    if real_tp and world != args.tp:
        raise ConfigError(
            f"{_named(args, 'tp')} times the real tensor-parallel layer and needs torchrun "
            f"--nproc_per_node {args.tp} (this is {world} process(es)); or pass --simulate-tp to time the "
            "per-rank shapes on one device"
        )
    device = resolve_device(args.device, "--device")
    torchao_fp8 = "fp8" in args.precisions and recipe_info(args.recipe).engine == "torchao"
    if real_tp and device.type == "cpu" and torchao_fp8:  # fp8kit's own TP styles communicate bf16 only
        raise ConfigError(
            f"{_named(args, 'tp')} with real tensor parallelism on the CPU: gloo has no float8 "
            f"collectives, so the FP8 layer of recipe {args.recipe} cannot all-gather; use --precisions bf16 on "
            "the CPU, --simulate-tp, GPUs (NCCL), or fp8kit's own recipes (blockwise, delayed)"
        )
    mesh = None
    if real_tp:
        from fp8kit.bench.tensor_parallel import init_tp_mesh

        mesh, device = init_tp_mesh(args.tp, device)
    sweep = args.shape_sweep or auto_sweep(32768)
    sites, notes = layer_sites(args.model, args.vocab_size, tp=args.tp, ep=args.ep)
    timed = sites
    topk = moe_router_topk(args.model, args.vocab_size)
    if any(s.is_grouped for s in sites) and real_tp:
        timed = [s for s in sites if not s.is_grouped]
        notes.append("grouped sites: not timed under real tensor parallelism (experts are whole on every rank; "
                     "use --simulate-tp for the per-rank shapes)")
    if mesh is not None and args.recipe != "tensorwise" and torchao_fp8:
        notes.append(
            f"real TP with recipe {args.recipe}: torchao's FP8 TP styles (float8_tensor_parallel: 'assumes "
            "tensorwise scaling') cast each linear's input and output gradient tensorwise, so only the weight "
            "casts follow the recipe (fp8_linear_scaling lists the Float8Linear configs); training's TP does "
            "the same (parallel/parallelize.py)"
        )
    pairs = experts_mlp_pairs(timed) if any(s.is_grouped for s in timed) and _fused_experts(args, device) else {}
    by_name = {s.name: s for s in timed}
    followers = {down.name: by_name[up_name] for up_name, down in pairs.items()}  # down site -> its unit's up site
    timed = [s for s in timed if s.name not in followers] + [s for s in timed if s.name in followers]  # units first
    for up_name, down in pairs.items():
        g = args.grouped_config()
        routed = (f"tokens routed top-{unit_topk(topk, down.num_gemms, args.ep)}" if args.ep == 1
                  else "one row per received token")
        notes.append(f"{up_name} + {down.name}: timed together as the experts' MLP (the fused FP8 path training "
                     f"runs: dispatch, both grouped GEMMs, SwiGLU, combine; {routed}; fp8.grouped_wgrad = {g.wgrad}, "
                     f"grouped_gemm = {g.gemm}; one static-shape compile per point); both sites carry the unit's "
                     "time")
    unit_recs: dict[tuple[str, str], list[dict]] = {}
    measurements = []
    scaling: dict[str, str] | None = None  # read back from the timed Float8Linear modules
    grouped_note = "grouped sites: the FP8 grouped GEMM scales rowwise whatever the recipe, as in training"
    total = len(timed) * len(sweep) * len(args.precisions)
    show = rank == 0
    progress = Progress(TextColumn("[bold]bench-layers"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(),
                        TextColumn("{task.fields[info]}"), console=console, disable=not show)
    with progress:
        task = progress.add_task("bench", total=total, info="")
        for site in timed:
            for precision in args.precisions:
                if site.name in followers:  # the down projection of a unit: the unit's records, under its own key
                    up = followers[site.name]
                    if (up.name, precision) not in unit_recs:
                        notes.append(f"{site.name} {precision}: not timed (timed with {up.name}, which was not)")
                    measurements.extend(_record(site, r, topk) for r in unit_recs.get((up.name, precision), []))
                    progress.advance(task, len(sweep))
                    continue
                try:
                    if site.name in pairs:
                        timer = _ExpertsMLPSiteTimer(site, pairs[site.name], precision, args, device, topk)
                    elif site.is_grouped:
                        timer = _GroupedTimer(site, precision, args, device)
                    else:
                        timer = _Timer(site, precision, args, device, mesh)
                except CapabilityError as e:  # FP8 grouped experts on a GPU without the kernel, a blockwise shape not of 128-blocks
                    notes.append(f"{site.name} {precision}: not timed: {e}")
                    progress.advance(task, len(sweep))
                    continue
                scaling = scaling or timer.scaling
                if site.is_grouped and precision == "fp8" and grouped_note not in notes:
                    notes.append(grouped_note)
                recs = []
                for seq, mbs in sweep:
                    tokens = seq * mbs * (topk if site.is_grouped else 1)
                    progress.update(task, info=f"{site.name} {precision} {tokens} tokens")
                    ms, err = _measure(timer, tokens, device, mesh)
                    rec = {"num_tokens": tokens, "seq_length": seq, "micro_batch_size": mbs, "precision": precision,
                           "ms": ms, "tp": args.tp}
                    if err:
                        rec["error"] = err
                    if site.name in pairs:
                        rec.update(unit="experts.mlp", unit_sites=[site.name, pairs[site.name].name])
                    recs.append(_record(site, rec, topk))
                    progress.advance(task)
                if args.retime:
                    progress.update(task, info=f"{site.name} {precision}: re-timing spikes")
                    _retime_spikes(recs, timer, site, device, mesh, args.retime)
                    recs = [_record(site, r, topk) for r in recs]  # tflops of the re-timed ms
                unit_recs[(site.name, precision)] = recs
                measurements.extend(recs)
                del timer
    report = {
        "format": "fp8kit-layer-report",
        "version": 1,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device_name(device),
        "device_type": device.type,
        "versions": versions(),
        "recipe": args.recipe,
        "fast_accum": list(fast_accum_for(args.recipe, args.fast_accum)),  # the dense linears' (fp8.fast_accum)
        "grouped": {k: getattr(args.grouped_config(), k) for k in ("kernel", "wgrad", "gemm")},
        "sources": {key: args.source(key) for key in SOURCED},
        "fp8_linear_scaling": scaling,
        "model": args.model.describe(),
        "moe_router_topk": topk,
        "tp": args.tp, "ep": args.ep,
        "simulated_tp": bool(args.tp > 1 and args.simulate_tp),
        "world_size": world,
        "compiled": _compile(args, device),
        "compile_shapes": ("dynamic" if args.dynamic else "static") if _compile(args, device) else None,
        "timing": "device queue: GPU held while the host enqueues, host launch overhead hidden"
        if device.type == "cuda" else "host perf_counter per iteration",
        "warmup": args.warmup, "iters": args.iters, "retime": args.retime,
        "precisions": list(args.precisions),
        "sites": [s.to_dict() for s in sites],
        "notes": notes,
        "measurements": measurements,
    }
    if device.type == "cpu":
        report["note"] = CPU_NOTE
    return report


def _record(site: BenchSite, rec: dict, topk: int) -> dict:
    """``rec`` (``num_tokens``, ``precision``, ``ms``, ``tp`` and the rest of a measurement) keyed to ``site``, its
    TFLOP/s from ``ms``: the site's GEMMs, or both sites' of an ``experts.mlp`` unit (``unit_sites``; the down site
    of a unit gets the unit's records with its own key)."""
    tokens, ms = rec["num_tokens"], rec["ms"]
    flops = site.flops(tokens)
    if "unit" in rec:  # (H, 2I) + (I, H): 3 H I per token and GEMM, from either site
        (k, n), = site.gemms
        flops = 6.0 * tokens * 3 * (k * n // 2 if site.module_kind == "column_grouped" else k * n)
    return {**rec, "site": site.name, "component": site.component, "module_kind": site.module_kind,
            "ub_name": site.ub_name, "tp": rec["tp"] if not site.is_grouped else None, "etp": site.etp,
            "num_gemms": site.num_gemms, "topk": topk if site.is_grouped else None,
            "tflops": (flops / (ms * 1e-3) / 1e12) if ms else None}


def moe_router_topk(model: ModelConfig, vocab_size: int) -> int:
    """Experts per token of the model's HF config (1 for dense models)."""
    from fp8kit.config.options import moe_topk
    from fp8kit.models.build import build_hf_config

    return moe_topk(build_hf_config(model, vocab_size))


def speedup_table(report: dict) -> list[tuple[str, int, float | None, float | None, float | None]]:
    """``(site, tokens, bf16_ms, fp8_ms, speedup)`` rows of a report, for printing."""
    by: dict[tuple[str, int], dict[str, float]] = {}
    for m in report["measurements"]:
        by.setdefault((m["site"], m["num_tokens"]), {})[m["precision"]] = m["ms"]
    rows = []
    for (site, tokens), p in by.items():
        b, f = p.get("bf16"), p.get("fp8")
        rows.append((site, tokens, b, f, (b / f) if b and f else None))
    return rows
