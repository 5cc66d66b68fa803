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

import torch
from torch import nn

from fp8kit.errors import Fp8kitError
from fp8kit.moe import routing
from fp8kit.moe.grouped_mm import bf16_grouped_mm, fp8_grouped_mm

WEIGHTS = ("gate_up_proj", "down_proj")


def check_supported(module: nn.Module, fqn: str) -> None:
    """Raise unless ``module`` is an HF v5 experts module of the supported layout (module docstring).

    Raises:
        Fp8kitError: naming the module and what is not supported, with the fix (``fp8.exclude``).
    """
    fix = f"keep it in BF16 with fp8.exclude = [\"{fqn}\"]"
    for name in WEIGHTS:
        p = getattr(module, name, None)
        if not isinstance(p, nn.Parameter) or p.dim() != 3:
            raise Fp8kitError(f"{fqn} ({type(module).__name__}): no 3-D {name} weight; FP8 grouped experts need the "
                              f"transformers v5 fused layout; {fix}")
    for attr, want in (("has_gate", True), ("has_bias", False), ("is_transposed", False)):
        if getattr(module, attr, want) != want:
            raise Fp8kitError(f"{fqn} ({type(module).__name__}): {attr} = {not want} is not supported by FP8 grouped "
                              f"experts; {fix}")
    if not hasattr(module, "_apply_gate") and not hasattr(module, "act_fn"):
        raise Fp8kitError(f"{fqn} ({type(module).__name__}): no _apply_gate / act_fn; {fix}")


class Float8GroupedExperts(nn.Module):
    """An HF v5 experts module computed with grouped GEMMs, each weight in FP8 or BF16.

    Args:
        source: the HF experts module (kept, unregistered, to restore it and for its ``_apply_gate``).
        fp8_weights: which of ``gate_up_proj`` / ``down_proj`` run in FP8.
        backend: resolved FP8 grouped backend (``moe/grouped_mm.resolve_backend``).
        compile_quantize: compile the FP8 quantization functions (CUDA).

    Forward: ``(hidden (T, H), top_k_index (T, topk) int, top_k_weights (T, topk)) -> (T, H)`` in
    ``hidden``'s dtype, like the module it replaces.
    """

    def __init__(self, source: nn.Module, fp8_weights: frozenset[str], backend: str, compile_quantize: bool = True):
        super().__init__()
        self.gate_up_proj = source.gate_up_proj
        self.down_proj = source.down_proj
        self.num_experts = source.gate_up_proj.shape[0]
        self.fp8_weights = frozenset(fp8_weights)
        self.backend = backend
        self.compile_quantize = compile_quantize
        self.__dict__["source"] = source  # not a submodule: its parameters are ours

    def extra_repr(self) -> str:
        e, n, k = self.gate_up_proj.shape
        return (f"experts={e}, hidden={k}, intermediate={n // 2}, fp8={sorted(self.fp8_weights)}, "
                f"backend={self.backend}")

    def _linear(self, name: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        w = getattr(self, name)
        if name in self.fp8_weights:
            return fp8_grouped_mm(x, w, offs, self.backend, compile_quantize=self.compile_quantize)
        return bf16_grouped_mm(x, w, offs)

    def _gate(self, h: torch.Tensor) -> torch.Tensor:
        src = self.source
        if hasattr(src, "_apply_gate"):
            return src._apply_gate(h)
        gate, up = h.chunk(2, dim=-1)
        return src.act_fn(gate) * up

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        d = routing.dispatch(top_k_index, self.num_experts)
        x = routing.gather(hidden_states, d)
        h = self._gate(self._linear("gate_up_proj", x, d.offs))
        y = self._linear("down_proj", h, d.offs)
        return routing.combine(y, d, top_k_weights, hidden_states.dtype)


def swap_in(model: nn.Module, fqn: str, fp8_weights: frozenset[str], backend: str, compile_quantize: bool) -> nn.Module:
    """Replace the experts module at ``fqn`` by a :class:`Float8GroupedExperts` (or update the one there).

    Raises:
        Fp8kitError: the module's layout is not supported (:func:`check_supported`).
    """
    module = model.get_submodule(fqn)
    if isinstance(module, Float8GroupedExperts):
        module.fp8_weights = frozenset(fp8_weights)
        return module
    check_supported(module, fqn)
    new = Float8GroupedExperts(module, fp8_weights, backend, compile_quantize)
    parent_name, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return new


def swap_out(model: nn.Module) -> int:
    """Put every original HF experts module back (same parameters); returns how many were swapped."""
    count = 0
    for fqn, module in list(model.named_modules()):
        if isinstance(module, Float8GroupedExperts):
            src = module.source
            src.gate_up_proj, src.down_proj = module.gate_up_proj, module.down_proj
            parent_name, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, src)
            count += 1
    return count
