"""Meta-device initialisation (``fp8kit.models.init``, ``distributed.meta_init``).

- One process keeps today's initialisation: ``build_setup`` builds on the device (not on ``meta``), and its
  weights equal ``build_model``'s bit for bit.
- The recorded initialisation of the presets replays with the statistics of transformers' own
  (``normal(0, initializer_range)`` for linears and embeddings, ones for norms), the padding row zero, the
  rotary buffers equal, tied embeddings one parameter; ``trunc_normal_`` (an in-place op chain) and block
  writes replay too; what cannot be replayed is refused naming the parameter.
- 2 gloo ranks (tests/meta_init_worker.py; FSDP2 with FP8 all-gather + AC + tied embeddings, dp_replicate 2,
  TP 2, EP 2 on tiny-moe): per-layer statistics against the unsharded init, the whole model equal to a
  single-process meta init bit for bit (the init does not depend on the layout), replicas equal, shards
  different, no allocation larger than one random chunk or the largest local shard.

Statistical tolerances, per parameter of n elements drawn from normal(0, s) (both inits independent):
|mean difference| <= 6 s sqrt(2 / n) (6 standard deviations of the difference of two sample means) and
|std ratio - 1| <= 6 / sqrt(n) + 4e-3 (the sample std's relative spread is 1 / sqrt(2 n) each; 4e-3 covers
bf16 rounding of the values). Constant parameters (norms) must be equal exactly.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from fp8kit.base.errors import ConfigError
from fp8kit.config import load_config
from fp8kit.models.build import build_model
from fp8kit.models.init import (
    CHUNK_NUMEL,
    build_model_on_meta,
    chunk_layout,
    initialize_shards,
    record_initialization,
)

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ["fsdp", "replicate", "tp", "ep"]


def _check_stats(name: str, got: dict, want: dict) -> None:
    """The module docstring's tolerances; ``got`` / ``want``: mean, std, min, max, numel."""
    if want["std"] == 0.0:
        assert got == want, f"{name}: constant init differs: meta {got} vs unsharded {want}"
        return
    n, s = want["numel"], want["std"]
    tol_mean = 6 * s * math.sqrt(2 / n)
    tol_std = 6 / math.sqrt(n) + 4e-3
    assert abs(got["mean"] - want["mean"]) <= tol_mean, (
        f"{name}: mean {got['mean']:.3e} vs unsharded {want['mean']:.3e} (tol {tol_mean:.1e}, n {n})")
    assert abs(got["std"] / s - 1) <= tol_std, (
        f"{name}: std {got['std']:.5f} vs unsharded {s:.5f} (relative tol {tol_std:.1e}, n {n})")


def _stats(t: torch.Tensor) -> dict:
    t = t.detach().double()
    return {"mean": t.mean().item(), "std": t.std().item() if t.numel() > 1 else 0.0, "min": t.min().item(),
            "max": t.max().item(), "numel": t.numel()}


# ------------------------------------------------------------------------------------------- one process


def test_one_process_keeps_todays_init(small_run):
    """The default single-process run never goes through meta: bit-equal to build_model on the device."""
    from fp8kit.train.setup import build_setup

    cfg = load_config(None, small_run + ["train.mixed_precision=bf16"])
    setup = build_setup(cfg)
    assert setup.info["parallel"]["meta_init"] is False
    want = dict(build_model(cfg.model, cfg.data.vocab_size, device="cpu", seed=cfg.train.seed).named_parameters())
    for name, p in setup.model.named_parameters():
        assert not p.is_meta and torch.equal(p, want[name]), f"{name} differs from today's init"


@pytest.mark.parametrize("preset", ["tiny", "llama3-1b", "qwen2.5-72b", "tiny-moe", "deepseek-v3"])
def test_replayed_init_has_the_statistics_of_transformers_init(preset):
    """Shapes of real presets at 4 layers (deepseek-v3: the 4th is MoE), vocabulary 4096: every parameter's
    statistics, every buffer equal (rotary inv_freq), tied embeddings one parameter, finite logits."""
    # the large presets narrower (the test is about the init, not the size), with a padding row
    which = f"model.hf_config={_narrow(preset)}" if preset in _NARROWED else f"model.preset={preset}"
    cfg = load_config(None, [which, "model.num_layers=4", "data.vocab_size=4096"])
    model, program = build_model_on_meta(cfg.model, 4096, seed=3)
    initialize_shards(model, program, "cpu")
    ref = build_model(cfg.model, 4096, device="cpu", seed=3)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        _check_stats(name, _stats(p), _stats(ref_params[name]))
    ref_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        assert torch.equal(b, ref_buffers[name]), f"buffer {name} differs from the CPU build"
    tied = ref.get_output_embeddings().weight is ref.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied
    with torch.no_grad():
        logits = model(input_ids=torch.arange(16).reshape(1, 16)).logits
    assert torch.isfinite(logits.float()).all()


_NARROWED = ("llama3-1b", "qwen2.5-72b", "deepseek-v3")
_NARROW = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 64, "moe_intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
           "v_head_dim": 32, "n_group": 2, "topk_group": 1, "pad_token_id": 7}


def _narrow(preset: str) -> str:
    """A config.json of ``preset`` at a CPU-friendly width (and a padding row), in a temporary directory."""
    import tempfile

    from fp8kit.models.presets import PRESETS

    cfg = dict(PRESETS[preset])
    cfg.update({k: v for k, v in _NARROW.items() if k in cfg or k == "pad_token_id"})
    if cfg["model_type"] == "deepseek_v3":  # MLA: as many key/value heads as query heads
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_padding_row_is_zero_and_the_rest_random():
    cfg = load_config(None, ["model.num_layers=1", "data.vocab_size=1024", f"model.hf_config={_narrow('tiny')}"])
    model, program = build_model_on_meta(cfg.model, 1024, seed=0)
    initialize_shards(model, program, "cpu")
    w = model.get_input_embeddings().weight
    assert torch.count_nonzero(w[7]) == 0 and torch.count_nonzero(w[6]) == w.shape[1]


class _Toy(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.w = nn.Parameter(torch.empty(64, 48))
        self.s = nn.Parameter(torch.empty(()))  # a 0-d parameter
        nn.init.normal_(self.s, mean=3.0, std=0.5)
        if how == "trunc_normal":
            nn.init.trunc_normal_(self.w, std=0.02, a=-0.03, b=0.03)  # returns early on meta: seen as a call
            with torch.no_grad():
                self.w.mul_(2.0)
                self.w[5].zero_()
                self.w[:, 40:].fill_(2.0)
        elif how == "computed":
            with torch.no_grad():
                self.w.copy_(torch.arange(64 * 48.0).reshape(64, 48) * 2)  # values only meta knows
        elif how == "orthogonal":
            nn.init.orthogonal_(self.w)  # a whole-matrix construction (returns early on meta)
        elif how == "strided":
            nn.init.normal_(self.w)
            with torch.no_grad():
                self.w[:, ::2].zero_()


def _record(how: str):
    def build():
        with torch.device("meta"):
            return _Toy(how)
    return record_initialization(build, seed=0)


def test_in_place_chains_and_blocks_replay():
    model, program = _record("trunc_normal")
    assert [w.kind for w in program.writes["w"]] == ["trunc_normal", "elementwise", "fill", "fill"]
    initialize_shards(model, program, "cpu")
    w = model.w.detach()
    body = w[torch.arange(64) != 5, :40]
    # 2 x normal(0, 0.02) truncated to +-1.5 std: std 2 x 0.7427 x 0.02 = 0.0297 (n = 2520: +-9% is 6 std
    # of the sample std)
    assert body.abs().max() <= 0.06 and abs(body.std() / 0.0297 - 1) < 0.09, (body.abs().max(), body.std())
    assert torch.count_nonzero(w[5, :40]) == 0 and (w[:, 40:] == 2.0).all()
    assert model.s.dim() == 0 and 0.0 < model.s.item() < 6.0 and program.writes["s"][0].kind == "normal"


@pytest.mark.parametrize("how, needle", [
    ("computed", "'w' (64, 48) is initialised from values computed at build time (copy_)"),
    ("orthogonal", "'w' (64, 48) is initialised from values computed at build time (orthogonal_)"),
    ("strided", "'w' (64, 48) is initialised through a view that is not a block of it (zero_)"),
    ("none", "'w' (64, 48) is never initialised (torch.empty without an init)"),
])
def test_what_cannot_be_replayed_is_refused(how, needle):
    with pytest.raises(ConfigError) as e:
        _record(how)
    assert needle in str(e.value) and "distributed.meta_init = false" in str(e.value), str(e.value)


def test_a_parameter_added_after_the_build_is_refused():
    model, program = _record("trunc_normal")
    model.extra = nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(ConfigError, match="parameter 'extra' was not in the model when it was built"):
        initialize_shards(model, program, "cpu")


def test_chunk_layout():
    assert chunk_layout((8192, 256), CHUNK_NUMEL) == (0, 4096)  # blocks of rows
    assert chunk_layout((8, 4096, 7168), CHUNK_NUMEL) == (1, 146)  # one expert: blocks of its rows
    assert chunk_layout((256,), CHUNK_NUMEL) == (0, CHUNK_NUMEL)
    assert chunk_layout((3, 5), 4) == (1, 4)


# -------------------------------------------------------------------------------------------- 2 gloo ranks


def _run_worker(out: Path, *args: str) -> dict:
    """tests/meta_init_worker.py under ``torchrun --nproc_per_node 2``; its JSON records."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(ROOT / "tests" / "meta_init_worker.py"), str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run_worker(tmp_path_factory.mktemp("meta_init") / "records.json", *LAYOUTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_statistics_match_the_unsharded_init(two_ranks, layout):
    rec = two_ranks[layout]
    assert rec["params"], rec
    for name, p in rec["params"].items():
        _check_stats(f"{layout} {name}", p["meta"], p["reference"])
        # the layout does not change the model: the same numbers as one process with meta_init = true
        assert p["equals_single_process_meta_init"], f"{layout} {name}: differs from the single-process meta init"
    assert all(rec["buffers_equal"].values()), rec["buffers_equal"]  # rotary inv_freq recomputed exactly
    assert rec["logits_finite"]


@pytest.mark.parametrize("layout, sharded, replicated", [
    # FSDP2: every parameter is Shard(0) over 2 ranks (norms included)
    ("fsdp", "all", ""),
    # dp_replicate 2, dp_shard 1: every parameter is whole on both ranks
    ("replicate", "", "all"),
    # TP 2: attention / MLP linears split, embeddings / lm_head / norms plain and equal on both ranks
    ("tp", "layers.0.self_attn.q_proj.weight layers.0.mlp.down_proj.weight", "embed_tokens lm_head norm.weight"),
    # EP 2 + FSDP2: experts Shard(0) over ep (the rest FSDP2)
    ("ep", "experts.gate_up_proj experts.down_proj embed_tokens", ""),
])
def test_two_ranks_hold_different_shards_and_equal_replicas(two_ranks, layout, sharded, replicated):
    params = two_ranks[layout]["params"]

    def pick(spec):
        return list(params) if spec == "all" else [n for n in params if any(k in n for k in spec.split())]

    for name in pick(sharded):
        p = params[name]
        assert p["n_distinct_boxes"] >= 1, f"{layout} {name}: not sharded ({p})"
        if p["reference"]["std"] > 0:  # random: the two ranks' parts differ
            assert p["distinct_boxes_differ"], f"{layout} {name}: both ranks hold the same numbers"
    for name in pick(replicated):
        p = params[name]
        assert p["n_same_box"] >= 1 and p["same_box_equal"], f"{layout} {name}: replicas differ ({p})"
    assert pick(sharded) or pick(replicated)


@pytest.mark.parametrize("layout", ["fsdp", "ep"])
def test_no_rank_allocates_the_whole_tensor(two_ranks, layout):
    """dp_shard 2: the embeddings (8192 x 256 = 2^21 elements, twice a random chunk) never exist whole; no
    allocation exceeds max(one chunk, the largest local shard) = 2^20 elements."""
    a = two_ranks[layout]["alloc"]
    bound = max(a["chunk_numel"], a["largest_local"])
    assert a["largest_param"] == 8192 * 256 and a["largest_local"] == a["largest_param"] // 2, a
    assert a["max_numel"] <= bound < a["largest_param"], (
        f"{layout}: largest allocation {a['max_numel']} elements {a['max_shape']} vs bound {bound} "
        f"(largest parameter {a['largest_param']})")


def test_tied_embeddings_stay_tied_under_fsdp2(two_ranks):
    assert two_ranks["fsdp"]["tied"]
    assert "lm_head.weight" not in two_ranks["fsdp"]["params"]  # one parameter, listed once
    assert two_ranks["fsdp"]["steps"] == ["fp8", "ac", "fsdp2"]


@pytest.mark.slow
def test_fsdp2_with_meta_init_off_trains_like_one_process(small_run, tmp_path):
    """distributed.meta_init = false under torchrun: every rank builds the whole model with today's init, so
    3 steps on 2 ranks (FSDP2, bf16, micro-batch 2) track one process (micro-batch 4) within 2e-3 (bf16
    reduction order only: tests/test_distributed.py), where a different init would differ at step 1."""
    from fp8kit.train.metrics import read_metrics
    from fp8kit.train.trainer import train

    cache = small_run[small_run.index(next(s for s in small_run if s.startswith("data.cache_dir=")))].split("=", 1)[1]
    sets = small_run + ["train.steps=3", "train.eval_every=0", "train.checkpoint_every=0",
                        "train.final_checkpoint=false", "train.mixed_precision=bf16"]
    ref = [r["loss"] for r in train(load_config(None, sets), tmp_path / "ref").metrics]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           str(ROOT / "tests" / "distributed_worker.py"), str(tmp_path), cache, "fsdp_bf16_full_init"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    run = tmp_path / "fsdp_bf16_full_init"
    got = [r["loss"] for r in read_metrics(run / "metrics.jsonl")]
    diffs = [abs(a - b) for a, b in zip(got, ref, strict=True)]
    assert max(diffs) <= 2e-3, f"2 ranks without meta init {got} vs one process {ref}"
    assert json.loads((run / "summary.json").read_text())["parallel"].endswith("(fsdp2)"), "not an FSDP2 run"
    assert json.loads((run / "run_info.json").read_text())["parallel"]["meta_init"] is False


# ------------------------------------------------------------------------------------------------------ GPU

_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@_cuda
def test_cuda_meta_init_allocates_the_parameters_and_one_chunk():
    """One GPU, llama3-8b shapes at 2 layers (1.5 B parameters, embeddings 128256 x 4096): the replay on CUDA
    generators allocates the bf16 parameters plus at most two float32 chunks (no full-size float32 copy,
    which would add 2 GiB for each embedding), with the statistics of transformers' init on the GPU."""
    import time

    cfg = load_config(None, ["model.preset=llama3-8b", "model.num_layers=2", "data.vocab_size=128256"])
    model, program = build_model_on_meta(cfg.model, 128256, seed=0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    initialize_shards(model, program, "cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    slack = 2 * CHUNK_NUMEL * 4 + (16 << 20)
    print(f"meta init on {torch.cuda.get_device_name()}: {weights / 2**30:.2f} GiB of weights in {seconds:.2f} s, "
          f"peak {peak / 2**30:.3f} GiB")
    assert peak <= weights + slack, f"peak {peak} B > weights {weights} B + two chunks and 16 MiB"
    ref = build_model(cfg.model, 128256, device="cuda", seed=0)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        _check_stats(name, _stats(p), _stats(ref_params[name]))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_meta_init(tmp_path):
    """tests/meta_init_worker.py with NCCL on 2 GPUs (FSDP2 + FP8 all-gather + AC + tied, TP 2): the CPU
    test's checks, and each GPU's peak over prepare + init at most its shards plus two float32 chunks."""
    records = _run_worker(tmp_path / "records.json", "--device", "cuda", "fsdp", "tp")
    for layout, rec in records.items():
        for name, p in rec["params"].items():
            _check_stats(f"{layout} {name}", p["meta"], p["reference"])
            assert p["equals_single_process_meta_init"], f"{layout} {name}: differs from one GPU's meta init"
        assert all(rec["buffers_equal"].values()) and rec["logits_finite"], rec
        a = rec["alloc"]
        print(f"{layout}: peak {a['peak_bytes']} B, local weights {a['local_bytes']} B, largest allocation "
              f"{a['max_numel']} elements")
        assert a["peak_bytes"] <= a["local_bytes"] + 2 * CHUNK_NUMEL * 4 + (16 << 20), a
    assert records["fsdp"]["alloc"]["max_numel"] < records["fsdp"]["alloc"]["largest_param"]
