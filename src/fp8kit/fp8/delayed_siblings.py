"""Which delayed-scaling linears read the same input tensor, so that they cast it once.

In HF Llama / Qwen2 / Qwen3 / Mistral / Mixtral / Qwen3-MoE decoder layers, ``q_proj``, ``k_proj`` and ``v_proj``
of the self-attention read one tensor (the input RMSNorm's output), as ``gate_proj`` and ``up_proj`` of a SwiGLU
MLP do (the post-attention RMSNorm's output). With the delayed recipe each keeps its own amax history, so each
would cast that tensor at its own scale: three E4M3 copies of the attention input for fprop and three transposed
copies for wgrad per layer, where one of each serves all. :func:`link_input_siblings` gives every such linear
the entries of its group; :class:`fp8kit.fp8.delayed.Float8DelayedLinear` then casts at the group's smallest
input scale (``DelayedScalingState.shared_input_scale``), the same expression in every module of the group, which
``torch.compile`` merges into one cast (CSE). The histories record the same amaxes, so the scales, and the bits,
are those of separate scales in a run (Transformer Engine's fused ``LayerNormLinear`` over q/k/v has one input
scale for the same reason). The delayed fused SwiGLU MLP (:mod:`fp8kit.fp8.delayed_mlp`) applies the same rule
to gate and up on its own.

Where the histories differ the smallest scale wins, which no sibling's history saturates but which is coarser for
the others: after the divergence guard (``fp8kit.train.guard``) kept one projection in BF16 for a while, its
history still holds the amaxes from before that window when it returns, and its group casts at the smaller of
the scales until those leave the history (``fp8.amax_history_len`` steps at most).

Only the module classes below are linked: in other models (encoder-decoder cross-attention, for one) ``k_proj``
may read another tensor than ``q_proj``.
"""

from __future__ import annotations

from torch import nn

from fp8kit.fp8.delayed import Float8DelayedLinear

#: parent module class -> the projections that read one input tensor
SIBLINGS: dict[str, tuple[str, ...]] = {
    **{cls: ("q_proj", "k_proj", "v_proj") for cls in (
        "LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention", "MixtralAttention",
        "Qwen3MoeAttention")},
    **{cls: ("gate_proj", "up_proj") for cls in ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "Qwen3MoeMLP")},
}


def link_input_siblings(model: nn.Module) -> int:
    """Set ``_input_siblings`` on every :class:`Float8DelayedLinear` projection of a :data:`SIBLINGS` parent in
    ``model`` to the entries of its group's projections that are delayed linears of the same state now (a group
    of one is no group: ``()``). Call after every change of which modules are FP8 (``apply_fp8``,
    ``restore_bf16`` do). Returns the number of linked modules."""
    linked = 0
    for parent in model.modules():
        names = SIBLINGS.get(type(parent).__name__)
        if names is None:
            continue
        mods = [getattr(parent, n, None) for n in names]
        delayed = [m for m in mods if isinstance(m, Float8DelayedLinear)]
        group = [m for m in delayed if m.state is delayed[0].state] if delayed else []
        entries = tuple(m._entry for m in group) if len(group) > 1 else ()
        for m in delayed:
            m._input_siblings = entries if m in group else ()
        linked += len(group) if entries else 0
    return linked
