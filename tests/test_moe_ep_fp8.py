"""FP8 token dispatch under expert parallelism (``distributed.ep_fp8_dispatch``) and expert parallel with
tensor parallel, on gloo CPU ranks (torchrun) against one process.

Two torchrun launches; this file is also their worker (``python tests/test_moe_ep_fp8.py MODE OUT CACHE``):

- ``ep2`` (2 ranks): 10 training steps of tiny-moe with ep = 2 and FP8 dispatch, recording every payload the
  dispatch all-to-all sends; then a model whose hidden size (192) is not a multiple of 128, which must be
  refused at set-up; then 10 steps with FP8 experts on the fused kernel, whose dispatch sends the rowwise payload
  (the experts' own cast), against the same run with a bf16 dispatch.
- ``eptp`` (4 ranks): one MoE layer under dp 2 x tp 2 with ep = 2 and ep = 4, bf16 or FP8 dispatch, against
  the same layer in one process on the global batch (float32: outputs and every gradient to 1e-5); then 5
  training steps of tiny-moe with dp 2 x tp 2 (sequence parallel), ep = 2, FP8 dispatch (the LR warmup does
  not depend on train.steps: they are the reference's first 5).

Thresholds (training losses, relative to one process on the same global batch, bf16): 0.5% per step,
tighter than the issue's 3% (measured 2.0e-4 for ep = 2 over 10 steps and 6.8e-4 for dp 2 x tp 2 x ep 2,
torch 2.13 CPU; a missing 1/dp on the expert gradients drifts by > 1.5% within 10 steps, which 3% would
not catch). FP8 dispatch rounds every token to E4M3 (3 mantissa bits, one scale per 128 elements) on its
way to the experts; routing is unchanged (the router runs before the dispatch). The layer comparison is
float32 and exact up to summation order: 1e-5 of the largest reference value (measured <= 1e-6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8kit.base.errors import ConfigError
from fp8kit.fp8.blockwise import dequantize_rows, quantize_1x128
from fp8kit.moe.fp8_dispatch import check_dispatch_hidden, pack, payload_row_bytes, unpack

ROOT = Path(__file__).resolve().parent.parent

STEPS = ["train.steps=10", "train.eval_every=0", "train.checkpoint_every=0", "train.final_checkpoint=false"]
RANKS = ["train.micro_batch_size=2", "train.eval_batches=1"]  # global batch 4 = the reference's
MOE = ["model.preset=tiny-moe", "train.mixed_precision=bf16"]
LOSS_RTOL = 5e-3  # per step, relative (module docstring)
LAYER_RTOL = 1e-5  # max |diff| / max |reference|, float32 layer (module docstring)
HIDDEN = 256  # tiny-moe


# ----------------------------------------------------------------------------------------------------------
# In-process: the payload format and the set-up check


def test_payload_is_uint8_e4m3_plus_scales_about_half_of_bf16():
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    payload = pack(x)
    assert payload.dtype == torch.uint8 and payload.shape == (37, HIDDEN + 4 * HIDDEN // 128), payload.shape
    ratio = payload.numel() / (x.numel() * x.element_size())
    assert 0.5 < ratio <= 0.52, f"FP8 payload / bf16 bytes = {ratio:.4f}"
    q, s = quantize_1x128(x)
    want = dequantize_rows(q, s).to(torch.bfloat16)
    got = unpack(payload, HIDDEN, torch.bfloat16)
    assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max().item()}"
    err = (got.float() - x.float()).pow(2).mean() / x.float().pow(2).mean()
    sqnr = -10 * torch.log10(err).item()
    assert sqnr >= 25, f"E4M3 + 1x128 round trip SQNR {sqnr:.1f} dB < 25 dB"


def test_rowwise_payload_holds_the_experts_fprop_cast_and_regathers_it_bit_for_bit():
    """The rowwise payload (E4M3 bytes + float32 inv_scale per token row) carries exactly what the fused experts'
    fprop cast computes (``gather_quantize_rows``), and the receiver's gather into expert order (padding rows
    included) gives the same bits as casting on the receiving rank; dequantized it is exact in bf16."""
    from fp8kit.moe.rowwise_payload import (
        dequantize_payload,
        gather_quantize_payload,
        payload_rows,
        payload_views,
        rowwise_payload_bytes,
    )
    from fp8kit.moe.rowwise_quant import gather_quantize_rows

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(41, HIDDEN, generator=g) * 4).to(torch.bfloat16)
    x[7] = 0  # a zero token: inv_scale of the zero row
    sent = torch.randint(0, 41, (60,), generator=g)  # sorted pairs -> their tokens
    payload = gather_quantize_payload(x, sent)
    assert payload.dtype == torch.uint8 and payload.shape == (60, HIDDEN + 16) == (60, rowwise_payload_bytes(HIDDEN))
    assert 0.5 < payload.numel() / (60 * HIDDEN * 2) <= 0.532, payload.shape  # 0.531 at H = 256, 0.504 at 2048
    q, inv = gather_quantize_rows(x, sent)
    pq, pinv = payload_views(payload, HIDDEN)
    assert torch.equal(pq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(pinv, inv)

    index = torch.cat([torch.randint(0, 60, (70,), generator=g), torch.full((9,), 60)])  # 60: padding (zero row)
    got_q, got_inv = payload_rows(payload, index, HIDDEN)
    want_q, want_inv = gather_quantize_rows(x, torch.cat([sent, torch.tensor([41])])[index])
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), "payload_rows: E4M3 bytes differ"
    assert torch.equal(got_inv, want_inv), f"payload_rows: scales differ {(got_inv != want_inv).sum()}"
    # the grouped GEMM's operands: torch._scaled_grouped_mm refuses strided scales (seen on the H100 when the
    # compiled gather fell back to eager and returned views of the gathered payload rows)
    assert got_q.is_contiguous() and got_inv.is_contiguous(), (got_q.stride(), got_inv.stride())
    deq = dequantize_payload(payload, HIDDEN, torch.bfloat16)
    assert torch.equal(deq.float(), q.float() * inv[:, None]), "dequantized payload is not exact in bf16"
    assert torch.equal(dequantize_payload(payload, HIDDEN, torch.bfloat16, index=index[:70]), deq[index[:70]])
    with pytest.raises(ValueError, match="multiple of 16"):
        gather_quantize_payload(torch.randn(3, 40), torch.arange(3))
    # a rank that receives no rows: its local dispatch still has padding rows, all pointing at the zero row
    empty = gather_quantize_payload(x, torch.zeros(0, dtype=torch.long))
    zq, zinv = payload_rows(empty, torch.zeros(16, dtype=torch.long), HIDDEN)
    want_q, want_inv = gather_quantize_rows(x[:0], torch.zeros(16, dtype=torch.long))
    assert torch.equal(zq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(zinv, want_inv)
    assert dequantize_payload(empty, HIDDEN, torch.bfloat16, index=torch.zeros(16, dtype=torch.long)).abs().max() == 0
    # one output row (its two outputs would be views of one gathered row), an int32 index, and a bad index
    one_q, one_inv = payload_rows(payload, index[:1].int(), HIDDEN)
    assert torch.equal(one_q.view(torch.uint8), got_q[:1].view(torch.uint8)) and torch.equal(one_inv, got_inv[:1])
    for bad in (index.float(), index[None]):
        with pytest.raises(ValueError, match="index must be a 1-D int64 / int32 tensor"):
            payload_rows(payload, bad, HIDDEN)


def test_payload_from_the_tokens_side_takes_the_send_layout_and_refuses_a_wrong_one():
    """``gather_quantize_payload(x, token_rows, pair_rows)`` (expert parallelism's send order, the layout known from
    both sides: the scatter kernel on CUDA) gives the payload of ``gather_quantize_payload(x, token_rows)``; a
    ``pair_rows`` that is not a whole number of rows per token is refused, naming the op (the CPU reference path;
    the kernel's bits: ``tests/test_moe_ep_fp8_gpu.py``)."""
    from fp8kit.moe.rowwise_payload import gather_quantize_payload

    g = torch.Generator().manual_seed(8)
    tokens, topk = 37, 4
    x = (torch.randn(tokens, HIDDEN, generator=g) * 3).to(torch.bfloat16)
    ids = torch.rand(tokens, 16, generator=g).argsort(dim=1)[:, :topk].reshape(-1)
    order = torch.argsort(ids, stable=True)  # sorted row -> pair, as moe/expert_parallel.py sorts by rank
    token_rows = order // topk
    pair_rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    assert torch.equal(token_rows[pair_rows], torch.arange(tokens * topk) // topk)  # the layout's contract
    assert torch.equal(gather_quantize_payload(x, token_rows, pair_rows), gather_quantize_payload(x, token_rows))
    with pytest.raises(ValueError, match="moe_rw_gather_quant_payload: pair_rows must hold topk rows per token"):
        gather_quantize_payload(x, token_rows, pair_rows[:-1])


def test_hidden_size_not_a_multiple_of_128_is_refused():
    check_dispatch_hidden(256, "model.layers.0.mlp.experts")
    with pytest.raises(ConfigError) as e:
        check_dispatch_hidden(192, "model.layers.0.mlp.experts")
    msg = str(e.value)
    assert "distributed.ep_fp8_dispatch" in msg and "hidden size 192" in msg and "multiple of 128" in msg, msg


def test_payload_row_bytes():
    assert payload_row_bytes(7168) == 7168 + 4 * 56  # DeepSeek-V3: 0.5156x of bf16's 14336 bytes


def test_etp_was_removed_but_old_configs_with_etp_1_load(tmp_path):
    """Old configs and run directories' resolved_config.toml carry ``etp = 1``: they load, with a note."""
    from fp8kit.config import load_config

    old = tmp_path / "resolved_config.toml"
    old.write_text("[distributed]\nep = 1\netp = 1\n")
    cfg = load_config(old)
    assert "etp" not in cfg.to_dict()["distributed"], cfg.to_dict()["distributed"]
    assert any("distributed.etp = 1 is ignored (the key was removed" in n for n in cfg.notes), cfg.notes
    old.write_text("[distributed]\netp = 2\n")
    with pytest.raises(ConfigError, match="distributed.etp = 2: expert tensor parallelism is not supported"):
        load_config(old)


# ----------------------------------------------------------------------------------------------------------
# Multi-process (torchrun, gloo)


def _torchrun(nproc: int, args: list[str], timeout: int = 300) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
           str(Path(__file__).resolve()), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _run_overrides(cache) -> list[str]:
    from tests.conftest import small_run_overrides

    return small_run_overrides(cache) + STEPS + MOE


@pytest.fixture(scope="module")
def reference(cache_dir, tmp_path_factory):
    """One process, global batch 4, the torchrun runs' initialisation (meta init); ep_fp8_dispatch is set
    (ep = 1: it must only warn)."""
    from fp8kit.config import load_config
    from fp8kit.train.trainer import train

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_config(None, _run_overrides(cache_dir) + ["distributed.meta_init=true",
                                                             "distributed.ep_fp8_dispatch=true"])
        return train(cfg, tmp_path_factory.mktemp("ref") / "run")
    finally:
        torch.set_num_threads(before)


def _losses(run: Path) -> list[float]:
    from fp8kit.train.metrics import read_metrics

    return [r["loss"] for r in read_metrics(run / "metrics.jsonl")]


def _close(got: list[float], want: list[float], what: str, fall: float) -> None:
    rel = [abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)]
    table = "\n".join(f"  step {i + 1}: {a:.5f} vs {b:.5f} (rel {r:.1e})"
                      for i, (a, b, r) in enumerate(zip(got, want, rel, strict=True)))
    assert max(rel) <= LOSS_RTOL, f"{what}: max relative diff {max(rel):.2e} > {LOSS_RTOL}\n{table}"
    assert all(torch.isfinite(torch.tensor(got))) and got[-1] < got[0] - fall, f"{what}: does not train\n{table}"


def test_ep_fp8_dispatch_without_ep_warns(reference):
    note = "distributed.ep_fp8_dispatch = true has no effect: no expert parallelism (ep = 1)"
    assert note in reference.summary["parallel_notes"], reference.summary["parallel_notes"]


def test_ep2_fp8_dispatch_trains_like_one_process(reference, cache_dir, tmp_path):
    _torchrun(2, ["ep2", str(tmp_path), str(cache_dir)])
    run = tmp_path / "run"
    _close(_losses(run), [r["loss"] for r in reference.metrics], "ep=2, FP8 dispatch, vs 1 process", fall=0.5)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parallel"].endswith("(ep2 -> fsdp2), EP dispatch: fp8 (E4M3 + 1x128 scales)"), summary["parallel"]

    sent = json.loads((tmp_path / "payloads.json").read_text())
    forward = [c for c in sent if c["dtype"] == "torch.uint8"]
    backward = [c for c in sent if c["dtype"] != "torch.uint8"]
    # 2 MoE layers x (10 steps + 1 final validation batch) forward dispatches; the 10 steps' backward
    # returns the bf16 gradient
    assert len(forward) == 2 * (10 + 1) and len(backward) == 2 * 10, (len(forward), len(backward), sent[:3])
    assert all(c["cols"] == HIDDEN + HIDDEN // 32 for c in forward), {c["cols"] for c in forward}
    assert all(c["dtype"] == "torch.bfloat16" and c["cols"] == HIDDEN for c in backward), backward[:2]
    # rank 0 sends its 2 x 64 tokens x top-2 = 256 (token, expert) pairs per layer over the two ranks
    assert all(c["rows_sent"] == 256 for c in forward[:2]), forward[:2]
    sent_bytes = sum(c["rows_sent"] * c["cols"] for c in forward)
    bf16_bytes = sum(c["rows_sent"] * HIDDEN * 2 for c in forward)
    assert sent_bytes / bf16_bytes == pytest.approx(264 / 512), (sent_bytes, bf16_bytes)

    error = (tmp_path / "hidden192.txt").read_text()
    assert error.startswith("ConfigError: distributed.ep_fp8_dispatch = true: model.layers.0.mlp.experts has "
                            "hidden size 192, not a multiple of 128"), error

    # FP8 experts (fused kernel): the payload is their own rowwise cast, H + 16 bytes per row, and training
    # follows the same run with a bf16 dispatch (same forward bits; gate_up's wgrad sees the E4M3 tokens)
    summary = json.loads((tmp_path / "fp8_rowwise" / "summary.json").read_text())
    assert summary["parallel"].endswith("EP dispatch: fp8 (E4M3 rowwise, straight into the FP8 experts)"), \
        summary["parallel"]
    sent = json.loads((tmp_path / "payloads_rowwise.json").read_text())
    forward = [c for c in sent if c["dtype"] == "torch.uint8"]
    assert len(forward) == 2 * (10 + 1) and all(c["cols"] == HIDDEN + 16 for c in forward), forward[:3]
    _close(_losses(tmp_path / "fp8_rowwise"), _losses(tmp_path / "fp8_bf16_dispatch"),
           "ep=2, FP8 experts, rowwise FP8 dispatch vs bf16 dispatch", fall=0.5)

    # gradient accumulation under EP x FSDP2: the experts' FP8 weights cast once per step (FSDP2 leaves them alone),
    # the dense linears' at every micro-batch (FSDP2's), as the run says; the same losses as no cache at all
    cached = json.loads((tmp_path / "accum_cached" / "summary.json").read_text())["precision"]
    assert cached.endswith("dense weights cast at every micro-batch; expert weights cast once per step of 2 "
                           "micro-batches)"), cached
    uncached = json.loads((tmp_path / "accum_uncached" / "summary.json").read_text())["precision"]
    assert uncached.endswith("(fast accumulation: fprop; weights cast at every micro-batch)"), uncached
    assert _losses(tmp_path / "accum_cached") == _losses(tmp_path / "accum_uncached"), "the cache changed the bits"


def test_ep_with_tp_matches_one_process(reference, cache_dir, tmp_path):
    _torchrun(4, ["eptp", str(tmp_path), str(cache_dir)])
    layer = json.loads((tmp_path / "layer.json").read_text())
    assert len(layer) == 6 * 4, layer  # 6 layouts x 4 ranks
    for r in layer:
        rel = dict(r["rel"])
        fmt, fwd_diff = rel.pop("format"), rel.pop("fwd_vs_bf16_dispatch", None)
        assert rel.pop("scale_hints_wrong", 0.0) == 0.0, f"{r['case']} rank {r['rank']}: scale hints {r['rel']}"
        worst = max(rel.values())
        assert worst <= LAYER_RTOL, f"{r['case']} rank {r['rank']}: {r['rel']}"
        want = "bf16" if "fp8_dispatch=False" in r["case"] else "rowwise" if "fp8_experts=True" in r["case"] else "1x128"
        assert fmt == want, (r["case"], fmt)
        if fwd_diff is not None:  # the rowwise payload is the experts' own fprop cast, made on the other rank
            assert fwd_diff == 0.0, f"{r['case']} rank {r['rank']}: output differs from bf16 dispatch by {fwd_diff}"
    run = tmp_path / "run"
    _close(_losses(run), [r["loss"] for r in reference.metrics[:5]], "dp 2 x tp 2 (SP), ep=2, FP8 dispatch vs 1 "
           "process", fall=0.1)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["parallel"].startswith("4 ranks: dp_replicate 1 x dp_shard 2 x tp 2 (tp+sp -> ep2 -> fsdp2)"), \
        summary["parallel"]


# ----------------------------------------------------------------------------------------------------------
# The torchrun worker


def _layer_case(mesh, ep: int, fp8_dispatch: bool, fp8_experts: bool = False, wgrad: str = "auto",
                tokens: int = 21) -> dict:
    """One MoE layer (8 experts, top-2, hidden 256, float32) on this rank's tokens against the same layer in
    one process on all data-parallel ranks' tokens: relative max errors of the output and every gradient.

    ``fp8_experts``: both weights FP8 on the fused rowwise kernel (emulated GEMMs on the CPU), so that FP8 dispatch
    sends the rowwise payload the experts consume directly; the reference then runs on the tokens as they arrive
    (rowwise quantize-dequantize, straight-through), and ``fwd_vs_bf16_dispatch`` is the largest output difference
    from the same layer with a bf16 dispatch (which casts the same tokens on the receiving rank: 0 expected).
    ``wgrad``: the fused path's weight-gradient precision (``auto`` is bf16 at this width; ``fp8`` reads the received
    tokens dequantized through its per-(expert, column) casts)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from fp8kit.moe.expert_parallel import EPGroup, dispatch_format, ep_mesh, shard_experts
    from fp8kit.moe.experts import WEIGHTS, Float8GroupedExperts
    from fp8kit.moe.grouped_mm import GroupedGemmConfig
    from fp8kit.moe.quantize import quantize_rows

    dp, tp = mesh["dp_shard"].size(), mesh["tp"].size()
    e, topk = 8, 2
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=128, num_experts=e,
                               num_experts_per_tok=topk)

    def layer() -> Float8GroupedExperts:
        torch.manual_seed(0)
        src = Qwen3MoeExperts(cfg)
        with torch.no_grad():
            src.gate_up_proj.normal_(0, 0.06)
            src.down_proj.normal_(0, 0.09)
        if fp8_experts:
            return Float8GroupedExperts(src, frozenset(WEIGHTS), GroupedGemmConfig(kernel="fused", wgrad=wgrad))
        return Float8GroupedExperts(src, frozenset())

    g = torch.Generator().manual_seed(1)
    x = torch.randn(dp, tokens, HIDDEN, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(dp * tokens)]).view(dp, tokens, topk)
    w = torch.rand(dp, tokens, topk, generator=g)
    dy = torch.randn(dp, tokens, HIDDEN, generator=g)

    # one process: every data-parallel rank's tokens; the objective is the mean over dp of each rank's loss
    ref = layer()
    rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
    xin = rx
    if fp8_dispatch:  # what the experts receive; the gradient goes straight through (moe/fp8_dispatch.py)
        flat = rx.detach().view(-1, HIDDEN)
        if fp8_experts:  # rowwise payload: one power-of-two scale per token
            q, s = quantize_rows(flat)
            arrived = q.float() * s[:, None]
        else:
            q, s = quantize_1x128(flat)
            arrived = dequantize_rows(q, s)
        xin = rx + (arrived.view_as(rx) - rx).detach()
    ry = ref(xin.view(-1, HIDDEN), ids.view(-1, topk), rw.view(-1, topk)).view(dp, tokens, HIDDEN)
    ((ry * dy).sum() / dp).backward()

    i = mesh["dp_shard"].get_local_rank()

    def ep_layer(dispatch: bool) -> Float8GroupedExperts:
        mod = layer()
        shard_experts(mod, EPGroup(ep_mesh("cpu", dp, ep, tp), ep, dp, fp8_dispatch=dispatch,
                                   tp_mesh=mesh["tp"] if tp > 1 else None))
        return mod

    mod = ep_layer(fp8_dispatch)
    lx, lw = x[i].clone().requires_grad_(), w[i].clone().requires_grad_()
    y = mod(lx, ids[i], lw)
    (y * dy[i]).sum().backward()  # this rank's loss; the expert hook divides by dp

    def rel(got: torch.Tensor, want: torch.Tensor) -> float:
        return ((got - want).abs().max() / want.abs().max()).item()

    out = {"output": rel(y, ry[i]), "grad_hidden": rel(lx.grad, dp * rx.grad[i]),
           "grad_router_weights": rel(lw.grad, dp * rw.grad[i])}
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(mod, name)
        n, r = e // ep, mod.ep_group.rank
        out[f"grad_{name}"] = rel(p.grad.to_local(), getattr(ref, name).grad[r * n:(r + 1) * n])
    if fp8_experts:
        other = ep_layer(False)(x[i], ids[i], w[i])
        out["fwd_vs_bf16_dispatch"] = (y.detach() - other.detach()).abs().max().item()
        # the scale hints were re-made for this rank's experts and hold the scales of its last cast
        from fp8kit.moe.expert_parallel import local_weight
        from fp8kit.moe.rowwise_quant import quantize_experts_dual

        up, down = (local_weight(getattr(mod, name)).detach() for name in WEIGHTS)
        hints = mod.scale_hints(up, down)
        want = [c[i] for c in (quantize_experts_dual(up), quantize_experts_dual(down)) for i in (1, 3)]
        out["scale_hints_wrong"] = 1.0 if hints is None else float(sum(
            not torch.equal(h.view(torch.float32), t) for h, t in zip(hints, want, strict=True)))
    out["format"] = dispatch_format(mod, x.device)
    return out


def _record_payloads(log: list[dict]) -> None:
    """Append every payload the dispatch all-to-alls send to ``log`` (one patch per process; rebind the list with
    ``log[:] = []`` between runs)."""
    from fp8kit.moe import fp8_dispatch

    real = fp8_dispatch._exchange

    def exchange(t, out_splits, in_splits, group, during=None):
        log.append({"dtype": str(t.dtype), "cols": t.shape[1], "rows_sent": sum(in_splits)})
        return real(t, out_splits, in_splits, group, during)

    fp8_dispatch._exchange = exchange


def _worker(mode: str, out: Path, cache: str) -> None:
    import torch.distributed as dist

    from fp8kit.config import load_config
    from fp8kit.train.trainer import train

    torch.set_num_threads(1)
    sets = _run_overrides(cache) + RANKS + ["distributed.ep=2", "distributed.ep_fp8_dispatch=true"]
    if mode == "ep2":
        log: list[dict] = []
        _record_payloads(log)
        train(load_config(None, sets), out / "run")
        if dist.get_rank() == 0:
            (out / "payloads.json").write_text(json.dumps(log))
        from fp8kit.models.presets import PRESETS

        hf = dict(PRESETS["tiny-moe"], hidden_size=192)
        (out / "hidden192.json").write_text(json.dumps(hf))
        try:
            train(load_config(None, sets + [f"model.hf_config={out / 'hidden192.json'}"]), out / "bad")
            message = "no error"
        except ConfigError as e:
            message = f"ConfigError: {e}"
        if dist.get_rank() == 0:
            (out / "hidden192.txt").write_text(message)
        # FP8 experts on the fused kernel (emulated GEMMs on the CPU): the rowwise payload, then a bf16 dispatch
        fp8 = sets + ["train.mixed_precision=fp8", "selective.selective_fp8=false", "fp8.grouped_kernel=fused"]
        log.clear()
        train(load_config(None, fp8), out / "fp8_rowwise")
        if dist.get_rank() == 0:
            (out / "payloads_rowwise.json").write_text(json.dumps(log))
        train(load_config(None, fp8 + ["distributed.ep_fp8_dispatch=false"]), out / "fp8_bf16_dispatch")
        # 2 micro-batches per step under EP x FSDP2: the experts (FSDP2's ignored_params) keep their weight cache,
        # the FSDP2-managed dense linears do not; casting every micro-batch instead gives the same bits
        accum = fp8 + ["train.grad_accum=2", "train.micro_batch_size=1", "train.steps=4"]
        train(load_config(None, accum), out / "accum_cached")
        train(load_config(None, accum + ["fp8.weight_cache=false"]), out / "accum_uncached")
    else:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        cases = ((2, False, False, "auto"), (2, True, False, "auto"), (4, False, False, "auto"), (2, True, True, "auto"),
                 (4, True, True, "auto"), (2, True, True, "fp8"))
        results = [{"case": f"dp2 x tp2, ep={ep}, fp8_dispatch={fp8}, fp8_experts={experts}, wgrad={wgrad}",
                    "rank": dist.get_rank(), "rel": _layer_case(mesh, ep, fp8, experts, wgrad)}
                   for ep, fp8, experts, wgrad in cases]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, results)
        if dist.get_rank() == 0:
            (out / "layer.json").write_text(json.dumps([r for rs in gathered for r in rs]))
        train(load_config(None, sets + ["distributed.tp=2", "distributed.sequence_parallel=true", "train.steps=5"]),
              out / "run")
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]), sys.argv[3])


def test_ep_group_copies_and_pickles_after_its_group_was_looked_up(tmp_path):
    """``EPGroup`` keeps its looked-up process group (a ``ProcessGroup``, not picklable) out of its state: a model
    holding one can still be deep-copied or saved after its first forward."""
    import copy
    import pickle

    import torch.distributed as dist

    from fp8kit.moe.expert_parallel import EPGroup, ep_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        g = EPGroup(ep_mesh("cpu", 1, 1, 1), 1, 1)
        assert g.group is not None and g.rank == 0  # looked up, cached
        for c in (copy.deepcopy(g), pickle.loads(pickle.dumps(g))):
            assert (c.ep, c.dp, c.fp8_dispatch) == (1, 1, False) and "group" not in c.__dict__
            assert c.rank == 0 and c.group is not None  # looked up again
    finally:
        dist.destroy_process_group()
