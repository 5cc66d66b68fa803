"""Bytes per parameter of the training state, by role, for any optimizer fp8kit builds.

Roles (FP8-LM, arXiv:2310.18313, section 2.1 accounting): ``master`` (the weights the optimizer updates
at full/decoupled precision), ``grad`` (gradients between backward and step), ``m`` and ``v`` (Adam's
moments, with their scales; ``m`` with COAT's exponents when expanded) and ``working`` (a separate copy
the model computes with, when it is not the master itself).

FP8AdamW over bf16 parameters, per-tensor scales (whose 4 bytes per tensor and state round to 0.00):

================================================= ====== ==== === === ===== =======================
layout                                            master grad m   v   state + working (bf16)
================================================= ====== ==== === === ===== =======================
defaults (autograd's bf16 gradient, no hooks)     2      2    1   2   7     9
FP8-LM (``grad="e5m2"``: FP8 gradient via hooks)  2      1    1   2   6     8
``torch.optim.AdamW``, fp32 master weights        4      4    4   4   16    16 (the master is used)
================================================= ====== ==== === === ===== =======================

Per-block scales add ``4 / block_size`` per scaled state (0.03125 each at 128; COAT's ``k`` one more on
``m``); the flat layout pads each tensor to ``block_size`` elements, and both are charged here.
"""

from __future__ import annotations

import torch

ROLES = ("master", "grad", "m", "v", "working")


def training_state_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes/param of each role, ``state`` (master + grad + m + v) and ``total`` (+ working), and ``params``.

    Args:
        params: the trained parameters (counted by element, so padding in flat buffers is charged).
        optimizer: an :class:`~fp8kit.optim.FP8AdamW` or a ``torch.optim`` Adam/AdamW.

    Gradients are charged at the size they have between backward and step (``param.numel *
    param.element_size`` for torch optimizers), whether or not they exist at the moment of the call.
    """
    from fp8kit.optim.fp8_adamw import FP8AdamW

    # FSDP2 (DTensor) parameters: this rank's shards on both sides of the ratio (FP8AdamW's flat buffers
    # hold only the local shards; dividing them by the global count would halve the figure at dp_shard 2)
    n = sum(_local(p).numel() for p in params)
    if isinstance(optimizer, FP8AdamW):
        b = optimizer.memory_bytes()
        shared = b["master"] == 0  # bf16_sr over bf16 parameters: the working weights are the master
        raw = {"master": b["working"] if shared else b["master"], "grad": b["grad"], "m": b["m"], "v": b["v"],
               "working": 0 if shared else b["working"]}
    else:
        raw = dict.fromkeys(ROLES, 0)
        raw["master"] = sum(_nbytes(p) for p in params)
        raw["grad"] = raw["master"]
        for p in params:
            st = optimizer.state.get(p, {})
            raw["m"] += _nbytes(st.get("exp_avg")) if st else _nbytes(p)
            raw["v"] += _nbytes(st.get("exp_avg_sq")) if st else _nbytes(p)
    out = {k: raw[k] / n for k in ROLES}
    out["state"] = out["master"] + out["grad"] + out["m"] + out["v"]
    out["total"] = out["state"] + out["working"]
    out["params"] = float(n)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else _local(t).numel() * _local(t).element_size()


def format_state_bytes(b: dict[str, float]) -> str:
    """One line: ``master 2.00 + grad 1.00 + m 1.00 + v 2.00 = 6.00 B/param (8.00 with working weights)``."""
    return (
        f"master {b['master']:.2f} + grad {b['grad']:.2f} + m {b['m']:.2f} + v {b['v']:.2f} = "
        f"{b['state']:.2f} B/param ({b['total']:.2f} with working weights)"
    )
