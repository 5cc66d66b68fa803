"""Session 37 experiment, second round: the delayed module's probe (fp8kit's code after the first fix) still fails
under train.compile on CUDA whenever the output-gradient hook gets the history scale ``sg`` (a graph input that the
autograd function also takes). Which way of handing the scale to the gradient hook compiles?
  clone     ``partial(grad_hook, sg.clone())``: an intermediate instead of the graph input;
  bufscale  the probe copies ``sg`` into a per-module float32 buffer in the forward; the hook reads the buffer.
`python exp2.py VARIANT OUT [graphs]`.
"""
import functools
import sys

import torch

import fp8kit.train.health as h
from fp8kit.config import load_config
from fp8kit.train.trainer import train

variant, out = sys.argv[1], sys.argv[2]
graphs = len(sys.argv) > 3
orig = h.FP8HealthMonitor._register


def _register(self, module, name, casts):
    handles, slots = orig(self, module, name, casts)
    if not isinstance(module, h.Float8DelayedLinear):
        return handles, slots
    monitor, bufs = self, {op: buf for _, op, _, buf in slots}
    sbuf = torch.ones((), dtype=torch.float32, device=module.weight.device)

    def grad_hook(scale, grad):
        bufs["grad_output"].copy_(h.operand_stats(grad.reshape(-1, grad.shape[-1]), casts["grad_output"], scale))

    def grad_hook_buf(grad):
        bufs["grad_output"].copy_(h.operand_stats(grad.reshape(-1, grad.shape[-1]), casts["grad_output"], sbuf))

    def probe(x, weight, scales, y):
        if monitor.active:
            sx, _, sw, _, sg, _ = scales
            bufs["input"].copy_(h.operand_stats(x, casts["input"], sx))
            bufs["weight"].copy_(h.operand_stats(weight, casts["weight"], sw))
            if y.requires_grad and sg is not None:
                if variant == "clone":
                    y.register_hook(functools.partial(grad_hook, sg.clone()))
                else:
                    sbuf.copy_(sg)
                    y.register_hook(grad_hook_buf)

    module.health_probe = probe
    return handles, slots


h.FP8HealthMonitor._register = _register
cfg = load_config(None, [
    "model.preset=tiny", "data.vocab_size=4096", "data.seq_length=256", "train.micro_batch_size=8", "train.steps=4",
    "train.compile=true", f"train.cuda_graphs={str(graphs).lower()}", "train.eval_every=0", "train.checkpoint_every=0",
    "train.final_checkpoint=false", "train.mixed_precision=fp8", "fp8.recipe=delayed", "selective.selective_fp8=false",
    "fp8.stats_every=1", f"data.cache_dir={out}/cache",
])
run = train(cfg, f"{out}/{variant}-{graphs}")
rows = [r["fp8_health"] for r in run.metrics if "fp8_health" in r][-1]
print(variant, "graphs" if graphs else "", "OK", [r for r in rows if r["operand"] == "grad_output"][-1])
