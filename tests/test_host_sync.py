"""A pretraining step queues its work without waiting for the GPU (fp8kit/train/host_sync.py).

The host syncs are caught as the ATen ops that read a device value on the host (``is_nonzero``, ``item``,
``_local_scalar_dense``), recorded with their Python stacks by a dispatch mode around ``train_step`` with the loss
left on the device (``read=False``, as ``train.async_loss`` runs it). The same ops are what the CUDA trace showed
(``aten::is_nonzero`` from transformers' mask code, docs/benchmarks.md section 6, "Session 40").
"""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8kit.config import ModelConfig, load_config
from fp8kit.train import loop
from fp8kit.train.host_sync import batch_to_device, no_packed_sequence_check
from fp8kit.train.setup import build_setup, cross_entropy

_SYNC_OPS = {torch.ops.aten.is_nonzero.default, torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


class _HostSyncs(TorchDispatchMode):
    """Records each op that reads a tensor's value on the host, with the innermost frames of its Python stack."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _SYNC_OPS:
            frames = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]]
            self.calls.append(f"{func}\n      " + "\n      ".join(frames[-6:]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides", [
    [],
    ["train.mixed_precision=fp8", "fp8.recipe=delayed", "fp8.selective_fp8=off", "fp8.output_head=true",
     "optim.name=fp8_adamw"],
    ["train.mixed_precision=fp8", "fp8.recipe=tensorwise", "fp8.selective_fp8=off"],
    ["model.preset=tiny-moe", "train.mixed_precision=fp8", "fp8.selective_fp8=off"],
], ids=["bf16", "delayed-head-fp8adamw", "tensorwise", "tiny-moe-fp8"])
def test_pretraining_step_reads_nothing_on_the_host(small_run, overrides):
    """An optimizer step of a pretraining run (delayed: two, the second after its amax histories exist): no op reads
    a device value on the host. Before session 40, transformers' packed-sequence check did in every forward."""
    setup = build_setup(load_config(None, [*small_run, *overrides]))
    params = [p for p in setup.model.parameters() if p.requires_grad]
    for step in range(2 if "fp8.recipe=delayed" in overrides else 1):
        micro = [loop.next_micro_batch(setup)]
        with _HostSyncs() as syncs:
            loss, _, _, _ = loop.train_step(setup, params, micro, None, read=False)
        assert not syncs.calls, f"step {step}: {len(syncs.calls)} host syncs:\n" + "\n".join(syncs.calls)
        assert torch.isfinite(loss), f"step {step}: loss {loss}"


def test_packed_check_is_skipped_only_where_the_model_builds_the_positions(monkeypatch):
    """``_loss`` of token windows skips the check (same logits, bit for bit); a fine-tuning batch with position ids
    still runs it, since its mask depends on the answer."""
    from transformers import masking_utils

    from fp8kit.data.sft import SFTBatch
    from fp8kit.models.build import build_model

    original = masking_utils.find_packed_sequence_indices
    calls = []

    def counting(position_ids):
        calls.append(position_ids.shape)
        return original(position_ids)

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counting)
    model = build_model(ModelConfig(num_layers=2), 320, device=torch.device("cpu"), dtype=torch.float32, seed=0)
    cfg = SimpleNamespace(train=SimpleNamespace(cuda_graphs=False, param_dtype="bf16"))
    setup = SimpleNamespace(device=torch.device("cpu"), cfg=cfg, model=model, loss_fn=cross_entropy)
    windows = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(0))

    with torch.no_grad():
        loss = loop._loss(setup, windows)
        assert calls == [], f"token windows: the packed-sequence check ran {len(calls)} times"
        checked = model(input_ids=windows[:, :-1]).logits
        assert len(calls) == 1, f"a plain forward must run the check once, ran it {len(calls)} times"
        with no_packed_sequence_check():
            skipped = model(input_ids=windows[:, :-1]).logits
        model(input_ids=windows[:, :-1])
        assert len(calls) == 2, f"after the block a forward must run the check again ({len(calls) - 1} runs)"
        assert torch.equal(checked, skipped), (
            f"skipping the check changed the logits by {(checked - skipped).abs().max().item()}")
        ref = cross_entropy(checked, windows[:, 1:])
        assert torch.equal(loss, ref), f"_loss {loss.item()} != the checked forward's loss {ref.item()}"

        pos = torch.cat([torch.arange(9), torch.arange(7)])[None].expand(2, -1).contiguous()
        labels = windows[:, 1:].clone()
        sft = SFTBatch(windows[:, :-1].contiguous(), labels, pos, labels.numel())
        before = len(calls)
        loop._loss(setup, sft)
        assert len(calls) == before + 1, "a fine-tuning batch with position ids must keep transformers' check"


def test_other_threads_keep_the_check():
    """The skip is per thread (a context variable): inside the block, a packed-position query on another thread still
    gets transformers' answer, and so does this thread after the block."""
    import threading

    from transformers import masking_utils

    packed = torch.cat([torch.arange(5), torch.arange(3)])[None]
    got = {}
    with no_packed_sequence_check():
        assert masking_utils.find_packed_sequence_indices(packed) is None
        worker = threading.Thread(target=lambda: got.update(other=masking_utils.find_packed_sequence_indices(packed)))
        worker.start()
        worker.join()
    assert got["other"] is not None and got["other"].tolist() == [[0] * 5 + [1] * 3], got
    after = masking_utils.find_packed_sequence_indices(packed)
    assert after is not None and after.tolist() == [[0] * 5 + [1] * 3], after


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overrides", [[], ["train.mixed_precision=fp8", "fp8.recipe=delayed", "fp8.selective_fp8=off",
                                            "fp8.output_head=true", "optim.name=fp8_adamw", "train.compile=true"]],
                         ids=["bf16", "delayed-head-fp8adamw-compiled"])
def test_cuda_step_does_not_synchronize(small_run, overrides):
    """On the GPU (CUDA kernels, the Triton FP8AdamW step, compiled blocks): after a warm-up step, a step with the loss
    left on the device makes no synchronizing CUDA call (``torch.cuda.set_sync_debug_mode("error")`` raises on one;
    no dispatch mode is active then, which would make Dynamo skip the compiled frames)."""
    setup = build_setup(load_config(None, [*small_run, *overrides]))
    params = [p for p in setup.model.parameters() if p.requires_grad]
    loop.train_step(setup, params, [loop.next_micro_batch(setup)], None)  # compiles, autotunes
    micro = [loop.next_micro_batch(setup)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, _, _, _ = loop.train_step(setup, params, micro, None, read=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item(), loss


def test_batch_to_device_keeps_the_values():
    """On the same device the batch is returned as is; on CUDA (the GPU machine) it arrives equal, copied from pinned
    memory (the sources of the host-to-device copies, recorded by a dispatch mode)."""
    batch = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    assert batch_to_device(batch, torch.device("cpu")) is batch
    if torch.cuda.is_available():
        sources = []

        class _Copies(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
                    src = args[1] if func is torch.ops.aten.copy_.default else args[0]
                    if src.device.type == "cpu" and (kwargs or {}).get("device", args[0].device).type == "cuda":
                        sources.append(src.is_pinned())
                return func(*args, **(kwargs or {}))

        with _Copies():
            got = batch_to_device(batch, torch.device("cuda"))
        assert sources and all(sources), f"host-to-device copies from pinned memory: {sources}"
        assert got.device.type == "cuda" and torch.equal(got.cpu(), batch), "the pinned copy changed the batch"


@pytest.mark.parametrize("packed", [False, True])
def test_a_fine_tuning_batch_moves_each_tensor_through_batch_to_device(packed):
    """``SFTBatch.apply`` (what the loop does with a fine-tuning batch): every tensor through ``batch_to_device`` (on
    CUDA from pinned memory, as the pretraining windows), the supervised count and an absent ``position_ids`` kept."""
    import functools

    from fp8kit.data.sft import SFTBatch

    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 1000, (2, 8), generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100
    pos = torch.arange(8).repeat(2, 1) if packed else None
    batch = SFTBatch(ids, labels, pos, 10)
    seen = []
    moved = batch.apply(lambda t: seen.append(t) or batch_to_device(t, torch.device("cpu")))
    assert len(seen) == (3 if packed else 2), len(seen)
    assert moved.input_ids is ids and moved.labels is labels and moved.num_supervised == 10
    assert (moved.position_ids is pos) if packed else moved.position_ids is None
    if torch.cuda.is_available():
        got = batch.apply(functools.partial(batch_to_device, device=torch.device("cuda")))
        assert got.input_ids.is_cuda and torch.equal(got.labels.cpu(), labels), "the pinned copies changed the batch"
