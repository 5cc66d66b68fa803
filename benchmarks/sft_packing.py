"""Fine-tuning rows: packed (position ids restart per sample) vs one sample per row, in time per epoch.

Samples have lengths drawn from a log-normal (median ``--median`` tokens, sigma 0.8, cut to seq_length + 1:
the shape of instruction data such as alpaca; the token ids are random, the lengths are what matters). For
each layout it builds :class:`fp8kit.data.sft.SFTData`, counts rows per epoch and the share of positions
that hold a sample (fill), times forward + backward of a micro-batch of the model (median of ``--iters``
after warm-up; a packed batch makes transformers build a block-diagonal mask, so attention cannot use its
plain causal kernel), and prints the estimated time per epoch.

    python benchmarks/sft_packing.py --preset llama-125m --seq-length 2048 --mbs 8 --out sft_packing.json
    python benchmarks/sft_packing.py --device cpu --tiny --out /tmp/sft_packing.json   # a CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from fp8kit.config import ModelConfig
from fp8kit.data.sft import SFTData
from fp8kit.models.build import build_model


def _samples(n: int, median: int, seq_length: int, vocab: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(median), 0.8, size=n)), 8, seq_length + 1).astype(int)
    out = []
    for n_tok in lengths:
        ids = rng.integers(0, vocab, size=n_tok)
        learnt = np.zeros(n_tok, dtype=bool)
        learnt[n_tok // 2 :] = True  # second half: the answer
        out.append((ids, learnt))
    return out


def _time(model, data: SFTData, mbs: int, iters: int, device: torch.device) -> float:
    times = []
    for i in range(iters + 2):
        b = data.next_batch(mbs).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=b.input_ids, **b.model_kwargs()).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b.labels.flatten())
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-125m")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--median", type=int, default=200, help="median sample length in tokens")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny preset, 2 layers, seq 256, 2000 samples (CPU check)")
    ap.add_argument("--out", required=True, help="JSON results file")
    args = ap.parse_args()
    if args.tiny:
        args.preset, args.num_layers, args.seq_length, args.samples, args.median, args.mbs, args.iters = (
            "tiny", 2, 256, 2000, 40, 4, 3)
    device = torch.device(args.device)
    vocab = 4096 if args.tiny else 32000
    samples = _samples(args.samples, args.median, args.seq_length, vocab, seed=0)
    model = build_model(ModelConfig(preset=args.preset, num_layers=args.num_layers), vocab, device=device,
                        dtype=torch.bfloat16, seed=0)
    rows = []
    for pack in (True, False):
        data = SFTData(samples, args.seq_length, 0.02, args.mbs, 0, pack=pack, pad_id=0)
        step_s = _time(model, data, args.mbs, args.iters, device)
        n_rows = len(data.train_rows)
        rows.append({"pack": pack, "train_rows": n_rows, "fill": data.fill, "step_s": step_s,
                     "epoch_s": n_rows / args.mbs * step_s})
    print(f"{args.preset} seq {args.seq_length} mbs {args.mbs} on {device}: {args.samples} samples, median "
          f"{args.median} tokens")
    print("| rows | per epoch | fill | fwd+bwd ms / micro-batch | epoch s (est.) |")
    print("|---|---|---|---|---|")
    for r in rows:
        name = "packed (position ids restart)" if r["pack"] else "one sample per row"
        print(f"| {name} | {r['train_rows']} | {r['fill']:.1%} | {r['step_s'] * 1e3:.1f} | {r['epoch_s']:.1f} |")
    speedup = rows[1]["epoch_s"] / rows[0]["epoch_s"]
    print(f"packing: {speedup:.2f}x faster per epoch")
    result = {"args": vars(args), "device": str(device), "torch": torch.__version__, "rows": rows,
              "packed_speedup_per_epoch": speedup}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
