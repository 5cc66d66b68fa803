"""MoE experts in FP8: rowwise E4M3 quantization, the FP8 grouped GEMM, token dispatch, the experts module."""
