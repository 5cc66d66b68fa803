"""Distributed training throughput on 2 (or --nproc) GPUs through the user's command (``torchrun -m fp8kit train``).

Workload: Llama-3-8B layer shapes (``model.preset=llama3-8b``), ``--layers`` blocks (default 4), seq 4096,
micro-batch 2 per data-parallel rank, vocab 32000, per-block torch.compile, AdamW, stdlib corpus.
Variants (each a fresh ``torchrun --nproc_per_node NPROC -m fp8kit train`` process group)::

    fsdp-bf16             FSDP2 (dp_shard 2), bf16
    fsdp-fp8-bf16ag       FSDP2, fp8 tensorwise, BF16 all-gather (fp8.enable_fsdp_float8_all_gather=false)
    fsdp-fp8-fp8ag        FSDP2, fp8 tensorwise, FP8 all-gather (the default)
    fsdp-delayed-bf16ag / fsdp-delayed-fp8ag      the delayed recipe, BF16 / E4M3 all-gather (fp8.delayed_all_gather)
    fsdp-blockwise-bf16ag / fsdp-blockwise-fp8ag  blockwise, BF16 / 128x128-block E4M3 all-gather
                          (fp8.blockwise_all_gather)
    tp-bf16, tp-fp8       tensor parallel 2 (dp 1: micro-batch 4 so the global batch equals FSDP2's)
    tpsp-bf16, tpsp-fp8   the same with sequence parallel (norms and residual stream split over tokens)
    tpfsdp-bf16/-fp8      (--nproc 4) TP 2 x FSDP2 2, fp8 with FP8 all-gather (the default for tensorwise)
    hsdp-bf16/-fp8        (--nproc 4) HSDP: 2 replicas x FSDP2 2
    moe-fsdp-bf16/-fp8    Qwen3-30B-A3B layer shapes (128 experts, 8 per token), FSDP2 over all weights
    moe-ep-bf16/-fp8      the same with expert parallel 2 (64 experts per GPU, all-to-all dispatch)
    moe-ep-fp8-fp8dispatch  moe-ep-fp8 with the dispatch all-to-all in FP8 (distributed.ep_fp8_dispatch)
    fsdp-fp8-fp8rs        fsdp-fp8-fp8ag with the gradient reduce-scatter in FP8 E5M2
                          (distributed.fp8_reduce_scatter; NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 for a slow link)

Each run's ``summary.json`` gives the median tokens/s (all ranks) and per GPU; speed-ups are per GPU
against fsdp-bf16 of the same invocation. All-gather bytes per step are counted from the parameter
shapes and dtypes (:func:`all_gather_bytes`), not measured on the wire.

    python benchmarks/distributed_throughput.py --out /tmp/dist --steps 20
    python benchmarks/distributed_throughput.py --variants fsdp-bf16,fsdp-fp8-fp8ag --layers 8 \
        --set train.micro_batch_size=4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import COMMON as THROUGHPUT_COMMON  # noqa: E402 - the shared benchmark settings

COMMON = ["model.preset=llama3-8b", "data.seq_length=4096", *THROUGHPUT_COMMON]
VARIANTS = {
    "fsdp-bf16": ["train.mixed_precision=bf16", "train.micro_batch_size=2"],
    "fsdp-fp8-bf16ag": ["train.mixed_precision=fp8", "selective.selective_fp8=false", "train.micro_batch_size=2", "fp8.enable_fsdp_float8_all_gather=false"],
    "fsdp-fp8-fp8ag": ["train.mixed_precision=fp8", "selective.selective_fp8=false", "train.micro_batch_size=2", "fp8.enable_fsdp_float8_all_gather=true"],
    # the delayed recipe with the BF16 and its E4M3 all-gather (fp8.delayed_all_gather, session 48)
    "fsdp-delayed-bf16ag": ["train.mixed_precision=fp8", "fp8.recipe=delayed", "selective.selective_fp8=false",
                            "train.micro_batch_size=2", "fp8.enable_fsdp_float8_all_gather=false"],
    "fsdp-delayed-fp8ag": ["train.mixed_precision=fp8", "fp8.recipe=delayed", "selective.selective_fp8=false",
                           "train.micro_batch_size=2", "fp8.enable_fsdp_float8_all_gather=true"],
    # the blockwise recipe with the BF16 and its 128x128-block E4M3 all-gather (fp8.blockwise_all_gather, session 49)
    "fsdp-blockwise-bf16ag": ["train.mixed_precision=fp8", "fp8.recipe=blockwise", "selective.selective_fp8=false",
                              "train.micro_batch_size=2", "fp8.enable_fsdp_float8_all_gather=false"],
    "fsdp-blockwise-fp8ag": ["train.mixed_precision=fp8", "fp8.recipe=blockwise", "selective.selective_fp8=false",
                             "train.micro_batch_size=2", "fp8.enable_fsdp_float8_all_gather=true"],
    "tp-bf16": ["train.mixed_precision=bf16", "train.micro_batch_size=4", "distributed.tp=2"],
    "tp-fp8": ["train.mixed_precision=fp8", "selective.selective_fp8=false", "train.micro_batch_size=4", "distributed.tp=2"],
    "tpsp-bf16": ["train.mixed_precision=bf16", "train.micro_batch_size=4", "distributed.tp=2",
                  "distributed.sequence_parallel=true"],
    "tpsp-fp8": ["train.mixed_precision=fp8", "selective.selective_fp8=false", "train.micro_batch_size=4", "distributed.tp=2",
                 "distributed.sequence_parallel=true"],
    # 4 GPUs (--nproc 4): TP 2 x FSDP2 2 and HSDP 2 x 2; global batch 8 sequences like fsdp-* on 4 ranks
    "tpfsdp-bf16": ["train.mixed_precision=bf16", "train.micro_batch_size=4", "distributed.tp=2"],
    "tpfsdp-fp8": ["train.mixed_precision=fp8", "selective.selective_fp8=false", "train.micro_batch_size=4", "distributed.tp=2"],
    "hsdp-bf16": ["train.mixed_precision=bf16", "train.micro_batch_size=2", "distributed.dp_replicate=2"],
    "hsdp-fp8": ["train.mixed_precision=fp8", "selective.selective_fp8=false", "train.micro_batch_size=2", "distributed.dp_replicate=2"],
    "moe-fsdp-bf16": ["model.preset=qwen3-30b-a3b", "train.mixed_precision=bf16", "train.micro_batch_size=2"],
    "moe-fsdp-fp8": ["model.preset=qwen3-30b-a3b", "train.mixed_precision=fp8", "selective.selective_fp8=false", "train.micro_batch_size=2"],
    "moe-ep-bf16": ["model.preset=qwen3-30b-a3b", "train.mixed_precision=bf16", "train.micro_batch_size=2",
                    "distributed.ep=2"],
    "moe-ep-fp8": ["model.preset=qwen3-30b-a3b", "train.mixed_precision=fp8", "selective.selective_fp8=false", "train.micro_batch_size=2",
                   "distributed.ep=2"],
    "fsdp-fp8-fp8rs": ["train.mixed_precision=fp8", "selective.selective_fp8=false", "train.micro_batch_size=2",
                       "distributed.fp8_reduce_scatter=e5m2"],
    "moe-ep-fp8-fp8dispatch": ["model.preset=qwen3-30b-a3b", "train.mixed_precision=fp8", "selective.selective_fp8=false",
                               "train.micro_batch_size=2", "distributed.ep=2", "distributed.ep_fp8_dispatch=true"],
}


def all_gather_bytes(layers: int, fp8_all_gather: bool, world: int = 2) -> dict:
    """Bytes FSDP2 all-gathers per optimizer step and rank (the unsharded outputs; the wire carries
    ``(world - 1) / world`` of them), from the parameter shapes and dtypes.

    Every block is gathered in forward and again in backward except the last (kept gathered:
    ``reshard_after_forward=False``); the root (embeddings, final norm, lm_head) once. FP8 all-gather:
    the weights of FP8 linears travel as 1-byte E4M3 plus one fp32 scale each; all else bf16.
    """
    from fp8kit.config import load_config
    from fp8kit.config.options import options_from_config
    from fp8kit.models.build import build_model
    from fp8kit.parallel.convert import fp8_fqns
    from fp8kit.selective.decide import decide
    from fp8kit.selective.sites import find_sites

    cfg = load_config(None, COMMON + [f"model.num_layers={layers}"])
    model = build_model(cfg.model, cfg.data.vocab_size, device="meta")
    fp8 = {f + ".weight" for f in fp8_fqns(decide(find_sites(model), options_from_config(cfg)))}
    block_bytes, root_bytes = [0] * layers, 0
    for name, p in model.named_parameters():
        size = p.numel() + 4 if (fp8_all_gather and name in fp8) else 2 * p.numel()
        parts = name.split(".")
        if "layers" in parts:
            block_bytes[int(parts[parts.index("layers") + 1])] += size
        else:
            root_bytes += size
    per_step = root_bytes + sum(block_bytes) + sum(block_bytes[:-1])
    return {"per_step_bytes": per_step, "wire_bytes_per_rank": per_step * (world - 1) / world,
            "root_bytes": root_bytes, "block_bytes": block_bytes[0]}


def run_variant(name: str, out: Path, steps: int, layers: int, cache: Path, timeout: int, extra: list[str],
                nproc: int = 2) -> dict:
    sets = COMMON + VARIANTS[name] + [f"model.num_layers={layers}", f"train.steps={steps}", f"data.cache_dir={cache}"]
    sets += extra  # --set overrides last: they win over the variant's settings
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "-m", "fp8kit", "train", "--out", str(out / name)] + [a for s in sets for a in ("--set", s)]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    (out / f"{name}.log").write_text(proc.stdout[-20000:] + "\n" + proc.stderr[-20000:])
    if proc.returncode != 0:
        # the ranks' own exception, not torchrun's ChildFailedError wrapper (session 49 lost the cause that way)
        err = [ln for ln in proc.stderr.splitlines() if ("Error" in ln or "Exception" in ln or ln.startswith("error"))
               and "ChildFailedError" not in ln and "torch/_guards.py" not in ln]
        return {"variant": name, "ok": False, "error": (err[-1] if err else proc.stderr[-500:]), "wall_s": wall,
                "log": str(out / f"{name}.log"), "command": " ".join(cmd)}
    s = json.loads((out / name / "summary.json").read_text())
    return {"variant": name, "ok": True, "tokens_per_s": s["tokens_per_s"], "tokens_per_s_per_gpu": s["tokens_per_s_per_gpu"],
            "step_ms": s["step_ms"], "mfu": s["mfu"], "peak_mem_gib_rank0": s["peak_mem_gib"], "final_loss": s["final_loss"],
            "parallel": s["parallel"], "device": s["device"], "versions": s["versions"], "wall_s": wall,
            "command": " ".join(cmd)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/distributed_throughput")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2, help="GPUs (torchrun --nproc_per_node)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cache", default=None, help="data cache dir (default OUT/cache)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per variant")
    ap.add_argument("--json", default=None, help="write all results to this JSON file")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config override applied to every variant after its own (e.g. train.micro_batch_size=4)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else out / "cache"
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "layers": args.layers, "steps": args.steps,
               "sets": args.sets,
               "nproc": args.nproc,
               "all_gather": {"bf16": all_gather_bytes(args.layers, False, args.nproc),
                              "fp8": all_gather_bytes(args.layers, True, args.nproc)},
               "runs": []}
    from fp8kit.config import load_config
    from fp8kit.data.prepare import prepare_data

    t0 = time.time()  # tokenizer and token cache once, outside the timed variants
    prepare_data(load_config(None, COMMON + [f"data.cache_dir={cache}"]).data, micro_batch_size=4, seed=0)
    print(f"data prepared in {time.time() - t0:.0f} s", flush=True)
    for name in args.variants.split(","):
        try:
            r = run_variant(name, out, args.steps, args.layers, cache, args.timeout, args.sets, args.nproc)
        except subprocess.TimeoutExpired:
            r = {"variant": name, "ok": False, "error": f"timeout after {args.timeout} s"}
        results["runs"].append(r)
        print(json.dumps(r)[:400], flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    bases = {fam: next((r for r in results["runs"] if r["variant"] == f"{fam}fsdp-bf16" and r["ok"]), None)
             for fam in ("", "moe-")}
    print(f"\n{'variant':<18} {'tok/s/GPU':>10} {'step ms':>8} {'MFU':>6} {'peak GiB':>9} {'vs (moe-)fsdp-bf16':>18}")
    for r in results["runs"]:
        if not r["ok"]:
            print(f"{r['variant']:<18} FAILED: {r['error'][:150]}")
            continue
        base = bases["moe-" if r["variant"].startswith("moe-") else ""]
        sp = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else float("nan")
        r["speedup_per_gpu_vs_fsdp_bf16"] = sp
        mfu = f"{r['mfu']:.1%}" if r["mfu"] else "-"
        print(f"{r['variant']:<18} {r['tokens_per_s_per_gpu']:>10,.0f} {r['step_ms']:>8.1f} {mfu:>6} "
              f"{r['peak_mem_gib_rank0']:>9.1f} {sp:>11.2f}x")
    ag = results["all_gather"]
    print(f"all-gather per step and rank: bf16 {ag['bf16']['per_step_bytes'] / 2**30:.2f} GiB, "
          f"fp8 {ag['fp8']['per_step_bytes'] / 2**30:.2f} GiB ({ag['fp8']['per_step_bytes'] / ag['bf16']['per_step_bytes']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
