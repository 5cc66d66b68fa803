import os

if os.environ.get("EXP_TILE"):
    import torch._inductor.config as c
    c.triton.tile_reductions = True
    c.triton.prefer_nd_tiling = True
