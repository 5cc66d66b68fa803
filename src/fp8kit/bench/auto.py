"""``selective.selective_fp8 = "auto"`` at the start of ``fp8kit train``: time, cache, decide.

:func:`resolve_auto` is the one call ``fp8kit.train.setup`` makes after the static decisions:

- ``auto`` on CUDA: the FP8 candidates are grouped into units (``fp8kit.selective.auto.auto_units``), each
  distinct shape is looked up in the cache (``fp8kit.selective.auto_cache``) and, on a miss, timed here in
  BF16 and in FP8 with the run's ``fp8.recipe`` by the ``bench-layers`` method (``bench/layers.py``'s
  ``_Timer`` / ``_GroupedTimer``: forward + backward of the unit's linears, compiled as ``train.compile``
  compiles, static shapes, device time through ``bench/timing.py``), then ``decide`` runs again with the
  table. Under torchrun rank 0 measures (the per-rank shapes of tp / ep, on one GPU: no communication) and
  broadcasts the table, so every rank takes the same decisions.
- ``auto`` on the CPU or with ``fp8.emulate`` (FP8 GEMMs emulated: their timings say nothing about a GPU):
  nothing is measured, the static rules decide (as ``selective_fp8 = false``) and a warning says so.
- ``false`` / a policy on CUDA: nothing is measured, but cached measurements of this GPU that say FP8 is
  slower than BF16 at a site the run keeps in FP8 give a warning with the measured ratios.

MoE expert weights are timed as ``bench-layers`` times them (the FP8 grouped GEMM, rowwise, on rows padded
to 16 per expert, the routed pairs split evenly over the local experts), except where the experts run the fused
rowwise FP8 MLP (grouped kernel ``fused``): there both weights of a layer are one ``experts.mlp`` unit, timed as
that whole MLP with the run's ``fp8.grouped_wgrad`` against BF16's grouped GEMMs (``bench/experts_timer.py``), and
decided together.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from fp8kit.base.errors import CapabilityError, ConfigError
from fp8kit.base.runtime import device_name, versions
from fp8kit.bench.experts_timer import ExpertsMLPTimer
from fp8kit.bench.layers import BenchLayersArgs, _GroupedTimer, _Timer
from fp8kit.bench.sites import BenchSite
from fp8kit.config import ModelConfig, RunConfig
from fp8kit.config.options import grouped_gemm_config, requested_fast_accum
from fp8kit.config.prepare_options import weight_cast_accumulations
from fp8kit.fp8.recipes import fast_accum_for, recipe_info
from fp8kit.fp8.weight_cache import clear_weight_caches
from fp8kit.moe.grouped_mm import GroupedGemmConfig, resolve_grouped_kernel
from fp8kit.selective.auto import (
    AutoOptions,
    AutoShape,
    AutoUnit,
    Timing,
    auto_units,
    distinct_shapes,
    shape_names,
    slower_in_fp8,
)
from fp8kit.selective.auto_cache import AutoCache, cache_key
from fp8kit.selective.decide import DecideOptions, Decision, decide
from fp8kit.selective.sites import Site

#: Untimed calls per measurement (the first compiles) and timed calls (x 3 repeats on CUDA, median).
AUTO_WARMUP = 3
AUTO_ITERS = 10


@dataclass
class Measured:
    """The timings of one start-up and how they were obtained.

    Attributes:
        timings: shape -> :class:`Timing` (``source`` ``"measured"`` or ``"cache"``).
        measured / cached: shapes timed now / read from the cache.
        seconds: wall time of the lookups and measurements.
        warnings: one line each (an untrusted cache file, an unwritable cache directory).
    """

    timings: dict[AutoShape, Timing] = field(default_factory=dict)
    measured: int = 0
    cached: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)


def grouped_recipe_key(device: torch.device, recipe: str = "tensorwise", config=None) -> str:
    """``"grouped:<kernel>"``: what the FP8 grouped GEMM of this device runs for the run's ``recipe`` (the key
    of grouped units: blockwise experts for ``blockwise``, the rowwise grouped kernel otherwise); ``config``: a
    ``GroupedGemmConfig`` to resolve instead of the recipe's default."""
    try:
        return "grouped:" + resolve_grouped_kernel(config or GroupedGemmConfig.for_fp8_recipe(recipe), device)
    except (CapabilityError, ConfigError):
        return "grouped:unavailable"


@dataclass(frozen=True)
class FP8SiteOptions:
    """How a run builds its FP8 sites, as far as it changes their speed: what ``auto`` builds them with when it times
    them, and what their cache keys say (:func:`shape_recipe_key`). :meth:`for_run` is the one place these are read
    from a run's config; a new setting that changes an FP8 site's speed is added here.

    Attributes:
        recipe: ``fp8.recipe``.
        grouped: the run's ``GroupedGemmConfig`` (kernel, ``wgrad``, ``gemm``) for grouped shapes; None: the recipe's
            defaults.
        accumulate: micro-batches per optimizer step that share their cast FP8 expert weights (expert MLP shapes are
            timed in that steady state: :class:`~fp8kit.bench.experts_timer.ExpertsMLPTimer`;
            ``config.prepare_options.weight_cast_accumulation``).
        dense_accumulate: the same for the dense linears and blockwise-loop expert weights
            (``BenchLayersArgs.accumulate``; ``config.prepare_options.dense_weight_cast_accumulation``).
        wgrad_x: the blockwise linears' ``fp8.blockwise_wgrad_x``.
        fast_accum: the dense linears' ``fp8.fast_accum`` (None: the recipe's default).
        fused_cast: the delayed linears' ``fp8.delayed_fused_cast``.
    """

    recipe: str
    grouped: GroupedGemmConfig | None = None
    accumulate: int = 1
    dense_accumulate: int = 1
    wgrad_x: str = "128x1"
    fast_accum: tuple[str, ...] | None = None
    fused_cast: str = "none"

    @classmethod
    def for_run(cls, cfg: RunConfig, mesh=None) -> FP8SiteOptions:
        """The options of the run ``cfg`` on ``mesh`` (the training run's DeviceMesh; None: one process, or, for
        ``plan``, the launch the config's data-parallel sizes describe: ``weight_cast_accumulation``)."""
        dense, experts = weight_cast_accumulations(cfg, mesh)
        return cls(recipe=cfg.fp8.recipe, grouped=grouped_gemm_config(cfg), accumulate=experts,
                   dense_accumulate=dense,
                   wgrad_x=cfg.fp8.blockwise_wgrad_x, fast_accum=requested_fast_accum(cfg.fp8),
                   fused_cast=cfg.fp8.delayed_fused_cast)

    def bench_args(self, *, warmup: int, iters: int, compile: bool) -> BenchLayersArgs:
        """The ``bench-layers`` settings that time one site built with these options: the dense timers' recipe,
        ``blockwise_wgrad_x``, fast accumulation, weight-cast accumulation and delayed fused cast, and the grouped
        timer's kernel (``grouped``: a run that forces ``fp8.grouped_kernel`` is timed on that kernel, as its cache
        key says)."""
        return BenchLayersArgs(model=ModelConfig(), vocab_size=0, recipe=self.recipe, warmup=warmup, iters=iters,
                               compile=compile, dynamic=False, blockwise_wgrad_x=self.wgrad_x,
                               fast_accum=self.fast_accum, accumulate=self.dense_accumulate,
                               delayed_fused_cast=self.fused_cast, grouped=self.grouped)

    @property
    def wgrad(self) -> str:
        """The fused experts' ``fp8.grouped_wgrad``."""
        return self.grouped.wgrad if self.grouped is not None else "auto"

    @property
    def gemm(self) -> str:
        """The fused experts' ``fp8.grouped_gemm``."""
        return self.grouped.gemm if self.grouped is not None else "auto"


def shape_recipe_key(shape: AutoShape, opts: FP8SiteOptions, grouped_key: str | None) -> str:
    """The ``recipe`` part of a shape's cache key under ``opts``: the dense recipe or the grouped kernel key of one
    expert weight
    (both with ``:wgrad_x=128x128`` for the blockwise recipe with ``fp8.blockwise_wgrad_x = "128x128"``; a dense
    recipe that takes fast accumulation with ``:fast_accum=<gemms joined by +, or none>``, ``fp8.fast_accum``
    resolved by ``fp8.recipes.fast_accum_for``: spelled out always, so that a change of a recipe's default
    accumulation cannot reuse timings of the old one), or for an
    expert MLP (``shape.mlp``, only on the fused kernel) ``grouped:fused:wgrad=<fp8.grouped_wgrad>:gemm=<fp8.grouped_gemm>``,
    with ``:accum=<N>`` when its FP8 weights are cast once per ``N`` micro-batches (``ExpertsMLPTimer(accumulate=)``);
    a dense shape or a blockwise-loop expert weight with ``:accum=<dense_accumulate>`` likewise
    (``BenchLayersArgs.accumulate``); a dense delayed shape with ``:fused_cast=<fp8.delayed_fused_cast>`` when not
    ``"none"`` (so the default's keys are those of before the setting was timed)."""
    o, recipe = opts, opts.recipe
    if shape.mlp:
        return f"grouped:fused:wgrad={o.wgrad}:gemm={o.gemm}" + (f":accum={o.accumulate}" if o.accumulate > 1 else "")
    key = grouped_key if shape.is_grouped else recipe
    if not shape.is_grouped and recipe_info(recipe).fast_accum_gemms:
        key += ":fast_accum=" + ("+".join(fast_accum_for(recipe, o.fast_accum)) or "none")
    if recipe == "blockwise" and o.wgrad_x != "128x1":
        key += f":wgrad_x={o.wgrad_x}"
    if recipe == "delayed" and not shape.is_grouped and o.fused_cast != "none":
        key += f":fused_cast={o.fused_cast}"
    cached = not shape.is_grouped or grouped_key == "grouped:blockwise_loop"  # where BenchLayersArgs.accumulate acts
    return key + (f":accum={o.dense_accumulate}" if o.dense_accumulate > 1 and cached else "")


def run_auto_options(auto: AutoOptions, cfg: RunConfig, device: torch.device) -> AutoOptions:
    """``auto`` with ``fused_experts`` set: whether the run's FP8 experts (``fp8.grouped_kernel``, resolved on
    ``device``) run the fused rowwise MLP. The one place it is decided, so that every caller (``train``'s measuring
    and forced paths, ``plan``) builds the units ``decide`` builds."""
    fused = grouped_recipe_key(device, config=grouped_gemm_config(cfg)) == "grouped:fused"
    return replace(auto, fused_experts=fused)


def run_units(decisions: list[Decision], cfg: RunConfig, auto: AutoOptions) -> list[AutoUnit]:
    """The timed units of the FP8 ``decisions`` for ``auto`` (from :func:`run_auto_options`)."""
    d = cfg.distributed
    return auto_units([x.site for x in decisions if x.is_fp8], tp=d.tp, ep=d.ep, num_tokens=auto.num_tokens,
                      topk=auto.topk, fused_experts=auto.fused_experts)


def shape_keys(shapes: Sequence[AutoShape], opts: FP8SiteOptions, *, device: torch.device, tp: int, ep: int,
               compiled: bool) -> dict[AutoShape, dict]:
    """The cache key of each shape for one run (:func:`~fp8kit.selective.auto_cache.cache_key` with
    :func:`shape_recipe_key` of ``opts``): the one place :func:`measure_shapes` (which stores) and
    :func:`lookup_cached` (which only reads) build them."""
    dev_name, vers = device_name(device), _key_versions()
    grouped_key = grouped_recipe_key(device, opts.recipe, opts.grouped) if any(s.is_grouped for s in shapes) else None
    return {s: cache_key(s, device=dev_name, versions=vers, recipe=shape_recipe_key(s, opts, grouped_key), tp=tp,
                         ep=ep, compiled=compiled)
            for s in shapes}


def measure_shapes(
    shapes: Sequence[tuple[AutoShape, str]], opts: FP8SiteOptions, *, device: torch.device, tp: int, ep: int,
    cache: AutoCache, compile: bool, warmup: int = AUTO_WARMUP, iters: int = AUTO_ITERS,
    progress: Callable[[int, int, str], None] | None = None,
) -> Measured:
    """Time each ``(shape, name)`` in BF16 and in FP8 built with ``opts``, or read it from ``cache`` (module
    docstring).

    ``progress(done, total, what)`` is called before each timing and once at the end. A shape whose FP8
    module cannot be built here (a GPU without the FP8 grouped GEMM, blockwise dims) or that runs out of
    memory gets a :class:`Timing` with ``error`` (BF16 in the decision); out-of-memory results are not cached.
    """
    t0 = time.perf_counter()
    out = Measured()
    keys = shape_keys([s for s, _ in shapes], opts, device=device, tp=tp, ep=ep, compiled=compile)
    todo = []
    for shape, name in shapes:
        key = keys[shape]
        hit, warning = cache.load(key)
        if warning:
            out.warnings.append(warning)
        if hit is not None:
            out.timings[shape] = hit
            out.cached += 1
        else:
            todo.append((shape, name, key))
    total, done = 2 * len(todo), 0
    for shape, name, key in todo:
        ms: dict[str, float | None] = {}
        error, oom = None, False
        for precision in ("bf16", "fp8"):
            if progress:
                progress(done, total, f"{name} ({shape.describe()}) in {precision}")
            done += 1
            if error:
                ms[precision] = None
                continue
            try:
                ms[precision] = _time_one(shape, name, precision, opts, device=device, compile=compile,
                                          warmup=warmup, iters=iters, ep=ep)
            except (CapabilityError, ConfigError) as e:
                ms[precision], error = None, f"{precision}: {e}"
            except torch.OutOfMemoryError:
                ms[precision], error, oom = None, f"{precision}: out of memory", True
                torch.cuda.empty_cache()
        timing = Timing(ms["bf16"], ms["fp8"], source="measured", error=error)
        out.timings[shape] = timing
        out.measured += 1
        if not oom:
            warning = cache.save(key, timing)
            if warning and warning not in out.warnings:
                out.warnings.append(warning)
    if progress:
        progress(total, total, "done")
    if todo and device.type == "cuda":
        torch._dynamo.reset()  # drop the sites' compiled graphs before the model compiles
        gc.collect()  # the timers' layers and tensors, then the FP8 weight copies they cached
        clear_weight_caches()
        torch.cuda.empty_cache()
    out.seconds = time.perf_counter() - t0
    return out


def _key_versions() -> dict[str, str]:
    v = dict(versions())
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = "none"
    return v


def _time_one(shape: AutoShape, name: str, precision: str, opts: FP8SiteOptions, *, device: torch.device,
              compile: bool, warmup: int, iters: int, ep: int = 1) -> float:
    """Milliseconds of one forward + backward of ``shape``'s linears in ``precision``, FP8 built with ``opts``
    (``bench-layers``' timers; an expert MLP shape: ``bench/experts_timer.ExpertsMLPTimer``)."""
    if shape.mlp:
        timer = ExpertsMLPTimer(shape.gemms, shape.num_gemms, shape.num_tokens, precision, device=device,
                                wgrad=opts.wgrad, gemm=opts.gemm, compile=compile, accumulate=opts.accumulate,
                                whole_layer=ep == 1, topk=shape.topk)
        try:
            return timer(warmup=warmup, iters=iters)
        finally:
            timer.close()
    site = BenchSite("llm", "column_grouped" if shape.is_grouped else "column", name, list(shape.gemms),
                     list(shape.gemms), tp=1, num_gemms=shape.num_gemms)
    args = opts.bench_args(warmup=warmup, iters=iters, compile=compile)
    timer = _GroupedTimer(site, precision, args, device) if shape.is_grouped else _Timer(site, precision, args, device)
    return timer(shape.num_tokens)


@dataclass
class AutoOutcome:
    """What :func:`resolve_auto` hands back to the setup: the final decisions, warnings, and ``info`` for
    ``run_info.json`` and the start-up table (``fp8kit.selective.report.print_auto_table``)."""

    decisions: list[Decision]
    warnings: list[str]
    info: dict


def resolve_auto(cfg: RunConfig, sites: list[Site], decisions: list[Decision], options: DecideOptions,
                 device: torch.device, *, emulated: bool, topk: int = 1,
                 status: Callable[[str], None] | None = None, mesh=None) -> AutoOutcome:
    """Apply ``selective.selective_fp8`` (module docstring) to the static ``decisions`` of ``sites``.

    Args:
        cfg: the run config (``selective``, ``fp8.recipe``, ``data.cache_dir``, ``train.compile``, sizes).
        options: the options ``decisions`` were decided with (``options.auto`` set for ``auto``).
        device: the training device; emulated: its FP8 GEMMs are emulated (``fp8.emulate``).
        topk: experts per token (grouped units are timed at ``tokens x topk`` pairs).
        status: one-line progress messages (the trainer's spinner).
        mesh: the run's DeviceMesh (None: one process): where the weight cache applies, FP8 expert MLPs and the
            dense blockwise and delayed linears are timed with their weights cast once per ``train.grad_accum``
            micro-batches (:meth:`FP8SiteOptions.for_run`).

    Raises:
        ConfigError: tp / ep do not divide a unit's dimension or expert count.
    """
    mode = cfg.selective.selective_fp8
    info: dict = {"mode": mode, "applied": False}
    fp8 = [d for d in decisions if d.is_fp8]
    if cfg.train.mixed_precision != "fp8" or not fp8:
        info["note"] = "no FP8 candidates (train.mixed_precision or the static rules): nothing to decide"
        return AutoOutcome(decisions, [], info)
    from fp8kit.data.tokenizer import resolve_cache_dir

    cache = AutoCache(resolve_cache_dir(cfg.data.cache_dir))
    real_gpu = device.type == "cuda" and not emulated
    if mode == "auto" and not real_gpu:
        where = "on the CPU" if device.type != "cuda" else f"with fp8.emulate on {device_name(device)}"
        w = (f'selective.selective_fp8 = "auto" {where}: FP8 GEMMs are emulated, so timings would not show how FP8 '
             f"runs on a GPU; nothing is measured and the static rules decide, as selective_fp8 = false "
             f"({len(fp8)} of {len(decisions)} sites in FP8)")
        info["note"] = w
        return AutoOutcome(decisions, [w], info)
    if mode == "auto":
        if options.auto is None:  # no token count (not a training run): nothing to time at
            return AutoOutcome(decisions, [], info)
        return measure_and_decide(cfg, sites, decisions, options, device, cache, status=status, mesh=mesh)
    if not real_gpu:
        return AutoOutcome(decisions, [], info)
    # false / policy: no measuring; warn where the cache says FP8 is slower at a site kept in FP8
    tokens = {"*": options.num_tokens or cfg.data.seq_length * cfg.train.micro_batch_size,
              **cfg.selective.component_num_tokens}
    units = run_units(fp8, cfg, run_auto_options(AutoOptions(tokens, topk), cfg, device))
    timings = lookup_cached(units, cfg, device, cache, mesh)
    slow = slower_in_fp8(units, timings, {x.fqn for x in fp8})
    if not slow:
        return AutoOutcome(decisions, [], info)
    spelled = "false" if mode == "off" else "true (policy)"
    w = (f"selective.selective_fp8 = {spelled} keeps FP8 where a cached measurement on {device_name(device)} says "
         f"it is slower than BF16: " + ", ".join(f"{n} {s:.2f}x at {t} tokens" for n, s, t in slow)
         + " (BF16 time / FP8 time); selective_fp8 = \"auto\" keeps them in BF16")
    info["forced_slower"] = [{"units": n, "speedup": s, "num_tokens": t} for n, s, t in slow]
    return AutoOutcome(decisions, [w], info)


def measure_and_decide(cfg: RunConfig, sites: list[Site], decisions: list[Decision], options: DecideOptions,
                       device: torch.device, cache: AutoCache, *, status: Callable[[str], None] | None = None,
                       warmup: int = AUTO_WARMUP, iters: int = AUTO_ITERS, mesh=None) -> AutoOutcome:
    """The ``auto`` path of :func:`resolve_auto` on any device (the CPU only in tests): units of the FP8
    ``decisions``, timings (cache or measured; rank 0 under torchrun), ``decide`` again with the table.
    ``mesh``: as :func:`resolve_auto`."""
    auto = run_auto_options(options.auto, cfg, device)
    units = run_units(decisions, cfg, auto)
    measured = _measure_on_rank0(units, cfg, device, cache, status, warmup, iters, mesh)
    final = decide(sites, replace(options, auto=replace(auto, timings=measured.timings)))
    info = {"mode": cfg.selective.selective_fp8,
            **_table_info(units, measured, final, auto.min_speedup, cfg, device, cache.dir)}
    return AutoOutcome(final, measured.warnings, info)


def lookup_cached(units: list[AutoUnit], cfg: RunConfig, device: torch.device, cache: AutoCache,
                  mesh=None) -> dict:
    """The cached timings of ``units``' shapes on ``device`` for this run's recipe, sizes and weight-cast
    accumulation on ``mesh`` (:meth:`FP8SiteOptions.for_run`; no measuring)."""
    d = cfg.distributed
    keys = shape_keys(list(distinct_shapes(units)), FP8SiteOptions.for_run(cfg, mesh), device=device, tp=d.tp,
                      ep=d.ep, compiled=cfg.train.compile)
    out = {}
    for shape, key in keys.items():
        hit, _ = cache.load(key)
        if hit is not None:
            out[shape] = hit
    return out


def _measure_on_rank0(units: list[AutoUnit], cfg: RunConfig, device: torch.device, cache: AutoCache,
                      status: Callable[[str], None] | None, warmup: int, iters: int, mesh=None) -> Measured:
    """Measure on this process, or under torchrun on rank 0 and broadcast the result to every rank."""
    import torch.distributed as dist

    shapes = [(shape, shape_names(us)) for shape, us in distinct_shapes(units).items()]
    d = cfg.distributed
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    measured = None
    if not distributed or dist.get_rank() == 0:
        measured = measure_shapes(shapes, FP8SiteOptions.for_run(cfg, mesh), device=device, tp=d.tp, ep=d.ep,
                                  cache=cache, compile=cfg.train.compile, warmup=warmup, iters=iters,
                                  progress=_progress_line(status))
    if distributed:
        box = [measured]
        dist.broadcast_object_list(box, src=0)
        measured = box[0]
    return measured


def _progress_line(status: Callable[[str], None] | None) -> Callable[[int, int, str], None] | None:
    """A text progress bar in the trainer's status line: ``selective_fp8 = auto ━━━━╺─── 3/8 12 s: timing ...``."""
    if status is None:
        return None
    t0 = time.perf_counter()

    def show(done: int, total: int, what: str) -> None:
        width = 20
        filled = width * done // max(total, 1)
        bar = "━" * filled + "─" * (width - filled)
        status(f"selective_fp8 = auto {bar} {done}/{total} {time.perf_counter() - t0:.0f} s: timing {what}")

    return show


def _table_info(units: list[AutoUnit], measured: Measured, decisions: list[Decision], min_speedup: float,
                cfg: RunConfig, device: torch.device, cache_dir: Path) -> dict:
    """The ``info`` of an applied ``auto``: one row per distinct shape, plus how the table was obtained."""
    precision = {x.fqn: x.precision for x in decisions}
    rows = []
    for shape, us in distinct_shapes(units).items():
        t = measured.timings.get(shape)
        fqns = [f for u in us for f in u.fqns]
        rows.append({
            "units": shape_names(us), "sites": len(fqns), "shape": shape.describe(), "num_tokens": shape.num_tokens,
            "bf16_ms": t.bf16_ms if t else None, "fp8_ms": t.fp8_ms if t else None,
            "speedup": t.speedup if t else None, "source": t.source if t else None, "error": t.error if t else None,
            "precision": precision.get(fqns[0]),
        })
    return {
        "applied": True, "device": device_name(device), "recipe": cfg.fp8.recipe, "compiled": cfg.train.compile,
        "min_speedup": min_speedup, "shapes": len(rows), "measured": measured.measured, "cached": measured.cached,
        "seconds": round(measured.seconds, 2), "cache_dir": str(cache_dir), "rows": rows,
    }
