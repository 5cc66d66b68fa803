"""Everything a run needs, built and checked before the run directory is written.

Order (one place, for one process and for torchrun alike): parallel layout checked against the world
size (and, under torchrun, the process group and DeviceMesh started) -> device and FP8 capability ->
resume checkpoint located -> data (corpus, tokenizer, packing; rank 0 first, the others read its cache)
-> model on the device (``model.pretrained``: its weights), or, with ``distributed.meta_init`` (default
under torchrun), on ``meta`` -> sites and decisions -> resume compatibility -> ``prepare_model`` (TP -> EP ->
FP8 -> AC -> FSDP2 -> compile; ``fp8kit.parallel.prepare``) -> meta init: each rank materialises its own
shards and initialises them (``fp8kit.models.init``) or reads them from ``model.pretrained`` -> optimizer
and LR schedule (after
``prepare_model``: FSDP2 replaces the parameters) -> (``restore``) the checkpoint loaded into the
prepared model and optimizer. Every step can fail with a one-line
:class:`~fp8kit.base.errors.Fp8kitError`; none of them writes into the run directory (the tokenizer
cache is the only thing written, and it is atomic).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fp8kit.base import cpu_bf16_gemm
from fp8kit.base.capability import fp8_support
from fp8kit.base.errors import CapabilityError, CheckpointError, ConfigError
from fp8kit.base.runtime import device_name, is_main, launched_world_size, resolve_device, versions
from fp8kit.bench.auto import resolve_auto
from fp8kit.config import RunConfig
from fp8kit.config.optim_choice import resolve_optimizer
from fp8kit.config.options import grouped_gemm_config, load_policies, moe_topk, options_from_config
from fp8kit.config.prepare_options import prepare_options, weight_cast_accumulations
from fp8kit.config.pretrained import resolve_pretrained
from fp8kit.data.prepare import PreparedData, prepare_data
from fp8kit.fp8.recipes import GEMMS, fast_accum_for
from fp8kit.models.build import build_hf_config, build_model, count_params, flops_per_token
from fp8kit.models.init import build_model_on_meta, initialize_shards
from fp8kit.models.pretrained import (
    check_weights,
    inspect_pretrained,
    load_pretrained,
    load_sharded,
    materialize,
)
from fp8kit.moe.experts import Float8GroupedExperts
from fp8kit.optim.memory import training_state_bytes
from fp8kit.parallel.convert import ConversionOptions
from fp8kit.parallel.mesh import ParallelDims, resolve_dims
from fp8kit.parallel.prepare import Prepared, prepare_model
from fp8kit.selective.decide import Decision, decide, decision_notes, fp8_head
from fp8kit.selective.sites import find_sites
from fp8kit.train import checkpoint as ckpt
from fp8kit.train.memory_fit import activation_bytes, check_state_fits, fp8_adamw_precision
from fp8kit.train.metrics import bf16_peak_flops
from fp8kit.train.schedule import lr_factor, precision_at


@dataclass
class Setup:
    """A run ready to train (see the module docstring for how it is built)."""

    cfg: RunConfig
    device: torch.device
    data: PreparedData
    model: nn.Module
    hf_cfg: object
    decisions: list[Decision]
    prepared: Prepared
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    flops_per_token: float
    peak_flops: float | None
    params: dict[str, int]
    capability: str
    start_step: int = 0
    resume_from: Path | None = None
    resume_state: dict | None = None
    info: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    shown_warnings: list[str] = field(default_factory=list)  # those of ``warnings`` already printed by set-up's warn
    facts: list[str] = field(default_factory=list)  # what the run does that is not a warning (printed as notes)
    loss_fn: object = None  # the token cross-entropy (compiled when train.compile)
    dims: ParallelDims | None = None  # the resolved [distributed] sizes (world size 1: all 1)
    mesh: object = None  # DeviceMesh ("dp_replicate", "dp_shard", "tp") of a distributed run, else None

    @property
    def distributed(self) -> bool:
        """Launched on more than one process (torchrun): FSDP2 / TP / EP over the mesh."""
        return self.mesh is not None

    @property
    def param_order(self) -> list[str]:
        """FQNs of the optimizer's parameters in its order (maps index-keyed optimizer states to FQNs)."""
        names = {id(p): n.replace("_checkpoint_wrapped_module.", "") for n, p in self.model.named_parameters()}
        return [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]


def check_fp8_capability(cfg: RunConfig, device: torch.device) -> str:
    """The capability sentence for the run; raises when fp8 is asked for where it cannot run.

    Raises:
        CapabilityError: ``mixed_precision = "fp8"`` on a device without FP8 support (or, for
            ``fp8.recipe = "blockwise"``, a CUDA device without cuBLAS blockwise FP8 GEMMs) and without
            ``fp8.emulate = true``.
    """
    return _capability(cfg, device)[0]


def fp8_emulated(cfg: RunConfig, device: torch.device) -> bool:
    """Whether this run's FP8 GEMMs are emulated (``fp8.emulate`` on a GPU that cannot run them natively)."""
    return _capability(cfg, device)[1]


def _capability(cfg: RunConfig, device: torch.device) -> tuple[str, bool]:
    ok, reason = fp8_support(device)
    if cfg.train.mixed_precision != "fp8":
        return reason, False
    if ok and cfg.fp8.recipe == "blockwise" and device.type == "cuda":
        from fp8kit.fp8.kernels.ops import blockwise_gemm_support

        ok, reason = blockwise_gemm_support(device)
    if not ok:
        if cfg.fp8.emulate and device.type == "cuda":
            return f"{reason} (emulating FP8: fp8.emulate = true)", True
        raise CapabilityError(f"train.mixed_precision = \"fp8\": {reason}")
    return reason, False


def check_resume_recipe(cfg: RunConfig, resume_ckpt: Path, state: dict) -> None:
    """Refuse to continue an FP8 run with another FP8 recipe (its scales, histories and numerics differ).

    Raises:
        CheckpointError: the checkpoint was saved by an FP8 run of another ``fp8.recipe``.
    """
    saved = state.get("recipe")
    if saved and cfg.train.mixed_precision == "fp8" and saved != cfg.fp8.recipe:
        raise CheckpointError(
            f"--resume {str(resume_ckpt)!r}: the checkpoint was trained with fp8.recipe = {saved!r}, this run asks "
            f"for {cfg.fp8.recipe!r}; resume with --set fp8.recipe={saved}"
        )


def output_head_resume_note(resume_ckpt: Path, state: dict, decisions: list[Decision]) -> str | None:
    """The warning for a resume whose output head runs in another precision than in the checkpoint's run
    (:func:`fp8_head`; checkpoints from before ``fp8.output_head`` count as BF16), or None. Not refused: the head's
    weights are the same either way, only its matmul's precision changes from here; with the delayed recipe a head
    that becomes FP8 starts an empty amax history (its first step scales from its own amax, as any module entering
    FP8 does)."""
    saved, now = bool(state.get("output_head", False)), fp8_head(decisions)
    if saved == now:
        return None
    was, will = ("FP8", "BF16") if saved else ("BF16", "FP8")
    return (f"--resume {str(resume_ckpt)!r}: the output head ran in {was} in the checkpoint's run and runs in {will} "
            f"from here on (fp8.output_head and the FP8 decisions of this run)")


def weight_cast_reuse(cfg: RunConfig, mesh, decisions: list[Decision], model: nn.Module,
                      device: torch.device) -> dict[str, int | None] | None:
    """How many micro-batches share one cast of each FP8 weight in this run, as prepared: ``"dense"`` where some
    dense linears are FP8 (``config.prepare_options.weight_cast_accumulations``: ``fp8.weight_cache`` with
    ``train.grad_accum > 1``, not under FSDP2, the delayed linears not with CUDA graphs, torchao's recipes never; a
    delayed linear's first step, before its history has a scale, casts at every micro-batch), ``"experts"`` where
    some converted MoE expert layers are FP8 (``grad_accum`` if every such layer of ``model`` caches its weights on
    ``device``, ``Float8GroupedExperts.caches_weights``, else 1; None while they are not converted yet, in a BF16
    phase of the precision schedule: decided at the switch); None for a BF16 run, one micro-batch per step, or no FP8
    weight."""
    if cfg.train.mixed_precision != "fp8" or cfg.train.grad_accum == 1:
        return None
    dense, expert = weight_cast_accumulations(cfg, mesh)
    reuse = {}
    if any(d.is_fp8 and not d.site.is_grouped_weight for d in decisions):
        reuse["dense"] = dense
    experts = [m for m in model.modules() if isinstance(m, Float8GroupedExperts) and m.fp8_weights]
    if experts:  # only the fused and blockwise-loop kernels keep a cache
        reuse["experts"] = expert if all(m.caches_weights(device) for m in experts) else 1
    elif any(d.is_fp8 and d.site.is_grouped_weight for d in decisions):
        reuse["experts"] = None  # FP8 from the precision switch on: the layers are converted there
    return reuse or None


def run_fast_accum(cfg: RunConfig, conversion: ConversionOptions, decisions: list[Decision]) -> list[str] | None:
    """The GEMMs of this run's dense FP8 linears that run with fast accumulation, in ``fp8.recipes.GEMMS`` order, as
    checkpoints record them (``"fast_accum"``), or None for a run that is not FP8 or decided no dense linear FP8
    (``decisions``: the run's, whatever the current precision phase; MoE experts accumulate as their kernels do).
    The conversion's ``fp8.fast_accum`` (``Prepared.conversion``) resolved by ``fp8.recipes.fast_accum_for``, as
    every dense FP8 linear takes it (torchao's configs, the delayed recipe's ``DelayedScaling``; none for
    blockwise)."""
    if cfg.train.mixed_precision != "fp8" or not any(d.is_fp8 and not d.site.is_grouped for d in decisions):
        return None
    return list(fast_accum_for(cfg.fp8.recipe, conversion.fast_accum))


def fast_accum_resume_note(resume_ckpt: Path, state: dict, now: list[str] | None) -> str | None:
    """The warning for a resume whose FP8 linears accumulate fast in other GEMMs than in the checkpoint's run (its
    ``"fast_accum"``; ``now``: :func:`run_fast_accum` of this run), or None: also when either run is not FP8 (the
    precision itself changed) or the checkpoint was saved before the key existed. Not refused: no saved state depends
    on it (weights, optimizer states and amax histories are the same either way), only the GEMMs' numerics change
    from here on."""
    saved = state.get("fast_accum")
    if saved is None or now is None:
        return None
    saved = [g for g in GEMMS if g in saved]
    if saved == now:
        return None
    keep = "[" + ",".join(f'"{g}"' for g in saved) + "]"
    return (f"--resume {str(resume_ckpt)!r}: the checkpoint's run used fast accumulation in {saved}, this run uses it "
            f"in {now} (fp8.fast_accum): the FP8 GEMMs' numerics change from here on; resume with "
            f"--set 'fp8.fast_accum={keep}' to keep the checkpoint's")


def check_resume_data(resume_ckpt: Path, state: dict, data: PreparedData) -> None:
    """Refuse to continue a run on another corpus than the one it was trained on.

    The checkpoint's data position (window cursor and epoch, or chat row cursor) indexes the corpus it was saved
    with, and a tokenizer trained on the corpus (the default BPE) gives other token ids for another one, so a
    resume on changed ``data.paths`` (or, with the default corpus, another Python's standard library) would train
    on garbage or fail mid-run. The corpus is compared by its contents only
    (:attr:`fp8kit.data.prepare.PreparedData.content_fingerprint`: the documents in order, and for chat data the
    chat template; not their paths, so the same files under another path or staged elsewhere resume), saved in
    the checkpoint's train state. Checkpoints from before it was saved, and pre-tokenized ``.bin`` corpora
    (whose token ids need no tokenizer), are not checked.

    Raises:
        CheckpointError: the contents differ; names the new corpus and what to do.
    """
    saved, now = state.get("corpus_content"), data.content_fingerprint
    if not saved or not now or saved == now:
        return
    chat = (" For chat data the chat template counts too: the one the run trained with is in its tokenizer/ "
            "(--set data.tokenizer=RUN/tokenizer).") if data.chat else ""
    raise CheckpointError(
        f"--resume {str(resume_ckpt)!r}: the checkpoint was trained on another corpus (content {saved[:12]}; "
        f"data.paths now gives {data.corpus}, content {now[:12]}): its data position (and a tokenizer trained on "
        f"the corpus) does not carry over. Resume with the data it was trained on (the run's resolved_config.toml), "
        f"or train its weights on the new data as a new run: fp8kit export RUN DIR, then --set "
        f"model.pretrained=DIR.{chat}"
    )


def phase_at(cfg: RunConfig, step: int) -> str:
    """The precision phase (``fp8`` / ``bf16``) of optimizer step ``step`` (0-based; the last step's phase
    for ``step >= train.steps``), from ``train.mixed_precision`` and the BF16 warm-up / cool-down."""
    t, f8 = cfg.train, cfg.fp8
    return precision_at(
        min(step, t.steps - 1), mixed_precision=t.mixed_precision, steps=t.steps,
        bf16_warmup_steps=f8.bf16_warmup_steps, bf16_cooldown_steps=f8.bf16_cooldown_steps,
    )


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32: logits ``[B, T, V]`` (bf16), labels ``[B, T]`` (int64).

    Labels ``-100`` (fine-tuning: prompt, template and padding tokens) are ignored, and the mean is over the
    other labels only (``F.cross_entropy``'s ``ignore_index`` with ``reduction="mean"``; NaN when none).

    Under ``train.compile`` it is compiled: the fp32 upcast, log-softmax and NLL fuse into one pass over
    the bf16 logits.
    """
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build_optimizer(cfg: RunConfig, model: nn.Module, device: torch.device):
    """The optimizer (``optim.name``) with weight decay on matrices only, and the warmup+cosine LR schedule.

    ``adamw``: ``torch.optim.AdamW`` (fused on CUDA). ``fp8_adamw``: :class:`fp8kit.optim.FP8AdamW` with
    the ``[optim]`` precisions (it flattens each group, so build it after every module conversion).
    """
    t, o = cfg.train, cfg.optim
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in decay + no_decay):
        # Tensor parallel without FSDP2 leaves embeddings, norms and lm_head plain tensors beside the TP
        # DTensors, and expert parallelism puts the experts on their own mesh; a fused/foreach AdamW kernel
        # takes one kind (plain, or DTensors of one mesh) per group, so split each group by kind.
        def kind(p) -> str:
            return repr(p.device_mesh) if isinstance(p, DTensor) else ""

        groups = [
            {**g, "params": [p for p in g["params"] if kind(p) == k]}
            for g in groups for k in dict.fromkeys(kind(p) for p in g["params"])
        ]
    groups = [g for g in groups if g["params"]]
    if o.name == "fp8_adamw":
        from fp8kit.optim import FP8AdamW

        opt = FP8AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, precision=fp8_adamw_precision(o))
    else:
        opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_factor(s, warmup_steps=t.warmup_steps, total_steps=t.steps, min_lr_ratio=t.min_lr_ratio),
    )
    return opt, sched


def build_setup(cfg: RunConfig, *, resume: Path | None = None, status=None, warn=None) -> Setup:
    """Build and check everything (see the module docstring). Writes nothing into the run directory.

    ``status(message)`` is told each stage as it starts; ``warn(message)`` gets a warning that must be seen
    before a long stage (the training state taking most of the free memory); it is also in ``Setup.warnings`` (for
    the summary) and in ``Setup.shown_warnings`` (so the run's header does not print it twice).

    Raises:
        Fp8kitError: any bad input, as one line; CapabilityError when one process cannot hold the model's
            weights, gradients and optimizer states (:mod:`fp8kit.train.memory_fit`).
    """
    say = status or (lambda _m: None)
    early_warnings: list[str] = []
    shown_warnings: list[str] = []  # printed through ``warn`` already: the run's header does not repeat them
    cfg = resolve_pretrained(cfg)  # model.pretrained fixes data.vocab_size / data.tokenizer (idempotent)
    resume_ckpt = ckpt.find_checkpoint(resume) if resume is not None else None
    resume_state = ckpt.load_train_state(resume_ckpt) if resume_ckpt is not None else None
    saved = ckpt.saved_optimizer(resume_ckpt, resume_state) if resume_ckpt is not None else None
    saved_gran = (ckpt.saved_fp8adamw_precision(resume_ckpt, resume_state) or {}).get("granularity") \
        if saved == "fp8_adamw" else None
    d = cfg.distributed
    dims = resolve_dims(d.dp_shard, d.dp_replicate, d.tp, d.ep, launched_world_size())
    # optim.name / train.param_dtype / optim.granularity = auto -> concrete
    cfg, optim_choice = resolve_optimizer(cfg, saved, distributed=dims.distributed, saved_granularity=saved_gran)
    if dims.distributed:
        check_distributed_config(cfg)
    if cfg.selective.selective_fp8 == "policy":  # a missing or bad policy file: the first error, before the data
        load_policies(cfg.selective)
    device = resolve_device(cfg.train.device)
    if cfg.train.cuda_graphs and device.type != "cuda":
        raise ConfigError(f"train.cuda_graphs = true on {device}: CUDA graphs need a CUDA device; set "
                          "train.cuda_graphs = false")
    capability = check_fp8_capability(cfg, device)
    mesh = None
    if dims.distributed:
        from fp8kit.parallel.mesh import init_distributed

        say(f"starting the process group ({dims.describe()})")
        mesh, device = init_distributed(dims, device)

    pretrained = skeleton = None
    meta_init = use_meta_init(cfg, dims)
    if cfg.model.pretrained:  # its files checked (config, weights, shapes) before the data is prepared
        say(f"checking {cfg.model.pretrained}")
        pretrained = inspect_pretrained(cfg.model.pretrained)
        with torch.device("meta"):
            skeleton = build_model(cfg.model, cfg.data.vocab_size, device="meta")
        check_weights(pretrained, skeleton, require_all=meta_init)

    hf_cfg = build_hf_config(cfg.model, cfg.data.vocab_size)
    max_pos = getattr(hf_cfg, "max_position_embeddings", None)
    if max_pos is not None and cfg.data.seq_length > max_pos:
        raise ConfigError(
            f"data.seq_length = {cfg.data.seq_length} exceeds the model's max_position_embeddings = {max_pos}"
        )
    if not dims.distributed:  # one process holds the whole model: refuse (or warn) before the data and the build
        if skeleton is None:
            with torch.random.fork_rng(devices=[]):  # build_model seeds the global generator: leave it as it was
                skeleton = build_model(cfg.model, cfg.data.vocab_size, device="meta")
        n = count_params(skeleton)["total"]
        note = check_state_fits(n, cfg, device, activations=activation_bytes(hf_cfg, cfg))
        if note:
            early_warnings.append(note)
            if warn is not None:
                warn(note)
                shown_warnings.append(note)
            else:
                say(note)
    del skeleton

    say("preparing data")
    data = _prepare_data_rank0_first(cfg, say, distributed=dims.distributed)
    if resume_ckpt is not None:
        check_resume_data(resume_ckpt, resume_state, data)

    say("building the model")
    param_dtype = torch.float32 if cfg.train.param_dtype == "fp32" else torch.bfloat16
    load_weights = pretrained is not None and resume_ckpt is None  # a resumed run loads its checkpoint
    # Meta init (distributed.meta_init; default under torchrun): build on meta, shard (prepare_model), then
    # each rank initialises (or, model.pretrained, reads) its own shards only.
    init_program = None
    if load_weights and not meta_init:
        say(f"loading {cfg.model.pretrained}")
        torch.manual_seed(cfg.train.seed)
        model = load_pretrained(pretrained, hf_cfg, device=device, dtype=param_dtype)
    elif meta_init and pretrained is None:
        model, init_program = build_model_on_meta(cfg.model, cfg.data.vocab_size, dtype=param_dtype,
                                                  seed=cfg.train.seed)
    else:
        model = build_model(cfg.model, cfg.data.vocab_size, device="meta" if meta_init else device,
                            dtype=param_dtype, seed=cfg.train.seed)
    if resume_ckpt is not None:
        ckpt.check_compatible(resume_ckpt, model, resume_state)
        ckpt.check_optimizer(resume_ckpt, resume_state, cfg.optim.name)
        check_resume_recipe(cfg, resume_ckpt, resume_state)

    options = options_from_config(cfg, hf_cfg, device_name(device))
    sites = find_sites(model)
    # selective.selective_fp8 = "auto": time the candidates' shapes (CUDA; cached) and decide again
    # with gradient accumulation (and the weight cache on), FP8 expert weights are cast once per optimizer step
    auto = resolve_auto(cfg, sites, decide(sites, options), options, device, emulated=fp8_emulated(cfg, device),
                        topk=moe_topk(hf_cfg), status=say, mesh=mesh)
    decisions = auto.decisions
    if resume_ckpt is not None:
        note = output_head_resume_note(resume_ckpt, resume_state, decisions)
        if note is not None:
            early_warnings.append(note)
    if any(d.is_fp8 and d.site.is_grouped_weight for d in decisions):
        # FP8 MoE experts need an FP8 grouped GEMM on this device (or fp8.emulate): fail now, not mid-run.
        from fp8kit.moe.grouped_mm import resolve_grouped_kernel

        resolve_grouped_kernel(grouped_gemm_config(cfg), device)
    params = count_params(model)
    fpt = flops_per_token(model, hf_cfg, cfg.data.seq_length)
    start_step = int(resume_state["step"]) if resume_state is not None else 0
    say("preparing the model")
    prepared = prepare_model(
        model, decisions,
        prepare_options(cfg, fp8_now=phase_at(cfg, start_step) == "fp8",
                        emulate=fp8_emulated(cfg, device)),
        mesh, hf_cfg=hf_cfg,
    )
    fast_accum = run_fast_accum(cfg, prepared.conversion, decisions)  # the accumulation the conversion took
    if resume_ckpt is not None:  # against the checkpoint's
        note = fast_accum_resume_note(resume_ckpt, resume_state, fast_accum)
        if note is not None:
            early_warnings.append(note)
    if init_program is not None:
        say("initialising the model (each rank its own shards)")
        initialize_shards(model, init_program, device)
    elif meta_init:
        materialize(model, device)  # this rank's shards, uninitialised; rotary buffers recomputed
        if load_weights:
            say(f"loading {cfg.model.pretrained} (each rank its own shards)")
            load_sharded(pretrained, model)
    optimizer, scheduler = build_optimizer(cfg, model, device)
    setup = Setup(
        cfg=cfg,
        device=device,
        data=data,
        model=model,
        hf_cfg=hf_cfg,
        decisions=decisions,
        prepared=prepared,
        optimizer=optimizer,
        scheduler=scheduler,
        flops_per_token=fpt,
        peak_flops=bf16_peak_flops(device),
        params=params,
        capability=capability,
        resume_from=resume_ckpt,
        resume_state=resume_state,
        warnings=early_warnings + list(options.warnings) + auto.warnings + decision_notes(decisions, options),
        shown_warnings=shown_warnings,
        dims=dims,
        mesh=mesh,
        loss_fn=torch.compile(cross_entropy) if cfg.train.compile else cross_entropy,
    )
    setup.info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device_name(device),
        "device_type": device.type,
        "capability": capability,
        "versions": versions(),
        "corpus": data.corpus,
        "corpus_fingerprint": data.corpus_fingerprint,
        "tokenizer": data.tokenizer,
        "tokens": data.num_tokens,
        "train_sequences": int(len(data.packed.train_windows)),
        "val_sequences": int(len(data.packed.val_windows)),
        "data_format": cfg.data.format,
        "chat": data.chat,  # data.format = "chat": records, skipped (no assistant turn), truncated, packing, template
        "model_type": hf_cfg.model_type,
        "pretrained": cfg.model.pretrained,
        "params": params,
        "flops_per_token": setup.flops_per_token,
        "bf16_peak_flops": setup.peak_flops,
        "warnings": setup.warnings,
        "optimizer_choice": optim_choice,  # what optim.name / train.param_dtype = auto chose, and why
        # the dense FP8 GEMMs with fast accumulation (fp8.fast_accum resolved against the recipe's default, which
        # changed in session 42 for delayed; None: no dense linear in FP8), as the checkpoints record it
        "fast_accum": fast_accum,
        # micro-batches that share one cast of each FP8 weight (fp8.weight_cache; 1: cast at every micro-batch), for
        # the dense linears and, where some are FP8, the MoE experts; None: no FP8 or no gradient accumulation
        "weight_cast_reuse": weight_cast_reuse(cfg, mesh, decisions, model, device),
        "selective_auto": auto.info,  # selective_fp8 = "auto": the measured table, or why nothing was measured
        "training_state_bytes": training_state_bytes([p for p in model.parameters() if p.requires_grad], optimizer),
        "parallel": {
            "world_size": dims.world_size,
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            "tp": dims.tp,
            "steps": prepared.steps,
            "fp8_all_gather": prepared.fp8_all_gather,
            # distributed.fp8_reduce_scatter: the FP8 format of FSDP2's gradient reduce-scatter (None: float32)
            "grad_reduce_scatter": prepared.grad_comm.fp8_dtype if prepared.grad_comm is not None else None,
            "meta_init": meta_init,  # built on meta, each rank initialised / loaded its own shards
            "notes": prepared.notes,
            "facts": prepared.facts,
        },
    }
    setup.warnings.extend(prepared.notes)
    fused_key = f"{cfg.fp8.recipe}_fused_mlp"  # fp8.blockwise_fused_mlp / fp8.delayed_fused_mlp
    if getattr(cfg.fp8, fused_key, False) and cfg.fp8.stats_every:  # any precision phase
        setup.warnings.append(f"fp8.{fused_key}: the SwiGLU MLPs run unfused in this run: fp8.stats_every hooks "
                              "each projection to measure its operands (fp8kit.train.health)")
        # prepare_model counted the fused MLPs before the hooks: drop that count from the notes and the run's record
        prepared.facts[:] = [f for f in prepared.facts if not f.startswith(f"fp8.{fused_key}:")]
    setup.facts.extend(prepared.facts)
    if device.type == "cpu":  # what this CPU's bf16 matmuls run (fp8kit.base.cpu_bf16_gemm)
        setup.info["cpu_bf16_gemm"] = cpu_bf16_gemm.state()
        if (note := cpu_bf16_gemm.describe()) is not None:
            setup.facts.append(note)
    return setup


def use_meta_init(cfg: RunConfig, dims: ParallelDims) -> bool:
    """Whether the model is built on ``meta`` and each rank initialises (or loads) its own shards only:
    ``distributed.meta_init``, or when unset, a torchrun launch of more than one process."""
    wanted = cfg.distributed.meta_init
    return dims.distributed if wanted is None else wanted


def check_distributed_config(cfg: RunConfig) -> None:
    """Refuse what a distributed (FSDP2 / TP) run cannot do, one line each.

    Raises:
        ConfigError: ``optim.name = "fp8_adamw"`` with tensor or expert parallelism (FP8AdamW steps
            FSDP2 / HSDP shards, ``Shard(0)``, only), or with ``optim.granularity = "block"`` or FP8
            gradients (``fp8kit.optim.sharded``), a precision schedule (it swaps modules that FSDP2/TP have wrapped),
            ``train.on_divergence = "recover"`` or ``fp8.stats_every > 0`` (single-process features),
            ``distributed.fp8_reduce_scatter`` with HSDP (``dp_replicate > 1``), ``train.cuda_graphs``
            (one process only).
    """
    if cfg.optim.name == "fp8_adamw":
        d, o = cfg.distributed, cfg.optim
        if d.tp > 1 or d.ep > 1:
            raise ConfigError(
                f"optim.name = \"fp8_adamw\": FP8AdamW steps FSDP2 / HSDP shards (dim 0) only, not tensor or expert "
                f"parallel ones (distributed.tp = {d.tp}, ep = {d.ep}); use optim.name = \"adamw\" or tp = ep = 1"
            )
        if o.granularity != "tensor" or o.grad != "param":
            raise ConfigError(
                f"optim.name = \"fp8_adamw\" under FSDP2 needs optim.granularity = \"tensor\" and optim.grad = "
                f"\"param\" (got {o.granularity!r}, {o.grad!r}): per-block scales would straddle shard boundaries, "
                f"and FSDP2 already holds the reduce-scattered gradient shard"
            )
    d = cfg.distributed
    if cfg.train.cuda_graphs:
        raise ConfigError(
            f"train.cuda_graphs = true in a distributed run ({launched_world_size()} ranks): the CUDA graphs of the "
            "compiled blocks are supported in one process only (FSDP2's, TP's and EP's collectives run between and "
            "inside the blocks); set train.cuda_graphs = false"
        )
    if d.fp8_reduce_scatter != "off" and d.dp_replicate > 1:
        raise ConfigError(
            f"distributed.fp8_reduce_scatter = {d.fp8_reduce_scatter!r} with dp_replicate = {d.dp_replicate} (HSDP): "
            "not supported (only plain FSDP2's reduce-scatter is replaced); set it to 'off' or dp_replicate = 1"
        )
    f8 = cfg.fp8
    if cfg.train.mixed_precision == "fp8" and (f8.bf16_warmup_steps or f8.bf16_cooldown_steps):
        raise ConfigError(
            f"fp8.bf16_warmup_steps = {f8.bf16_warmup_steps} / fp8.bf16_cooldown_steps = {f8.bf16_cooldown_steps}: "
            f"the precision schedule swaps modules that FSDP2 / tensor parallel hold, which is not supported in a "
            f"distributed run; set both to 0"
        )
    if cfg.train.on_divergence == "recover":
        raise ConfigError(
            "train.on_divergence = \"recover\": the divergence guard rolls back host-memory copies of a "
            "single process's state and swaps modules that FSDP2 / tensor parallel hold; it runs in one process "
            "only: set train.on_divergence = \"stop\" for a torchrun launch"
        )
    if f8.stats_every:
        raise ConfigError(
            f"fp8.stats_every = {f8.stats_every}: FP8 health statistics are measured in one process only (the "
            f"operands of FSDP2 / tensor-parallel layers are shards); set fp8.stats_every = 0 for a torchrun launch"
        )


def _prepare_data_rank0_first(cfg: RunConfig, say, *, distributed: bool) -> PreparedData:
    """Prepare the data; in a distributed run rank 0 first (it trains the tokenizer and writes the token
    cache), then the other ranks, which read the cache."""
    kw = dict(micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed, status=say)
    if not distributed:
        return prepare_data(cfg.data, **kw)
    import torch.distributed as dist

    data = prepare_data(cfg.data, **kw) if is_main() else None
    dist.barrier()
    return data if data is not None else prepare_data(cfg.data, **kw)


def restore(setup: Setup) -> None:
    """Load model, optimizer, scheduler, data position and RNG from the resume checkpoint."""
    if setup.resume_from is None:
        return
    state = setup.resume_state
    if setup.distributed or ckpt.is_dcp(setup.resume_from):
        # Any layout -> this layout (DCP reshards; a single-process checkpoint loads as full state dicts). FP8AdamW's
        # warning (per-block states recast per tensor) joins the run's warnings: printed once, kept in run_info.json
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ckpt.load_into(setup.resume_from, setup.model, setup.optimizer, state, param_order=setup.param_order)
        for w in caught:
            if str(w.message).startswith("FP8AdamW:"):
                setup.warnings.append(str(w.message))
            else:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    else:
        ckpt.load_model_weights(setup.resume_from, setup.model)
        setup.optimizer.load_state_dict(state["optimizer"])
    sched = dict(state["scheduler"])
    n_groups = len(setup.optimizer.param_groups)
    if len(sched.get("base_lrs", [])) != n_groups:
        # Another layout splits the parameters into other groups (plain / FSDP2 / expert-parallel
        # DTensors); every group has the same schedule (train.lr x lr_factor(step)), so the step count
        # carries it over.
        sched["base_lrs"] = [sched["base_lrs"][0]] * n_groups
        sched["_last_lr"] = [sched["_last_lr"][0]] * n_groups
        sched["lr_lambdas"] = [None] * n_groups  # plain functions are not saved (LambdaLR stores None)
    setup.scheduler.load_state_dict(sched)
    setup.data.packed.load_state_dict(state["data"])
    _note_global_batch(setup, state)
    if state.get("fp8_delayed"):
        try:
            setup.prepared.conversion.delayed.load_state_dict(state["fp8_delayed"], setup.device)
        except ValueError as e:
            raise CheckpointError(f"--resume {str(setup.resume_from)!r}: {e}") from None
    _restore_grad_comm(setup, state)
    ckpt.set_rng_state(state["rng"], setup.device)
    from fp8kit.fp8.kernels.ops import clear_weight_cache

    clear_weight_cache()  # blockwise FP8 weights were quantized from the weights before the load
    setup.start_step = int(state["step"])


def global_batch(setup: Setup) -> int:
    """Sequences (rows) per optimizer step: ``train.micro_batch_size x train.grad_accum x`` the data-parallel size."""
    t = setup.cfg.train
    return t.micro_batch_size * t.grad_accum * (setup.dims.dp if setup.distributed else 1)


def _note_global_batch(setup: Setup, state: dict) -> None:
    """A resume whose sequences per optimizer step differ from the checkpoint's (another data-parallel size,
    micro-batch or accumulation) continues, with a warning: the data order and the schedule go on, but each
    step now sees another number of sequences (docs/distributed.md: the same global batch resumes exactly)."""
    saved, now = state.get("global_batch"), global_batch(setup)
    if saved is not None and int(saved) != now:
        t = setup.cfg.train
        setup.warnings.append(
            f"--resume {str(setup.resume_from)!r}: the checkpoint was trained with {int(saved)} sequences per "
            f"optimizer step, this run takes {now} (train.micro_batch_size {t.micro_batch_size} x train.grad_accum "
            f"{t.grad_accum} x data-parallel size {now // (t.micro_batch_size * t.grad_accum)}): the data order and "
            "the learning-rate schedule continue, but the steps are not those of the original layout"
        )


def _restore_grad_comm(setup: Setup, state: dict) -> None:
    """The FP8 reduce-scatter's auto-scale state (``distributed.fp8_reduce_scatter``) from the train state."""
    comm, saved = setup.prepared.grad_comm, state.get("grad_comm")
    where = f"--resume {str(setup.resume_from)!r}"
    if comm is None:
        if saved:
            setup.warnings.append(f"{where}: the checkpoint holds an FP8 gradient reduce-scatter state "
                                  "(distributed.fp8_reduce_scatter), which is off in this run: not used")
        return
    if not saved:
        setup.warnings.append(f"{where}: no FP8 gradient reduce-scatter state in the checkpoint "
                              "(distributed.fp8_reduce_scatter was off): the auto-scale factors start afresh")
        return
    try:
        comm.load_state_dict(saved)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
