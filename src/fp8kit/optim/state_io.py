"""FP8AdamW's per-parameter states in the ``torch.optim`` layout (``state[param_index][name]``).

Each parameter's entry holds its part of the group's flat buffers (``optim/flat_group.py``):

========================== ===================================================================================
name                       value
========================== ===================================================================================
``step``                   float32 0-dim tensor (as ``torch.optim.AdamW``)
``m``, ``v``, ``master``   the payload in its storage dtype (E4M3, FP16, ...), the parameter's shape; under
                           FSDP2 a DTensor of the parameter's global shape, mesh and placements (``Shard(0)``)
``*_scale``, ``m_k``       per tensor: float32 0-dim (equal on every rank: reduced over the shards); per block:
                           the tensor's block scales, 1-D
========================== ===================================================================================

(``master`` and its scale are absent when the working weights are the master; ``m_k`` only with COAT's
expansion.) This is what ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` reads, so
DCP saves the payloads as sharded tensors and reshards them on load (dp_shard = 2 -> 1, ...) and a
single-process checkpoint loads into FSDP2 through ``set_state_dict(full_state_dict=True)``. A payload is
stored with its own scale and no requantization happens on a reshard, because the per-tensor scales are
the unsharded tensor's (``optim/sharded.py``).
"""

from __future__ import annotations

import torch

from fp8kit.optim.flat_group import FlatGroup

#: per-parameter state names, in order (those whose buffer exists)
DATA_NAMES = ("m", "v", "master")
SCALE_NAMES = ("m_scale", "m_k", "v_scale", "master_scale")


def param_entry(fg: FlatGroup, ti: int, bufs: dict[str, torch.Tensor | None], step: int,
                clone: bool) -> dict[str, torch.Tensor]:
    """The state entry of parameter ``ti`` of group ``fg`` from flat buffers ``bufs`` (``fg.buffers()`` or a
    copy): views into ``bufs``, cloned (and wrapped as DTensors under FSDP2) when ``clone``."""
    p, L = fg.params[ti], fg.layout
    local_shape = fg.local(p).shape
    out: dict[str, torch.Tensor] = {"step": torch.tensor(float(step), dtype=torch.float32)}
    for name, buf in bufs.items():
        if buf is None:
            continue
        if name in DATA_NAMES:
            t = L.segment(buf, ti).view(local_shape)
            if fg.shard is not None and clone:
                t = fg.shard.wrap(t.clone(), p)
            elif clone:
                t = t.clone()
        else:
            t = buf[ti] if fg.spec.granularity == "tensor" else buf[L.block_range(ti)]
            if clone:
                t = t.clone()
        out[name] = t
    return out


def load_entry(fg: FlatGroup, ti: int, key, st: dict) -> int:
    """Copy a saved entry (:func:`param_entry`'s layout) into group ``fg``'s buffers; returns its step.

    Raises:
        ValueError: names, dtypes or sizes that differ from this optimizer's (another precision or model).
    """
    mine = {k: v for k, v in fg.buffers().items() if v is not None}
    saved = {k for k in st if k != "step"}
    if saved != set(mine):
        raise ValueError(
            f"FP8AdamW.load_state_dict: parameter {key!r} has saved states {sorted(saved)}, this optimizer keeps "
            f"{sorted(mine)} (saved with another optim.master / m / v / m_expand)"
        )
    L = fg.layout
    for name, buf in mine.items():
        src = st[name]
        if hasattr(src, "to_local"):
            src = src.to_local()
        if name in DATA_NAMES:
            dst = L.segment(buf, ti)
        else:
            dst = buf[ti : ti + 1] if fg.spec.granularity == "tensor" else buf[L.block_range(ti)]
        if src.dtype != dst.dtype:
            raise ValueError(
                f"FP8AdamW.load_state_dict: state {name!r} of parameter {key!r} was saved as {src.dtype}, this "
                f"optimizer stores {dst.dtype} (another optim precision)"
            )
        if src.numel() != dst.numel():
            raise ValueError(
                f"FP8AdamW.load_state_dict: state {name!r} of parameter {key!r} has {src.numel()} elements here "
                f"{tuple(src.shape)}, expected {dst.numel()} (another model shape or sharding)"
            )
        dst.copy_(src.reshape(dst.shape))
    return int(round(float(st["step"])))
