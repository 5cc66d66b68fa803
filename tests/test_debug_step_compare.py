"""benchmarks/debug_step_compare.py on the CPU: two dumps of the same prepared tiny-moe step (FP8 emulated,
fused experts; eager, to keep CI fast: the compiled step is what the GPU run compares) have identical losses and
gradients, every expert-branch parameter has a non-zero
gradient, and ``compare`` puts a zeroed gradient (the session-13 regression's signature) first with relative
difference 1."""

from __future__ import annotations

import torch

from tests.script_loader import load_script
from tests.test_distributed import ROOT

SETS = ["model.preset=tiny-moe", "data.vocab_size=1024", "data.seq_length=64", "train.micro_batch_size=2",
        "train.mixed_precision=fp8", "fp8.recipe=tensorwise", "fp8.emulate=true", "selective.selective_fp8=false",
        "fp8.grouped_kernel=fused", "train.compile=false"]


def test_dump_is_deterministic_and_compare_names_a_zeroed_gradient(tmp_path):
    mod = load_script(ROOT / "benchmarks" / "debug_step_compare.py")
    a = mod.dump(SETS, str(tmp_path / "a.pt"))
    b = torch.load(tmp_path / "a.pt")
    assert a["loss_train"] == b["loss_train"] and torch.isfinite(torch.tensor(a["loss_eval"]))
    experts = [n for n in a["grads"] if "experts" in n or "mlp.gate" in n]
    assert experts, f"no expert-branch gradients among {sorted(a['grads'])[:8]}..."
    for n in experts:
        assert a["grads"][n].abs().max().item() > 0, f"{n}: zero gradient"
    again = mod.dump(SETS, str(tmp_path / "b.pt"))
    worst = mod.compare(a, again, top=1)[0]
    assert worst[0] == 0.0, f"two dumps of the same step differ: {worst}"
    broken = {**again, "grads": dict(again["grads"])}
    broken["grads"][experts[0]] = torch.zeros_like(again["grads"][experts[0]])
    first = mod.compare(a, broken, top=2)[0]
    assert first[1] == experts[0] and first[0] == 1.0, f"compare ranked {first} first"
