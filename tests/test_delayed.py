"""Delayed scaling (``fp8.recipe = "delayed"``, Transformer Engine's DelayedScaling): numerics against float64,
the amax history (scale of step t from steps < t, max vs most_recent, margin, length), state round trip,
exact resume, the one-line errors, and ``torch.compile``: no graph break, compiled == eager bit for bit,
activation checkpointing, the amax all-reduce over a process group."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from fp8kit.base.errors import CheckpointError, ConfigError
from fp8kit.config import load_config
from fp8kit.fp8.delayed import DelayedScaling, DelayedScalingState, Float8DelayedLinear
from fp8kit.train.trainer import train
from tests.conftest import RMSNorm, sqnr

torch.manual_seed(0)


def _layer(k=256, n=512, **cfg):
    lin = nn.Linear(k, n, bias=False)
    state = DelayedScalingState(DelayedScaling(**cfg))
    return Float8DelayedLinear.from_linear(lin, state, "l"), state


def _fwd_bwd(layer, x, dy):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y, x.grad, layer.weight.grad


def test_numerics_against_float64():
    """Output (E4M3 x E4M3) >= 25 dB; dgrad / wgrad (E5M2 gradients) >= 18 dB, against float64 math."""
    layer, _ = _layer()
    x, dy = torch.randn(512, 256), torch.randn(512, 512)
    for _ in range(2):  # step 0 takes a dynamic scale; step 1 the delayed one (same distribution)
        layer.weight.grad = None
        y, dx, dw = _fwd_bwd(layer, x, dy)
    w = layer.weight.detach().double()
    ref_y, ref_dx, ref_dw = x.double() @ w.T, dy.double() @ w, dy.double().T @ x.double()
    got = {"out": sqnr(ref_y, y), "dgrad": sqnr(ref_dx, dx), "wgrad": sqnr(ref_dw, dw)}
    assert got["out"] >= 25 and got["dgrad"] >= 18 and got["wgrad"] >= 18, got
    assert got["out"] < 45, f"output {got['out']:.1f} dB: not quantized at all?"


def test_scale_of_step_t_comes_from_earlier_steps_and_a_jump_saturates_once():
    layer, state = _layer(amax_history_len=4)
    x = torch.randn(256, 256)
    w = layer.weight.detach().double()
    dbs = []
    for mult in [1.0, 1.0, 100.0, 100.0]:
        y = layer(x * mult)
        y.sum().backward()
        dbs.append(sqnr((x * mult).double() @ w.T, y.detach()))
    # steps 0-1 well scaled; step 2 jumps 100x with step 0-1's scale: saturates; step 3 has the jump in its history
    assert dbs[0] > 25 and dbs[1] > 25, dbs
    assert dbs[2] < 10, f"a 100x jump did not saturate with the stale scale: {dbs}"
    assert dbs[3] > 25, f"the step after the jump did not recover: {dbs}"


def test_max_vs_most_recent_margin_and_history_length():
    def scales_after(amaxes, **cfg):
        state = DelayedScalingState(DelayedScaling(**cfg))
        e = state.entry("l", torch.device("cpu"))
        for a in amaxes:
            state.advance(e, torch.tensor([a, 1.0, 1.0]))
        return state.scales(e)[0].item()

    assert scales_after([8.0, 2.0]) == pytest.approx(448 / 8)  # max of the history
    assert scales_after([8.0, 2.0], amax_compute_algo="most_recent") == pytest.approx(448 / 2)
    assert scales_after([8.0, 2.0], margin=2) == pytest.approx(448 / 8 / 4)
    # length 2: the oldest amax (8) falls out after two newer steps
    assert scales_after([8.0, 2.0, 1.0], amax_history_len=2) == pytest.approx(448 / 2)
    assert scales_after([8.0, 2.0, 1.0], amax_history_len=3) == pytest.approx(448 / 8)


def test_scale_tensors_are_separate_aligned_tensors():
    """The scales handed to ``torch._scaled_mm`` are three tensors of their own, not views of one ``[3]`` tensor:
    cuBLASLt refuses a scale pointer 4 or 8 bytes into an allocation (CUBLAS_STATUS_NOT_SUPPORTED, seen on the
    H100 when inductor computed a reciprocal in place in such a view)."""
    layer, state = _layer()
    layer(torch.randn(64, 256)).sum().backward()
    assert state.scale_tensors(state.entries["l"]) is None, "started before its first step was rolled in"
    state.roll()
    e = state.entries["l"]
    parts = state.scale_tensors(e)
    everything = (*parts, *e.inv_scale, e.group_scale, e.group_inv_scale)
    assert len(parts) == 3 and all(t.dim() == 0 and t.dtype == torch.float32 for t in everything)
    assert [t.storage_offset() for t in everything] == [0] * 8, [t.storage_offset() for t in everything]
    assert len({t.untyped_storage().data_ptr() for t in everything}) == 8, "the scales share one allocation"
    assert torch.equal(torch.stack(parts), state.scales(e))
    assert torch.equal(torch.stack(e.inv_scale), torch.stack(parts).reciprocal())


def test_state_dict_round_trip_and_length_mismatch():
    layer, state = _layer()
    for _ in range(3):
        layer(torch.randn(64, 256)).sum().backward()
    other = DelayedScalingState(DelayedScaling())
    other.load_state_dict(state.state_dict())
    e1, e2 = state.entries["l"], other.entries["l"]
    assert torch.equal(e1.history, e2.history) and int(e1.steps) == int(e2.steps) == 3 and e2.started
    assert torch.equal(state.scales(e1), other.scales(e2))
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScalingState(DelayedScaling(amax_history_len=8)).load_state_dict(state.state_dict())


def test_checkpoint_of_the_previous_format_loads_with_its_pending_step_rolled_in():
    """Checkpoints written when the history advanced at the next forward (``pending``, ``has_pending``)."""
    old = {"config": {"amax_history_len": 4, "amax_compute_algo": "max", "margin": 0},
           "entries": {"l": {"history": torch.tensor([[2.0, 0, 0, 0]] * 3), "pending": torch.tensor([8.0, 1, 1]),
                             "steps": 1, "has_pending": True}}}
    state = DelayedScalingState(DelayedScaling(amax_history_len=4))
    state.load_state_dict(old)
    e = state.entries["l"]
    assert e.history[:, :2].tolist() == [[8.0, 2.0], [1.0, 2.0], [1.0, 2.0]] and int(e.steps) == 2, e.history
    assert state.scales(e)[0].item() == pytest.approx(448 / 8)


def test_eval_forward_records_nothing():
    layer, state = _layer()
    layer(torch.randn(64, 256)).sum().backward()
    state.roll()
    e = state.entries["l"]
    before, hist = int(e.steps), e.history.clone()
    assert before == 1
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(64, 256) * 1000)
    layer(torch.randn(64, 256) * 1000).sum().backward()  # eval mode with grad: still not recorded
    state.roll()
    assert int(e.steps) == before and torch.equal(e.history, hist)
    layer.train()
    layer(torch.randn(64, 256)).sum().backward()
    state.roll()
    assert int(e.steps) == before + 1 and e.history[0, 0] < 100, e.history[0]


def test_frozen_weight_still_records_and_no_backward_records_nothing():
    """A frozen weight (adapter fine-tuning): dgrad only, the step still joins the history. A training
    forward whose output needs no gradient has no backward: nothing recorded, scales stay dynamic."""
    layer, state = _layer()
    layer.weight.requires_grad_(False)
    x = torch.randn(64, 256, requires_grad=True)
    layer(x).sum().backward()
    state.roll()
    assert x.grad is not None and layer.weight.grad is None and int(state.entries["l"].steps) == 1
    layer(torch.randn(64, 256))  # neither operand requires grad: its record is never completed
    state.roll()
    assert int(state.entries["l"].steps) == 1


def test_meta_entry_is_materialised_by_to_empty():
    """A model built on meta (FSDP2 + model.pretrained) gets empty histories on the device with its weights."""
    with torch.device("meta"):
        lin = nn.Linear(32, 16, bias=False)
    state = DelayedScalingState()
    layer = Float8DelayedLinear.from_linear(lin, state, "l")
    assert state.entries["l"].history.is_meta
    layer.to_empty(device="cpu")
    e = state.entries["l"]
    assert e.history.device.type == "cpu" and not e.history.any() and int(e.steps) == 0
    assert e.forward_amax.device.type == "cpu" and e.scale[0].device.type == "cpu", e.forward_amax.device
    # a state loaded onto a device before the model moves there: every tensor of the entry lands on that device
    with torch.device("meta"):
        lin = nn.Linear(32, 16, bias=False)
    state2 = DelayedScalingState()
    Float8DelayedLinear.from_linear(lin, state2, "l")
    state2.load_state_dict(state.state_dict(), "cpu")
    devices = {k: t.device.type for k, t in state2.entries["l"].tensors().items()}
    assert set(devices.values()) == {"cpu"}, devices


def test_one_roll_per_forward_of_the_attached_model_takes_every_record():
    """Attached to a model, the state rolls once before each of its forwards with grad enabled (not per module;
    the first has nothing to roll): a step's forward and backward write each module's record (input and weight
    amax, then the output gradient's) and leave the history; the next forward rolls every record in at once.
    Forwards without grad (evaluation, a probe between a forward and its backward) roll nothing and lose nothing."""
    torch.manual_seed(0)
    state = DelayedScalingState(DelayedScaling(amax_history_len=4))
    model = nn.Sequential(*(Float8DelayedLinear.from_linear(nn.Linear(32, 32, bias=False), state, f"l{i}")
                            for i in range(3)))
    state.attach(model)
    rolls, roll = [], state.roll
    state.roll = lambda *a, **k: rolls.append(1) or roll(*a, **k)
    x = torch.randn(16, 32, requires_grad=True)
    model(x).sum().backward()
    e = state.entries["l0"]
    assert len(rolls) == 0 and int(e.steps) == 0 and not e.history.any(), (len(rolls), e.history)
    want = [x.detach().abs().amax().item(), model[0].weight.detach().abs().amax().item()]
    assert e.forward_amax.tolist() == want and e.grad_amax.item() > 0, (e.forward_amax, want)
    y = model(x)
    assert len(rolls) == 1 and all(int(v.steps) == 1 for v in state.entries.values())
    assert e.history[:, 0].tolist() == [*want, e.history[2, 0].item()] and e.started
    with torch.no_grad():
        for _ in range(3):  # evaluation / a probe between this step's forward and its backward
            model(x)
    y.sum().backward()
    assert len(rolls) == 1, f"{len(rolls)} rolls: forwards without grad must not roll"
    model(x).sum().backward()
    assert len(rolls) == 2 and all(int(v.steps) == 2 for v in state.entries.values()), "the step before the probe"
    model(x)  # a training forward without a backward: its record is dropped at the next roll
    model(x).sum().backward()
    state.roll()
    assert all(int(v.steps) == 4 for v in state.entries.values()), [int(v.steps) for v in state.entries.values()]


def test_a_roll_between_a_compiled_forward_and_its_backward_leaves_its_scales():
    """A checkpoint (``state_dict`` rolls) or a precision switch between a forward and its backward writes the other
    of the entry's two scale sets: the backward's saved scales are untouched (no in-place error, the same
    gradients as without the roll)."""
    grads = []
    for between in (False, True):
        model, state = _make(block=True)
        compiled = torch.compile(model, fullgraph=True)
        state.attach(compiled)
        for i in range(4):
            g = torch.Generator().manual_seed(i)
            x = (torch.randn(2, 16, 64, generator=g) * (1 + i)).bfloat16().requires_grad_(True)
            y = compiled(x)
            if between and i == 3:
                state.state_dict()
            y.backward(torch.randn(y.shape, generator=g).bfloat16())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_a_state_never_attached_attaches_to_its_first_module():
    """Modules made with ``from_linear`` and used as they are: the first to run attaches the state to itself, so
    the roll runs once per step before it (not once per module)."""
    torch.manual_seed(0)
    state = DelayedScalingState()
    model = nn.Sequential(*(Float8DelayedLinear.from_linear(nn.Linear(32, 32, bias=False), state, f"l{i}")
                            for i in range(3)))
    for _ in range(4):
        model(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert state.attached and list(model[0]._forward_pre_hooks) and not model[1]._forward_pre_hooks
    state.roll()
    assert [int(e.steps) for e in state.entries.values()] == [4, 4, 4]


def test_compiled_graphs_take_precomputed_scales_and_no_history():
    """The steady-state forward and backward graphs of a compiled delayed linear read its scales and their
    reciprocals (no reciprocal, no history, no custom op in the graphs: the roll computes them once per step for
    the whole model) and write only its two records."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
    model, state = _make(block=True)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    state.attach(compiled)
    for _ in range(2):
        compiled(torch.randn(2, 16, 64).bfloat16().requires_grad_(True)).sum().backward()
    fw, bw = graphs[-2].graph, graphs[-1].graph
    length = state.config.amax_history_len
    for name, g in (("forward", fw), ("backward", bw)):
        targets = [str(n.target) for n in g.nodes if n.op == "call_function"]
        assert not [t for t in targets if "reciprocal" in t or "fp8kit" in t], (name, targets)
        shapes = [tuple(n.meta["val"].shape) for n in g.nodes if n.op == "placeholder" and "val" in n.meta
                  and hasattr(n.meta["val"], "shape")]
        assert (3, length) not in shapes, (name, shapes)
    scaled = [n for n in fw.nodes if n.op == "call_function" and "_scaled_mm" in str(n.target)]
    assert len(scaled) == 2 and all(a.op == "placeholder" for n in scaled for a in n.args[2:4]), \
        "the forward GEMMs' dequantization scales must be graph inputs (precomputed reciprocals)"


def test_bad_settings_are_one_line_errors():
    for bad, match in (("fp8.amax_history_len=0", "amax_history_len"), ("fp8.amax_compute_algo=mean", "max"),
                       ("fp8.margin=-1", "margin")):
        with pytest.raises(ConfigError, match=match) as e:
            load_config(None, [bad])
        assert "\n" not in str(e.value)


# -- torch.compile ------------------------------------------------------------------------------------


class _Block(nn.Module):
    """RMSNorm -> up (delayed) -> SiLU -> down (delayed, biased) + residual: the producers of a Llama MLP."""

    def __init__(self, state, d=64, h=128):
        super().__init__()
        self.norm = RMSNorm(d)
        self.up = Float8DelayedLinear.from_linear(nn.Linear(d, h, bias=False), state, "up")
        self.down = Float8DelayedLinear.from_linear(nn.Linear(h, d, bias=True), state, "down")

    def forward(self, x):
        return x + self.down(nn.functional.silu(self.up(self.norm(x))))


def _make(block: bool, fused_cast: str = "none"):
    torch.manual_seed(0)
    state = DelayedScalingState(DelayedScaling(amax_history_len=4, fused_cast=fused_cast))
    if block:
        return _Block(state).bfloat16(), state
    return Float8DelayedLinear.from_linear(nn.Linear(64, 96, bias=True), state, "l").bfloat16(), state


def _steps(model, state, fn, n, start=0):
    """``n`` training steps of ``fn`` (``model`` or its compiled form, to which ``state`` is attached here: it rolls
    before each call, outside the compiled graph) on inputs whose range grows 1x..nx; per step: output, input grad,
    parameter grads and every tensor of the state (histories, step counts, records, scales)."""
    state.attach(fn)
    out = []
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(i)
        x = (torch.randn(2, 16, 64, generator=g) * (1 + i)).bfloat16().requires_grad_(True)
        y = fn(x)
        y.backward(torch.randn(y.shape, generator=g).bfloat16())
        out.append([y.detach(), x.grad, *(p.grad.clone() for p in model.parameters())]
                   + [t.clone() for e in state.entries.values() for t in e.tensors().values()])
        for p in model.parameters():
            p.grad = None
    return out


def _assert_same(eager, compiled):
    for step, (a, b) in enumerate(zip(eager, compiled, strict=True)):
        diff = [i for i, (u, v) in enumerate(zip(a, b, strict=True)) if not torch.equal(u, v)]
        assert not diff, f"step {step}: compiled != eager at tensors {diff} (output, dx, grads..., histories)"


@pytest.mark.parametrize("fused_cast", ["none", "all"])
def test_compiled_linear_equals_eager_bit_for_bit_and_compiles_twice(fused_cast):
    """fullgraph=True (no graph break); bit for bit on the CPU: the same float32 cast math and _scaled_mm.
    Two compilations: the first step (dynamic warm-start scales) and every later step (history scales).
    With ``fused_cast = "all"`` every cast goes through ``fp8kit::cast_transpose`` (opaque to Inductor)."""
    eager_model, eager_state = _make(block=False, fused_cast=fused_cast)
    model, state = _make(block=False, fused_cast=fused_cast)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    _assert_same(_steps(eager_model, eager_state, eager_model, 5), _steps(model, state, compiled, 5))
    state.roll()
    assert int(state.entries["l"].steps) == 5, "the history must advance once per training step"
    assert counter.frame_count == 2, f"{counter.frame_count} compilations for 5 steps (expected 2)"


def test_compiled_block_has_no_graph_break_equals_eager_and_eval_records_nothing():
    """RMSNorm + SwiGLU-style producers and two delayed linears in one graph. Inductor keeps bf16
    intermediates in float32 unless ``emulate_precision_casts`` rounds them as eager does: with it, bit for bit."""
    model, state = _make(block=True)
    state.attach(model)  # the roll runs before the graph (a disabled call at its start: no graph break)
    x = torch.randn(2, 16, 64).bfloat16().requires_grad_(True)
    for _ in range(2):  # first-step graph and steady-state graph
        explained = torch._dynamo.explain(model)(x)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        model(x).sum().backward()
    eager_model, eager_state = _make(block=True)
    model, state = _make(block=True)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        _assert_same(_steps(eager_model, eager_state, eager_model, 4), _steps(model, state, compiled, 4))
        state.roll()
        assert [int(e.steps) for e in state.entries.values()] == [4, 4]
        hist = [e.history.clone() for e in state.entries.values()]
        model.eval()
        with torch.no_grad():
            compiled(torch.randn(2, 16, 64).bfloat16() * 1000)
        assert [int(e.steps) for e in state.entries.values()] == [4, 4]
        assert all(torch.equal(h, e.history) for h, e in zip(hist, state.entries.values(), strict=True))
    assert counter.frame_count == 3, f"{counter.frame_count} compilations (expected 2 training + 1 eval)"


def test_compiled_block_saves_for_backward_what_bf16_saves():
    """Under torch.compile the delayed linear keeps its bf16 input and casts it again in the backward (as torchao
    does): no FP8 activation is saved, and the block saves exactly the bytes its bf16 twin saves (before, the
    FP8 copy of the RMSNorm output came on top: +0.8 GiB in the 8B run). Gradients: compiled == eager above."""
    from tests.conftest import saved_for_backward

    class SwiGLU(nn.Module):  # RMSNorm -> gate, up (one input, two linears) -> SiLU(gate) * up -> down
        def __init__(self, state, d=64, h=128):
            super().__init__()
            self.norm = RMSNorm(d)
            self.gate, self.up, self.down = (
                Float8DelayedLinear.from_linear(nn.Linear(i, o, bias=False), state, n)
                for n, i, o in (("gate", d, h), ("up", d, h), ("down", h, d)))

        def forward(self, x):
            h = self.norm(x)
            return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    saved = {}
    for name in ("delayed", "bf16"):
        torch.manual_seed(0)
        model = SwiGLU(DelayedScalingState(DelayedScaling(amax_history_len=4))).bfloat16()
        if name == "bf16":
            model.gate, model.up, model.down = (m.to_linear() for m in (model.gate, model.up, model.down))
        compiled = torch.compile(model, fullgraph=True)
        if name == "delayed":
            next(model.modules()).down.state.attach(compiled)
        x = torch.randn(2, 16, 64).bfloat16().requires_grad_(True)
        for _ in range(2):  # the first-step graph, then the history graph (the one counted)
            got, y = saved_for_backward(lambda: compiled(x))  # noqa: B023
            y.float().sum().backward()
        saved[name] = got
    fp8 = [s for s in saved["delayed"] if s[0] in (torch.float8_e4m3fn, torch.float8_e5m2)]
    assert not fp8, f"FP8 tensors saved for the backward: {fp8}"
    nbytes = {k: sum(torch.empty((), dtype=d).element_size() * math.prod(sh) for d, sh in v) for k, v in saved.items()}
    assert nbytes["delayed"] <= nbytes["bf16"], f"saved bytes: {nbytes}"


def test_compiled_forward_takes_the_input_and_weight_amax_and_the_backward_only_the_gradients():
    """The input's and weight's amaxes are computed in the compiled forward (fused there into the kernels that
    cast them) and saved, not left to the backward, where the partitioner read the weight and the recomputed
    input once more (8B step: 24 weight-amax kernels per step, 1.4 ms, docs/benchmarks.md section 6, session 31).
    So every amax of the steady-state backward graph descends from the output gradient (``tangents``), and
    the record holds the latest training forward's two amaxes, compiled as eagerly."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=keep,
                           partition_fn=min_cut_rematerialization_partition)
    torch.manual_seed(0)
    state = DelayedScalingState(DelayedScaling(amax_history_len=4))
    norm = RMSNorm(64)
    lin = Float8DelayedLinear.from_linear(nn.Linear(64, 96, bias=False), state, "lin")
    model = nn.Sequential(norm, lin).bfloat16()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    state.attach(compiled)
    for _ in range(2):  # the first-step graph, then the history graph (the one checked)
        x = torch.randn(32, 64).bfloat16()
        compiled(x).float().sum().backward()
    bw = graphs[-1].graph

    def ancestors(node):
        seen, todo = set(), [node]
        while todo:
            for a in todo.pop().all_input_nodes:
                if a not in seen:
                    seen.add(a)
                    todo.append(a)
        return seen

    history = state.entries["lin"].history.numel()
    # the amaxes of tensors (no [3, L] history reaches a compiled graph any more; kept as a floor)
    amaxes = [n for n in bw.nodes if n.op == "call_function" and "amax" in str(n.target)
              and n.args[0].meta["val"].numel() > history]
    assert amaxes, "no amax of the output gradient in the backward graph"
    stray = [n.name for n in amaxes if not any(a.op == "placeholder" and a.name.startswith("tangents")
                                                 for a in ancestors(n))]
    assert not stray, f"amaxes of the backward computed from forward values: {stray}"
    with torch.no_grad():
        h = norm(x)
    want = torch.stack([h.abs().amax().float(), lin.weight.abs().amax().float()])
    got = state.entries["lin"].forward_amax
    assert torch.equal(got, want), f"record {got.tolist()} != {want.tolist()}"


def test_activation_checkpointing_eager_and_compiled_equal_plain_eager():
    """The recomputed forward casts with this step's scales and records nothing twice (eager), and the
    compiled backward's recomputation never reads the updated history (state written in backward only)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ref_model, ref_state = _make(block=True)
    ref = _steps(ref_model, ref_state, ref_model, 4)
    model, state = _make(block=True)
    _assert_same(ref, _steps(model, state, checkpoint_wrapper(model, preserve_rng_state=False), 4))
    model, state = _make(block=True)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(checkpoint_wrapper(model, preserve_rng_state=False), backend=counter)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        _assert_same(ref, _steps(model, state, compiled, 4))
    assert counter.frame_count == 2, f"{counter.frame_count} compilations (0: dynamo fell back to eager)"


def test_state_loaded_between_compiled_steps_takes_effect():
    """A rollback / resume replaces the entry's tensors: the compiled module reads the new ones."""
    model, state = _make(block=False)
    compiled = torch.compile(model, fullgraph=True)
    _steps(model, state, compiled, 3)
    saved = state.state_dict()
    _steps(model, state, compiled, 2, start=3)
    state.load_state_dict(saved)
    after = _steps(model, state, compiled, 1, start=3)
    ref_model, ref_state = _make(block=False)
    _steps(ref_model, ref_state, ref_model, 3)
    with torch.no_grad():
        for p, q in zip(ref_model.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    _assert_same(_steps(ref_model, ref_state, ref_model, 1, start=3), after)


def test_amax_all_reduce_compiles_in_a_process_group():
    """With ``group`` set, the functional all-reduce traces into the graph (one-rank gloo group: the values
    are this rank's own)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, state = _make(block=False)
        state.group = dist.group.WORLD
        ref_model, ref_state = _make(block=False)
        _assert_same(_steps(ref_model, ref_state, ref_model, 3),
                     _steps(model, state, torch.compile(model, fullgraph=True), 3))
    finally:
        dist.destroy_process_group()


def _rank_worker(out: Path) -> None:
    """Under torchrun (2 ranks, gloo): each rank feeds its own ranges; both must hold the MAX over ranks."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    state = DelayedScalingState(DelayedScaling(amax_history_len=4), group=dist.group.WORLD)
    layer = Float8DelayedLinear.from_linear(nn.Linear(32, 48, bias=False), state, "l").bfloat16()
    local = []
    for i in range(3):
        x = (torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * rank + i)) * (1 + 3 * rank)).bfloat16()
        dy = (torch.randn(8, 48, generator=torch.Generator().manual_seed(99 + 10 * rank + i)) * (2 - rank)).bfloat16()
        layer(x.requires_grad_(True)).backward(dy)
        local.append([x.float().abs().max().item(), layer.weight.float().abs().max().item(),
                      dy.float().abs().max().item()])
    state.roll()  # the third step's record (every rank rolls: one all-reduce)
    res = {"history": state.entries["l"].history.tolist(), "local": local}
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    from fp8kit.parallel.mesh import end_distributed

    end_distributed(completed=True)


@pytest.mark.slow
def test_amax_all_reduce_gives_every_rank_the_same_history(tmp_path):
    root = str(Path(__file__).resolve().parent.parent)  # the worker (this file as a script) imports tests.conftest
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["history"] == r1["history"], (r0["history"], r1["history"])
    # [step][operand]: the MAX over ranks
    expected = [[max(a, b) for a, b in zip(s0, s1, strict=True)] for s0, s1 in zip(r0["local"], r1["local"], strict=True)]
    got = [[r0["history"][op][3 - 1 - step] for op in range(3)] for step in range(3)]  # column 0 = newest
    assert got == expected, (got, expected)
    assert r0["local"] != r1["local"]  # the ranks did see different ranges


# -- training runs ----------------------------------------------------------------------------------


def _cfg(small_run, *extra):
    return load_config(None, [*small_run, "fp8.recipe=delayed", "train.warmup_steps=2", *extra])


@pytest.mark.slow
def test_resume_is_exact_and_another_recipe_is_refused(small_run, tmp_path):
    base = ["train.steps=6", "train.checkpoint_every=3", "train.eval_every=3"]
    full = train(_cfg(small_run, *base), tmp_path / "full").metrics
    ck = tmp_path / "full" / "checkpoints" / "step_000003"
    resumed = train(_cfg(small_run, *base), tmp_path / "resumed", resume=ck).metrics
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]], (resumed, full)
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[3:]]
    with pytest.raises(CheckpointError, match="fp8.recipe = 'delayed'"):
        train(load_config(None, [*small_run, *base, "fp8.recipe=tensorwise"]), tmp_path / "other", resume=ck)
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_resume_from_an_async_dcp_checkpoint_is_exact(small_run, tmp_path):
    """``train.async_checkpoint`` writes the model and optimizer as DCP files in the background; the delayed
    recipe's histories and scales travel in the training state beside them, so a resume from such a checkpoint
    continues bit for bit too."""
    base = ["train.steps=6", "train.checkpoint_every=3", "train.eval_every=3", "train.async_checkpoint=true"]
    full = train(_cfg(small_run, *base), tmp_path / "full").metrics
    ck = tmp_path / "full" / "checkpoints" / "step_000003"
    assert any((ck / "dcp").glob("*.distcp")), f"no DCP files in {ck / 'dcp'}"
    resumed = train(_cfg(small_run, *base), tmp_path / "resumed", resume=ck).metrics
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]], (resumed, full)
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in full[3:]]


if __name__ == "__main__":  # run by test_amax_all_reduce_gives_every_rank_the_same_history under torchrun
    _rank_worker(Path(sys.argv[1]))


def test_an_all_gathered_e4m3_weight_compiles_without_a_graph_break_and_equals_eager():
    """FSDP2's E4M3 all-gather (fp8.delayed_all_gather) hands the delayed linear a torchao ``Float8TrainingTensor``.
    Recognising it must not import inside the compiled region: that graph break split the fused MLP's first-step
    linears into frames that torch 2.11's Dynamo failed to compile on the GPU (session 49). fullgraph=True fails on
    any break; compiled equals eager bit for bit (same casts, the same _scaled_mm on the CPU)."""
    from fp8kit.fp8.delayed import float8_tensor_types

    tt = float8_tensor_types()  # what fsdp_post_all_gather calls before building the gathered weight
    torch.manual_seed(0)
    state = DelayedScalingState(DelayedScaling(amax_history_len=4))
    layer = Float8DelayedLinear.from_linear(nn.Linear(64, 96, bias=False), state, "l").bfloat16()
    x = torch.randn(32, 64).bfloat16()
    _fwd_bwd(layer, x, torch.randn(32, 96).bfloat16())  # the first recorded step: scales from here on
    state.roll()
    sw = state.entries["l"].scale[1]
    w8 = (layer.weight.detach().float() * sw).clamp(-448, 448).to(torch.float8_e4m3fn)
    gathered = tt.Float8TrainingTensor(w8, sw, torch.bfloat16, tt.LinearMMConfig(),
                                       gemm_input_role=tt.GemmInputRole.WEIGHT)

    def fwd(x_):
        return layer._local_forward(x_, gathered, None)

    compiled = torch.compile(fwd, fullgraph=True)
    with torch.no_grad():
        eager_y, compiled_y = fwd(x), compiled(x)
    assert torch.equal(eager_y, compiled_y), (
        f"compiled != eager with a gathered E4M3 weight: max |diff| {(eager_y - compiled_y).abs().max().item()}")
    ref = x.float() @ (w8.float() / sw).t()
    assert sqnr(ref, compiled_y.float()) >= 25, f"SQNR {sqnr(ref, compiled_y.float()):.1f} dB against the dequantized GEMM"
