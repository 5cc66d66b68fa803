"""The static module filter: which sites may run in FP8 at all, and why not.

The rules follow the FP8 trainers built on torchao (torchao's ``convert_to_float8_training`` filter as
torchtitan and KempnerForge use it; LLaMA-Factory's ``module_filter_func`` behind its HF Trainer FP8
flags), in this order, the first that applies giving the reason:

1. embeddings are not linear layers;
2. output heads (``lm_head`` / ``output`` / ``classifier`` ...) stay BF16 for accuracy (DeepSeek-V3,
   arXiv:2412.19437 section 3.3, keeps the output head in BF16; so do torchtitan and torchao), unless
   ``fp8.output_head`` lets them in, and then a head tied to the input embedding still stays BF16 (its
   weight is an ``nn.Embedding``'s too); an admitted head goes on through the rules below;
3. MoE routers / gates stay BF16 (output dim = number of experts: tiny, and routing-critical);
4. MoE experts: the 3-D expert weights of transformers v5 (``gate_up_proj`` / ``down_proj``) are
   candidates for the FP8 grouped GEMM (``fp8kit.moe``) when K and N are divisible by 16 and the
   module has the supported layout (gated, no bias, (E, out, in) weights); other expert modules and
   experts built as one ``nn.Linear`` per expert stay BF16, with the reason;
5. the weight must be 2-D;
6. in_features and out_features must be divisible by 16 (``torch._scaled_mm`` and
   ``torch._scaled_grouped_mm`` need it), or by the recipe's block (128 for ``blockwise``:
   ``fp8.recipes.RECIPES[...].dims_multiple``; grouped expert weights too: blockwise experts run
   ``moe/grouped_loop.py``);
7. ``fp8.exclude`` patterns; 8. ``fp8.include`` patterns (when any are given).

Patterns match whole dotted name parts (``selective/patterns.py``). A site that passes every rule is an FP8
*candidate*; whether it then runs in FP8 is decided in ``selective/decide.py`` (precision, policy).
"""

from __future__ import annotations

from dataclasses import dataclass

from fp8kit.selective.patterns import FqnPattern, compile_patterns, first_match
from fp8kit.selective.sites import Site


@dataclass(frozen=True)
class StaticVerdict:
    """Result of the static filter for one site: ``rule`` is a short id, ``reason`` a sentence."""

    candidate: bool
    rule: str
    reason: str


@dataclass(frozen=True)
class StaticRules:
    """The compiled static filter (include/exclude patterns)."""

    include: tuple[FqnPattern, ...] = ()
    exclude: tuple[FqnPattern, ...] = ()
    dims_multiple: int = 16  # the recipe's (linear layers and grouped expert weights alike)
    output_head: bool = False  # fp8.output_head: an untied output head is a candidate like any linear

    @classmethod
    def from_lists(cls, include: list[str], exclude: list[str], dims_multiple: int = 16,
                   output_head: bool = False) -> StaticRules:
        return cls(tuple(compile_patterns(include, "fp8.include")), tuple(compile_patterns(exclude, "fp8.exclude")),
                   dims_multiple, output_head)

    def check(self, site: Site) -> StaticVerdict:
        """Apply the rules of the module docstring, in order, to one site."""
        if site.role == "embedding":
            return StaticVerdict(False, "embedding", "embedding: not a linear layer")
        if site.role == "head" and not self.output_head:
            return StaticVerdict(False, "head", "output head: kept in BF16 for accuracy (fp8.output_head = true lets "
                                 "it run in FP8)")
        if site.role == "head" and site.tied:
            return StaticVerdict(False, "head-tied", "output head tied to the input embedding (one weight for both): "
                                 "kept in BF16 although fp8.output_head = true")
        if site.role == "router":
            return StaticVerdict(False, "router", "MoE router: tiny output dim, routing stays in BF16")
        if site.role == "expert" and not site.is_grouped_weight:
            return StaticVerdict(False, "expert-linear", "MoE expert built of per-expert nn.Linear: no grouped layout")
        if site.is_grouped_weight and site.unsupported:
            return StaticVerdict(False, "expert-layout", f"MoE experts: {site.unsupported}")
        if len(site.weight_shape) != (3 if site.is_grouped_weight else 2):
            return StaticVerdict(False, "not-2d", f"weight is {len(site.weight_shape)}-D, not 2-D")
        k, n = site.in_features, site.out_features
        if k is None or n is None or k % 16 or n % 16:
            return StaticVerdict(
                False, "dims%16", f"in_features={k}, out_features={n}: not both divisible by 16"
            )
        m = self.dims_multiple
        if m != 16 and (k % m or n % m):
            return StaticVerdict(
                False, f"dims%{m}", f"in_features={k}, out_features={n}: not both divisible by {m} "
                f"(the recipe's {m}-element blocks)"
            )
        hit = first_match(list(self.exclude), site.fqn)
        if hit is not None:
            return StaticVerdict(False, "exclude", f"matches fp8.exclude {hit.text!r}")
        if self.include:
            hit = first_match(list(self.include), site.fqn)
            if hit is None:
                return StaticVerdict(False, "include", "matches no fp8.include pattern")
            return StaticVerdict(True, "include", f"matches fp8.include {hit.text!r}")
        if site.is_grouped_weight:
            return StaticVerdict(True, "grouped", f"MoE expert weights with dims divisible by {self.dims_multiple}: "
                                                  f"FP8 grouped GEMM")
        return StaticVerdict(True, "linear", f"linear layer with dims divisible by {self.dims_multiple}")
