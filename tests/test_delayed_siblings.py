"""The delayed recipe's q/k/v and gate/up share their input's scale (fp8.delayed_siblings): one cast of that input.

CPU: the links follow which projections are FP8; the bits equal separate scales in a run; unequal histories give
the smallest scale; under torch.compile the shared input is cast once per group (counted in the AOT graphs)."""

from __future__ import annotations

import torch

from fp8kit.fp8.delayed import Float8DelayedLinear
from fp8kit.fp8.delayed_siblings import link_input_siblings
from fp8kit.parallel.convert import restore_bf16
from tests.conftest import llama_steps, prepared_llama
from tests.conftest import randn_outliers as _real


def _llama(extra=()):
    return prepared_llama(["fp8.recipe=delayed", "fp8.delayed_fused_mlp=false", *extra])[0]


def _unlink(model) -> None:
    for m in model.modules():
        if isinstance(m, Float8DelayedLinear):
            m._input_siblings = ()
            m._entry.leader, m._entry.members, m._entry.group_ready = None, (), False


def test_the_groups_are_qkv_and_gate_up_and_follow_the_fp8_modules():
    model, done = prepared_llama(["fp8.recipe=delayed", "fp8.delayed_fused_mlp=false"])
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv = tuple(p._entry for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert all(p._input_siblings == qkv for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert all(p._input_siblings == (mlp.gate_proj._entry, mlp.up_proj._entry) for p in (mlp.gate_proj, mlp.up_proj))
    assert attn.o_proj._input_siblings == () and mlp.down_proj._input_siblings == ()
    # k_proj back to BF16 (the divergence guard's single-layer switch): q and v stay a group of two
    assert restore_bf16(model, {"model.layers.0.self_attn.k_proj"}) == 1
    assert not isinstance(attn.k_proj, Float8DelayedLinear)
    assert attn.q_proj._input_siblings == attn.v_proj._input_siblings == (attn.q_proj._entry, attn.v_proj._entry)
    assert restore_bf16(model, {"model.layers.0.self_attn.v_proj"}) == 1
    assert attn.q_proj._input_siblings == ()  # a group of one is no group
    # back to FP8 (the guard's window ends, a precision phase switches back): one group of three again, with the
    # histories the returning modules kept (the state's entries by name)
    from fp8kit.config import load_config
    from fp8kit.config.options import options_from_config
    from fp8kit.models.build import build_hf_config
    from fp8kit.parallel.convert import apply_fp8
    from fp8kit.selective.decide import decide
    from fp8kit.selective.sites import find_sites

    cfg = load_config(None, ["model.preset=llama-125m", "model.num_layers=2", "data.vocab_size=1024",
                             "train.mixed_precision=fp8", "fp8.recipe=delayed"])
    decisions = decide(find_sites(model), options_from_config(cfg, build_hf_config(cfg.model, 1024), "cpu"))
    assert apply_fp8(model, decisions, done.conversion) == 2
    qkv_again = tuple(p._entry for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert qkv_again == qkv and all(p._input_siblings == qkv for p in (attn.q_proj, attn.k_proj, attn.v_proj))


def test_shared_scales_train_bit_for_bit_like_separate_ones():
    """The histories of one group record the same amaxes, so the shared (smallest) scale is each one's own."""
    linked, unlinked = _llama(), _llama()
    _unlink(unlinked)
    assert link_input_siblings(linked) == 2 * (3 + 2)
    loss_a, grads_a = llama_steps(linked, 3)
    loss_b, grads_b = llama_steps(unlinked, 3)
    assert torch.equal(loss_a, loss_b), (loss_a, loss_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    state_a = linked.model.layers[0].self_attn.q_proj.state
    state_b = unlinked.model.layers[0].self_attn.q_proj.state
    for name, e in state_a.entries.items():
        assert torch.equal(e.history, state_b.entries[name].history), name


def test_unequal_histories_cast_at_the_smallest_scale():
    model = _llama()
    llama_steps(model, 1)  # the histories start
    attn = model.model.layers[0].self_attn
    state = attn.q_proj.state
    state.roll()  # the model's forward rolls; this test calls the projections themselves
    x = _real(1, 40, attn.k_proj.in_features, seed=3)
    with torch.no_grad():
        own = attn.k_proj(x)  # k's own scale (the group's are equal)
        attn.q_proj._entry.history[0] *= 100.0  # q's input scale 100x smaller
        state.roll()
        shared = attn.k_proj(x)
        assert not torch.equal(shared, own)  # k now casts at q's scale
        # the scale the health statistics read (fp8.stats_every) is the one the casts used
        q_scale = attn.q_proj.state.scale_tensors(attn.q_proj._entry)[0]
        assert all(torch.equal(p.cast_scales()[0], q_scale) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        _unlink(model)
        attn.k_proj._entry.history[0] *= 100.0  # k's own scale made q's: the same cast
        state.roll()
        assert torch.equal(attn.k_proj(x), shared)


def _e4m3_casts(model, ids) -> tuple[int, int]:
    """E4M3 ``_to_copy`` nodes in the forward and backward graphs AOTAutograd makes of one compiled step (after its
    CSE, with the partitioner Inductor uses)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs: dict[str, list] = {"fw": [], "bw": []}

    def capture(kind):
        def compiler(gm, _inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=capture("fw"), bw_compiler=capture("bw"),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    compiled(input_ids=ids, labels=ids).loss.backward()

    def count(gms):
        return sum(n.target == torch.ops.aten._to_copy.default and n.kwargs.get("dtype") == torch.float8_e4m3fn
                   for gm in gms for n in gm.graph.nodes)
    return count(graphs["fw"]), count(graphs["bw"])


def test_compiled_step_casts_each_shared_input_once():
    """Without the links q, k, v, gate and up each cast their (shared) inputs; with them the q/k/v casts are one and
    the gate/up casts one: 3 fewer E4M3 casts per layer in the forward (6 in two layers; measured 30 -> 24), and the
    same 3 fewer wgrad re-casts of those inputs in the backward (26 -> 20)."""
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1))
    counts = {}
    for linked in (True, False):
        model = _llama()
        if not linked:
            _unlink(model)
        llama_steps(model, 1)  # the histories start (scales known: the delayed casts)
        counts[linked] = _e4m3_casts(model, ids)
    (fw_l, bw_l), (fw_u, bw_u) = counts[True], counts[False]
    assert fw_u - fw_l == 6, counts
    assert bw_u - bw_l == 6, counts


def _fp8_again(model, done) -> int:
    """Every candidate linear back to FP8 (the end of the guard's BF16 window, a precision phase switching back)."""
    from fp8kit.config import load_config
    from fp8kit.config.options import options_from_config
    from fp8kit.models.build import build_hf_config
    from fp8kit.parallel.convert import apply_fp8
    from fp8kit.selective.decide import decide
    from fp8kit.selective.sites import find_sites

    cfg = load_config(None, ["model.preset=llama-125m", "model.num_layers=2", "data.vocab_size=1024",
                             "train.mixed_precision=fp8", "fp8.recipe=delayed"])
    return apply_fp8(model, decide(find_sites(model), options_from_config(cfg, build_hf_config(cfg.model, 1024), "cpu")),
                     done.conversion)


def test_a_projection_back_from_bf16_takes_its_siblings_input_history():
    """q_proj kept in BF16 for 3 steps while k and v record: back in FP8 its input row and step count are k's (what
    it would have recorded: the same input), its weight and gradient rows its own, so the group's shared scale is
    k's own, not coarsened by q's stale amaxes. Then k and v leave for 2 steps while q alone records: back, they take
    q's row (the freshest: counts stay equal within a group after each link)."""
    model, done = prepared_llama(["fp8.recipe=delayed", "fp8.delayed_fused_mlp=false"])
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj._entry, attn.k_proj._entry, attn.v_proj._entry
    llama_steps(model, 2)
    restore_bf16(model, {"model.layers.0.self_attn.q_proj"})
    own_rows = q.history[1:].clone()
    q.history[0] *= 100.0  # stale amaxes that would coarsen the group's scale (as before a divergence)
    llama_steps(model, 3, seed=1)
    state = attn.k_proj.state
    state.roll()  # the third step's records (the next forward would roll them)
    assert int(q.steps) == 2 and int(k.steps) == 5
    assert _fp8_again(model, done) == 1
    assert torch.equal(q.history[0], k.history[0]) and int(q.steps) == int(k.steps) == 5, (q.history[0], k.history[0])
    assert torch.equal(q.history[1:], own_rows), "the weight / output-gradient rows must stay q's own"
    state.roll()  # the scales of the aligned histories (the next forward would compute them)
    assert q.leader is q and k.leader is q and torch.equal(q.group_scale, k.scale[0]), (q.group_scale, k.scale)
    # k and v leave while q records; back, the freshest row is q's
    restore_bf16(model, {"model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"})
    llama_steps(model, 2, seed=2)
    state.roll()
    assert int(q.steps) == 7 and int(k.steps) == int(v.steps) == 5
    assert _fp8_again(model, done) == 2
    assert torch.equal(k.history[0], q.history[0]) and torch.equal(v.history[0], q.history[0])
    assert int(k.steps) == int(v.steps) == 7


def test_a_projection_in_bf16_leaves_its_group_and_a_resumed_state_casts_shared_inputs():
    """k_proj swapped to BF16 (the guard's single-layer switch) no longer takes part in q/v's shared input scale,
    whatever its frozen history holds; and a state loaded from a checkpoint (``--resume``) casts each shared input at
    its group's scale at once, as the run that saved it did."""
    model, done = prepared_llama(["fp8.recipe=delayed", "fp8.delayed_fused_mlp=false"])
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj._entry, attn.k_proj._entry, attn.v_proj._entry
    llama_steps(model, 2)
    state = attn.q_proj.state
    restore_bf16(model, {"model.layers.0.self_attn.k_proj"})
    k.history[0] *= 100.0  # k's frozen input amaxes, 100x: its input scale 100x smaller
    state.roll()
    assert k.leader is None and not k.active and q.leader is q and q.members == (q, v)
    want = torch.minimum(q.scale[0], v.scale[0])
    assert torch.equal(q.group_scale, want) and q.group_scale > 10 * k.scale[0], (q.group_scale, k.scale[0])
    saved = state.state_dict()
    fresh, _ = prepared_llama(["fp8.recipe=delayed", "fp8.delayed_fused_mlp=false"])
    fa = fresh.model.layers[0].self_attn
    fa.q_proj.state.load_state_dict(saved)
    assert all(p._entry.started and p._entry.group_ready for p in (fa.q_proj, fa.k_proj, fa.v_proj))
    scales = [p.cast_scales()[0] for p in (fa.q_proj, fa.k_proj, fa.v_proj)]
    assert all(t is fa.q_proj._entry.group_scale for t in scales), "the group's cast must read one tensor"
