"""Which delayed-scaling linears read the same input tensor, so that they cast it once.

In HF Llama / Qwen2 / Qwen3 / Mistral / Mixtral / Qwen3-MoE decoder layers, ``q_proj``, ``k_proj`` and ``v_proj``
of the self-attention read one tensor (the input RMSNorm's output), as ``gate_proj`` and ``up_proj`` of a SwiGLU
MLP do (the post-attention RMSNorm's output). With the delayed recipe each keeps its own amax history, so each
would cast that tensor at its own scale: three E4M3 copies of the attention input for fprop and three transposed
copies for wgrad per layer, where one of each serves all. :func:`link_input_siblings` gives every such linear
the entries of its group; :class:`fp8kit.fp8.delayed.Float8DelayedLinear` then casts at the group's smallest
input scale (the group leader's ``group_scale``, computed by the state's roll), one tensor read by every module of
the group, so ``torch.compile`` merges their casts into one (CSE). The histories record the same amaxes, so the scales, and the bits,
are those of separate scales in a run (Transformer Engine's fused ``LayerNormLinear`` over q/k/v has one input
scale for the same reason). The delayed fused SwiGLU MLP (:mod:`fp8kit.fp8.delayed_mlp`) applies the same rule
to gate and up on its own.

Where the histories differ the smallest scale wins, which no sibling's history saturates. A projection that comes
back from BF16 (the divergence guard's window, ``fp8kit.train.guard``; a precision phase) would bring the input
amaxes from before it left, and coarsen its group's scale until they leave the history. So when the group is linked
again its members that recorded fewer steps take the input history (row 0) and step count of the member that recorded
the most: they read the same tensor, so that row is what they would have recorded. Members of a group advance
together, so after each link their counts are equal, and the largest count is always the freshest input history.
Their own weight and output-gradient rows stay theirs.

Only the module classes below are linked: in other models (encoder-decoder cross-attention, for one) ``k_proj``
may read another tensor than ``q_proj``.
"""

from __future__ import annotations

import torch
from torch import nn

from fp8kit.fp8.delayed import Float8DelayedLinear
from fp8kit.fp8.delayed_state import DelayedEntry

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
    of one is no group: ``()``), make the first of them the group's ``leader`` (whose ``group_scale`` every member's
    input cast reads), bring the input histories of members that missed steps up to date
    (:func:`align_input_histories`), and attach every delayed state of ``model`` to it
    (``DelayedScalingState.attach``: its roll runs before each forward of ``model``). Call after every change of
    which modules are FP8 (``apply_fp8``, ``restore_bf16`` do). Returns the number of linked modules."""
    linked = 0
    delayed_all = [m for m in model.modules() if isinstance(m, Float8DelayedLinear)]
    states = {id(m.state): m.state for m in delayed_all}.values()
    for state in states:  # the last step's records into the histories first: the counts below include it
        state.roll()
        for e in state.entries.values():  # a projection swapped to BF16 leaves its group and is not waited for
            e.leader, e.members, e.group_ready, e.active = None, (), False, False
    for m in delayed_all:
        m._entry.active = True
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
        for e in entries:
            e.leader = entries[0]
        if entries:
            entries[0].members = entries
            ready = all(e.started for e in entries)
            for e in entries:
                e.group_ready = ready
        if entries:
            linked += len(group)
            align_input_histories(entries)
    for state in states:
        state.attach(model)
        state.roll()  # the scales of the new groups and of the aligned histories, before any forward reads them
    return linked


@torch.no_grad()
def align_input_histories(entries: tuple[DelayedEntry, ...]) -> int:
    """Give every entry of one group (modules that read one input tensor) that recorded fewer steps than the group's
    most the input-history row (``history[0]``) and step count of the entry that recorded the most (the module
    docstring says why that one is the freshest). Entries still on ``meta`` (meta-device initialisation) are left
    alone. One host read of each step count: call on precision switches, not in the step. Returns how many entries
    were updated."""
    if any(e.steps.is_meta or e.history.is_meta for e in entries):
        return 0
    counts = [int(e.steps) for e in entries]
    top = max(counts)
    newest = entries[counts.index(top)]
    behind = [e for e, c in zip(entries, counts, strict=True) if c < top]
    for e in behind:
        e.history[0].copy_(newest.history[0])
        e.steps.fill_(top)
    return len(behind)
