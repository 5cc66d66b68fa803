"""Run under ``torchrun --nproc_per_node 2`` by tests/test_distributed.py: several small distributed runs.

Usage: ``torchrun --nproc_per_node 2 tests/distributed_worker.py OUT_ROOT CACHE_DIR SCENARIO ...``; each
scenario trains into ``OUT_ROOT/SCENARIO`` through :func:`fp8kit.train.trainer.train` (the same function
``torchrun -m fp8kit train`` calls), one process group for all of them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

#: the tiny preset with its MLP widened to 512 (688 is not a multiple of the blockwise recipe's 128, which would keep
#: the MLPs BF16 and the fused MLP idle): written by :func:`write_whole_block_config` into the cache directory
WHOLE_BLOCK_CONFIG = "{cache}/tiny_whole_blocks/config.json"
BLOCKWISE_FUSED = [f"model.hf_config={WHOLE_BLOCK_CONFIG}", "fp8.recipe=blockwise", "fp8.emulate=true",
                   "fp8.blockwise_fused_mlp=true"]


def write_whole_block_config(cache) -> None:
    """The HF config of :data:`WHOLE_BLOCK_CONFIG` (idempotent)."""
    from fp8kit.config import load_config
    from fp8kit.models.build import build_hf_config

    path = Path(WHOLE_BLOCK_CONFIG.format(cache=cache))
    if not path.is_file():
        cfg = load_config(None, ["model.num_layers=2"])
        hf = build_hf_config(cfg.model, 1024)
        hf.intermediate_size = 512
        path.parent.mkdir(parents=True, exist_ok=True)
        hf.to_json_file(str(path))


def scenario_sets(name: str, cache) -> list[str]:
    """The ``--set`` overrides of scenario ``name`` with the cache directory filled in."""
    return [s.format(cache=cache) for s in SCENARIOS[name]]

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
    # the output head in FP8 too (fp8.output_head): it takes the whole sequence, all-gathered after the final norm
    "tpsp_fp8_head": ["train.mixed_precision=fp8", "train.micro_batch_size=4", "distributed.tp=2",
                      "distributed.sequence_parallel=true", "fp8.output_head=true"],
    # blockwise with the fused SwiGLU MLPs (fp8.blockwise_fused_mlp) under FSDP2: the weights re-gathered for the
    # backward, their dgrad copies cast again there (keep_weight_copy = False)
    "fsdp_blockwise_fused": ["train.mixed_precision=fp8", "train.micro_batch_size=2", *BLOCKWISE_FUSED],
    # the same with the weights all-gathered as their 128x128-block E4M3 quantization (fp8.blockwise_all_gather)
    # (a DCP checkpoint at step 5, resumed on the same 2 ranks by the next scenario)
    "fsdp_blockwise_fused_e4m3": ["train.mixed_precision=fp8", "train.micro_batch_size=2", *BLOCKWISE_FUSED,
                                  "fp8.enable_fsdp_float8_all_gather=true", "train.checkpoint_every=5",
                                  "train.final_checkpoint=false"],
    "fsdp_blockwise_fused_e4m3_resumed": ["train.mixed_precision=fp8", "train.micro_batch_size=2", *BLOCKWISE_FUSED,
                                          "fp8.enable_fsdp_float8_all_gather=true", "train.final_checkpoint=false"],
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
    # the delayed recipe under FSDP2 (default optimizer: FP8AdamW) with the BF16 and the E4M3 all-gather
    # (fp8.delayed_all_gather), a DCP checkpoint at step 5 of the latter, resumed on the same 2 ranks
    "fsdp_delayed": ["train.mixed_precision=fp8", "fp8.recipe=delayed", "train.micro_batch_size=2",
                     "train.final_checkpoint=false"],
    "fsdp_delayed_e4m3": ["train.mixed_precision=fp8", "fp8.recipe=delayed", "train.micro_batch_size=2",
                          "fp8.enable_fsdp_float8_all_gather=true", "train.checkpoint_every=5",
                          "train.final_checkpoint=false"],
    "fsdp_delayed_e4m3_resumed": ["train.mixed_precision=fp8", "fp8.recipe=delayed", "train.micro_batch_size=2",
                                  "fp8.enable_fsdp_float8_all_gather=true", "train.final_checkpoint=false"],
}
#: scenario -> (scenario whose checkpoint it resumes, checkpoint directory name)
RESUME = {"fsdp_fp8adamw_resumed": ("fsdp_fp8adamw", "step_000005"),
          "fsdp_delayed_e4m3_resumed": ("fsdp_delayed_e4m3", "step_000005"),
          "fsdp_blockwise_fused_e4m3_resumed": ("fsdp_blockwise_fused_e4m3", "step_000005")}


def _count_blockwise_gathers() -> dict:
    """Count, per dtype of the gathered data, the weights FSDP2 hands to ``BlockwiseFloat8Weight.fsdp_post_all_gather``
    (the real method still runs): evidence that the blockwise FP8 all-gather took place, written per scenario."""
    from fp8kit.fp8.blockwise_all_gather import BlockwiseFloat8Weight

    counts: dict[str, int] = {}
    real = BlockwiseFloat8Weight.fsdp_post_all_gather

    def counting(self, all_gather_outputs, *args, **kwargs):
        key = str(all_gather_outputs[0].dtype)
        counts[key] = counts.get(key, 0) + 1
        return real(self, all_gather_outputs, *args, **kwargs)

    BlockwiseFloat8Weight.fsdp_post_all_gather = counting
    return counts


def main() -> None:
    out_root, cache = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    from fp8kit.config import load_config
    from fp8kit.train.trainer import train

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.conftest import small_run_overrides

    gathered = _count_blockwise_gathers()
    for name in sys.argv[3:]:
        sets = small_run_overrides(cache) + ["train.steps=10", "train.eval_every=0", "train.checkpoint_every=0"]
        cfg = load_config(None, sets + scenario_sets(name, cache))
        src = RESUME.get(name)
        gathered.clear()
        train(cfg, out_root / name, resume=out_root / src[0] / "checkpoints" / src[1] if src else None)
        rank = int(os.environ.get("RANK", "0"))
        (out_root / name / f"blockwise_gathers_rank{rank}.json").write_text(json.dumps(gathered))

    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


if __name__ == "__main__":
    main()
