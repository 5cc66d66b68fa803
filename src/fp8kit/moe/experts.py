"""FP8 grouped experts for HF transformers v5 MoE models, swapped in and out per module.

transformers v5 stores a MoE layer's experts as one module holding 3-D weights (``Qwen3MoeExperts``,
``DeepseekV3Experts``, ``MixtralExperts``...): ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I),
called as ``experts(hidden (T, H), top_k_index (T, topk), top_k_weights (T, topk)) -> (T, H)``.
:class:`Float8GroupedExperts` replaces such a module with one that holds the *same* ``Parameter``
objects (so optimizer state and ``state_dict`` keys are unchanged, and the BF16 weights stay the
master weights) and computes each weight's GEMMs in FP8 (``moe/grouped_mm.py``) or BF16, as decided
per site (``column_grouped`` = ``gate_up_proj``, ``row_grouped`` = ``down_proj``). The router is not
touched; shared experts are ordinary linears and follow the dense rules.

Supported layout: gated experts (``has_gate``) without biases, weights stored (E, out, in)
(``is_transposed = False``), the model's own ``_apply_gate`` (concatenated or interleaved gate/up).
Anything else raises rather than computing something different.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
from torch import nn

from fp8kit.base.errors import CapabilityError, Fp8kitError
from fp8kit.moe import routing
from fp8kit.moe.expert_parallel import ep_experts_forward, local_weight
from fp8kit.moe.fused_experts import expert_weight_copies, fused_rowwise_experts
from fp8kit.moe.grouped_loop import group_bounds
from fp8kit.moe.grouped_mm import (
    GroupedGemmConfig,
    bf16_grouped_mm,
    fp8_grouped_mm,
    grouped_fp8_support,
    resolve_grouped_gemm,
    resolve_grouped_kernel,
    resolve_wgrad_input,
    scaled_grouped_gemm,
    tune_once_for_all_row_counts,
)
from fp8kit.moe.rowwise_loop import loop_scaled_grouped_mm

WEIGHTS = ("gate_up_proj", "down_proj")


def layout_problem(module: nn.Module) -> str | None:
    """Why ``module`` is not an HF v5 experts module of the supported layout (module docstring), or None.

    The layout flags (``has_gate``, ``has_bias``, ``is_transposed``) that transformers' experts decorator
    sets must be present and right, and the weights must be (E, 2I, H) and (E, H, I).
    """
    weights = [getattr(module, name, None) for name in WEIGHTS]
    if not all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in weights):
        return "no 3-D gate_up_proj and down_proj (not the transformers v5 fused experts layout)"
    for attr, want in (("has_gate", True), ("has_bias", False), ("is_transposed", False)):
        got = getattr(module, attr, None)
        if got is None:
            return f"no {attr} attribute (not a transformers v5 experts module)"
        if got != want:
            return f"{attr} = {got} is not supported by FP8 grouped experts"
    gate_up, down = weights
    e, two_i, h = gate_up.shape
    if down.shape != (e, h, two_i // 2) or two_i % 2:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not (E, 2I, H) and (E, H, I)"
    if not (hasattr(module, "_apply_gate") or hasattr(module, "act_fn")):
        return "no _apply_gate / act_fn"
    return None


def fused_gate_problem(module: nn.Module) -> str | None:
    """Why the gate of HF experts ``module`` is not the ``silu(gate) * up`` of concatenated halves that the fused
    expert MLP computes (``moe/fused_experts.py``), or None. Decided once, when the module is swapped in (the
    check reads bound-method attributes that ``torch.compile`` does not trace faithfully)."""
    gate_fn = getattr(getattr(module, "_apply_gate", None), "__func__", None)
    if hasattr(module, "_apply_gate") and getattr(gate_fn, "__name__", "") != "_default_apply_gate":
        return f"{type(module).__name__} has its own _apply_gate (only silu(gate) * up of concatenated halves is fused)"
    if not getattr(module, "is_concatenated", True):
        return "gate and up are interleaved (is_concatenated = False)"
    act = getattr(module, "act_fn", None)
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        return f"activation {type(act).__name__} is not SiLU"
    return None


def check_supported(module: nn.Module, fqn: str) -> None:
    """Raise unless ``module`` is an HF v5 experts module of the supported layout (:func:`layout_problem`).

    Raises:
        Fp8kitError: naming the module, what is not supported, and the fix (``fp8.exclude``).
    """
    problem = layout_problem(module)
    if problem:
        raise Fp8kitError(f"{fqn} ({type(module).__name__}): {problem}; keep it in BF16 with "
                          f"fp8.exclude = [\"{fqn}\"]")


class Float8GroupedExperts(nn.Module):
    """An HF v5 experts module computed with grouped GEMMs, each weight in FP8 or BF16.

    Args:
        source: the HF experts module. Its two weights move to this module (``source`` keeps no
            reference to them, so FSDP2 can free the unsharded originals); ``source`` is kept,
            unregistered, for its ``_apply_gate`` and to be restored by :func:`swap_out`.
        fp8_weights: which of ``gate_up_proj`` / ``down_proj`` run in FP8.
        config: how FP8 grouped GEMMs run; the grouped-GEMM kernel is resolved on the first forward on each
            device (``moe/grouped_mm.resolve_grouped_kernel``), so a model converted on ``meta`` or on the CPU and then
            moved to a GPU uses the GPU kernel.

    Forward: ``(hidden (T, H), top_k_index (T, topk) int, top_k_weights (T, topk)) -> (T, H)`` in
    ``hidden``'s dtype, like the module it replaces.

    Raises (forward):
        CapabilityError: FP8 weights on a device without an FP8 grouped GEMM (``resolve_grouped_kernel``).
    """

    def __init__(self, source: nn.Module, fp8_weights: frozenset[str], config: GroupedGemmConfig | None = None):
        super().__init__()
        self.gate_up_proj = source.gate_up_proj
        self.down_proj = source.down_proj
        for name in WEIGHTS:
            del source._parameters[name]
        self.num_experts = self.gate_up_proj.shape[0]
        self.fp8_weights = frozenset(fp8_weights)
        self.config = config or GroupedGemmConfig()
        self._kernels: dict[str, str] = {}  # device -> resolved grouped-GEMM kernel
        self._fp8_kernel: dict[str, tuple[bool, str]] = {}  # device -> (runs the FP8 grouped GEMM, why not)
        self.ep_group = None  # set by moe/expert_parallel.shard_experts
        self.gate_problem = fused_gate_problem(source)  # None: the fused expert MLP computes this gate
        self.__dict__["source"] = source  # not a submodule: its weights are ours
        self.reset_scale_hints()

    #: Buffers that hold no model state (``models.init.initialize_shards`` zeroes them under meta init).
    scratch_buffers = tuple(f"_hint_{name}_{part}" for name in WEIGHTS for part in ("rows", "cols"))

    def reset_scale_hints(self) -> None:
        """(Re)allocate the fused rowwise MLP's scale hints for the local expert weights' shapes: four int32 buffers
        (not in the ``state_dict``; int32 so that ``module.to(dtype)`` leaves them alone) holding the float32 bits of
        the last ``fprop_inv`` / ``dgrad_inv`` of each weight (``rowwise_quant.quantize_experts_dual(hints=)``: the
        next step's casts read the weights once where the scales did not move; any value gives the same bits).
        Zeros at first: the first cast recasts every row and column. Called by ``expert_parallel.shard_experts``
        after the weights become this rank's shards."""
        for name, shape, device in zip(self.scratch_buffers, self._hint_shapes(), self._hint_devices(), strict=True):
            self.register_buffer(name, torch.zeros(shape, dtype=torch.int32, device=device), persistent=False)

    def _hint_shapes(self, w_up: torch.Tensor | None = None, w_down: torch.Tensor | None = None) -> list[torch.Size]:
        """The hint buffers' shapes, in ``scratch_buffers`` order, for the local weights (rows (E, N), cols (E, K))."""
        up = local_weight(self.gate_up_proj) if w_up is None else w_up
        down = local_weight(self.down_proj) if w_down is None else w_down
        return [up.shape[:2], up.shape[::2], down.shape[:2], down.shape[::2]]

    def _hint_devices(self) -> list[torch.device]:
        return [self.gate_up_proj.device] * 2 + [self.down_proj.device] * 2

    def scale_hints(self, w_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """``(up_rows, up_cols, down_rows, down_cols)`` int32 hint buffers (:meth:`reset_scale_hints`) for the local
        weights ``w_up`` (E, 2I, H) and ``w_down`` (E, H, I), or None (with a warning, once) where their shapes or
        device do not match: the weights were resharded or moved without :meth:`reset_scale_hints`, and each step
        then reads them twice (the same bits)."""
        hints = tuple(getattr(self, name) for name in self.scratch_buffers)
        want = self._hint_shapes(w_up, w_down)
        if any(h.shape != s or h.device != w_up.device for h, s in zip(hints, want, strict=True)):
            self._warn_hints(tuple(w_up.shape), [tuple(h.shape) for h in hints])
            return None
        return hints

    @torch.compiler.disable
    def _warn_hints(self, up_shape: tuple[int, ...], hint_shapes: list[tuple[int, ...]]) -> None:
        if not self.__dict__.get("_hints_warned"):
            self.__dict__["_hints_warned"] = True
            warnings.warn(f"FP8 MoE experts: the scale hints {hint_shapes} do not match the local weights (gate_up_proj "
                          f"{up_shape}); call reset_scale_hints() after resharding. The weights are cast without "
                          f"hints (two reads per step, the same bits).", stacklevel=3)

    def extra_repr(self) -> str:
        e, n, k = self.gate_up_proj.shape
        e = self.num_experts
        return (f"experts={e}, hidden={k}, intermediate={n // 2}, fp8={sorted(self.fp8_weights)}, "
                f"kernel={self.config.kernel} {self._kernels or ''}".rstrip())

    def grouped_kernel(self, device: torch.device) -> str:
        """The FP8 grouped-GEMM kernel on ``device`` (``torchao``, ``scaled_grouped_mm`` or ``emulated``;
        resolved once per device by ``grouped_mm.resolve_grouped_kernel``).

        Under expert parallelism with torchao's kernels, their token-keyed autotuning is made once per process
        (``grouped_mm.tune_once_for_all_row_counts``): the received row count changes every step.
        """
        key = str(device)
        if key not in self._kernels:
            self._kernels[key] = resolve_grouped_kernel(self.config, device)
            if self._kernels[key] in ("torchao", "fused") and self.ep_group is not None:
                tune_once_for_all_row_counts()
        return self._kernels[key]

    def _linear(self, name: str, x: torch.Tensor, offs: torch.Tensor,
                bounds: list[tuple[int, int]] | None = None) -> torch.Tensor:
        w = local_weight(getattr(self, name))
        if name in self.fp8_weights:
            if self.config.wgrad == "bf16" and not self.__dict__.get("_wgrad_warned"):
                self._warn_wgrad_in_fp8(x.device)
            return fp8_grouped_mm(x, w, offs, self.grouped_kernel(x.device), compile_quantize=self.config.compile_quantize,
                                  emulate=self.config.emulate, bounds=bounds,
                                  keep_weight_copy=self.config.keep_weight_copies,
                                  wgrad_x=self.config.blockwise_wgrad_x, cache_weight=self.config.cache_weights)
        return bf16_grouped_mm(x, w, offs)

    def _host_bounds(self, offs: torch.Tensor, device: torch.device) -> list[tuple[int, int]] | None:
        """The groups' rows on the host, copied once per layer when an FP8 weight runs the per-expert loop."""
        if self.fp8_weights and self.grouped_kernel(device) == "blockwise_loop":
            return group_bounds(offs)
        return None

    @torch.compiler.disable
    def _warn_wgrad_in_fp8(self, device: torch.device) -> None:
        """Say once, loudly, that this layer computes its weight gradients in FP8 although ``wgrad`` asks for bf16
        (only the fused whole-MLP path has a bf16 wgrad)."""
        self.__dict__["_wgrad_warned"] = True
        why = self.fused_problem(device) or "the per-weight path"
        warnings.warn(f"FP8 MoE experts: wgrad = {self.config.wgrad!r} asked for, but this layer's weight gradients "
                      f"run in FP8: {why}", stacklevel=3)

    def fused_problem(self, device: torch.device) -> str | None:
        """Why this layer cannot run the ``fused`` kernel's whole-MLP path (``moe/fused_experts.py``), or None."""
        if self.grouped_kernel(device) != "fused":
            return "the grouped kernel is not 'fused'"
        if self.fp8_weights != frozenset(WEIGHTS):
            return f"only {sorted(self.fp8_weights)} in FP8 (the fused path needs both weights)"
        return self.gate_problem

    def fp8_weight_copies(self, device: torch.device) -> tuple[tuple[torch.Tensor, ...], ...] | None:
        """This step's FP8 copies of both local weights as the fused MLP makes them
        (``fused_experts.expert_weight_copies``: cached, or cast with the scale hints), to pass to
        :meth:`local_experts` as ``weights``; None where this layer does not run fused or has nothing to make ahead.
        Expert parallelism calls it while its FP8 dispatch all-to-all is in flight, so the casts run while the tokens
        travel."""
        if not self.runs_fused(device):
            return None
        w_up, w_down = local_weight(self.gate_up_proj), local_weight(self.down_proj)
        hints = None if self.config.cache_weights else self.scale_hints(w_up, w_down)
        return expert_weight_copies(w_up, w_down, self.config.cache_weights, hints)

    def caches_weights(self, device: torch.device) -> bool:
        """Whether this layer casts its FP8 weights once per optimizer step on ``device`` and reuses them across
        micro-batches (``GroupedGemmConfig.cache_weights``, set by ``prepare_model`` with ``fp8.weight_cache`` and
        gradient accumulation): only the fused rowwise MLP (:meth:`runs_fused`) and the ``blockwise_loop`` kernel
        keep a cache; the other kernels (``torchao``, ``scaled_grouped_mm``, ``emulated``) cast at every call."""
        if not (self.config.cache_weights and self.fp8_weights):
            return False
        return self.runs_fused(device) or self.grouped_kernel(device) == "blockwise_loop"

    def runs_fused(self, device: torch.device) -> bool:
        """Whether this layer's experts run the fused rowwise FP8 MLP on ``device`` (:meth:`fused_problem` is None)."""
        return bool(self.fp8_weights) and self.fused_problem(device) is None

    def local_experts(self, x: torch.Tensor, d: routing.Dispatch, received: torch.Tensor | None = None,
                      top_k_weights: torch.Tensor | None = None,
                      weights: tuple[tuple[torch.Tensor, ...], ...] | None = None) -> torch.Tensor:
        """The MLP of this rank's experts on the token rows ``x`` (T, H) dispatched by ``d``: ``(P, H)`` rows in
        expert order (rows past ``d.offs[-1]`` undefined). The fused rowwise FP8 MLP where :meth:`runs_fused`, else
        the per-weight grouped GEMMs (each weight FP8 or BF16). ``received``: the rowwise FP8 payload of
        expert-parallel dispatch, ``x`` then its carrier (``moe/fp8_dispatch.rowwise_dispatch``; fused only).
        ``top_k_weights`` (T, topk): return ``routing.combine`` of those rows, (T, H) in ``x``'s dtype; the fused
        MLP takes the combine in, and its backward reads the combine's gradient through the pairs
        (``fused_rowwise_experts``), where ``x`` is in the GEMMs' output dtype (bf16 tokens on CUDA; float32 tokens
        under autocast combine outside, see ``fused_rowwise_experts``). ``weights``: the fused MLP's FP8 weight copies
        from :meth:`fp8_weight_copies` of this step (None: made here)."""
        if received is not None and top_k_weights is not None:
            raise ValueError("Float8GroupedExperts.local_experts: received (expert parallelism) and top_k_weights "
                             "cannot be given together: expert parallelism combines after its return all-to-all")
        if self.runs_fused(x.device):
            w_up, w_down = local_weight(self.gate_up_proj), local_weight(self.down_proj)
            gemm, out_dtype = scaled_grouped_gemm(x.device)
            run = fused_rowwise_experts
            if self.fused_gemm(x.device, w_down.shape, d.gather_idx.shape[0]) == "loop":
                gemm, run = None, _fused_loop_experts
            out_dtype = out_dtype or x.dtype
            inside = top_k_weights if x.dtype == out_dtype else None
            y = run(x, w_up, w_down, d.gather_idx, d.pair_rows, d.offs, gemm, out_dtype, self.config.cache_weights,
                    self.config.wgrad, received=received, top_k_weights=inside,
                    scale_hints=None if self.config.cache_weights else self.scale_hints(w_up, w_down),
                    keep_rows=resolve_wgrad_input(self.config.wgrad_input, False) == "saved", weights=weights)
            return y if top_k_weights is None or inside is not None else routing.combine(y, d, top_k_weights, x.dtype)
        if received is not None:
            raise ValueError("Float8GroupedExperts.local_experts: a rowwise FP8 payload needs the fused FP8 experts "
                             f"({self.fused_problem(x.device)})")
        h = routing.gather(x, d)
        bounds = self._host_bounds(d.offs, x.device)
        h = self._gate(self._linear("gate_up_proj", h, d.offs, bounds))
        y = self._linear("down_proj", h, d.offs, bounds)
        return y if top_k_weights is None else routing.combine(y, d, top_k_weights, x.dtype)

    def fused_gemm(self, device: torch.device, down_shape: torch.Size, rows: int) -> str:
        """``grouped`` or ``loop``: how the fused MLP runs its GEMMs for ``rows`` padded routed rows over local
        experts of ``down_proj`` shape ``(E, H, I)`` (``grouped_mm.resolve_grouped_gemm``). The first choice of each
        kind is printed once per process and expert shape."""
        e, h, i = down_shape
        kernels = self._fp8_kernel  # an attribute set in __init__: Dynamo traces it (a __dict__.setdefault broke the graph)
        if str(device) not in kernels:
            kernels[str(device)] = grouped_fp8_support(device)
        real, why = kernels[str(device)]
        choice = resolve_grouped_gemm(self.config.gemm, e, rows, h, i, real)
        if choice == "loop" and device.type == "cuda" and not real:
            raise CapabilityError(f"fp8.grouped_gemm = loop: the dense rowwise FP8 GEMMs need the GPU the grouped "
                                  f"kernel needs ({why}); the fused experts run emulated here, use grouped_gemm = "
                                  f"grouped or auto")
        if (choice, self.config.gemm, e, h, i) not in _GEMM_SAID:
            _say_gemm(choice, self.config.gemm, e, rows, h, i)
        return choice

    def _gate(self, h: torch.Tensor) -> torch.Tensor:
        src = self.source
        if hasattr(src, "_apply_gate"):
            return src._apply_gate(h)
        gate, up = h.chunk(2, dim=-1)
        return src.act_fn(gate) * up

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if getattr(self, "ep_group", None) is not None:  # expert parallel: moe/expert_parallel.py
            return ep_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        d = routing.dispatch(top_k_index, self.num_experts)
        return self.local_experts(hidden_states, d, top_k_weights=top_k_weights)


@torch.compiler.disable
def _fused_loop_experts(x, w_up, w_down, gather_idx, pair_rows, offs, _gemm, out_dtype, cache_weights, wgrad,
                        received=None, top_k_weights=None, scale_hints=None, keep_rows=False, weights=None):
    """``fused_rowwise_experts`` with the loop of dense GEMMs (``moe/rowwise_loop.py``), run eagerly inside a compiled
    block: the group bounds are read on the host here (one copy per layer, reused by the backward), and a traced
    list of bounds would make Dynamo recompile for every routing."""
    gemm = partial(loop_scaled_grouped_mm, bounds=group_bounds(offs))
    return fused_rowwise_experts(x, w_up, w_down, gather_idx, pair_rows, offs, gemm, out_dtype, cache_weights, wgrad,
                                 received=received, top_k_weights=top_k_weights, scale_hints=scale_hints,
                                 keep_rows=keep_rows, weights=weights)


_GEMM_SAID: set[tuple] = set()  # (choice, asked, experts, hidden, width) already printed


@torch.compiler.disable
def _say_gemm(choice: str, asked: str, e: int, rows: int, h: int, i: int) -> None:
    _GEMM_SAID.add((choice, asked, e, h, i))
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return  # one line per run, not per rank
    gflop = 2.0 * (rows / max(e, 1)) * h * i / 1e9
    how = ("a loop of dense rowwise GEMMs, one per expert (group bounds copied to the host per layer)"
           if choice == "loop" else "grouped GEMMs (torch._scaled_grouped_mm)")
    print(f"FP8 MoE experts: {e} local experts x {rows} routed rows (down projection {gflop:.1f} GFLOP per expert at "
          f"balanced routing), "
          f"fp8.grouped_gemm = {asked}: {how}", flush=True)


def swap_in(model: nn.Module, fqn: str, fp8_weights: frozenset[str], config: GroupedGemmConfig | None = None) -> nn.Module:
    """Replace the experts module at ``fqn`` by a :class:`Float8GroupedExperts` (or update the one there).

    Raises:
        Fp8kitError: the module's layout is not supported (:func:`check_supported`).
    """
    module = model.get_submodule(fqn)
    if isinstance(module, Float8GroupedExperts):
        module.fp8_weights = frozenset(fp8_weights)
        if config is not None and config != module.config:
            module.config, module._kernels = config, {}
            module.__dict__.pop("_wgrad_warned", None)  # the new config's wgrad is checked again
        return module
    check_supported(module, fqn)
    new = Float8GroupedExperts(module, fp8_weights, config)
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return new


def swap_out(model: nn.Module) -> int:
    """Put every original HF experts module back, holding the current weights; returns how many."""
    count = 0
    for fqn, module in list(model.named_modules()):
        if isinstance(module, Float8GroupedExperts):
            src = module.source
            src.gate_up_proj, src.down_proj = module.gate_up_proj, module.down_proj
            parent_name, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, src)
            count += 1
    return count
