"""Will the model's training state fit the device? Checked before the model is built on it.

A one-process run that cannot hold its weights, gradients and optimizer states would otherwise spend minutes
building the model and then be killed by the kernel's out-of-memory handler (CPU) or stop with a CUDA
out-of-memory error, neither of which names the cause. :func:`check_state_fits` estimates those bytes from
the parameter count and the resolved ``[optim]`` / ``train.param_dtype`` and compares them with the memory the
device has free. Activations come on top and are not estimated (they depend on the sequence length, the
micro-batch, activation checkpointing and the compiler), so the check is a lower bound: it refuses only what
cannot fit, and warns when the state alone takes most of the free memory.

Distributed runs are not checked here: their parameters are sharded after the build (meta init).
"""

from __future__ import annotations

import torch

from fp8kit.base.errors import CapabilityError
from fp8kit.optim.precision import FP8AdamWPrecision

#: warn when the estimated training state takes more than this fraction of the free memory
WARN_FRACTION = 0.8
GIB = 2**30


def fp8_adamw_precision(o):
    """The :class:`~fp8kit.optim.FP8AdamWPrecision` of an ``[optim]`` section (``OptimConfig``)."""
    return FP8AdamWPrecision(
        master=o.master, grad=o.grad, m=o.m, v=o.v, granularity=o.granularity, block_size=o.block_size,
        m_rounding=o.m_rounding, m_expand=o.m_expand,
    )


def state_bytes_per_param(cfg) -> tuple[int, str]:
    """``(bytes per parameter, what they are)`` of the training state between backward and step: working
    weights + gradients + master + ``m`` + ``v``, scales excluded.

    ``cfg`` is a resolved :class:`~fp8kit.config.RunConfig` (``optim.name`` and ``train.param_dtype`` concrete,
    as :func:`fp8kit.config.optim_choice.resolve_optimizer` leaves them). ``torch.optim.AdamW`` keeps ``m`` and
    ``v`` in the parameters' dtype: fp32 parameters 4 + 4 + 4 + 4 = 16 bytes, bf16 ones 8. FP8AdamW:
    :meth:`fp8kit.optim.FP8AdamWPrecision.bytes_per_param` (9 by default over bf16 parameters).
    """
    param_bytes = 4 if cfg.train.param_dtype == "fp32" else 2
    if cfg.optim.name == "fp8_adamw":
        roles = fp8_adamw_precision(cfg.optim).bytes_per_param(param_bytes)
        return sum(roles.values()), f"FP8AdamW ({', '.join(f'{k} {v}' for k, v in roles.items())})"
    dtype = "fp32" if param_bytes == 4 else "bf16"
    return 4 * param_bytes, f"AdamW over {dtype} parameters (weights, gradients, m, v: {param_bytes} each)"


def free_bytes(device: torch.device) -> int | None:
    """Memory free on ``device`` in bytes: ``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` of
    ``/proc/meminfo`` on a Linux CPU; ``None`` where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            with open("/proc/meminfo", encoding="ascii") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def activation_bytes(hf_cfg, cfg) -> int:
    """A rough estimate of the bytes autograd saves for one micro-batch's backward, for a warning only.

    Per decoder layer ``34 s b h`` bytes (Korthikanti et al. 2022, arXiv:2205.05198, section 4.1: a transformer
    layer in 16-bit without recomputation, with flash attention, so their ``5 a s / h`` term is gone); with
    ``train.activation_checkpointing`` each layer keeps its ``2 s b h``-byte input and one layer is recomputed at
    a time. Plus the logits, ``s b V`` in fp32. ``s`` = ``data.seq_length``, ``b`` = ``train.micro_batch_size``,
    ``h`` = hidden size, ``V`` = vocabulary. Gated MLPs, MoE routing and the compiler's choices move the real
    figure either way.
    """
    s, b = cfg.data.seq_length, cfg.train.micro_batch_size
    h, layers = hf_cfg.hidden_size, hf_cfg.num_hidden_layers
    layer = 34 * s * b * h
    body = layers * 2 * s * b * h + layer if cfg.train.activation_checkpointing else layers * layer
    return body + 4 * s * b * cfg.data.vocab_size


def _gib(n: int | float) -> str:
    """``n`` bytes in GiB, one decimal; small sizes in MiB (a tiny model's state is not "0.0 GiB")."""
    return f"{n / GIB:.1f} GiB" if n >= 0.1 * GIB else f"{n / 2**20:.1f} MiB"


def check_state_fits(num_params: int, cfg, device: torch.device, free: int | None = None,
                     activations: int = 0) -> str | None:
    """Refuse a run whose training state cannot fit the device's free memory; warn when it will likely not fit
    with its activations.

    Args:
        num_params: parameters of the model (all of them: one process holds them whole).
        cfg: the resolved run config (:func:`state_bytes_per_param`).
        device: where the model will be built.
        free: free bytes (default: :func:`free_bytes` of ``device``); the check is skipped when unknown.
        activations: estimated activation bytes (:func:`activation_bytes`), used for the warning only.

    Returns:
        ``None``, or one line of warning when the state takes more than :data:`WARN_FRACTION` of the free memory
        or the state plus ``activations`` exceed it.

    Raises:
        CapabilityError: the state alone exceeds the free memory (names the sizes and what to change).
    """
    free = free_bytes(device) if free is None else free
    if not free:
        return None
    per, what = state_bytes_per_param(cfg)
    need = num_params * per
    count = f"{num_params / 1e9:.2f}B" if num_params >= 1e9 else f"{num_params / 1e6:.1f}M"
    sizes = (f"{count} parameters x {per} bytes ({what}) = {_gib(need)} of weights, "
             f"gradients and optimizer states, with {_gib(free)} free on {device}")
    if need > free:
        raise CapabilityError(
            f"the model does not fit: {sizes}, before activations. Use a smaller model (model.num_layers, "
            "model.preset), a GPU with more memory, or shard it (torchrun with [distributed])"
        )
    if need + activations > free or need > WARN_FRACTION * free:
        return (f"memory: {sizes}, and activations of about {_gib(activations)} (estimated) on top: this "
                "run will likely run out of memory (lower train.micro_batch_size or data.seq_length, or set "
                "train.activation_checkpointing = true)")
    return None
