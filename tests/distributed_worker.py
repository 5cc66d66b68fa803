"""Run under ``torchrun --nproc_per_node 2`` by tests/test_distributed.py: several small distributed runs.

Usage: ``torchrun --nproc_per_node 2 tests/distributed_worker.py OUT_ROOT CACHE_DIR SCENARIO ...``; each
scenario trains into ``OUT_ROOT/SCENARIO`` through :func:`fp8kit.train.trainer.train` (the same function
``torchrun -m fp8kit train`` calls), one process group for all of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

SCENARIOS = {
    # global batch 4 sequences like the single-process reference (micro_batch_size 4)
    "fsdp_bf16": ["train.mixed_precision=bf16", "train.micro_batch_size=2"],
    "fsdp_fp8": ["train.mixed_precision=fp8", "train.micro_batch_size=2", "train.checkpoint_every=5"],
    "tp_bf16": ["train.mixed_precision=bf16", "train.micro_batch_size=4", "distributed.tp=2"],
    "tp_fp8": ["train.mixed_precision=fp8", "train.micro_batch_size=4", "distributed.tp=2"],
    "tpsp_bf16": ["train.mixed_precision=bf16", "train.micro_batch_size=4", "distributed.tp=2",
                  "distributed.sequence_parallel=true"],
    "tpsp_fp8": ["train.mixed_precision=fp8", "train.micro_batch_size=4", "distributed.tp=2",
                 "distributed.sequence_parallel=true"],
    # MoE: FP8 grouped experts under FSDP2 (the 3-D expert weights sharded on dim 0 like any weight)
    "fsdp_moe_fp8": ["model.preset=tiny-moe", "train.mixed_precision=fp8", "train.micro_batch_size=2"],
    # expert parallel: 4 of the 8 experts per rank, tokens by all-to-all, the rest FSDP2
    "ep_moe_fp8": ["model.preset=tiny-moe", "train.mixed_precision=fp8", "train.micro_batch_size=2",
                   "distributed.ep=2", "train.checkpoint_every=5"],
    "ep_moe_bf16": ["model.preset=tiny-moe", "train.mixed_precision=bf16", "train.micro_batch_size=2",
                    "distributed.ep=2"],
    # every rank builds the whole model first (today's single-process init), 3 steps (tests/test_meta_init.py)
    "fsdp_bf16_full_init": ["train.mixed_precision=bf16", "train.micro_batch_size=2", "distributed.meta_init=false",
                            "train.steps=3", "train.final_checkpoint=false"],
    # FP8AdamW over FSDP2 shards (tests/test_fp8_adamw_fsdp.py): a DCP checkpoint at step 5, then resumed from
    # it on the same 2 ranks (dp_shard = 2) by the next scenario
    "fsdp_fp8adamw": ["optim.name=fp8_adamw", "optim.grad=param", "train.mixed_precision=bf16", "train.micro_batch_size=2",
                      "train.checkpoint_every=5", "train.final_checkpoint=false"],
    "fsdp_fp8adamw_resumed": ["optim.name=fp8_adamw", "optim.grad=param", "train.mixed_precision=bf16", "train.micro_batch_size=2",
                              "train.final_checkpoint=false"],
}
#: scenario -> (scenario whose checkpoint it resumes, checkpoint directory name)
RESUME = {"fsdp_fp8adamw_resumed": ("fsdp_fp8adamw", "step_000005")}


def main() -> None:
    out_root, cache = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    from fp8kit.config import load_config
    from fp8kit.train.trainer import train

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.conftest import small_run_overrides

    for name in sys.argv[3:]:
        sets = small_run_overrides(cache) + ["train.steps=10", "train.eval_every=0", "train.checkpoint_every=0"]
        cfg = load_config(None, sets + SCENARIOS[name])
        src = RESUME.get(name)
        train(cfg, out_root / name, resume=out_root / src[0] / "checkpoints" / src[1] if src else None)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
