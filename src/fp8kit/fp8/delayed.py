"""Delayed scaling: the FP8 linear of Transformer Engine's ``DelayedScaling`` recipe (HYBRID format).

Numerics (Transformer Engine ``recipe.DelayedScaling``; Micikevicius et al. 2022, arXiv:2209.05433):

- Formats: inputs ``x`` and weights ``w`` in E4M3 (max 448), output gradients ``dy`` in E5M2 (max 57344).
- One scale per tensor and operand, taken from an **amax history** of earlier steps instead of the tensor
  being cast: for each operand (input, weight, output gradient) a module keeps the amax of its last
  ``amax_history_len`` training steps, and the scale of step t is::

      amax_t  = max(history of steps < t)          (amax_compute_algo = "max")
              | amax of step t-1                   (amax_compute_algo = "most_recent")
      scale_t = fp8_max / max(amax_t, eps) / 2 ** margin        (fp8.scaling.scale_from_amax, TE's margin)

  So the cast is one pass over the tensor (multiply by a known scale, saturate, convert) that also
  records this step's amax for the history: no amax pass before the cast. Under ``torch.compile`` the
  cast and the amax are plain tensor ops in the block's graph, so inductor fuses them into the kernel
  that produces the tensor (RMSNorm, SwiGLU, the residual add). Until a module's first recorded step is in its
  history (the first step on the CPU, the first two on CUDA: ``fp8.delayed_state`` says why), it takes its scales
  from its own tensors (dynamic), as a warm start.
  ``fp8.delayed_fused_cast`` can route casts through fp8kit's Triton cast-transpose op instead
  (``fp8kit::cast_transpose``: one read, both FP8 layouts, the amax; same bits). With every cast through it
  (``"all"``) a lone linear and the Llama-3-8B step run faster (session 50, H200: 1.442x BF16 against 1.403x),
  but the backward copies of the weights and inputs it writes in the forward are held until the backward
  (+2.5 GiB there), where ``torch.compile``'s own casts are made again in the backward; so the default leaves
  every cast to ``torch.compile``.
- The three GEMMs of ``y = x @ w.T`` through ``torch._scaled_mm`` (tensorwise): fprop ``x8 @ w8.T``
  (E4M3 x E4M3), dgrad ``dy8 @ w8`` (E5M2 x E4M3), wgrad ``dy8.T @ x8`` (E5M2 x E4M3); by default fprop and
  wgrad with the tensor cores' fast accumulation, dgrad with the FP32-promoting split accumulator (Transformer
  Engine's ``DelayedScaling`` promotes wgrad too; fp8kit measured the difference, session 42: ``Recipe.fast_accum``
  in :mod:`fp8kit.fp8.recipes`; ``fp8.fast_accum`` overrides it through ``DelayedScaling.fast_accum``;
  :func:`scaled_mm`). The FP8 copies
  ``x8`` and ``w8`` made in forward serve the backward, saved in the column-major layout its GEMMs take;
  under ``torch.compile`` the input is saved in bf16 instead and cast again in the backward with the same
  scale, as torchao's ``Float8Linear`` does, so a compiled model saves for the backward exactly what a bf16
  one does (the FP8 copies would come on top of the bf16 tensors the RMSNorm / SwiGLU backward keeps anyway).
  Where Inductor recomputes that input itself (an RMSNorm output) it may keep it in float32, without the bf16
  rounding, so the wgrad copy can differ from the fprop copy in the last E4M3 place.
- Saturation: values above the delayed scale's range clamp to the format's maximum. On a sudden jump of
  an operand's range (e.g. a 100x larger activation), that step saturates; the jump enters the history
  and the next step's scale covers it. This is the trade-off of delayed scaling in TE too: one pass per
  cast, at the price of stale scales for one step after a jump (``fp8.stats_every`` shows saturation).

State (:mod:`fp8kit.fp8.delayed_state`): the histories live in a :class:`DelayedScalingState`, one per run,
keyed by the module's plain FQN, outside the modules: a precision switch to BF16 and back keeps them, and
checkpoints save them with the training state, so ``--resume`` continues bit for bit. The history
advances once per training step of each module (forward in ``module.training`` with grad enabled, then
its backward) with no call the user must make: the forward reads its scales and writes its input and weight
amax into the module's record, the backward writes the output gradient's, and before the next forward of the
model (``DelayedScalingState.attach``, which ``apply_fp8`` calls) one roll takes every complete record of the step
into the histories and computes every scale (``fp8.delayed_state`` says why there: a fixed number of kernels per
step for the whole model, and every recomputation of the forward, as activation checkpointing does, on this
step's scales). The compiled graphs have no graph break and no host sync. Evaluation forwards use the current
scales and record nothing; so does a training forward without a backward (e.g. neither the input nor the weight
requires grad: its scales then stay dynamic). Under data parallelism each rank records its own amax;
with ``DelayedScalingState.group`` set (``prepare_model`` sets the data-parallel group under FSDP2, and the
group of all data- and tensor-parallel ranks with ``tp > 1``) the roll all-reduces every record of the step
(MAX, one all-reduce for the whole model) before they join the histories, so every rank computes the same
scales, as TE reduces amax over the data-parallel group. The warm-start steps' dynamic scales are reduced
over the group in the step.

With gradient accumulation (``DelayedScaling.cache_weights``, set by ``prepare_model``) a weight is cast once per
optimizer step, at a weight scale the roll holds for the step, and its two E4M3 layouts are reused by the step's
micro-batches (:mod:`fp8kit.fp8.delayed_weight_cache`, Transformer Engine's ``is_first_microbatch``).

SwiGLU MLPs (HF Llama / Qwen2 / Qwen3 / Mistral) whose three projections are delayed linears run as one function
by default (``fp8.delayed_fused_mlp``, :mod:`fp8kit.fp8.delayed_mlp`): the same formats, scales and histories, with
the SwiGLU backward's casts in one Triton kernel.

Linears that read one input (q/k/v, and gate/up when unfused, in Llama-family layers) cast it at the smallest
input scale of their group (:mod:`fp8kit.fp8.delayed_siblings`): equal to each one's own scale in a run, and the
same expression in each, so ``torch.compile`` makes one cast of the shared input instead of one per module.

Tensor parallel (``fp8kit.parallel.tp_own``): with a DTensor weight the module computes on its local
shards (``fp8.linear.sharded_linear``); the amaxes of a shard (a column-parallel weight or output
gradient, a row-parallel input) reduced over a group holding the tp ranks are those of the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fp8kit.base.cuda_compile import compiled_on_cuda
from fp8kit.base.torchao_lib import torchao_float8
from fp8kit.fp8.delayed_state import (
    AMAX_ALGOS,
    E4M3,
    E5M2,
    FUSED_CASTS,
    OPERANDS,
    DelayedEntry,
    DelayedScaling,
    DelayedScalingState,
    record_,
    reduce_max,
)
from fp8kit.fp8.delayed_weight_cache import cached_weight_cast
from fp8kit.fp8.kernels.cast_ops import cast_transpose, load_cuda_kernels
from fp8kit.fp8.linear import sharded_linear
from fp8kit.fp8.recipes import GEMMS
from fp8kit.fp8.scaling import DTYPE_MAX, scale_from_amax

__all__ = ["AMAX_ALGOS", "OPERANDS", "DelayedEntry", "DelayedScaling", "DelayedScalingState",
           "Float8DelayedLinear", "scaled_mm"]


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, gemm: str, fast_accum: tuple[str, ...]) -> torch.Tensor:
    """``torch._scaled_mm(a, b)`` of per-tensor-scaled FP8 operands for ``gemm`` (one of ``fp8.recipes.GEMMS``),
    with fast accumulation where ``gemm`` is in ``fast_accum`` (``DelayedScaling.fast_accum``, by default the recipe
    table's).

    Args:
        a: ``[M, K]`` row-major FP8; b: ``[K, N]`` column-major FP8; scale_a, scale_b: float32 ``[]`` decoding scales.
        out_dtype: the output's dtype (``[M, N]``).
        gemm: ``"fprop"``, ``"dgrad"`` or ``"wgrad"``.
        fast_accum: the GEMMs that accumulate fast.

    Raises:
        ValueError: ``gemm`` is not one of the three.
    """
    if gemm not in GEMMS:
        raise ValueError(f"scaled_mm: gemm must be one of {', '.join(GEMMS)}, got {gemm!r}")
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                            use_fast_accum=gemm in fast_accum)


def _amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` of ``x`` ``[M, K]`` as a float32 ``[]`` tensor, taken per row first: the same value as one
    whole-tensor reduction (max is exact), but a row reduction is what ``torch.compile`` fuses into the
    kernel producing ``x`` (RMSNorm's row kernel, the weight's cast), where a whole-tensor amax becomes a
    split reduction of its own that reads ``x`` again."""
    return x.detach().abs().amax(dim=-1).amax().float()


def _cast_impl(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(saturate(x * scale) -> dtype, amax(|x|))`` computed in float32."""
    m = DTYPE_MAX[dtype]
    return (x.float() * scale).clamp(-m, m).to(dtype), _amax(x)


# eagerly on CUDA one compiled kernel; the plain ops inside an outer compile and on the CPU
_cast_on_device = compiled_on_cuda(_cast_impl, dynamic=True)


def _cast(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype,
          group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x8, scale, amax)``: ``saturate(x * scale) -> dtype`` plus this step's amax. Without a scale (the
    first step) the scale comes from this tensor's amax, MAX-reduced over ``group`` first when one is given
    (a tensor-parallel shard then scales like the whole tensor, as it does from the history). Inside
    ``torch.compile`` the ops join the caller's graph (fused with the producer of ``x``); eagerly on CUDA one
    compiled kernel reads ``x`` once for both; eagerly on the CPU the same float32 math runs op by op."""
    if scale is None:
        amax = reduce_max(_amax(x), group)
        scale = scale_from_amax(amax, dtype)
        return _cast_impl(x, scale, dtype)[0], scale, amax
    x8, amax = _cast_on_device(x, scale, dtype)
    return x8, scale, amax


# torchao's ``Float8TrainingTensor`` once :func:`float8_tensor_types` has run. The only way such a weight reaches a
# delayed forward is FSDP2's ``fsdp_post_all_gather`` (fp8.delayed_all_gather), which calls it first; reading this
# global is what :func:`gathered_fp8` does inside ``torch.compile`` (the import behind it is a graph break: on
# torch 2.11 that break split the MLP's first-step linears into frames whose third compile, shapes dynamic, failed
# in Dynamo's guard builder; session 49).
_GATHERED_TYPE: type | None = None


def float8_tensor_types():
    """torchao's ``float8_training_tensor`` module (``Float8TrainingTensor``, ``LinearMMConfig``, ``GemmInputRole``)."""
    global _GATHERED_TYPE
    torchao_float8()  # the quiet import
    from torchao.float8 import float8_training_tensor

    _GATHERED_TYPE = float8_training_tensor.Float8TrainingTensor
    return float8_training_tensor


def gathered_fp8(weight: torch.Tensor) -> bool:
    """Whether ``weight`` arrives already in E4M3: all-gathered by FSDP2 as such (:mod:`fp8kit.fp8.delayed_all_gather`,
    a torchao ``Float8TrainingTensor``). Imports nothing, so ``torch.compile`` traces it without a graph break."""
    cls = _GATHERED_TYPE
    return cls is not None and isinstance(weight, cls)


def _weight_both(weight: torch.Tensor, scale: torch.Tensor | None, group, col_major: bool, fused: bool,
                 cache: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """:func:`_cast_both` of a weight ``[N, K]``; an E4M3 weight all-gathered by FSDP2 (:func:`gathered_fp8`) is used
    as it came, with the scale it was cast with, and no amax (recorded at its all-gather). With ``cache``
    (``DelayedScaling.cache_weights``) and a history scale, both layouts come from the once-per-optimizer-step cast
    of :mod:`fp8kit.fp8.delayed_weight_cache` (the same bits)."""
    if gathered_fp8(weight):
        w8 = weight._data
        return w8, _col_major(w8) if col_major else None, weight._scale, None
    if cache and scale is not None:
        w8, w8t, amax = cached_weight_cast(weight, scale)
        return w8, w8t.t() if col_major else None, scale, amax
    return _cast_both(weight, scale, E4M3, group, col_major, fused)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (``torch._scaled_mm``'s second operand)."""
    return t.t().contiguous().t()


def _recast_col_major(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The forward's E4M3 cast of ``x`` ``[M, K]`` again (same scale, same float32 math), column-major, for the
    wgrad GEMM of a compiled backward. Taken from ``x.T``: an identical cast of ``x`` would be merged with the
    forward's by CSE and its output saved after all."""
    return _cast_impl(x.t(), scale, E4M3)[0].contiguous().t()


def _cast_both(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, group, col_major: bool,
               fused: bool, mergeable: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                            torch.Tensor]:
    """``(x8, x8 column-major or None, scale, amax)`` of ``x`` ``[M, K]``. With a known ``scale`` and ``fused``
    one fused cast-transpose (one read of ``x``, both layouts, the amax; ``mergeable``: the custom op that
    ``torch.compile`` merges across sibling linears, :func:`fp8kit.fp8.kernels.cast_ops.cast_transpose`);
    otherwise :func:`_cast` and a transposing copy (under ``torch.compile`` both join the kernel that produces
    ``x``)."""
    if scale is not None and fused:
        x8, x8t, amax = cast_transpose(x, scale, dtype, col_major, mergeable=mergeable)
        return x8, x8t.t() if col_major else None, scale, amax
    x8, scale, amax = _cast(x, scale, dtype, group)
    return x8, _col_major(x8) if col_major else None, scale, amax


class _DelayedLinearFn(torch.autograd.Function):
    """``y = x @ w.T`` in FP8. Inputs: ``x`` ``[M, K]``, ``weight`` ``[N, K]``, the scales and their reciprocals
    ``sx, ix, sw, iw, sg, ig`` (input, weight, output gradient: float32 ``[]`` tensors of the entry,
    ``DelayedEntry.scale`` / ``inv_scale``, the input's its group's; None: dynamic, from the tensors themselves),
    ``records`` (the entry's ``(forward_amax, grad_amax)``, written with this step's input and weight amax here
    and the output gradient's in the backward; None: nothing recorded), ``group`` (reduces the dynamic scales of a recorded
    step), ``fused`` (the operands cast by ``fp8kit::cast_transpose``), ``fast_accum`` (the GEMMs with fast
    accumulation, ``DelayedScaling.fast_accum``) and ``cache_weight`` (the weight's casts from the once-per-step cache,
    ``DelayedScaling.cache_weights``). Output ``y`` ``[M, N]`` in ``x``'s dtype.

    Under activation checkpointing with ``torch.compile`` the recomputed forward takes the two amaxes again in
    the backward, so there the forward's fused row amaxes are extra work (small: they ride on the casts)."""

    @staticmethod
    def forward(ctx, x, weight, sx, ix, sw, iw, sg, ig, records, group, fused, fast_accum, cache_weight):
        # The warm-start (dynamic) scales of a recorded step are reduced over the group as the roll reduces the
        # records; an unrecorded forward (evaluation) communicates nothing: not every rank may run it.
        warm = group if records is not None else None
        dgrad, wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # x8 [M, K] for fprop and, for wgrad, x8 column-major; w8 [N, K] and, for dgrad, w8 column-major.
        # Under torch.compile (without the fused op) the wgrad copy of x is cast again in the backward from
        # the bf16 input, as torchao's Float8Linear does: the partitioner would otherwise save the FP8 copy
        # beside the bf16 tensor it keeps anyway (+1 byte per input element of q/k/v and gate/up).
        recast_x = wgrad and "input" not in fused and torch.compiler.is_compiling()
        # the input cast is the mergeable op: sibling linears reading x at their group's scale share it (CSE)
        x8, x8_cm, sx, ax = _cast_both(x, sx, E4M3, warm, wgrad and not recast_x, "input" in fused, mergeable=True)
        w8, w8_cm, sw, aw = _weight_both(weight, sw, warm, dgrad, "weight" in fused, cache_weight)
        ix = sx.reciprocal() if ix is None else ix
        iw = sw.reciprocal() if iw is None else iw
        if records is not None:
            # Under torch.compile these writes keep the two amaxes in the forward, fused into the kernels that
            # cast x and the weight (one row reduction each). Were the backward their only reader, the
            # partitioner would move them there, reading x (recomputed from its producer) and the weight again.
            record_(records[0], 0, ax)
            if aw is not None:  # (an all-gathered E4M3 weight's amax was recorded at its all-gather)
                record_(records[0], 1, aw)
        # fprop: [M, K] @ [K, N] -> [M, N]
        y = scaled_mm(x8, w8.t(), ix, iw, x.dtype, "fprop", fast_accum)
        # The layouts the backward's GEMMs take were made with the casts (the row-major x8 dies after fprop),
        # or, with recast_x, x itself is kept for the backward's cast.
        ctx.save_for_backward(x if recast_x else x8_cm, w8_cm, sx, ix, iw, sg, ig)
        ctx.recast_x = recast_x
        # The record is state the backward writes, not a saved value (autograd's version check would refuse a
        # second call's backward after the first one's write).
        ctx.records, ctx.group = records, group
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.fused, ctx.fast_accum = fused, fast_accum
        return y

    @staticmethod
    def backward(ctx, dy):
        x8_cm, w8_cm, sx, ix, iw, sg, ig = ctx.saved_tensors
        if ctx.recast_x:
            x8_cm = _recast_col_major(x8_cm, sx)
        x_dtype, w_dtype = ctx.dtypes
        records = ctx.records
        dgrad, wgrad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # g8 [M, N] for dgrad; g8.T [N, M] row-major for wgrad (its "column-major" copy, transposed).
        g8, g8_cm, sg, ag = _cast_both(dy, sg, E5M2, ctx.group if records is not None else None, wgrad,
                                       "grad_output" in ctx.fused)
        ig = sg.reciprocal() if ig is None else ig
        dx = dw = None
        if dgrad:  # dgrad: [M, N] @ [N, K] -> [M, K]
            dx = scaled_mm(g8, w8_cm, ig, iw, x_dtype, "dgrad", ctx.fast_accum)
        if wgrad:  # wgrad: [N, M] @ [M, K] -> [N, K]
            dw = scaled_mm(g8_cm.t(), x8_cm, ig, ix, w_dtype, "wgrad", ctx.fast_accum)
        if records is not None:  # the step's record is complete: the next roll takes it into the history
            record_(records[1], 0, ag)
        return dx, dw, None, None, None, None, None, None, None, None, None, None, None


class Float8DelayedLinear(nn.Module):
    """A bias-free or biased linear layer in FP8 with delayed (amax-history) scaling.

    Holds the very ``weight`` ``[out_features, in_features]`` and ``bias`` Parameters of the ``nn.Linear``
    it replaces (:meth:`from_linear` / :meth:`to_linear`), so optimizer state and ``state_dict`` keys are
    unchanged; the scaling state is the :class:`DelayedEntry` ``name`` of the shared
    :class:`DelayedScalingState`. Input ``[..., in_features]`` bf16 -> output ``[..., out_features]`` bf16;
    the bias is added in bf16. Traceable by ``torch.compile`` with ``fullgraph=True`` once its state is attached to
    a model outside the compiled one (``apply_fp8`` attaches it; otherwise the module attaches it to itself on its
    first forward, ``DelayedScalingState.attach_first``, a call Dynamo does not trace).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, state: DelayedScalingState, name: str):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self.name = name
        self._state = state
        self._entry = state.entry(name, weight.device)
        load_cuda_kernels()  # the fused cast's triton_op, registered outside traced code (cast_ops)
        # the entries of the delayed linears that read this module's input tensor, itself included (set by
        # fp8.delayed_siblings.link_input_siblings): their shared input scale makes one cast of that input
        self._input_siblings: tuple[DelayedEntry, ...] = ()
        # fp8.stats_every (fp8kit.train.health): called after each forward with the scales its casts used,
        # ``probe(x [..., k], weight [n, k], (sx, ix, sw, iw, sg, ig) or six Nones, y [..., n])``; None: off
        self.health_probe: Callable | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, state: DelayedScalingState, name: str) -> Float8DelayedLinear:
        """Wrap ``linear``'s Parameters; ``name`` keys the module's history in ``state``."""
        mod = cls(linear.weight, linear.bias, state, name)
        mod.train(linear.training)
        return mod

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` holding this module's Parameters (the history stays in the state)."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        linear.weight, linear.bias = self.weight, self.bias
        linear.train(self.training)
        return linear

    @property
    def state(self) -> DelayedScalingState:
        """The :class:`DelayedScalingState` holding this module's history (its ``group`` reduces the amaxes)."""
        return self._state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in_features]`` -> ``[..., out_features]`` in ``x``'s dtype."""
        if isinstance(self.weight, DTensor):  # tensor parallel: the FP8 casts and GEMMs run on this rank's shards
            return sharded_linear(x, self.weight, self.bias, self._local_forward, f"Float8DelayedLinear {self.name}")
        return self._local_forward(x, self.weight, self.bias)

    def cast_scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The scales (input, weight, output gradient; float32 ``[]`` each) this module's next casts use, from the
        histories: the input's is its group's smallest input scale when it has siblings
        (:mod:`fp8kit.fp8.delayed_siblings`; its own while a sibling has not started). None before the first
        recorded step is rolled in (dynamic scales)."""
        scales = self._scales_and_inverses()
        return None if scales is None else scales[0::2]

    def _scales_and_inverses(self) -> tuple[torch.Tensor, ...] | None:
        """``(sx, ix, sw, iw, sg, ig)``: :meth:`cast_scales` each followed by its reciprocal, or None."""
        # Plain attribute reads only (no generator, no identity test): what Dynamo traces in every version we run.
        e = self._entry
        if not e.started:
            return None
        if e.group_ready and self._input_siblings:  # every sibling started: the leader's (first sibling's) scale
            lead = self._input_siblings[0]
            sx, ix = lead.group_scale, lead.group_inv_scale
        else:
            sx, ix = e.scale[0], e.inv_scale[0]
        return sx, ix, e.scale[1], e.inv_scale[1], e.scale[2], e.inv_scale[2]

    def _local_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``[..., k] x [n, k] (+ [n]) -> [..., n]`` on plain tensors (a whole weight or a TP shard)."""
        state, e = self._state, self._entry
        if e.history.device != x.device:  # not moved with its module (``_apply``): once, before the first step
            state.place(e, x.device)
        state.ensure_rolled(self)
        # The forward reads the scales (None before the first recorded step: dynamic) and writes its record;
        # the roll before the next forward takes the step into the history (fp8.delayed_state: why there).
        scales = self._scales_and_inverses() or (None,) * 6
        record = self.training and torch.is_grad_enabled()
        n, k = weight.shape
        y = _DelayedLinearFn.apply(x.reshape(-1, k), weight, *scales, (e.forward_amax, e.grad_amax) if record else None, state.group,
                                   self._fused_casts(), state.config.fast_accum, state.config.cache_weights)
        y = y.reshape(*x.shape[:-1], n)
        if self.health_probe is not None:  # the scales passed to the casts above, not a second read of the entry
            self.health_probe(x, weight, scales, y)
        return y if bias is None else y + bias.to(y.dtype)

    def _fused_casts(self) -> tuple[str, ...]:
        """The operands this module casts with ``fp8kit::cast_transpose`` (``fp8.delayed_fused_cast``,
        :data:`FUSED_CASTS`): the one place they are chosen (the fused SwiGLU MLP takes its down projection's)."""
        return FUSED_CASTS[self._state.config.fused_cast]

    def _apply(self, fn, recurse=True):
        """``nn.Module._apply`` (``.to``, ``.cuda``, ``.to_empty``) that moves the scaling entry with the
        weight; an entry on ``meta`` (a model built on meta, materialised later) starts empty."""
        super()._apply(fn, recurse)
        device = self.weight.device
        if not device.type == "meta" and self._entry.history.device != device:
            self._state.place(self._entry, device)
        return self

    def extra_repr(self) -> str:
        c = self._state.config
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe=delayed, amax_history_len={c.amax_history_len}, algo={c.amax_compute_algo}, "
                f"margin={c.margin}")


