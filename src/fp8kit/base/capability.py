"""Can this device run FP8 matmuls? ``fp8_support(device) -> (ok, reason)``.

One function serves both the runtime error of ``train`` and the skip reason of GPU-only tests (the
Transformer Engine habit, ``check_fp8_support``). FP8 tensor cores need CUDA compute capability 8.9
(Ada) or 9.0+ (Hopper, Blackwell). On the CPU, PyTorch's ``_scaled_mm`` runs FP8 matmuls in software:
slow, but the real code path, so it is supported.
"""

from __future__ import annotations

import torch

MIN_CAPABILITY = (8, 9)


def fp8_support(device: torch.device | str) -> tuple[bool, str]:
    """Whether FP8 matmuls run natively on ``device``, and a sentence saying why (not).

    Returns:
        ``(True, reason)`` on CPU and on CUDA GPUs of compute capability >= 8.9, else
        ``(False, reason)`` naming the GPU, its capability and the fix.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        if not hasattr(torch, "_scaled_mm"):
            return False, f"torch {torch.__version__} has no torch._scaled_mm; upgrade torch"
        return True, ("CPU: FP8 matmuls run in software (torch._scaled_mm; blockwise's GEMMs emulated in float32): "
                      "slow, same numerics")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available in this torch build or on this machine"
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
        cap = torch.cuda.get_device_capability(index)
        if cap < MIN_CAPABILITY:
            return False, (
                f"GPU {name} (cuda:{index}) has compute capability {cap[0]}.{cap[1]}; FP8 matmuls need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell). Fix: set "
                f"train.mixed_precision = \"bf16\", or fp8.emulate = true to emulate FP8 numerics "
                f"without the speed-up"
            )
        return True, f"GPU {name} (cuda:{index}), compute capability {cap[0]}.{cap[1]}: native FP8"
    return False, f"device type {dev.type!r} is not supported by fp8kit (use cpu or cuda)"
