"""FP8 grouped GEMM with BF16 master weights: ``y[g] = x[g] @ W[e]^T`` for every expert group, in E4M3.

:func:`fp8_grouped_mm` is differentiable. Its three GEMMs (fprop, dgrad, wgrad) each quantize their
operands rowwise (``moe/quantize.py``) and run one grouped GEMM through a grouped-GEMM *kernel*
(:data:`GROUPED_KERNELS`, chosen by :func:`resolve_grouped_kernel`):

``torchao``            torchao's ``_to_fp8_rowwise_then_scaled_grouped_mm``: the same
                       ``torch._scaled_grouped_mm`` GEMMs with torchao's Triton quantization kernels, per
                       weight (the default on Hopper before ``fused``; figures in docs/benchmarks.md).
``scaled_grouped_mm``  ``torch._scaled_grouped_mm`` (CUTLASS, Hopper SM90) with fp8kit's own
                       quantization (``moe/quantize.py``, compiled): the reference CUDA path, the
                       same numerics as the emulation; slower (its per-group scales use a scatter).
``emulated``           the same quantized operands and scales, dequantized to float32 and multiplied
                       group by group (``torch._scaled_grouped_mm`` has no CPU kernel). The CUDA kernel
                       accumulates with ``use_fast_accum`` and writes bf16, the emulation accumulates
                       and writes in the input's dtype, so the two differ by rounding (SQNR between them
                       in docs/benchmarks.md, from ``benchmarks/grouped_gemm.py``). No speed-up.
``fused``              rowwise, the whole expert MLP as one autograd Function with fp8kit's fused Triton
                       quantization (dispatch gather + cast, SwiGLU + cast, per-group wgrad scales without a
                       scatter, both weight copies in one pass; ``moe/fused_experts.py``); the GEMMs are
                       ``torch._scaled_grouped_mm`` (emulated on the CPU). For gated SiLU experts with both
                       weights in FP8; a layer that does not qualify runs the per-weight path
                       (``torchao`` kernels on CUDA, ``emulated`` on the CPU). The default on Hopper:
                       a Qwen3-30B-A3B expert layer 0.90x BF16 vs torchao's 0.73x, end to end 0.953x vs
                       0.885x (``benchmarks/moe_layer.py``, docs/benchmarks.md section 4).
``blockwise_loop``     the *blockwise* recipe (``GroupedGemmConfig.recipe = "blockwise"``, DeepSeek-V3's
                       1x128 / 128x128 E4M3): a loop of dense cuBLAS blockwise GEMMs, one per expert
                       (``moe/grouped_loop.py``); emulated in float32 on the CPU or with ``emulate``.
                       The only kernel of that recipe (torch 2.11 has no blockwise grouped GEMM).

How the ``fused`` kernel runs its six GEMMs (``GroupedGemmConfig.gemm``, :func:`resolve_grouped_gemm`): ``grouped``
(one ``torch._scaled_grouped_mm`` per GEMM) or ``loop`` (one dense rowwise ``torch._scaled_mm`` per expert,
``moe/rowwise_loop.py``: 1.03-1.16x faster GEMMs once each expert's GEMM is large enough to hide the host's launch,
slower below; the group bounds copied to the host once per layer).

Group layout (all kernels): ``offs`` (E,) int32 holds the cumulative end row of each expert's
group; groups must start on multiples of 16 rows (``moe/routing.py`` pads them), because the wgrad
GEMM groups along K. Rows past ``offs[-1]`` are not computed: the CUDA kernels leave them unwritten,
the emulation writes zeros; nothing downstream may read them.

Sources: torchao ``prototype/moe_training/fp8_grouped_mm.py`` (the operand layouts and the per-group
wgrad scales), PyTorch ``torch._scaled_grouped_mm`` (``aten/src/ATen/native/cuda/GroupedBlas.cpp``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8kit.base.errors import CapabilityError, ConfigError
from fp8kit.fp8.kernels.ops import blockwise_gemm_support
from fp8kit.moe import quantize as q
from fp8kit.moe.grouped_loop import blockwise_loop_mm

#: The grouped-GEMM kernels :func:`fp8_grouped_mm` can run (``auto``: let :func:`resolve_grouped_kernel` pick).
GROUPED_KERNELS = ("auto", "scaled_grouped_mm", "torchao", "emulated", "blockwise_loop", "fused")
#: Recipes of FP8 grouped experts: rowwise (torch._scaled_grouped_mm) or blockwise (moe/grouped_loop.py).
GROUPED_RECIPES = ("rowwise", "blockwise")
#: Precisions of the fused kernel's weight-gradient GEMMs (``GroupedGemmConfig.wgrad``; ``auto``: :func:`resolve_wgrad`).
WGRAD_PRECISIONS = ("auto", "fp8", "bf16")
#: How a bf16 wgrad of ``gate_up_proj`` gets the tokens in expert order (``GroupedGemmConfig.wgrad_input``).
WGRAD_INPUTS = ("auto", "saved", "gathered")
#: ``auto`` runs the wgrad GEMMs in bf16 for experts narrower than this (the expert MLP's intermediate width).
#: Measured on the H100 (``benchmarks/moe_layer.py``, docs/benchmarks.md section 4, 2026-11-25): at Qwen3-30B-A3B's
#: 768-wide experts the FP8 grouped wgrad GEMM is no faster than bf16's (1.95 vs 1.96 ms) and its operands' casts
#: cost 1.8 ms (layer 1.18x bf16 with a bf16 wgrad, 1.03x with FP8); at DeepSeek-V3's 2048 and Mixtral's 14336 the
#: FP8 wgrad is 1-5% faster.
WGRAD_BF16_BELOW_WIDTH = 1024
#: How the fused kernel runs its GEMMs (``GroupedGemmConfig.gemm``; ``auto``: :func:`resolve_grouped_gemm`).
GROUPED_GEMMS = ("auto", "grouped", "loop")
#: ``auto`` runs the loop of dense GEMMs when the smallest per-expert GEMM of the layer (``2 * rows per expert *
#: hidden * width``, the down projection's) has at least this many GFLOP. Measured on the H100
#: (``benchmarks/grouped_gemm_loop.py`` and ``benchmarks/moe_layer.py``, docs/benchmarks.md section 4, 2026-11-26):
#: the host launches a dense ``torch._scaled_mm`` every ~20 us, so below ~25 GFLOP (20 us of GEMM at 1250 TFLOP/s)
#: the loop is host-bound (Qwen3-30B-A3B at 1024 rows per expert: 3.2 GFLOP, the six GEMMs 0.31x the grouped
#: kernel; DeepSeek-V3 with 128 experts of 1024 rows, 30 GFLOP: whole layer 0.97x); at 50 GFLOP (Qwen3-30B-A3B under
#: EP 16) the layer gained nothing (1.112x vs 1.107x BF16, and 0.92x vs 1.12x in the accumulation variant); from 120
#: GFLOP (Mixtral-8x7B, DeepSeek-V3 under EP 32: 480) it won every time (layer 1.31x vs 1.28x, 1.41x vs 1.35x).
LOOP_MIN_EXPERT_GFLOP = 100.0
ALIGN = 16  # rows per group alignment the FP8 grouped GEMM needs (wgrad groups along K)


@dataclass(frozen=True)
class GroupedGemmConfig:
    """How FP8 grouped GEMMs run.

    Attributes:
        kernel: the grouped-GEMM kernel, one of :data:`GROUPED_KERNELS`; ``auto`` = ``fused`` on a Hopper
            GPU, ``emulated`` on the CPU (see :func:`resolve_grouped_kernel`); always ``blockwise_loop`` for the
            blockwise recipe.
        recipe: ``rowwise`` (per-row / per-expert-channel scales; the run's tensorwise, rowwise and delayed
            recipes) or ``blockwise`` (``fp8.recipe = "blockwise"``: 1x128 / 128x128 blocks).
        compile_quantize: ``torch.compile`` the quantization functions on CUDA (fuses amax, scale and
            cast into one or two kernels per operand).
        emulate: allow the emulation on a CUDA GPU without an FP8 grouped kernel (``fp8.emulate``).
        cache_weights: the ``fused`` and ``blockwise_loop`` kernels quantize each expert weight once per weight
            version and optimizer step and reuse it across gradient-accumulation micro-batches
            (:mod:`fp8kit.fp8.weight_cache`). Off by
            default: it only pays with ``train.grad_accum > 1`` and it keeps both FP8 copies of every layer's
            experts alive until the next step (2 bytes per expert weight element; under FSDP2 of the unsharded
            weights, which would undo the sharding). ``fp8kit train`` turns it on for ``grad_accum > 1`` without
            FSDP2 (``PrepareOptions.cache_weights``).
        keep_weight_copies: ``blockwise_loop`` keeps each expert's FP8 ``w^T`` from forward to backward; False
            (``prepare_model`` under FSDP2) quantizes it again in the backward instead of holding FP8 copies of
            the unsharded experts.
        wgrad: precision of the weight-gradient GEMMs on the ``fused`` kernel: ``fp8`` (all three GEMMs of each
            weight in FP8), ``bf16`` (fprop and dgrad in FP8, wgrad a bf16 ``torch._grouped_mm`` without the
            per-(expert, column) casts of its operands; torchao's ``rowwise_with_gw_hp``) or ``auto`` (bf16 for
            experts narrower than :data:`WGRAD_BF16_BELOW_WIDTH`, else fp8; :func:`resolve_wgrad`). Other kernels
            run every GEMM in FP8 and refuse ``bf16``.
        gemm: how the ``fused`` kernel runs its GEMMs: ``grouped`` (``torch._scaled_grouped_mm``), ``loop`` (one dense
            rowwise ``torch._scaled_mm`` per expert, ``moe/rowwise_loop.py``) or ``auto`` (:func:`resolve_grouped_gemm`:
            the loop for large experts). Other kernels ignore it.
        blockwise_wgrad_x: ``blockwise_loop`` only: the blocks of each expert's wgrad copy of its input, ``"128x1"``
            or ``"128x128"`` (``fp8.blockwise_wgrad_x``; :mod:`fp8kit.fp8.blockwise`).
        wgrad_input: the ``fused`` kernel with a bf16 wgrad: ``saved`` (the dispatch writes the tokens' bf16 rows in
            expert order beside their FP8 copy and keeps them for ``gate_up_proj``'s wgrad: ``(P, H)`` bf16 more per
            layer from forward to backward), ``gathered`` (gathered again in the backward) or ``auto``
            (:func:`resolve_wgrad_input`: ``saved`` under activation checkpointing, which holds one layer's saved
            tensors at a time).
    """

    kernel: str = "auto"
    compile_quantize: bool = True
    emulate: bool = False
    recipe: str = "rowwise"
    cache_weights: bool = False
    keep_weight_copies: bool = True
    wgrad: str = "auto"
    wgrad_input: str = "auto"
    gemm: str = "auto"
    blockwise_wgrad_x: str = "128x1"

    @classmethod
    def for_fp8_recipe(cls, recipe: str, emulate: bool = False, kernel: str = "auto",
                       wgrad: str = "auto", gemm: str = "auto", wgrad_x: str = "128x1",
                       wgrad_input: str = "auto") -> GroupedGemmConfig:
        """The experts' config for a run's ``fp8.recipe``, ``fp8.grouped_kernel`` and ``fp8.grouped_wgrad``:
        ``blockwise`` -> blockwise experts (``blockwise_loop``, whatever ``kernel`` says; ``wgrad`` ``auto`` or
        ``fp8``), every other recipe -> rowwise grouped GEMMs (Hopper's only grouped FP8 kernel has rowwise
        scales) on ``kernel``; ``wgrad_x``: ``fp8.blockwise_wgrad_x`` (blockwise experts); ``wgrad_input``:
        ``fp8.grouped_wgrad_input`` (the fused kernel)."""
        if recipe == "blockwise":
            return cls(emulate=emulate, recipe="blockwise", wgrad=wgrad, gemm=gemm, blockwise_wgrad_x=wgrad_x)
        return cls(kernel=kernel, emulate=emulate, recipe="rowwise", wgrad=wgrad, gemm=gemm, wgrad_input=wgrad_input)


def resolve_wgrad(wgrad: str, expert_width: int) -> str:
    """``fp8`` or ``bf16``: the precision of the fused experts' wgrad GEMMs for ``GroupedGemmConfig.wgrad`` and
    the experts' intermediate width (``down_proj``'s K); ``auto`` -> ``bf16`` below :data:`WGRAD_BF16_BELOW_WIDTH`.

    Raises:
        ValueError: a precision not in :data:`WGRAD_PRECISIONS`.
    """
    if wgrad not in WGRAD_PRECISIONS:
        raise ValueError(f"FP8 MoE experts: wgrad = {wgrad!r}; choose one of {', '.join(WGRAD_PRECISIONS)}")
    if wgrad == "auto":
        return "bf16" if expert_width < WGRAD_BF16_BELOW_WIDTH else "fp8"
    return wgrad


def resolve_wgrad_input(wgrad_input: str, activation_checkpointing: bool) -> str:
    """``saved`` or ``gathered`` for ``GroupedGemmConfig.wgrad_input``: ``auto`` -> ``saved`` under activation
    checkpointing (each block's saved tensors live only through its own recompute and backward, so the rows cost one
    layer's ``(P, H)`` bf16), else ``gathered`` (saved, they would add ``(P, H)`` bf16 per MoE layer to the peak:
    0.5 GiB per layer at Qwen3-30B-A3B with 16K tokens, for 0.14 ms per layer on the H100; docs/benchmarks.md
    section 4).

    Raises:
        ValueError: a value not in :data:`WGRAD_INPUTS`.
    """
    if wgrad_input not in WGRAD_INPUTS:
        raise ValueError(f"FP8 MoE experts: wgrad_input = {wgrad_input!r}; choose one of {', '.join(WGRAD_INPUTS)}")
    if wgrad_input == "auto":
        return "saved" if activation_checkpointing else "gathered"
    return wgrad_input


def resolve_grouped_gemm(gemm: str, experts: int, rows: int, hidden: int, width: int, fp8_kernel: bool) -> str:
    """``grouped`` or ``loop``: how the fused experts of one layer run their GEMMs (``GroupedGemmConfig.gemm``).

    ``auto`` -> ``loop`` where the FP8 GEMMs are real (``fp8_kernel``) and the per-expert GEMM of the down projection,
    ``2 * (rows / experts) * hidden * width`` FLOP at balanced routing (the shape is known on the host, so no copy is
    needed to decide), reaches :data:`LOOP_MIN_EXPERT_GFLOP`; else ``grouped``. Elsewhere the fused path runs the
    float32 emulation, and ``auto`` keeps it (a ``loop`` asked for explicitly runs the CPU ``torch._scaled_mm`` on
    the CPU; on a GPU without the kernel ``Float8GroupedExperts`` refuses it).

    Args:
        experts: local experts; rows: the padded routed rows ``P`` of the layer's dispatch; hidden, width: ``H``,
            ``I`` of the gated expert MLP; fp8_kernel: the device runs the FP8 grouped GEMM
            (:func:`grouped_fp8_support`).

    Raises:
        ValueError: ``gemm`` not in :data:`GROUPED_GEMMS`.
    """
    if gemm not in GROUPED_GEMMS:
        raise ValueError(f"FP8 MoE experts: gemm = {gemm!r}; choose one of {', '.join(GROUPED_GEMMS)}")
    if gemm != "auto":
        return gemm
    if not fp8_kernel or experts == 0:
        return "grouped"
    gflop = 2.0 * (rows / experts) * hidden * width / 1e9
    return "loop" if gflop >= LOOP_MIN_EXPERT_GFLOP else "grouped"


def grouped_fp8_support(device: torch.device) -> tuple[bool, str]:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device`` (CUDA compute capability 9.x), and why not
    (:func:`grouped_fp8_verdict`)."""
    if device.type != "cuda":
        return False, f"torch._scaled_grouped_mm has no {device.type.upper()} kernel"
    return grouped_fp8_verdict(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
                               torch.__version__, hasattr(torch, "_scaled_grouped_mm"))


def grouped_fp8_verdict(gpu: str, capability: tuple[int, int], torch_version: str,
                        has_scaled_grouped_mm: bool) -> tuple[bool, str]:
    """:func:`grouped_fp8_support`'s decision from the facts it reads (pure: tests give it GPUs this machine
    lacks). Every refusal names the GPU, its compute capability and the torch version.

    Args:
        gpu: the GPU's name; capability: ``(major, minor)``; torch_version: ``torch.__version__``;
        has_scaled_grouped_mm: torch has ``torch._scaled_grouped_mm``.
    """
    where = f"{gpu} (capability {capability[0]}.{capability[1]}, torch {torch_version})"
    if not has_scaled_grouped_mm:
        return False, f"torch {torch_version} has no torch._scaled_grouped_mm; this is {where}"
    if capability[0] != 9:
        return False, (f"torch._scaled_grouped_mm (rowwise FP8) needs a Hopper GPU (compute capability 9.x); "
                       f"this is {where}")
    return True, f"torch._scaled_grouped_mm on Hopper: {where}"


def resolve_grouped_kernel(config: GroupedGemmConfig, device: torch.device) -> str:
    """The grouped-GEMM kernel (one of :data:`GROUPED_KERNELS` but ``auto``) that runs on ``device``.

    ``auto`` picks ``fused`` where ``torch._scaled_grouped_mm`` runs (Hopper) and ``emulated`` on the CPU
    (where FP8 runs in software anyway), except that ``wgrad = "bf16"`` always resolves to ``fused`` (its only
    kernel; on the CPU with the emulated GEMMs); the blockwise recipe always resolves to ``blockwise_loop``. On a CUDA GPU without the kernel, emulation must be asked for
    (``fp8.emulate``).

    Raises:
        ConfigError: an unknown kernel name, recipe or wgrad precision, or ``wgrad = "bf16"`` with the blockwise
            recipe or a kernel other than ``auto`` / ``fused``.
        CapabilityError: a CUDA kernel on a device that cannot run it, or an emulation on a GPU that was
            not asked for.
    """
    if config.kernel not in GROUPED_KERNELS:
        raise ConfigError(f"FP8 grouped GEMM: unknown kernel {config.kernel!r}; choose one of "
                          f"{', '.join(GROUPED_KERNELS)}")
    if config.recipe not in GROUPED_RECIPES:
        raise ConfigError(f"FP8 grouped GEMM: unknown recipe {config.recipe!r}; choose one of {', '.join(GROUPED_RECIPES)}")
    if config.wgrad not in WGRAD_PRECISIONS:
        raise ConfigError(f"FP8 grouped GEMM: unknown wgrad precision {config.wgrad!r}; choose one of "
                          f"{', '.join(WGRAD_PRECISIONS)}")
    if config.wgrad == "bf16" and (config.recipe == "blockwise" or config.kernel not in ("auto", "fused")):
        raise ConfigError(f"FP8 grouped GEMM: wgrad = {config.wgrad!r} runs only on the fused kernel of the rowwise "
                          f"experts (fp8.grouped_kernel = auto or fused, fp8.recipe not blockwise); this run has "
                          f"kernel {config.kernel!r}, recipe {config.recipe!r}")
    if config.recipe == "blockwise" or config.kernel == "blockwise_loop":
        if config.kernel not in ("auto", "blockwise_loop") or config.recipe != "blockwise":
            raise ConfigError(f"FP8 grouped GEMM: kernel {config.kernel!r} does not run recipe {config.recipe!r} "
                              f"(blockwise experts run only on the blockwise_loop kernel)")
        if device.type == "cuda" and not config.emulate:
            ok, reason = blockwise_gemm_support(device)
            if not ok:
                raise CapabilityError(f"FP8 MoE experts, blockwise recipe: {reason}; or keep the experts in BF16 "
                                      f"with fp8.exclude = [\"experts\"]")
        return "blockwise_loop"
    ok, reason = grouped_fp8_support(device)
    if config.kernel == "fused":
        if device.type == "cuda" and not ok and not config.emulate:
            raise CapabilityError(f"FP8 grouped GEMM kernel 'fused': {reason}")
        return "fused"
    if config.kernel == "auto":
        if ok or config.wgrad == "bf16":  # only the fused kernel has a bf16 wgrad (CPU: with the emulated GEMMs)
            if device.type == "cuda" and not ok and not config.emulate:
                raise CapabilityError(f"FP8 MoE experts with wgrad = {config.wgrad!r} (fused kernel): {reason}. Fix: "
                                      f"fp8.grouped_wgrad = \"auto\" (or fp8.emulate = true), or keep the experts in "
                                      f"BF16 with fp8.exclude = [\"experts\"]")
            return "fused"
        if device.type == "cpu" or config.emulate:
            return "emulated"
        raise CapabilityError(
            f"FP8 MoE experts: {reason}. Fix: fp8.emulate = true (FP8 numerics, no speed-up), or keep the "
            f"experts in BF16 with fp8.exclude = [\"experts\"]"
        )
    if config.kernel in ("scaled_grouped_mm", "torchao") and not ok:
        raise CapabilityError(f"FP8 grouped GEMM kernel {config.kernel!r}: {reason}")
    if config.kernel == "torchao" and _torchao_grouped() is None:
        raise CapabilityError("FP8 grouped GEMM kernel 'torchao': torchao.prototype.moe_training cannot be imported")
    return config.kernel


def _torchao_grouped() -> Callable | None:
    """torchao's differentiable FP8 rowwise grouped GEMM, or None when it cannot be imported."""
    try:
        from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm
    except Exception:  # noqa: BLE001 - any import failure means: not available here
        return None
    return _to_fp8_rowwise_then_scaled_grouped_mm


# torchao's Triton kernels whose autotuning key holds the token (row) count of the grouped GEMM: the
# per-group column scales of the wgrad operands (torchao 0.18 prototype/moe_training/kernels/
# jagged_float8_scales.py, key ["K", "N_GROUPS"] with K = rows). (module, kernel, key argument)
TOKEN_KEYED_KERNELS = (
    ("torchao.prototype.moe_training.kernels.jagged_float8_scales",
     "_triton_fp8_per_group_colwise_scales_dual_kernel", "K"),
)


def tune_once_for_all_row_counts() -> list[str]:
    """Make torchao's token-keyed Triton kernels (:data:`TOKEN_KEYED_KERNELS`) autotune once per process
    instead of once per row count; returns the kernels changed.

    Why: Triton's ``@autotune`` benchmarks every config (36 for this kernel) again for each new key. Under
    expert parallelism the rows a rank receives change every step, so it re-tuned at almost every step,
    which made expert-parallel steps seconds long instead of a tenth of a second. The first tuning (at
    the first step's count) is kept for all counts; ``benchmarks/ep_row_count_tuning.py`` checks that
    steps with that one tuning run as fast as steps tuned for their own row count (figures for both in
    docs/benchmarks.md, "MoE under FSDP2 and expert parallel"). The single-process path pads to a fixed
    row count and is unaffected.

    This removes the token key from the autotuner's ``keys`` (Triton ``Autotuner.keys``) of torchao's
    kernel object for the whole process. Where torchao or Triton changed shape (no such kernel, or no
    ``keys`` list holding the key), nothing is changed and a warning says so.
    """
    import importlib

    changed = []
    for module_name, kernel_name, key in TOKEN_KEYED_KERNELS:
        try:
            kernel = getattr(importlib.import_module(module_name), kernel_name)
        except (ImportError, AttributeError) as e:
            warnings.warn(f"fp8kit: {module_name}.{kernel_name} not found ({e}); expert-parallel FP8 steps may "
                          f"re-tune torchao's kernels when the received row count changes", stacklevel=2)
            continue
        keys = getattr(kernel, "keys", None)
        if not isinstance(keys, list):
            warnings.warn(f"fp8kit: {kernel_name} has no autotuning key list (Triton changed?); left as is: "
                          f"expert-parallel FP8 steps may re-tune it when the received row count changes",
                          stacklevel=2)
            continue
        if key in keys:  # (already removed by an earlier call otherwise)
            kernel.keys = [k for k in keys if k != key]
        changed.append(kernel_name)
    return changed


def emulated_scaled_grouped_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` semantics in float32 on any device (2d x 3d and 2d x 2d).

    2d x 3d: ``a`` (P, K), ``b`` (E, K, N), ``scale_a`` (P,), ``scale_b`` (E, N) -> (P, N), rows grouped by ``offs``.
    2d x 2d: ``a`` (N, P), ``b`` (P, K), ``scale_a`` (E*N,), ``scale_b`` (E*K,) -> (E, N, K), the shared P
    dim grouped by ``offs``. Rows (2d x 3d) past ``offs[-1]`` are zero.
    """
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[-1], dtype=torch.float32, device=a.device)
        for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
            if t > s:
                out[s:t] = (a[s:t].float() * scale_a[s:t, None]) @ (b[e].float() * scale_b[e][None, :])
        return out.to(out_dtype)
    n, k, num = a.shape[0], b.shape[1], len(ends)
    out = torch.zeros(num, n, k, dtype=torch.float32, device=a.device)
    for e, (s, t) in enumerate(zip(starts, ends, strict=True)):
        if t > s:
            out[e] = (a[:, s:t].float() * scale_a[e * n:(e + 1) * n, None]) @ (
                b[s:t].float() * scale_b[e * k:(e + 1) * k][None, :])
    return out.to(out_dtype)


def _cuda_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype, use_fast_accum=True)


_COMPILED: dict[str, tuple[Callable, ...]] = {}


def _quantizers(compiled: bool) -> tuple[Callable, ...]:
    """The three quantization functions, compiled on first use when asked (eager under an outer
    ``torch.compile``, which traces and fuses them itself)."""
    fns = (q.quantize_rows, q.quantize_experts, q.quantize_group_cols)
    if not compiled or torch.compiler.is_compiling():
        return fns
    if "fns" not in _COMPILED:
        # dynamic=None: static first, one dynamic recompile when a second shape comes (a model's layers
        # share shapes; benchmarks sweep them).
        _COMPILED["fns"] = tuple(torch.compile(f) for f in fns)
    return _COMPILED["fns"]


class _FP8GroupedMM(torch.autograd.Function):
    """fprop / dgrad / wgrad of ``x @ W[e]^T`` in FP8 (module docstring); saves ``x`` and ``W`` in their dtype."""

    @staticmethod
    def forward(ctx, x, w, offs, gemm, compiled, out_dtype):
        rows, experts, cols = _quantizers(compiled)
        xq, xs = rows(x)
        wq, ws = experts(w, -1)
        ctx.save_for_backward(x, w, offs)
        ctx.gemm, ctx.compiled, ctx.out_dtype = gemm, compiled, out_dtype
        return gemm(xq, wq, xs, ws, offs, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, w, offs = ctx.saved_tensors
        rows, experts, cols = _quantizers(ctx.compiled)
        g = grad_out.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq, gs = rows(g)
            wq, ws = experts(w, -2)
            dx = ctx.gemm(gq, wq, gs, ws, offs, ctx.out_dtype).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gid = q.group_ids(offs, x.shape[0])
            gtq, gts = cols(g, gid, w.shape[0], transposed=True)
            xq, xs = cols(x, gid, w.shape[0], transposed=False)
            dw = ctx.gemm(gtq, xq, gts, xs, offs, ctx.out_dtype).to(w.dtype)
        return dx, dw, None, None, None, None


def _check(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1:
        raise ValueError(f"fp8_grouped_mm: need x (P, K), w (E, N, K), offs (E,); got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(offs.shape)}")
    if x.shape[1] != w.shape[2] or offs.shape[0] != w.shape[0]:
        raise ValueError(f"fp8_grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)} and offs {tuple(offs.shape)} "
                         f"do not match (x.shape[1] == w.shape[2], len(offs) == w.shape[0])")
    if w.shape[1] % 16 or w.shape[2] % 16 or x.shape[0] % ALIGN:
        raise ValueError(f"fp8_grouped_mm: N={w.shape[1]}, K={w.shape[2]} and the padded rows P={x.shape[0]} "
                         f"must be multiples of 16")
    if offs.dtype != torch.int32:
        raise ValueError(f"fp8_grouped_mm: offs must be int32, got {offs.dtype}")


def fp8_grouped_mm(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, kernel: str, *, compile_quantize: bool = True,
    emulate: bool = False, bounds: list[tuple[int, int]] | None = None, keep_weight_copy: bool = True,
    wgrad_x: str = "128x1", cache_weight: bool = False,
) -> torch.Tensor:
    """Differentiable FP8 grouped GEMM ``out[rows of group e] = x[rows] @ w[e]^T``.

    Args:
        x: (P, K) bf16 or float32 activations, rows grouped by expert, each group starting on a multiple
            of 16 rows (see ``moe/routing.py``); P a multiple of 16.
        w: (E, N, K) expert weights (the HF v5 layout of ``gate_up_proj`` / ``down_proj``), any float
            dtype; its gradient comes back in ``w``'s dtype. On CUDA the wgrad kernel writes bf16 first, so
            FP32 master weights receive bf16-rounded expert gradients (as with torchao's path).
        offs: (E,) int32 cumulative end rows of the groups (non-decreasing; equal ends = empty expert).
        kernel: a resolved grouped-GEMM kernel (:func:`resolve_grouped_kernel`), not ``auto``.
        compile_quantize: compile the quantization functions (``scaled_grouped_mm`` only).
        emulate: ``blockwise_loop`` only: multiply in float32 on CUDA too.
        bounds: ``blockwise_loop`` only: the groups' host-side ``(start, end)`` rows, if already known.
        keep_weight_copy: ``blockwise_loop`` only: keep the FP8 weight copies for the backward
            (:attr:`GroupedGemmConfig.keep_weight_copies`).
        wgrad_x: ``blockwise_loop`` only: :attr:`GroupedGemmConfig.blockwise_wgrad_x`.
        cache_weight: ``blockwise_loop`` only: the experts' FP8 copies from the weight cache
            (:attr:`GroupedGemmConfig.cache_weights`).

    Returns:
        (P, N) in bf16 on CUDA (the kernel's output dtype), in ``x.dtype`` when emulated; rows past
        ``offs[-1]`` are not defined on CUDA.

    Raises:
        ValueError: shapes, dtypes or alignment that the kernel cannot take (message names them).
    """
    _check(x, w, offs)
    if kernel == "torchao":
        return _torchao_grouped()(
            x.to(torch.bfloat16), w.to(torch.bfloat16).transpose(-2, -1), offs, torch.bfloat16,
            pad_token_groups_for_grouped_mm=False,
        )
    if kernel == "scaled_grouped_mm":
        return _FP8GroupedMM.apply(x, w, offs, _cuda_scaled_grouped_mm, compile_quantize, torch.bfloat16)
    if kernel == "emulated":
        return _FP8GroupedMM.apply(x, w, offs, emulated_scaled_grouped_mm, False, x.dtype)
    if kernel == "fused":  # a single weight of a fused-kernel layer: the per-weight rowwise path
        return fp8_grouped_mm(x, w, offs, per_weight_kernel(x.device), compile_quantize=compile_quantize)
    if kernel == "blockwise_loop":
        return blockwise_loop_mm(x, w, offs, emulate=emulate, bounds=bounds, keep_weight_copy=keep_weight_copy,
                                 wgrad_x=wgrad_x, cache_weight=cache_weight)
    raise ValueError(f"fp8_grouped_mm: kernel must be resolved first (scaled_grouped_mm, torchao, emulated, blockwise_loop), "
                     f"got {kernel!r}")


def per_weight_kernel(device: torch.device) -> str:
    """The per-weight rowwise kernel a ``fused`` layer falls back to: ``torchao`` on a Hopper GPU with torchao's
    MoE kernels, else ``scaled_grouped_mm`` there, ``emulated`` elsewhere."""
    if grouped_fp8_support(device)[0]:
        return "torchao" if _torchao_grouped() is not None else "scaled_grouped_mm"
    return "emulated"


def scaled_grouped_gemm(device: torch.device) -> tuple[Callable, torch.dtype | None]:
    """``(gemm, out_dtype)`` with ``torch._scaled_grouped_mm`` semantics for the fused path on ``device``: the
    CUTLASS kernel with bf16 output on a Hopper GPU, else the float32 emulation (``out_dtype`` None: the input's
    dtype)."""
    if grouped_fp8_support(device)[0]:
        return _cuda_scaled_grouped_mm, torch.bfloat16
    return emulated_scaled_grouped_mm, None


def bf16_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The BF16 grouped GEMM ``x @ w[e]^T`` (``torch._grouped_mm``, differentiable), for experts left in BF16.

    Shapes as :func:`fp8_grouped_mm`; computes in ``w``'s dtype, except float32 weights on CUDA (FP32
    master weights under autocast), which compute in bf16 as autocast would (the CUDA grouped GEMM is a
    bf16 kernel); the gradient still reaches ``w`` in its own dtype.
    """
    dtype = torch.bfloat16 if (w.is_cuda and w.dtype == torch.float32) else w.dtype
    return torch._grouped_mm(x.to(dtype), w.to(dtype).transpose(-2, -1), offs=offs)
