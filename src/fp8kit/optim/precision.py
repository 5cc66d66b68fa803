"""FP8AdamW's per-state storage precisions (:class:`FP8AdamWPrecision`) and their valid values."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from fp8kit.fp8.scaling import AMAX_EPS

MASTER_CHOICES = ("fp16", "fp32", "bf16_sr")
GRAD_CHOICES = ("param", "e5m2", "e4m3")
M_CHOICES = ("e4m3", "fp16", "bf16", "fp32")
V_CHOICES = ("fp16", "e4m3", "fp32")
GRANULARITIES = ("tensor", "block")
M_ROUNDINGS = ("stochastic", "nearest")
M_EXPANDS = ("none", "coat")
#: Fields that define the saved state buffers (what ``load_state_dict`` must match), with the value a
#: checkpoint written before the field existed had.
STATE_FIELDS = {"master": None, "m": None, "v": None, "granularity": None, "block_size": None, "m_expand": "none"}


@dataclass(frozen=True)
class FP8AdamWPrecision:
    """Storage precision of each optimizer state.

    Defaults: FP8-LM's states (arXiv:2310.18313: scaled FP16 master, E4M3 ``m``, scaled FP16 ``v``) with
    two changes that measured better: ``m`` rounded stochastically (FP32-AdamW quality on long runs) and
    the framework's gradient read by the fused step (no gradient hooks; 1 byte/param more than FP8
    gradients between backward and step). ``m_rounding="nearest", grad="e5m2"`` is the paper's layout.

    Attributes:
        master: ``fp16`` (scaled), ``fp32`` or ``bf16_sr`` (bf16 with stochastic rounding; with bf16
            parameters the working weights are the master, so the master costs no extra bytes).
        grad: ``param`` (the gradients autograd makes, in the parameters' dtype, read by the step; no
            hooks) or ``e5m2`` / ``e4m3`` (scaled FP8 in the optimizer's flat buffer, quantized by a
            post-accumulate-grad hook per parameter: the paper's 1 byte/param).
        m: first moment: ``e4m3`` (scaled), ``fp16`` (scaled), ``bf16`` or ``fp32``.
        v: second moment: ``fp16`` (scaled), ``e4m3`` (scaled; underflows) or ``fp32``.
        granularity: ``tensor`` (one scale per parameter) or ``block``.
        block_size: elements per scale for ``block`` (and the padding unit of the flat layout).
        amax_eps: floor of amax in ``scale = dtype_max / max(amax, eps)``.
        m_rounding: ``stochastic`` (unbiased, hash-based random numbers; deterministic given the step) or
            ``nearest`` for the stores of ``m`` (``fp32`` ``m`` is stored exactly either way).
        m_expand: ``none`` or ``coat`` (COAT's dynamic range expansion of a scaled ``m``, one float32
            exponent per scale; ``optim/numerics.py``).
    """

    master: str = "fp16"
    grad: str = "param"
    m: str = "e4m3"
    v: str = "fp16"
    granularity: str = "tensor"
    block_size: int = 128
    amax_eps: float = AMAX_EPS
    m_rounding: str = "stochastic"
    m_expand: str = "none"

    def validate(self, where: str = "FP8AdamW") -> None:
        """Raise ``ValueError`` naming the field and the valid values for anything unknown."""
        for name, value, choices in (
            ("master", self.master, MASTER_CHOICES),
            ("grad", self.grad, GRAD_CHOICES),
            ("m", self.m, M_CHOICES),
            ("v", self.v, V_CHOICES),
            ("granularity", self.granularity, GRANULARITIES),
            ("m_rounding", self.m_rounding, M_ROUNDINGS),
            ("m_expand", self.m_expand, M_EXPANDS),
        ):
            if value not in choices:
                raise ValueError(f"{where}: {name} = {value!r} is not one of {', '.join(choices)}")
        if self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"{where}: block_size = {self.block_size} must be a positive multiple of 16")
        if not (self.amax_eps > 0 and math.isfinite(self.amax_eps)):
            raise ValueError(f"{where}: amax_eps = {self.amax_eps} must be a positive finite number")
        if self.m_expand == "coat" and self.m not in ("e4m3", "fp16"):
            raise ValueError(f"{where}: m_expand = 'coat' needs a scaled m (e4m3 or fp16), got m = {self.m!r}")

    def as_dict(self) -> dict:
        """Plain ``{field: value}`` (what ``state_dict`` saves)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def bytes_per_param(self, param_bytes: int) -> dict[str, int]:
        """Bytes per parameter of each role between backward and step, before the optimizer exists: ``master``,
        ``grad``, ``m``, ``v`` and ``working`` (the model's parameters, ``param_bytes`` each: 2 for bf16, 4 for
        fp32). Scales and the flat layout's padding are left out (:meth:`FP8AdamW.memory_bytes` counts them once
        built); ``bf16_sr`` over bf16 parameters shares the working weights (master 0). The default layout over
        bf16 parameters: 2 + 2 + 1 + 2 + 2 = 9 (the module docstring of ``optim/fp8_adamw.py``)."""
        size = {"fp32": 4, "fp16": 2, "bf16": 2, "e4m3": 1, "e5m2": 1}
        master = 0 if self.master == "bf16_sr" and param_bytes == 2 else size.get(self.master, 2)
        grad = param_bytes if self.grad == "param" else size[self.grad]
        return {"master": master, "grad": grad, "m": size[self.m], "v": size[self.v], "working": param_bytes}

    def describe(self) -> str:
        """One line, e.g. ``master fp16, grad param, m e4m3 (stochastic rounding), v fp16, per tensor``."""
        m = f"m {self.m} ({self.m_rounding} rounding" + (", COAT expansion)" if self.m_expand == "coat" else ")")
        return f"master {self.master}, grad {self.grad}, {m}, v {self.v}, per {self.granularity}"
