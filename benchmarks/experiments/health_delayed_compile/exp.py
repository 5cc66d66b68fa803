"""Session 37 experiment: `fp8.stats_every` with `fp8.recipe = delayed` and `train.compile` fails on the H100 in
Inductor's pre-grad lint ("Argument ..._entry_scale_2_ of Node autograd_function_apply was used before it has been
defined"). Which hook change avoids it? `python exp.py VARIANT OUT`:
  base      fp8kit's hooks as they are;
  prehook   the delayed module's scales read (all three realized) in the forward pre-hook, before its forward;
  nograd    the post-hook registers the gradient hook without the history scale (dynamic scale in the stats).
"""
import functools
import math
import sys

import torch

import fp8kit.train.health as h
from fp8kit.config import load_config
from fp8kit.train.trainer import train

variant, out = sys.argv[1], sys.argv[2]


def _register(self, module, name, casts):
    monitor = self
    delayed = isinstance(module, h.Float8DelayedLinear)
    autocast = not isinstance(module, (h.Float8DelayedLinear, h.Float8BlockwiseLinear))
    bufs = {op: torch.full((6,), math.nan, dtype=torch.float64, device=module.weight.device) for op in casts}

    def stats(x, cast, scale=None):
        fn = h.operand_stats if torch.compiler.is_compiling() else monitor._stats
        return fn(x, cast, scale)

    def pre_hook(mod, args):
        if monitor.active and not delayed:
            x = args[0]
            if autocast and torch.is_autocast_enabled():
                x = x.to(torch.get_autocast_gpu_dtype())
            bufs["input"].copy_(stats(x, casts["input"]))
            bufs["weight"].copy_(stats(mod.weight, casts["weight"]))
        if monitor.active and delayed and variant == "prehook":
            scales = mod.cast_scales()
            sx, sw, sg = (None, None, None) if scales is None else scales
            bufs["input"].copy_(stats(args[0], casts["input"], sx))
            bufs["weight"].copy_(stats(mod.weight, casts["weight"], sw))
            if sg is not None:
                bufs["grad_output"].add_(sg * 0)  # NaN stays NaN: only realizes sg before the forward

    def grad_hook(scale, grad):  # as fp8kit.train.health's (session 41: measured in the hook, nothing kept)
        fn = h.operand_stats if torch.compiler.is_compiling() else h.operand_stats_chunked
        bufs["grad_output"].copy_(fn(grad.reshape(-1, grad.shape[-1]), casts["grad_output"], scale))

    def post_hook(mod, args, out):
        if monitor.active:
            g_scale = None
            if delayed and variant != "nograd":
                scales = mod.cast_scales()
                sx, sw, g_scale = (None, None, None) if scales is None else scales
                if variant == "base":
                    bufs["input"].copy_(stats(args[0], casts["input"], sx))
                    bufs["weight"].copy_(stats(mod.weight, casts["weight"], sw))
            if "grad_output" in bufs and out.requires_grad:
                out.register_hook(functools.partial(grad_hook, g_scale))

    handles = [module.register_forward_pre_hook(pre_hook), module.register_forward_hook(post_hook)]
    return handles, [(name, op, casts[op], bufs[op]) for op in casts]


h.FP8HealthMonitor._register = _register
cfg = load_config(None, [
    "model.preset=tiny", "data.vocab_size=4096", "data.seq_length=256", "train.micro_batch_size=8", "train.steps=4",
    "train.compile=true", "train.eval_every=0", "train.checkpoint_every=0", "train.final_checkpoint=false",
    "train.mixed_precision=fp8", "fp8.recipe=delayed", "selective.selective_fp8=false", "fp8.stats_every=1",
    f"data.cache_dir={out}/cache",
])
run = train(cfg, f"{out}/{variant}")
print(variant, "OK", [r.get("fp8_health", [{}])[0] for r in run.metrics if "fp8_health" in r][-1])
