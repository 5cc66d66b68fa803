"""``fp8.delayed_fused_cast = "grad_output"`` without q_proj / k_proj: their output gradients come out of RoPE's
backward, a pointwise kernel Inductor fuses their casts into; through the op, that kernel writes a bf16 copy first.
Imported by ``sitecustomize.py`` when ``EXP_GRAD_NO_ROPE=1`` (experiment only; fp8kit reads no environment)."""

from fp8kit.fp8.delayed import Float8DelayedLinear

_ROPE_FED = ("q_proj", "k_proj")
_fused_casts = Float8DelayedLinear._fused_casts


def _without_rope_fed(self) -> tuple[str, ...]:
    ops = _fused_casts(self)
    return tuple(o for o in ops if o != "grad_output") if self.name.rsplit(".", 1)[-1] in _ROPE_FED else ops


Float8DelayedLinear._fused_casts = _without_rope_fed
print("grad_cast_rope: q_proj / k_proj cast their output gradients through Inductor", flush=True)
