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

Gloo has no float8 type ("Invalid scalar type"), and ``set_state_dict(full_state_dict=True)`` scatters each
full state to its shards (``distribute_tensor``): :func:`float8_as_bytes` turns the E4M3 states of a full
state dict into their ``uint8`` bytes for that, and :func:`load_entry` takes ``uint8`` bytes back into a
float8 state (the bytes are the payload; E4M3 is the only 1-byte state, so nothing is ambiguous).
"""

from __future__ import annotations

import torch

from fp8kit.fp8.scaling import DTYPE_MAX, scale_from_amax
from fp8kit.optim.flat_group import FlatGroup

#: per-parameter state names, in order (those whose buffer exists)
DATA_NAMES = ("m", "v", "master")
SCALE_NAMES = ("m_scale", "m_k", "v_scale", "master_scale")


#: float8 dtypes a state can be stored in (sent as their uint8 bytes through collectives: gloo has none)
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def float8_as_bytes(osd: dict) -> dict:
    """``osd`` (a ``torch.optim`` layout state dict, any keys) with every float8 tensor of ``osd["state"]``
    replaced by its ``uint8`` view (same bytes, no copy), for a scatter or broadcast over gloo; the other
    entries are the same objects. :func:`load_entry` reads the bytes back as the state's float8 dtype."""
    state = {
        key: {name: (t.view(torch.uint8) if isinstance(t, torch.Tensor) and t.dtype in FLOAT8_DTYPES else t)
              for name, t in st.items()} if isinstance(st, dict) else st
        for key, st in (osd.get("state") or {}).items()
    }
    return {**osd, "state": state}


def block_to_tensor_scales(osd: dict, block: int, eps: float) -> dict:
    """``osd`` (a full, per-parameter state dict, any keys) with every state saved with per-block scales recast
    with one scale per tensor: what a run with ``granularity = "tensor"`` (FSDP2) loads from a one-process
    checkpoint written with ``"block"``.

    Each scaled state (``m``, ``v``, ``master`` beside its ``*_scale``) is dequantized with its block scales (value
    ``data * (1 / scale)`` per block of ``block`` elements, ``numerics.load``'s formula) and cast again with
    ``scale = dtype_max / amax`` of the whole tensor (``fp8.scaling.scale_from_amax``; round to nearest, saturating):
    one rounding per element, as one optimizer step of the per-tensor recipe stores. Entries without block scales
    (per-tensor ones, unscaled states) are kept as they are.

    Raises:
        ValueError: a state with COAT's ``m_k`` (its expansion is not undone here), or fewer block scales than
            the tensor has blocks.
    """
    state = {}
    for key, st in (osd.get("state") or {}).items():
        if not isinstance(st, dict):
            state[key] = st
            continue
        new = dict(st)
        for name in DATA_NAMES:
            scale = st.get(f"{name}_scale")
            if scale is None or name not in st or scale.dim() == 0:
                continue
            if "m_k" in st:
                raise ValueError(f"FP8AdamW: parameter {key!r}: states with COAT's m_k cannot change granularity")
            data = st[name]
            x = data.float().reshape(-1)
            nb = -(-x.numel() // block)
            if scale.dim() != 1 or scale.numel() < nb:
                raise ValueError(f"FP8AdamW: parameter {key!r} state {name!r}: {scale.numel()} block scales for "
                                 f"{x.numel()} elements in blocks of {block}")
            # the last tensor of a group is padded by whole blocks (FlatLayout): its extra scales cover no element
            x = (torch.nn.functional.pad(x, (0, nb * block - x.numel())).view(nb, block)
                 * (1 / scale[:nb].float())[:, None]).reshape(-1)[: data.numel()]
            s = scale_from_amax(x.abs().amax(), data.dtype, eps)
            mx = DTYPE_MAX[data.dtype]
            new[name] = (x * s).clamp(-mx, mx).to(data.dtype).view(data.shape)
            new[f"{name}_scale"] = s.reshape(())
        state[key] = new
    return {**osd, "state": state}


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

    A ``uint8`` source for a float8 state is its bytes (:func:`float8_as_bytes`).

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
        if src.dtype == torch.uint8 and dst.dtype in FLOAT8_DTYPES:  # bytes of a float8 state (float8_as_bytes)
            src = src.view(dst.dtype)
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
