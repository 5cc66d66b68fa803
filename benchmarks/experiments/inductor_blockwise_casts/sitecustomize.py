# Experiment: blockwise activation / output-gradient casts as plain PyTorch under torch.compile (Inductor fuses
# them into their producers), the Triton kernels eagerly. Enabled by EXP_CAST=1.
import os

if os.environ.get("EXP_CAST") == "1":
    import torch

    from fp8kit.fp8 import blockwise
    from fp8kit.fp8.kernels import ops

    _act, _fprop = ops.quantize_act, ops.quantize_act_fprop

    def quantize_act(x, wgrad_x="128x1"):
        if torch.compiler.is_compiling():
            return blockwise.quantize_act(x, wgrad_x)
        return _act(x, wgrad_x)

    def quantize_act_fprop(x):
        if torch.compiler.is_compiling():
            return blockwise.quantize_act_fprop(x)
        return _fprop(x)

    ops.quantize_act, ops.quantize_act_fprop = quantize_act, quantize_act_fprop
    print("EXP_CAST: blockwise activation casts through Inductor", flush=True)
