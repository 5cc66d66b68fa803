"""FP8AdamW: AdamW with FP8-LM's precision decoupling (Peng et al. 2023, arXiv:2310.18313, section 2.1).

Per-state precision (defaults = the paper's 6 bytes/param layout):

=============== ============================================ =========================================
state           default                                      also selectable (for the paper's ablations)
=============== ============================================ =========================================
master weights  FP16 with a scale (2 bytes)                  fp32; bf16 with stochastic rounding
gradient        FP8 E5M2 with a scale (1 byte)               e4m3; ``param`` (the framework's gradient)
first moment m  FP8 E4M3 with a scale (1 byte)               fp16, bf16, fp32
second moment v FP16 with a scale (2 bytes)                  e4m3 (underflows: the paper's reason), fp32
=============== ============================================ =========================================

Scales are ``dtype_max / max(amax, eps)`` (``fp8kit.fp8.scaling``), per tensor (the paper) or per block
of ``block_size`` elements. Gradients are quantized to FP8 by a post-accumulate-grad hook the moment
autograd produces them (and re-quantized as micro-batches accumulate), then ``param.grad`` is freed, so
no full-precision gradient copy lives between backward and step.

Layout: each parameter group is flattened (``optim.layout``): the parameters become views into one flat
working buffer and the states are flat buffers, so a step is one ``torch.compile``-fused function per
group on CUDA (eager on CPU).
"""

from __future__ import annotations

import math
import types
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from fp8kit.fp8.scaling import AMAX_EPS, is_scaled, storage_dtype
from fp8kit.optim.layout import FlatLayout
from fp8kit.optim.numerics import StateSpec, accumulate_gradient, adamw_update, load, store

MASTER_CHOICES = ("fp16", "fp32", "bf16_sr")
GRAD_CHOICES = ("e5m2", "e4m3", "param")
M_CHOICES = ("e4m3", "fp16", "bf16", "fp32")
V_CHOICES = ("fp16", "e4m3", "fp32")
GRANULARITIES = ("tensor", "block")


@dataclass(frozen=True)
class FP8AdamWPrecision:
    """Storage precision of each optimizer state; defaults are FP8-LM's (6 bytes/param).

    Attributes:
        master: ``fp16`` (scaled), ``fp32`` or ``bf16_sr`` (bf16 with stochastic rounding; with bf16
            parameters the working weights are the master, so the master costs no extra bytes).
        grad: ``e5m2`` / ``e4m3`` (scaled FP8, quantized in the backward hook) or ``param`` (keep
            ``param.grad`` as autograd made it).
        m: first moment: ``e4m3`` (scaled), ``fp16`` (scaled), ``bf16`` or ``fp32``.
        v: second moment: ``fp16`` (scaled), ``e4m3`` (scaled; underflows) or ``fp32``.
        granularity: ``tensor`` (one scale per parameter) or ``block``.
        block_size: elements per scale for ``block`` (and the padding unit of the flat layout).
        amax_eps: floor of amax in ``scale = dtype_max / max(amax, eps)``.
    """

    master: str = "fp16"
    grad: str = "e5m2"
    m: str = "e4m3"
    v: str = "fp16"
    granularity: str = "tensor"
    block_size: int = 128
    amax_eps: float = AMAX_EPS

    def validate(self, where: str = "FP8AdamW") -> None:
        """Raise ``ValueError`` naming the field and the valid values for anything unknown."""
        for name, value, choices in (
            ("master", self.master, MASTER_CHOICES),
            ("grad", self.grad, GRAD_CHOICES),
            ("m", self.m, M_CHOICES),
            ("v", self.v, V_CHOICES),
            ("granularity", self.granularity, GRANULARITIES),
        ):
            if value not in choices:
                raise ValueError(f"{where}: {name} = {value!r} is not one of {', '.join(choices)}")
        if self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"{where}: block_size = {self.block_size} must be a positive multiple of 16")
        if not (self.amax_eps > 0 and math.isfinite(self.amax_eps)):
            raise ValueError(f"{where}: amax_eps = {self.amax_eps} must be a positive finite number")


def grad_sq_sum(grad: torch.Tensor, scale: torch.Tensor | None, owner: torch.Tensor, spec: StateSpec) -> torch.Tensor:
    """Sum of squares (float32) of a flat gradient's values."""
    return load(grad, scale, owner, spec).square().sum()


def _select_step(spec: StateSpec, master, device: torch.device, compile_step: bool):
    """(step function, gradient square-sum function, step implementation name): ``"triton"`` (the Triton
    kernels of ``optim/triton_step.py``, on CUDA where they cover the layout), else ``"torch.compile"`` of
    the reference math, else ``"eager"``."""
    if not compile_step:
        return adamw_update, grad_sq_sum, "eager"
    sq = torch.compile(_own_code(grad_sq_sum), fullgraph=True, dynamic=False)
    if device.type == "cuda":
        from fp8kit.optim import triton_step

        if triton_step.supported(spec, master):
            return triton_step.adamw_update_triton, sq, "triton"
    return torch.compile(_own_code(adamw_update), fullgraph=True, dynamic=False), sq, "torch.compile"


def _own_code(fn):
    """``fn`` with a code object of its own: torch.compile caches per code object, so each group's step
    compiles once for its static shapes instead of counting against one shared recompile limit."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class _FlatGroup:
    """The flat states of one parameter group (see the module docstring)."""

    def __init__(self, params: list[torch.Tensor], prec: FP8AdamWPrecision, compile_step: bool):
        device, pdtype = params[0].device, params[0].dtype
        for p in params:
            if p.device != device or p.dtype != pdtype:
                raise ValueError(
                    f"FP8AdamW: a parameter group mixes devices/dtypes ({device}/{pdtype} and {p.device}/{p.dtype}); "
                    "put parameters of different dtypes or devices into different groups"
                )
            if type(p.data) is not torch.Tensor:
                raise ValueError(
                    f"FP8AdamW: parameters must be plain tensors, got {type(p.data).__name__} "
                    "(DTensor/FSDP2 parameters are not supported by this version)"
                )
        self.params = params
        self.layout = FlatLayout.build([p.numel() for p in params], prec.block_size, device)
        L, T = self.layout, len(params)
        self.work = torch.zeros(L.total, device=device, dtype=pdtype)
        for i, p in enumerate(params):
            L.segment(self.work, i).copy_(p.detach().reshape(-1))
            p.data = L.segment(self.work, i).view(p.shape)
        n_scales = T if prec.granularity == "tensor" else L.num_blocks

        def scaled(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
            data = torch.zeros(L.total, device=device, dtype=dtype)
            scale = torch.ones(n_scales, device=device, dtype=torch.float32) if is_scaled(dtype) else None
            return data, scale

        sr = prec.master == "bf16_sr"
        master_dtype = torch.bfloat16 if sr else storage_dtype(prec.master, "FP8AdamW master")
        self.master, self.master_scale = (None, None) if sr and pdtype == torch.bfloat16 else scaled(master_dtype)
        if self.master is not None:
            spec0 = self._spec(prec, T, None)
            self._spec_no_master = spec0
            store(self.work.view(-1, L.block).float(), self.master, self.master_scale, L.block_owner, spec0)
        self.m, self.m_scale = scaled(storage_dtype(prec.m, "FP8AdamW m"))
        self.v, self.v_scale = scaled(storage_dtype(prec.v, "FP8AdamW v"))
        self.fp8_grad = prec.grad != "param"
        if self.fp8_grad:
            self.grad, self.grad_scale = scaled(storage_dtype(prec.grad, "FP8AdamW grad"))
        else:
            self.grad, self.grad_scale = torch.zeros(L.total, device=device, dtype=torch.float32), None
        self.has_grad = [False] * T
        self.grads_final = False  # _grads_ready ran since the last step / zero_grad / backward
        self.spec = self._spec(prec, T, master_dtype if self.master is not None else None)
        self.step_fn, self.grad_sq_fn, self.step_impl = _select_step(self.spec, self.master, device, compile_step)
        # the backward hooks' quantization: one compiled graph for every parameter shape
        self.quantize_fn = (
            torch.compile(_own_code(accumulate_gradient), dynamic=True) if compile_step else accumulate_gradient
        )
        self.hp = torch.zeros(7, device=device, dtype=torch.float32)
        self.work_version = self.param_versions()

    @staticmethod
    def _spec(prec: FP8AdamWPrecision, T: int, master_dtype: torch.dtype | None) -> StateSpec:
        return StateSpec(
            block=prec.block_size,
            num_tensors=T,
            granularity=prec.granularity,
            grad=storage_dtype(prec.grad, "grad") if prec.grad != "param" else torch.float32,
            m=storage_dtype(prec.m, "m"),
            v=storage_dtype(prec.v, "v"),
            master=master_dtype,
            stochastic_rounding=prec.master == "bf16_sr",
            eps=prec.amax_eps,
        )

    def buffers(self) -> dict[str, torch.Tensor | None]:
        return {
            "master": self.master, "master_scale": self.master_scale, "m": self.m, "m_scale": self.m_scale,
            "v": self.v, "v_scale": self.v_scale,
        }

    def grad_scale_slice(self, i: int) -> torch.Tensor:
        assert self.grad_scale is not None
        if self.spec.granularity == "tensor":
            return self.grad_scale[i : i + 1]
        return self.grad_scale[self.layout.block_range(i)]

    def sync_master_if_weights_changed(self) -> None:
        """Rebuild the master from the working weights if something wrote to the parameters since the
        optimizer last did (``load_state_dict`` on the model, ``nn.init``, ``copy_``): an in-place write bumps
        the parameter's version counter; the optimizer's own writes go through ``work`` and bump none."""
        now = self.param_versions()
        if self.master is not None and now != self.work_version:
            store(self.work.view(-1, self.layout.block).float(), self.master, self.master_scale,
                  self.layout.block_owner, self._spec_no_master)
        self.work_version = now

    def param_versions(self) -> int:
        return sum(p._version for p in self.params)

    def check_views(self) -> None:
        """Raise if a parameter no longer aliases the flat working buffer (its ``.data`` was replaced)."""
        for i, p in enumerate(self.params):
            if p.data_ptr() != self.work.data_ptr() + self.layout.offsets[i] * self.work.element_size():
                raise RuntimeError(
                    f"FP8AdamW: parameter {i} of shape {tuple(p.shape)} no longer views the optimizer's flat "
                    "buffer (its .data was replaced after the optimizer was built, e.g. by load_state_dict(assign=True) "
                    "or a module conversion that made new tensors); build the optimizer after such changes"
                )


class FP8AdamW(torch.optim.Optimizer):
    """AdamW with FP8/FP16 optimizer states and FP8 gradients (FP8-LM precision decoupling).

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``. Each group must hold one
            device and dtype; its parameters become views into a flat buffer (don't replace their
            ``.data`` afterwards: the step checks and raises).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        precision: :class:`FP8AdamWPrecision` (default: the paper's layout).
        compile: fuse the step with ``torch.compile`` (default: on CUDA only).

    Gradient clipping: call :meth:`clip_grad_norm_` (``param.grad`` is ``None`` after backward when
    gradients are FP8: they live in the optimizer). The clip coefficient is applied inside the step.

    Raises:
        ValueError: bad hyperparameters or precision names, mixed devices/dtypes in a group, DTensor
            parameters.
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
        self._flat: list[_FlatGroup] = []
        self._where: dict[int, tuple[int, int]] = {}
        self.clip_coef: torch.Tensor | float = 1.0
        self._step_count = 0
        for gi, group in enumerate(self.param_groups):
            params_g = [p for p in group["params"] if p.requires_grad]
            if not params_g:
                raise ValueError(f"FP8AdamW: param group {gi} is empty; leave it out")
            if len(params_g) != len(group["params"]):
                raise ValueError(f"FP8AdamW: param group {gi} holds parameters that do not require grad")
            use_compile = compile if compile is not None else params_g[0].device.type == "cuda"
            fg = _FlatGroup(params_g, self.precision, use_compile)
            self._flat.append(fg)
            for ti, p in enumerate(params_g):
                if id(p) in self._where:
                    raise ValueError("FP8AdamW: a parameter appears twice (in one group or in two)")
                self._where[id(p)] = (gi, ti)
                if fg.fp8_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(_make_hook(weakref.ref(self))))

    # -- gradients ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _grad_hook(self, p: torch.Tensor) -> None:
        """Quantize ``p.grad`` into the flat FP8 gradient (accumulating) and free it."""
        gi, ti = self._where[id(p)]
        fg = self._flat[gi]
        seg = fg.layout.padded_segment(fg.grad, ti)
        fg.quantize_fn(seg, fg.grad_scale_slice(ti), p.grad, fg.has_grad[ti], fg.layout.block,
                       self.precision.amax_eps)
        fg.has_grad[ti] = True
        fg.grads_final = False
        p.grad = None

    def _gather_param_grads(self, fg: _FlatGroup) -> None:
        """``grad = "param"``: copy the framework's gradients into the flat float32 buffer."""
        for i, p in enumerate(fg.params):
            seg = fg.layout.segment(fg.grad, i)
            if p.grad is None:
                seg.zero_()
                fg.has_grad[i] = False
            else:
                seg.copy_(p.grad.reshape(-1))
                fg.has_grad[i] = True

    def _grads_ready(self, fg: _FlatGroup) -> None:
        """Make the flat gradient final for this step (once: grad_norm and step both need it)."""
        if fg.grads_final and fg.fp8_grad:  # "param" gradients may change without a hook: always gather
            return
        fg.grads_final = True
        if not fg.fp8_grad:
            self._gather_param_grads(fg)
            return
        for i, has in enumerate(fg.has_grad):
            if not has:  # no gradient this step: step it with zero (stale FP8 data must not be reused)
                fg.layout.padded_segment(fg.grad, i).zero_()

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm (float32, 0-dim) of the gradients the next step will use."""
        total = None
        for fg in self._flat:
            self._grads_ready(fg)
            spec, owner = fg.spec, fg.layout.block_owner
            sq = fg.grad_sq_fn(fg.grad, fg.grad_scale, owner, spec)
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
        """Forget the accumulated gradients (FP8 gradients are overwritten by the next backward)."""
        super().zero_grad(set_to_none=set_to_none)
        for fg in self._flat:
            fg.has_grad = [False] * len(fg.has_grad)
            fg.grads_final = False

    # -- step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of every group (fused per group); returns the closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_count += 1
        for group, fg in zip(self.param_groups, self._flat, strict=True):
            fg.check_views()
            fg.sync_master_if_weights_changed()
            self._grads_ready(fg)
            b1, b2 = group["betas"]
            hp = torch.tensor(
                [group["lr"], b1, b2, group["eps"], group["weight_decay"], self._step_count, 1.0], dtype=torch.float32
            )
            fg.hp.copy_(hp, non_blocking=True)
            if isinstance(self.clip_coef, torch.Tensor):
                fg.hp[6:7].copy_(self.clip_coef.reshape(1))
            fg.step_fn(
                fg.grad, fg.grad_scale, fg.m, fg.m_scale, fg.v, fg.v_scale, fg.master, fg.master_scale, fg.work,
                fg.hp, fg.layout.block_owner, fg.spec,
            )
            fg.has_grad = [False] * len(fg.has_grad)
            fg.grads_final = False
            fg.work_version = fg.param_versions()
        self.clip_coef = 1.0
        return loss

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim`` layout plus ``"flat"``: per group the state buffers and scales, and the step count.

        Loadable with ``torch.load(weights_only=True)`` (tensors, lists, dicts, numbers, strings only).
        """
        sd = super().state_dict()
        sd["flat"] = [{k: (v.clone() if v is not None else None) for k, v in fg.buffers().items()} for fg in self._flat]
        sd["fp8adamw"] = {"step": self._step_count, "precision": dict(vars(self.precision))}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters, step count and states.

        Raises:
            ValueError: when the state was saved with other precisions or parameter shapes.
        """
        if "flat" not in state_dict or "fp8adamw" not in state_dict:
            raise ValueError("FP8AdamW.load_state_dict: not an FP8AdamW state (no 'flat' entry); was it saved by torch AdamW?")
        saved = state_dict["fp8adamw"]["precision"]
        if saved != dict(vars(self.precision)):
            raise ValueError(f"FP8AdamW.load_state_dict: saved with precision {saved}, this optimizer has {dict(vars(self.precision))}")
        if len(state_dict["flat"]) != len(self._flat):
            raise ValueError(f"FP8AdamW.load_state_dict: {len(state_dict['flat'])} groups saved, {len(self._flat)} here")
        for gi, (fg, saved_bufs) in enumerate(zip(self._flat, state_dict["flat"], strict=True)):
            for name, buf in fg.buffers().items():
                src = saved_bufs.get(name)
                if (buf is None) != (src is None) or (buf is not None and buf.shape != src.shape):
                    raise ValueError(
                        f"FP8AdamW.load_state_dict: group {gi} state {name!r} has shape "
                        f"{None if src is None else tuple(src.shape)}, expected {None if buf is None else tuple(buf.shape)}"
                    )
                if buf is not None:
                    buf.copy_(src)
        self._step_count = int(state_dict["fp8adamw"]["step"])
        for fg in self._flat:  # the restored master is authoritative from here
            fg.work_version = fg.param_versions()
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held now, by role: ``master``, ``grad``, ``m``, ``v`` (each with its scales), ``working``
        (the model's parameters), and ``params`` (their element count, for bytes/param)."""
        out = {"master": 0, "grad": 0, "m": 0, "v": 0, "working": 0, "params": 0}

        def nb(*ts):
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        for fg in self._flat:
            out["master"] += nb(fg.master, fg.master_scale)
            out["grad"] += nb(fg.grad, fg.grad_scale)
            if not fg.fp8_grad:  # the framework's gradients live on beside the flat copy
                out["grad"] += sum(p.numel() * p.element_size() for p in fg.params)
            out["m"] += nb(fg.m, fg.m_scale)
            out["v"] += nb(fg.v, fg.v_scale)
            out["working"] += nb(fg.work)
            out["params"] += sum(fg.layout.numels)
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
        """Detach the gradient hooks from the parameters (after which gradients stay in ``param.grad``)."""
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
