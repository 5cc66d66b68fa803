"""Does torch._scaled_mm (the GEMM of torchao's Float8Linear, tensorwise) take a tensor-parallel shard whose width is
not a multiple of 16 on the GPU? The tiny preset's MLP (688 wide) over tp 2 gives 344-wide shards.

    python benchmarks/experiments/tp_shard_shape/check.py

Prints one line per shape: ok, or the error torch raises.
"""

import torch

e4m3 = torch.float8_e4m3fn
one = torch.ones((), device="cuda")
for m, k, n in ((256, 256, 688), (256, 256, 344), (256, 344, 256)):
    a = torch.randn(m, k, device="cuda").to(e4m3)
    b = torch.randn(n, k, device="cuda").to(e4m3).t()  # column-major second operand
    try:
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        print(f"{m}x{k} @ {k}x{n}: ok")
    except RuntimeError as err:
        print(f"{m}x{k} @ {k}x{n}: {str(err).splitlines()[0]}")
print(torch.__version__, torch.cuda.get_device_name())
