"""FP8AdamW: AdamW with FP8-LM's precision decoupling (Peng et al. 2023, arXiv:2310.18313, section 2.1).

Per-state precision (:class:`FP8AdamWPrecision`; bytes per parameter, scales excluded):

=============== ============================================== =========================================
state           default                                        also selectable (ablations)
=============== ============================================== =========================================
master weights  FP16 with a scale (2)                          fp32 (4); bf16 with stochastic rounding
gradient        the parameters' dtype, autograd's own (2 bf16) FP8 e5m2 / e4m3 with a scale (1, paper)
first moment m  FP8 E4M3 with a scale, stochastic rounding (1) nearest rounding (paper); COAT expansion;
                                                               fp16, bf16, fp32
second moment v FP16 with a scale (2)                          e4m3 (underflows: the paper's reason), fp32
=============== ============================================== =========================================

Bytes/param between backward and step, bf16 parameters, per-tensor scales: default 2 + 2 + 1 + 2 = 7
(9 with the bf16 working weights the model computes with); ``grad="e5m2"`` 6 (8), the paper's layout;
``torch.optim.AdamW`` with fp32 master weights 16. Scales add 4 bytes per tensor and state (per tensor)
or ``4 / block_size`` per state (per block; COAT's ``k`` another ``4 / block_size`` on ``m``); the flat
layout pads each tensor to ``block_size`` elements (``optim/memory.py`` counts both).

Scales are ``dtype_max / max(amax, eps)`` (``fp8kit.fp8.scaling``), per tensor (the paper) or per block
of ``block_size`` elements. Why ``m`` is rounded stochastically and what COAT's expansion does:
``optim/numerics.py``. How the gradient reaches the step (no hooks by default): ``optim/flat_group.py``.

Layout: each parameter group is flattened (``optim/layout.py``): the parameters become views into one
flat working buffer and the states are flat buffers, so a step is one fused multi-tensor Triton pass (two
for per-tensor scales: amax, then update) per group on CUDA (``optim/triton_step.py``), the reference
math eagerly on CPU (per-block scales: in cache-sized chunks, ``optim/chunked_step.py``), and ``torch.compile``
of it for layouts the kernels don't cover.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import torch

from fp8kit.optim import state_io
from fp8kit.optim.flat_group import FlatGroup
from fp8kit.optim.numerics import HP_CLIP, make_hp
from fp8kit.optim.precision import STATE_FIELDS, FP8AdamWPrecision

__all__ = ["FP8AdamW", "FP8AdamWPrecision"]


class FP8AdamW(torch.optim.Optimizer):
    """AdamW with FP8/FP16 optimizer states (FP8-LM precision decoupling), one fused step per group.

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``. Each group must hold one
            device and dtype (bf16, fp16 or fp32); its parameters become views into a flat buffer (don't
            replace their ``.data`` afterwards: the step checks and raises).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        precision: :class:`FP8AdamWPrecision` (module docstring for the defaults).
        compile: fuse the step (Triton, else ``torch.compile``; default: on CUDA only).

    Gradients: ``precision.grad="param"`` reads ``param.grad`` as autograd leaves it (``zero_grad`` as in
    torch); ``"e5m2"``/``"e4m3"`` quantize it into the optimizer in a backward hook and free it
    (``param.grad`` is ``None`` after backward). A parameter without a gradient is stepped with a zero
    gradient (weight decay and moment decay apply; ``torch.optim.AdamW`` skips it instead).

    Gradient clipping: call :meth:`clip_grad_norm_` (``fp8kit.train.clip`` does); the clip coefficient
    stays on the device and is applied inside the step (no host synchronisation).

    Raises:
        ValueError: bad hyperparameters or precision names, mixed devices/dtypes in a group, DTensor
            parameters other than FSDP2's (``optim/sharded.py``), or FSDP2 with per-block scales or FP8
            gradients.

    FSDP2: DTensor parameters are stepped shard by shard, with per-tensor scales reduced over the shard
    group and stochastic rounding by the unsharded element index (``optim/sharded.py``); the states save
    and reshard through DCP (``optim/state_io.py``).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        precision: FP8AdamWPrecision | None = None,
        compile: bool | None = None,
    ):
        self._hooks = []  # first: __del__ runs even when a check below raises
        if not lr >= 0:
            raise ValueError(f"FP8AdamW: lr = {lr} must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"FP8AdamW: betas = {betas} must be in [0, 1)")
        if not eps > 0:
            raise ValueError(f"FP8AdamW: eps = {eps} must be > 0")
        if not weight_decay >= 0:
            raise ValueError(f"FP8AdamW: weight_decay = {weight_decay} must be >= 0")
        self.precision = precision or FP8AdamWPrecision()
        self.precision.validate()
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._flat: list[FlatGroup] = []
        self._where: dict[int, tuple[int, int]] = {}
        self.clip_coef: torch.Tensor | float = 1.0
        self._step_count = 0
        self._step_tensor = torch.zeros((), dtype=torch.float32)  # self.state[p]["step"] (shared, CPU)
        for gi, group in enumerate(self.param_groups):
            params_g = [p for p in group["params"] if p.requires_grad]
            if not params_g:
                raise ValueError(f"FP8AdamW: param group {gi} is empty; leave it out")
            if len(params_g) != len(group["params"]):
                raise ValueError(f"FP8AdamW: param group {gi} holds parameters that do not require grad")
            use_compile = compile if compile is not None else params_g[0].device.type == "cuda"
            fg = FlatGroup(params_g, self.precision, use_compile, gi)
            self._flat.append(fg)
            for ti, p in enumerate(params_g):
                if id(p) in self._where:
                    raise ValueError("FP8AdamW: a parameter appears twice (in one group or in two)")
                self._where[id(p)] = (gi, ti)
                if fg.fp8_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(_make_hook(weakref.ref(self))))
        self._refresh_state()

    @property
    def step_impl(self) -> str:
        """The step implementation of the first group: ``triton``, ``torch.compile`` or ``eager``."""
        return self._flat[0].step_impl

    # -- gradients ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _grad_hook(self, p: torch.Tensor) -> None:
        """FP8 gradients: quantize ``p.grad`` into the flat FP8 gradient (accumulating) and free it."""
        gi, ti = self._where[id(p)]
        fg = self._flat[gi]
        seg = fg.layout.padded_segment(fg.grad, ti)
        fg.quantize_fn(seg, fg.grad_scale_slice(ti), p.grad, fg.has_grad[ti], fg.layout.block,
                       self.precision.amax_eps)
        fg.has_grad[ti] = True
        fg.grads_final = False
        p.grad = None

    def _fp8_grads_ready(self, fg: FlatGroup) -> None:
        """FP8 gradients: zero the segments of parameters that got none this step (once per step)."""
        if fg.grads_final:
            return
        fg.grads_final = True
        for i, has in enumerate(fg.has_grad):
            if not has:  # no gradient this step: step it with zero (stale FP8 data must not be reused)
                fg.layout.padded_segment(fg.grad, i).zero_()

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm (float32, 0-dim, on the parameters' device) of the gradients the next step uses."""
        if not self._flat[0].fp8_grad:
            device = self._flat[0].seg_start.device
            if any(fg.shard is not None for fg in self._flat):  # FSDP2: sum of squares over the shards
                total = torch.zeros((), device=device)
                for fg in self._flat:
                    grads = [g for g in fg.param_grads() if g is not None]
                    sq = torch.zeros((), device=device)
                    if grads:
                        sq = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()
                    total = total + (fg.shard.reduce_sum_(sq) if fg.shard is not None else sq)
                return total.sqrt()
            grads = [g for fg in self._flat for g in fg.param_grads() if g is not None]
            if not grads:
                return torch.zeros((), device=device)
            # float32 per-tensor norms (multi-tensor kernel), then their norm: no bf16 rounding of the norm
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
        total = None
        for fg in self._flat:
            self._fp8_grads_ready(fg)
            sq = fg.grad_sq_fn(fg.grad, fg.grad_scale, fg.layout.block_owner, fg.spec)
            total = sq if total is None else total + sq
        return total.sqrt()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Return the global gradient norm and clip to ``max_norm`` inside the next step (0/inf: no clipping).

        Same formula as ``torch.nn.utils.clip_grad_norm_``: coefficient ``min(1, max_norm / (norm + 1e-6))``.
        """
        norm = self.grad_norm()
        if max_norm and not math.isinf(max_norm):
            self.clip_coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad`` for ``param.grad``; also forgets accumulated FP8 gradients."""
        super().zero_grad(set_to_none=set_to_none)
        for fg in self._flat:
            fg.has_grad = [False] * len(fg.has_grad)
            fg.grads_final = False

    # -- step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every group (one fused step per group); returns the closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_count += 1
        for group, fg in zip(self.param_groups, self._flat, strict=True):
            fg.check_views()
            fg.sync_master_if_weights_changed()
            b1, b2 = group["betas"]
            hp = make_hp(group["lr"], b1, b2, group["eps"], group["weight_decay"], self._step_count, fg.index)
            fg.hp.copy_(hp, non_blocking=True)
            if isinstance(self.clip_coef, torch.Tensor):
                fg.hp[HP_CLIP : HP_CLIP + 1].copy_(self.clip_coef.reshape(1))
            work = fg.work_buffer()
            states = (fg.m, fg.m_scale, fg.m_k, fg.v, fg.v_scale, fg.master, fg.master_scale, work, fg.hp,
                      fg.layout.block_owner, fg.spec)
            kw = fg.step_kwargs()  # FSDP2: amax reduction over the shards, noise offsets
            if fg.fp8_grad:
                self._fp8_grads_ready(fg)
                fg.step_fn(fg.grad, fg.grad_scale, *states)
            elif fg.step_impl == "triton":
                fg.update_grad_table(fg.param_grads())
                fg.step_fn(None, None, *states, grad_table=fg.grad_table, seg_start=fg.seg_start,
                           grad_vec=fg.grad_vec, **kw)
            else:
                fg.step_fn(fg.gather_grads(fg.param_grads()), None, *states, **kw)
            fg.write_back(work)
            fg.has_grad = [False] * len(fg.has_grad)
            fg.grads_final = False
            fg.work_version = fg.param_versions()
        self.clip_coef = 1.0
        self._step_tensor.fill_(self._step_count)
        return loss

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim`` layout: ``state[i]`` per parameter (``optim/state_io.py``: payloads, scales,
        ``step``; DTensors under FSDP2, which DCP saves sharded and reshards), ``param_groups``, and
        ``"fp8adamw"``: the step count and the precision. One process also saves ``"flat"``: per group the
        flat buffers, which the per-parameter entries are views of (``torch.save`` writes them once).

        Loadable with ``torch.load(weights_only=True)`` (tensors, lists, dicts, numbers, strings only).
        """
        sd = super().state_dict()
        sharded = any(fg.shard is not None for fg in self._flat)
        flat = [{k: (v.clone() if v is not None else None) for k, v in fg.buffers().items()} for fg in self._flat]
        state, i = {}, 0
        for fg, bufs in zip(self._flat, flat, strict=True):
            for ti in range(len(fg.params)):
                state[i] = state_io.param_entry(fg, ti, fg.buffers() if sharded else bufs, self._step_count,
                                                clone=sharded)
                i += 1
        sd["state"] = state
        if not sharded:
            sd["flat"] = flat
        sd["fp8adamw"] = {"step": self._step_count, "precision": self.precision.as_dict()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters, step count and states (from ``"flat"``, else the per-parameter entries:
        DCP, another layout).

        The saved precision must match this optimizer's in the fields that define the stored states
        (master, m, v, granularity, block_size, m_expand); gradient mode, m rounding and amax_eps may
        differ (they change how the next steps compute, not what was saved). Checkpoints written before
        ``m_expand`` existed count as ``m_expand = "none"``.

        The restored master weights are the ones the next step starts from, even if the model's weights
        are written between this call and that step (``torch.distributed.checkpoint.state_dict.set_state_dict``
        loads the model after the optimizer; load the checkpoint's own weights, or the master wins). A
        1-byte state may arrive as its ``uint8`` bytes (:func:`fp8kit.optim.state_io.float8_as_bytes`).

        Raises:
            ValueError: when the state was saved with other state precisions or parameter shapes, or by
                another optimizer.
        """
        entries = state_dict.get("state") or {}
        if "flat" not in state_dict and not (entries and all("v" in st for st in entries.values())):
            raise ValueError("FP8AdamW.load_state_dict: not an FP8AdamW state (no 'flat' entry and no per-parameter "
                             "'m'/'v' states); was it saved by torch AdamW?")
        if "fp8adamw" in state_dict:
            self.check_saved_precision(state_dict["fp8adamw"]["precision"])
        groups = state_dict["param_groups"]
        if len(groups) != len(self._flat) or any(len(g["params"]) != len(fg.params) for g, fg in zip(groups, self._flat, strict=False)):
            raise ValueError(
                f"FP8AdamW.load_state_dict: {len(groups)} groups of {[len(g['params']) for g in groups]} parameters "
                f"saved, {len(self._flat)} groups of {[len(fg.params) for fg in self._flat]} here"
            )
        if "flat" in state_dict and all(fg.shard is None for fg in self._flat):
            self._load_flat(state_dict["flat"])
            step = int(state_dict["fp8adamw"]["step"])
        else:
            keys = [k for g in groups for k in g["params"]]
            where = [(gi, ti) for gi, fg in enumerate(self._flat) for ti in range(len(fg.params))]
            step = 0
            for key, (gi, ti) in zip(keys, where, strict=True):
                if key not in entries:
                    raise ValueError(f"FP8AdamW.load_state_dict: no saved state for parameter {key!r}")
                step = state_io.load_entry(self._flat[gi], ti, key, entries[key])
        self._step_count = step
        self._step_tensor.fill_(step)
        for fg in self._flat:  # the restored master is authoritative from here
            fg.work_version = fg.param_versions()
            # Kept at the next step even if the weights are written before it: torch.distributed.checkpoint's
            # set_state_dict loads the optimizer before the model (one process and FSDP2), and FSDP2 bumps
            # the DTensor parameters' versions at its lazy init. Rebuilding the master from the bf16 weights
            # there would round it (resumes within ~1e-3 instead of exactly).
            fg.trust_master = True
        super().load_state_dict({"state": {}, "param_groups": groups})
        self._refresh_state()

    def adapt_full_state(self, saved: dict, osd: dict) -> dict:
        """The full per-parameter state dict ``osd`` saved with precision ``saved``, in this optimizer's scales:
        states saved per block (a one-process run's default) recast per tensor when this optimizer keeps one
        scale per tensor (FSDP2), with a warning (one extra rounding of each state,
        :func:`fp8kit.optim.state_io.block_to_tensor_scales`); then :meth:`check_saved_precision`.

        Raises:
            ValueError: as :meth:`check_saved_precision`, for any other difference.
        """
        if saved.get("granularity") == "block" and self.precision.granularity == "tensor":
            warnings.warn(
                "FP8AdamW: the checkpoint's optimizer states have per-block scales (optim.granularity = block); this "
                "run keeps one scale per tensor (FSDP2), so m, v and the master weights are recast with per-tensor "
                "scales once, at load (one extra rounding)", stacklevel=2)
            osd = state_io.block_to_tensor_scales(osd, int(saved["block_size"]), self.precision.amax_eps)
            saved = {**saved, "granularity": "tensor", "block_size": self.precision.block_size}
        self.check_saved_precision(saved)
        return osd

    def check_saved_precision(self, saved: dict) -> None:
        """Refuse states saved with other state precisions (``state_dict()["fp8adamw"]["precision"]``; the
        fields of ``STATE_FIELDS``). ``fp8kit.train.checkpoint.load_into`` calls it before a full-state load,
        which keeps only the per-parameter entries.

        Raises:
            ValueError: naming both precisions and the differing fields.
        """
        mine = self.precision.as_dict()
        diff = [k for k, old in STATE_FIELDS.items() if saved.get(k, old) != mine[k]]
        if diff:
            raise ValueError(
                f"FP8AdamW.load_state_dict: saved with precision {saved}, this optimizer has {mine} "
                f"(differing in {', '.join(diff)})"
            )

    def _load_flat(self, flat: list[dict]) -> None:
        for gi, (fg, saved_bufs) in enumerate(zip(self._flat, flat, strict=True)):
            for name, buf in fg.buffers().items():
                src = saved_bufs.get(name)
                if (buf is None) != (src is None) or (buf is not None and buf.shape != src.shape):
                    raise ValueError(
                        f"FP8AdamW.load_state_dict: group {gi} state {name!r} has shape "
                        f"{None if src is None else tuple(src.shape)}, expected {None if buf is None else tuple(buf.shape)}"
                    )
                if buf is not None:
                    buf.copy_(src)

    def _refresh_state(self) -> None:
        """``self.state[p]``: live views of each parameter's states (local shards under FSDP2), as
        ``torch.optim`` keeps them (DCP's ``get/set_optimizer_state_dict`` read the names from here)."""
        for fg in self._flat:
            for ti, p in enumerate(fg.params):
                entry = state_io.param_entry(fg, ti, fg.buffers(), self._step_count, clone=False)
                entry["step"] = self._step_tensor
                self.state[p] = entry

    def memory_bytes(self) -> dict[str, int]:
        """Bytes by role: ``master``, ``grad``, ``m``, ``v`` (each with its scales; ``m`` with COAT's ``k``),
        ``working`` (the model's parameters), and ``params`` (their element count, for bytes/param).

        ``grad``: the FP8 buffer and its scales, or with ``grad="param"`` the framework's gradients at the
        size they have between backward and step (``numel * element_size``), whether or not they exist now.
        """
        out = {"master": 0, "grad": 0, "m": 0, "v": 0, "working": 0, "params": 0}
        for fg in self._flat:
            for k, v in fg.memory_bytes().items():
                out[k] += v
        return out

    def add_param_group(self, param_group: dict) -> None:
        """Only during construction: the flat layout of a group is fixed when the optimizer is built.

        Raises:
            ValueError: when called on a built optimizer (build a new FP8AdamW with all groups instead).
        """
        if hasattr(self, "_flat"):
            raise ValueError("FP8AdamW.add_param_group: groups are flattened at construction; "
                             "build a new FP8AdamW with every group instead")
        super().add_param_group(param_group)

    def remove_hooks(self) -> None:
        """Detach the FP8 gradient hooks from the parameters (after which gradients stay in ``param.grad``)."""
        for h in getattr(self, "_hooks", ()):
            h.remove()
        self._hooks = []

    def __del__(self):
        self.remove_hooks()


def _make_hook(opt_ref: weakref.ref):
    """A post-accumulate-grad hook holding the optimizer weakly (the parameters must not keep it alive)."""

    def hook(p: torch.Tensor) -> None:
        opt = opt_ref()
        if opt is not None:
            opt._grad_hook(p)

    return hook
