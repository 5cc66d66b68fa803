"""One training step of a model prepared as ``fp8kit train`` prepares it, every gradient dumped; and the comparison of
two dumps. For regressions that change training but not a unit test's layer: run ``dump`` with two source trees
(``PYTHONPATH=old/src`` vs ``src``) on the same settings, then ``compare`` names the parameters whose gradients
moved. It found session 13's zero expert gradients under ``torch.compile`` (docs/benchmarks.md section 4).

    python benchmarks/debug_step_compare.py dump OUT.pt --set model.hf_config=... --set fp8.recipe=tensorwise ...
    python benchmarks/debug_step_compare.py compare A.pt B.pt [--top 8]

``dump`` builds the model from the run config (seed 0, float32 weights, bf16 autocast), prepares it with the run's
FP8 decisions and ``train.compile``, and runs one training forward + backward and one evaluation forward on a fixed
random batch (``train.micro_batch_size`` x ``data.seq_length``). On the CPU it emulates FP8 (``fp8.emulate``).
"""

from __future__ import annotations

import argparse
import sys

import torch


def dump(sets: list[str], out: str) -> dict:
    """Run the step for the config overrides ``sets`` (``key=value``), save and return
    ``{"loss_train", "loss_eval", "grads": {name: float32 CPU tensor}}``."""
    from fp8kit.config import load_config
    from fp8kit.config.options import options_from_config
    from fp8kit.config.prepare_options import prepare_options
    from fp8kit.models.build import build_hf_config, build_model
    from fp8kit.parallel.prepare import prepare_model
    from fp8kit.selective.decide import decide
    from fp8kit.selective.sites import find_sites

    cfg = load_config(None, sets)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(cfg.model, cfg.data.vocab_size, device=dev, dtype=torch.float32, seed=0)
    hf_cfg = build_hf_config(cfg.model, cfg.data.vocab_size)
    fp8 = cfg.train.mixed_precision == "fp8"
    decisions = decide(find_sites(model), options_from_config(cfg, hf_cfg, dev))
    prepare_model(model, decisions, prepare_options(cfg, fp8_now=fp8, emulate=dev == "cpu"), None, hf_cfg=hf_cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.data.vocab_size, (cfg.train.micro_batch_size, cfg.data.seq_length + 1), generator=g)
    ids = ids.to(dev)
    res: dict = {}
    for mode in ("train", "eval"):
        model.train(mode == "train")
        with torch.autocast(dev, dtype=torch.bfloat16), torch.set_grad_enabled(mode == "train"):
            logits = model(ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        if mode == "train":
            loss.backward()
            res["grads"] = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
        res[f"loss_{mode}"] = loss.item()
    torch.save(res, out)
    return res


def compare(a: dict, b: dict, top: int = 8) -> list[tuple[float, str, float, float]]:
    """``(relative difference ||ga - gb|| / ||ga||, name, ||ga||, ||gb||)`` of every parameter, largest first; a
    parameter with a gradient in only one dump counts as relative difference 1. Returns the first ``top``."""
    rows = []
    for name in sorted(set(a["grads"]) | set(b["grads"])):
        ga, gb = a["grads"].get(name), b["grads"].get(name)
        if ga is None or gb is None:
            rows.append((1.0, name, 0.0 if ga is None else ga.norm().item(), 0.0 if gb is None else gb.norm().item()))
            continue
        rel = ((ga - gb).norm() / ga.norm().clamp_min(1e-30)).item()
        rows.append((rel, name, ga.norm().item(), gb.norm().item()))
    rows.sort(reverse=True)
    return rows[:top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("out")
    d.add_argument("--set", dest="sets", action="append", default=[])
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    if args.cmd == "dump":
        res = dump(args.sets, args.out)
        print(f"loss train {res['loss_train']:.6f} eval {res['loss_eval']:.6f}; {len(res['grads'])} gradients -> {args.out}")
        return 0
    a, b = torch.load(args.a), torch.load(args.b)
    print(f"loss train {a['loss_train']:.6f} vs {b['loss_train']:.6f}, eval {a['loss_eval']:.6f} vs {b['loss_eval']:.6f}")
    for rel, name, na, nb in compare(a, b, args.top):
        print(f"  {rel:.3e}  {name}  |g| {na:.4g} vs {nb:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
