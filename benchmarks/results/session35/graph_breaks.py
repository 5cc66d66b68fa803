"""Session 35 diagnosis (run on the GPU): graph breaks and recompiles of the delayed recipe in fp8kit's train step
(2-layer llama-125m, seq 1024, mbs 4, per-block compile). Prints whether the state is attached, the recompile /
graph-break log (TORCH_LOGS style) and Dynamo's counters: ``'graph_break': {}`` and 3 unique graphs is right.

    python benchmarks/results/session35/graph_breaks.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train_throughput import COMMON, variant_sets  # noqa: E402

from fp8kit.config import load_config  # noqa: E402
from fp8kit.train.loop import _loss_scales, next_micro_batch, train_step  # noqa: E402
from fp8kit.train.setup import build_setup  # noqa: E402

torch._logging.set_logs(graph_breaks=True, recompiles=True)
sets = [*COMMON, "model.preset=llama-125m", "data.seq_length=1024", "train.micro_batch_size=4",
        "data.cache_dir=/tmp/gbcache", "model.num_layers=2", *variant_sets("delayed", "llama-125m", "h100")]
cfg = load_config(None, sets)
setup = build_setup(cfg)
setup.model.train()
params = [p for p in setup.model.parameters() if p.requires_grad]
state = setup.prepared.conversion.delayed
print("attached", state.attached, len(state.entries))
for _ in range(4):
    micro = [next_micro_batch(setup) for _ in range(cfg.train.grad_accum)]
    scales, _ = _loss_scales(setup, micro)
    train_step(setup, params, micro, scales)
from torch._dynamo.utils import counters  # noqa: E402

print({k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break")})
