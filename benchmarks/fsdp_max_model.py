"""Largest model that trains under FSDP2 on 2 GPUs: AdamW (fp32 master) vs FP8AdamW, Llama-3-70B layer shapes.

What is measured: for each optimizer, the largest number of Llama-3-70B decoder layers (hidden 8192, MLP
28672, 64 heads, 8 KV heads, vocab 128256, rope theta 500000; ``--seq`` 2048 x micro-batch 1 per rank) for
which two whole training steps (forward, backward, clip, optimizer step) run without a CUDA out-of-memory
error, and the parameters that makes. Each probe is ``fp8kit train``'s own path, in process: the run config
(``fp8kit.config.load_config``) -> ``fp8kit.train.setup.build_setup`` (torchrun: meta-device build, FP8
conversion, activation checkpointing, FSDP2 ``fully_shard`` per block, then each rank materialises and
initialises its own shards on the GPU; the optimizer on the sharded parameters) ->
``fp8kit.train.guard.run_training`` for ``train.steps = 2`` (the trainer's loop; no checkpoint, one
validation batch after step 2). Settings besides the shape: ``train.mixed_precision = fp8``,
``fp8.recipe = tensorwise`` with its default FSDP2 FP8 all-gather, ``selective.selective_fp8 = off`` (every
candidate linear in FP8: no start-up timing, the same layers FP8 in every probe),
``train.activation_checkpointing = true``, ``distributed.dp_shard`` = all ranks, ``distributed.meta_init``
left at its torchrun default (on), data: a file of random token ids (``data.paths``, uint32; the values do
not matter for memory). The two optimizers:

- ``adamw`` (A): ``optim.name = adamw`` + ``train.param_dtype = fp32`` (fp32 master weights, gradients and
  moments, 16 bytes/param; FSDP2 all-gathers for bf16 compute, FP8 for the FP8 linears);
- ``fp8_adamw`` (B): ``optim.name = fp8_adamw`` + ``train.param_dtype = bf16`` with the ``[optim]`` defaults
  (bf16 working weights and gradients, E4M3 m, FP16 v, scaled FP16 master: 9 bytes/param).

The search (per optimizer, :func:`plan_next`): probe 2 layers; guess a larger count from the per-rank
bytes/param measured there; then fit the peak reserved memory (largest over ranks, over set-up and both
steps) linearly in the layer count and probe the predicted maximum; after that move by one layer (or
halve the gap after two out-of-memory probes in a row) until a count that trains is next to one that does
not. The limit the fit aims at is the GPU's total memory minus what the probe found used outside PyTorch's
allocator (CUDA context, NCCL). The boundary is always verified by probes, never taken from the fit.

Each probe is a fresh process group: ``torchrun --standalone --nproc_per_node N`` of this file with
``--probe-spec``, launched by the driver (rank 0 of the outer launch; the other outer ranks exit at once and
leave the GPUs to the probes) with a time limit, its process group killed on time-out. Why not in process:
an out-of-memory error may hit one rank and not the other, which then waits in an NCCL collective until
the watchdog ends it; a fresh process per probe also starts each one with an empty allocator. A rank that
runs out of memory writes its result and exits at once, and torchrun stops the other rank. A probe that
fails for another reason, or runs out of time, ends the search for that optimizer (reported, never counted
as a fit).

Output: ``OUT/fsdp_max_model.json`` (rewritten after every probe: device, versions, date, command,
every probe with its layers, parameters, status, peak allocated / reserved GiB per rank, step times,
bytes/param as fp8kit reports it and as counted from this rank's tensors; the summary: largest layers and
parameters for A and B and the ratio B/A, target >= 1.5), a Markdown table on stdout and in
``OUT/fsdp_max_model.md``, and each probe's log under ``OUT/probes/``.

``--tiny`` (a CPU check of everything but the GPU memory): a small model of the same architecture
(hidden 128, 2 KV heads, vocab 512, seq 32) on CPU gloo ranks; probes run in process on the outer ranks
(``--launch inprocess``, the default with ``--tiny``: a CPU probe takes about a second, a fresh torchrun
10-20 s here), and memory is *simulated*: a probe counts as out of memory when the parameter, gradient and
optimizer-state bytes counted from one rank's tensors after the two steps exceed ``--cap-gib`` (nothing
else: no activations, no allocator, no real OOM). That tests the training path under FSDP2 with both
optimizers, the search, the bookkeeping and the JSON, not the GPU's memory behaviour. ``--tiny --launch
torchrun`` runs the same probes through the GPU path's launcher.

    torchrun --nproc_per_node 2 benchmarks/fsdp_max_model.py --out runs/fsdp_max_model        # 2x H200
    torchrun --nproc_per_node 2 benchmarks/fsdp_max_model.py --tiny --out /tmp/fmm              # CPU check

Budget: ``--budget-s`` (default 510 s on the GPU) bounds the whole search; a probe is not started when the
slowest probe so far would not finish inside it, and the summary then says which bounds are unverified.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Llama-3-70B's decoder shapes (meta-llama/Meta-Llama-3-70B config.json; Llama 3, not 3.1: no rope scaling)
LLAMA3_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}
VOCAB_70B = 128256
#: --tiny: the same architecture, small (every linear dimension a multiple of 16: all FP8 on CPU too)
TINY = {**LLAMA3_70B, "hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256}
VOCAB_TINY = 512

OPTIMIZERS = {
    "adamw": ["optim.name=adamw", "train.param_dtype=fp32"],
    "fp8_adamw": ["optim.name=fp8_adamw", "train.param_dtype=bf16"],
}
LABELS = {"adamw": "A: AdamW, fp32 master", "fp8_adamw": "B: FP8AdamW"}
TARGET_RATIO = 1.5
#: text in a probe's log that means CUDA ran out of memory (when no rank could write its result)
OOM_TEXT = ("OutOfMemoryError", "CUDA out of memory", "out of memory")
#: torchrun's variables, dropped from a nested launch's environment (the inner torchrun sets its own)
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

GIB = 2**30
_T0 = time.time()


def say(msg: str) -> None:
    """A progress line with the wall-clock time and the seconds since start."""
    print(f"[{time.strftime('%H:%M:%S')} +{time.time() - _T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ config


def probe_sets(*, shape_path: Path, tokens_path: Path, cache: Path, n_layers: int, optimizer: str, seq: int,
               mbs: int, vocab: int, device: str) -> list[str]:
    """The ``--set`` overrides of one probe (module docstring)."""
    return [
        f"model.hf_config={shape_path}", f"model.num_layers={n_layers}",
        f'data.paths=["{tokens_path}"]', "data.token_dtype=uint32", f"data.vocab_size={vocab}",
        f"data.seq_length={seq}", f"data.cache_dir={cache}",
        f"train.device={device}", "train.steps=2", f"train.micro_batch_size={mbs}", "train.grad_accum=1",
        "train.eval_every=0", "train.eval_batches=1", "train.checkpoint_every=0", "train.final_checkpoint=false",
        "train.log_every=1000", "train.activation_checkpointing=true", "train.mixed_precision=fp8",
        "fp8.recipe=tensorwise", "selective.selective_fp8=off",
        *OPTIMIZERS[optimizer],
    ]


def write_tokens(path: Path, vocab: int, n_tokens: int) -> None:
    """Random token ids ``[0, vocab)`` as uint32 (a ``.bin`` corpus for ``data.paths``)."""
    import numpy as np

    rng = np.random.default_rng(0)
    rng.integers(0, vocab, size=n_tokens, dtype=np.uint32).tofile(path)


def model_params(shape_path: Path, vocab: int) -> tuple[int, int]:
    """(parameters of one decoder layer, parameters outside the layers), counted on a meta-device build."""
    from fp8kit.config import load_config
    from fp8kit.models.build import build_model, count_params

    def total(n: int) -> int:
        cfg = load_config(None, [f"model.hf_config={shape_path}", f"model.num_layers={n}", f"data.vocab_size={vocab}"])
        return count_params(build_model(cfg.model, vocab, device="meta"))["total"]

    one, two = total(1), total(2)
    return two - one, one - (two - one)


# -------------------------------------------------------------------------------------------------- probe


class _StepMemory:
    """The trainer loop's metrics writer for a probe: each step's record plus this rank's peak memory of
    that step (the loop resets the CUDA peak at the start of every step)."""

    def __init__(self, device):
        self.device, self.steps = device, []

    def write(self, record: dict) -> None:
        import torch

        row = {"step": record["step"], "step_ms": record["step_ms"], "loss": record["loss"]}
        if self.device.type == "cuda":
            row["peak_alloc_gib"] = torch.cuda.max_memory_allocated(self.device) / GIB
            row["peak_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / GIB
        self.steps.append(row)

    def close(self) -> None:
        pass


def counted_bytes(optimizer) -> dict:
    """This rank's bytes of parameters, gradients (charged at the size they have between backward and step)
    and optimizer states, counted from the local tensors (DTensor shards: ``to_local``).

    The parameters are the optimizer's (the sharded DTensors), not ``model.parameters()``: after the
    validation forward FSDP2 leaves the root module and the last block unsharded (no backward follows to
    reshard them), and the module then holds the unsharded tensors.
    """
    import torch
    from torch.distributed.tensor import DTensor

    from fp8kit.optim import FP8AdamW

    def loc(t):
        return t.to_local() if isinstance(t, DTensor) else t

    def nb(t):
        return 0 if t is None else t.numel() * t.element_size()

    params = [loc(p) for g in optimizer.param_groups for p in g["params"]]
    n_local = sum(p.numel() for p in params)
    p_bytes = sum(nb(p) for p in params)
    if isinstance(optimizer, FP8AdamW):
        b = optimizer.memory_bytes()
        g_bytes, s_bytes = b["grad"], b["master"] + b["m"] + b["v"]
    else:
        g_bytes = p_bytes
        s_bytes = sum(nb(loc(t)) for st in optimizer.state.values() for t in st.values()
                      if isinstance(t, torch.Tensor) and t.dim() > 0)
    total = p_bytes + g_bytes + s_bytes
    return {"params_local": n_local, "param_bytes": p_bytes, "grad_bytes": g_bytes, "state_bytes": s_bytes,
            "total_bytes": total, "bytes_per_param": total / max(n_local, 1)}


def run_probe(spec: dict) -> dict:
    """One probe on this rank: build the run through the trainer's setup, train 2 steps, report.

    Returns this rank's result (``status``: ok / oom / error; ``phase``: setup / train / simulated). CUDA
    out-of-memory errors (also NCCL's, by their message) are caught and reported, never raised.
    """
    import torch
    from rich.console import Console

    from fp8kit.base.runtime import device_name, versions
    from fp8kit.config import load_config
    from fp8kit.train.guard import run_training
    from fp8kit.train.setup import build_setup

    rank = int(os.environ.get("RANK", "0"))
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    res = {"rank": rank, "status": "ok", "phase": "setup", "error": None}
    t0 = time.perf_counter()
    setup = writer = None
    try:
        setup = build_setup(load_config(None, spec["sets"]), status=lambda m: res.__setitem__("setup_status", m))
        res["setup_s"] = time.perf_counter() - t0
        if cuda:
            res["setup_peak_alloc_gib"] = torch.cuda.max_memory_allocated(device) / GIB
            res["setup_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        info = setup.info
        res.update(params=setup.params["total"], fp8kit_bytes_per_param=info["training_state_bytes"],
                   meta_init=info["parallel"]["meta_init"], prepare_steps=info["parallel"]["steps"],
                   fp8_all_gather=info["parallel"]["fp8_all_gather"],
                   fp8_sites=sum(d.is_fp8 for d in setup.decisions), sites=len(setup.decisions),
                   device=info["device"], versions=info["versions"],
                   optimizer_impl=getattr(setup.optimizer, "step_impl", None))
        res["phase"] = "train"
        writer = _StepMemory(setup.device)
        loop = run_training(setup, Path(spec["run_dir"]), writer, Console(quiet=True))
        if loop.diverged:
            raise RuntimeError(f"training diverged: {loop.diverged}")
        res["steps"] = writer.steps
        res["counted"] = counted_bytes(setup.optimizer)
        res["counted_gib"] = res["counted"]["total_bytes"] / GIB
        cap = spec.get("cap_gib")
        largest = _max_over_ranks(res["counted_gib"]) if cap is not None else None
        if cap is not None and largest > cap:
            res.update(status="oom", phase="simulated",
                       error=f"simulated OOM: counted parameter+gradient+state bytes {largest:.4f} GiB > cap "
                             f"{cap} GiB on a rank")
    except Exception as e:  # noqa: BLE001 - every failure becomes a result; OOM is the expected one
        text = f"{type(e).__name__}: {e}"
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in text.lower()
        res.update(status="oom" if oom else "error", error=" ".join(text.split())[:600], where=_where(e))
        if not oom:
            res["traceback"] = traceback.format_exc()[-4000:]
        if writer is not None:
            res["steps"] = writer.steps
    res["wall_s"] = time.perf_counter() - t0
    if cuda:  # the peak over set-up and every step (the loop resets the counters at each step's start)
        for key, now in (("alloc", torch.cuda.max_memory_allocated(device)),
                         ("reserved", torch.cuda.max_memory_reserved(device))):
            seen = [res.get(f"setup_peak_{key}_gib"), now / GIB]
            seen += [s.get(f"peak_{key}_gib") for s in res.get("steps") or []]
            res[f"peak_{key}_gib"] = max(v for v in seen if v is not None)
        free, total = torch.cuda.mem_get_info(device)
        res["device_total_gib"] = total / GIB
        res["nonpytorch_gib"] = (total - free - torch.cuda.memory_reserved(device)) / GIB
    else:
        import resource

        res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        res.setdefault("device", device_name(device))
        res.setdefault("versions", versions())
    del setup
    return res


def _where(e: BaseException) -> str | None:
    """``file:line function`` of the innermost fp8kit frame of an exception (where a setup ran out of memory:
    the model's initialisation, the optimizer's construction, ...)."""
    here = str(Path(__file__).resolve())
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if "/fp8kit/" in f.filename.replace(os.sep, "/") and str(Path(f.filename).resolve()) != here]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename.replace(os.sep, '/').rsplit('/fp8kit/', 1)[-1]}:{f.lineno} {f.name}"


def _max_over_ranks(value: float) -> float:
    """The largest ``value`` over the probe's ranks (the caller's value without a process group)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64,
                     device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def probe_worker(spec_path: Path) -> int:
    """``--probe-spec``: one rank of a probe's torchrun launch. Writes ``rank<R>.json``; on failure exits at
    once (torchrun then stops the other ranks, which may be waiting in a collective)."""
    spec = json.loads(spec_path.read_text())
    res = run_probe(spec)
    out = Path(spec["result_dir"]) / f"rank{res['rank']}.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    if res["status"] != "ok":
        os._exit(3)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------- launchers


def merge_ranks(results: list[dict]) -> dict:
    """One probe record from its ranks' results: out of memory if any rank was, else error if any, else ok."""
    results = sorted(results, key=lambda r: r["rank"])
    statuses = [r["status"] for r in results]
    status = "oom" if "oom" in statuses else ("error" if "error" in statuses else "ok")
    bad = next((r for r in results if r["status"] == status), results[0])
    first = results[0]
    merged = {"status": status, "phase": bad.get("phase"), "error": bad.get("error"), "where": bad.get("where"),
              "setup_status": bad.get("setup_status"), "ranks": len(results)}
    for key in ("params", "meta_init", "prepare_steps", "fp8_all_gather", "fp8_sites", "sites", "device",
                "versions", "optimizer_impl", "fp8kit_bytes_per_param"):
        merged[key] = next((r[key] for r in results if key in r), None)
    for key in ("peak_alloc_gib", "peak_reserved_gib", "setup_peak_alloc_gib", "setup_peak_reserved_gib",
                "counted_gib", "peak_rss_gib", "nonpytorch_gib", "device_total_gib", "setup_s", "wall_s"):
        vals = [r.get(key) for r in results]
        merged[f"{key}_per_rank"] = vals
        known = [v for v in vals if v is not None]
        merged[key] = max(known) if known else None
    steps = first.get("steps") or []
    merged["step_s"] = [round(s["step_ms"] / 1e3, 4) for s in steps]
    merged["losses"] = [s["loss"] for s in steps]
    for key in ("peak_alloc_gib", "peak_reserved_gib"):  # the steps' own peaks (largest rank), set-up excluded
        vals = [s.get(key) for r in results for s in (r.get("steps") or []) if s.get(key) is not None]
        merged[f"train_{key}"] = max(vals) if vals else None
    counted = [r["counted"] for r in results if "counted" in r]
    if counted:
        merged["measured_bytes_per_param"] = max(c["bytes_per_param"] for c in counted)
        merged["counted_per_rank"] = counted
    if "traceback" in bad:
        merged["traceback"] = bad["traceback"]
    return merged


def _clean_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def launch_torchrun(spec: dict, probe_dir: Path, nproc: int, timeout: float, env_extra: dict) -> dict:
    """Run one probe as ``torchrun --standalone --nproc_per_node NPROC`` of this file (``--probe-spec``);
    kill its process group after ``timeout`` seconds."""
    probe_dir.mkdir(parents=True, exist_ok=True)
    for old in probe_dir.glob("rank*.json"):
        old.unlink()
    spec_path = probe_dir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1) + "\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(Path(__file__).resolve()), "--probe-spec", str(spec_path)]
    log_path = probe_dir.with_suffix(".log")
    timed_out = False
    with log_path.open("w") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_clean_env(env_extra),
                                start_new_session=True, cwd=ROOT)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
    results = [json.loads(p.read_text()) for p in sorted(probe_dir.glob("rank*.json"))]
    log_text = log_path.read_text(errors="replace")
    if results:
        merged = merge_ranks(results)
        if merged["status"] == "ok" and (rc != 0 or len(results) < nproc):
            merged.update(status="error", error=f"torchrun exit status {rc} after the ranks reported ok")
    else:
        oom = any(t in log_text for t in OOM_TEXT)
        merged = {"status": "oom" if oom else "error", "phase": None,
                  "error": ("no rank wrote a result; the log mentions out of memory" if oom else
                            f"no rank wrote a result (torchrun exit status {rc}): {_last_error(log_text)}")}
    if timed_out:
        merged.update(status="timeout", error=f"timed out after {timeout:.0f} s (process group killed)")
    merged["log"] = str(log_path)
    return merged


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the probe's own process group (torchrun and its workers only)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if "Error" in ln or "error" in ln]
    return (lines[-1] if lines else text.strip()[-300:])[:400]


def launch_inprocess(spec: dict) -> dict:
    """Run one probe on every outer rank, in this process, and clean up after it (``--launch inprocess``)."""
    import torch
    import torch.distributed as dist

    res = run_probe(spec)
    gc.collect()
    if torch.cuda.is_available() and spec["device"] == "cuda":
        torch.cuda.empty_cache()
    results = [None] * dist.get_world_size() if dist.is_initialized() else [res]
    if dist.is_initialized():
        dist.all_gather_object(results, res)
    return merge_ranks(results)


def rank0_decides(launch: str, mine: bool) -> bool:
    """Rank 0's value of ``mine`` on every rank (``--launch inprocess``: every outer rank runs the search loop and
    each probe is collective, so a decision taken on each rank's own clock, such as stopping for the budget, could
    split the ranks, one probing while the other waits); ``mine`` itself with torchrun launches (rank 0 alone searches)."""
    if launch != "inprocess":
        return mine
    import torch.distributed as dist

    if not dist.is_initialized():
        return mine
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    return bool(box[0])


# ------------------------------------------------------------------------------------------------- search


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares ``(slope, intercept)`` of ``metric = intercept + slope * n``; None below two distinct n."""
    if len({n for n, _ in points}) < 2:
        return None
    k = len(points)
    mx, my = sum(n for n, _ in points) / k, sum(m for _, m in points) / k
    sxx = sum((n - mx) ** 2 for n, _ in points)
    sxy = sum((n - mx) * (m - my) for n, m in points)
    slope = sxy / sxx
    return slope, my - slope * mx


def plan_next(history: list[dict], *, limit: float, start: int, max_layers: int,
              slope_guess: float | None) -> int | None:
    """The next layer count to probe, or None when the boundary is found (or can't be).

    Args:
        history: this optimizer's probes so far, in order: ``{"n": layers, "status": "ok" | "oom",
            "metric": memory of an ok probe}`` (GiB; the fitted quantity).
        limit: the memory the metric may reach (GiB).
        start: the first (small) layer count.
        max_layers: the largest count to try.
        slope_guess: per-layer memory guess (GiB) for the second probe, from the first one.

    Order: ``start``; a count a little under the guess from ``slope_guess`` (0.75 of the way to the limit);
    then the linear fit's prediction over every count that trained; then one layer up from the largest
    count that trained (the fit said it was the last) or one layer down from the smallest that did not (the
    fit overshot), halving the gap instead after two out-of-memory probes in a row. The result always lies
    strictly between the largest count that trained and the smallest that did not.
    """
    oks = [(h["n"], h["metric"]) for h in history if h["status"] == "ok"]
    lo = max((n for n, _ in oks), default=0)
    hi = min([h["n"] for h in history if h["status"] == "oom"] + [max_layers + 1])
    if lo + 1 >= hi:
        return None
    if not history:
        cand = start
    else:
        line = fit_line(oks)
        if line is not None and line[0] > 0:
            cand = math.floor((limit - line[1]) / line[0])
            cand = max(cand, lo + 1)  # the fit says lo is the last: verify lo + 1
        elif oks and slope_guess:
            n0, m0 = max(oks)
            cand = n0 + max(1, int(0.75 * (limit - m0) / slope_guess))
        else:
            cand = lo + 1
    if cand >= hi:
        trailing_oom = 0
        for h in reversed(history):
            if h["status"] != "oom":
                break
            trailing_oom += 1
        cand = hi - 1 if trailing_oom < 2 else (lo + hi) // 2
    return max(lo + 1, min(cand, hi - 1))


def summarize(probes: list[dict], optimizers: list[str], layer_params: int, fixed_params: int,
              stopped: dict, max_layers: int) -> dict:
    """Largest layers / parameters per optimizer, whether the boundary was verified, and the ratio B/A."""
    out: dict = {}
    for opt in optimizers:
        mine = [p for p in probes if p["optimizer"] == opt]
        oks = [p for p in mine if p["status"] == "ok"]
        best = max(oks, key=lambda p: p["n_layers"], default=None)
        ooms = [p["n_layers"] for p in mine if p["status"] == "oom"]
        first_oom = min(ooms, default=None)
        n = best["n_layers"] if best else 0
        params = best["params"] if best and best.get("params") else fixed_params + n * layer_params
        out[opt] = {
            "label": LABELS[opt], "max_layers": n, "params": params, "params_b": params / 1e9,
            "first_oom_layers": first_oom,
            "boundary_verified": first_oom is not None and first_oom == n + 1,
            "peak_reserved_gib": best.get("peak_reserved_gib") if best else None,
            "step_s": best.get("step_s") if best else None,
            "fp8kit_bytes_per_param": (best.get("fp8kit_bytes_per_param") or {}).get("total") if best else None,
            "measured_bytes_per_param": best.get("measured_bytes_per_param") if best else None,
            "probes": len(mine),
            "stopped": stopped.get(opt) or (f"reached --max-layers {max_layers}" if n == max_layers else None),
        }
    if "adamw" in out and "fp8_adamw" in out and out["adamw"]["params"]:
        a, b = out["adamw"], out["fp8_adamw"]
        out["ratio_params_b_over_a"] = b["params"] / a["params"] if a["max_layers"] else None
        out["ratio_layers_b_over_a"] = b["max_layers"] / a["max_layers"] if a["max_layers"] else None
        out["target_ratio"] = TARGET_RATIO
        complete = a["boundary_verified"] and b["boundary_verified"]
        out["complete"] = complete
        r = out["ratio_params_b_over_a"]
        out["target_met"] = (r is not None and r >= TARGET_RATIO) if complete else None
    return out


# ------------------------------------------------------------------------------------------------- report


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _count(n: int) -> str:
    """Parameters as ``14.12B`` or ``0.53M``."""
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def markdown(doc: dict) -> str:
    rows = ["| optimizer | layers | params | status | phase | peak alloc GiB (per rank) | peak reserved GiB "
            "(per rank) | step 1 / 2 s | B/param fp8kit | B/param counted | probe s |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]

    def gib(vals):
        return " / ".join("-" if v is None else f"{v:.1f}" for v in vals or []) or "-"

    for p in doc["probes"]:
        bpp = (p.get("fp8kit_bytes_per_param") or {}).get("total")
        params = p.get("params") or p.get("params_est")
        rows.append(
            f"| {p['optimizer']} | {p['n_layers']} | {_count(params)} | {p['status']} | {p.get('phase') or '-'} | "
            f"{gib(p.get('peak_alloc_gib_per_rank'))} | {gib(p.get('peak_reserved_gib_per_rank'))} | "
            f"{' / '.join(f'{s:.2f}' for s in p.get('step_s') or []) or '-'} | "
            f"{_fmt(bpp, '.2f')} | {_fmt(p.get('measured_bytes_per_param'), '.2f')} | {p.get('probe_s', 0):.0f} |")
    s = doc.get("summary", {})
    lines = ["", "| optimizer | max layers | params | boundary verified (first OOM at) | peak reserved GiB | step s |",
             "|---|---|---|---|---|---|"]
    for opt in doc["settings"]["optimizers"]:
        o = s.get(opt)
        if not o:
            continue
        step = o["step_s"][-1] if o.get("step_s") else None
        lines.append(f"| {o['label']} | {o['max_layers']} | {_count(o['params'])} | "
                     f"{'yes' if o['boundary_verified'] else 'no'} ({o['first_oom_layers']}) | "
                     f"{_fmt(o['peak_reserved_gib'], '.1f')} | {_fmt(step, '.2f')} |")
    if s.get("ratio_params_b_over_a") is not None:
        lines.append(f"\nparameters B/A = {s['ratio_params_b_over_a']:.2f}x (layers {s['ratio_layers_b_over_a']:.2f}x), "
                     f"target >= {TARGET_RATIO}x: "
                     f"{'met' if s['target_met'] else ('not met' if s['target_met'] is False else 'undecided (incomplete)')}")
    return "\n".join(rows + lines) + "\n"


def write_doc(out: Path, doc: dict) -> None:
    path = out / "fsdp_max_model.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


# -------------------------------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default="runs/fsdp_max_model", help="output directory")
    ap.add_argument("--tiny", action="store_true", help="CPU gloo check with a small model and a simulated memory cap")
    ap.add_argument("--cap-gib", type=float, default=None,
                    help="--tiny: simulated memory per rank (GiB; default 0.01)")
    ap.add_argument("--optimizers", default="adamw,fp8_adamw", help="comma-separated: adamw, fp8_adamw")
    ap.add_argument("--launch", choices=["torchrun", "inprocess"], default=None,
                    help="how probes run (default: torchrun on the GPU, inprocess with --tiny)")
    ap.add_argument("--nproc", type=int, default=None,
                    help="ranks per probe (default: the outer torchrun's world size, else 2)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; --tiny 32)")
    ap.add_argument("--mbs", type=int, default=1, help="micro-batch size per rank")
    ap.add_argument("--start-layers", type=int, default=2, help="the first, small probe")
    ap.add_argument("--max-layers", type=int, default=None, help="largest layer count tried (default 80; --tiny 64)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall-clock budget of the search (default 510; --tiny 300)")
    ap.add_argument("--probe-timeout", type=float, default=None, help="seconds per probe (default 200; --tiny 120)")
    ap.add_argument("--expandable-segments", action="store_true",
                    help="run the probes with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (default: the "
                         "environment's allocator settings, as `fp8kit train` gets them)")
    ap.add_argument("--probe-spec", default=None, help=argparse.SUPPRESS)  # internal: one rank of a probe
    args = ap.parse_args(argv)
    if args.probe_spec:
        return probe_worker(Path(args.probe_spec))

    outer_world = int(os.environ.get("WORLD_SIZE", "1"))
    outer_rank = int(os.environ.get("RANK", "0"))
    launch = args.launch or ("inprocess" if args.tiny else "torchrun")
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    for o in optimizers:
        if o not in OPTIMIZERS:
            ap.error(f"--optimizers: unknown {o!r}; choose from {', '.join(OPTIMIZERS)}")
    if launch == "inprocess" and outer_world < 2:
        ap.error("--launch inprocess runs the probes on the launch's own ranks: start it with "
                 "torchrun --nproc_per_node 2 (or more)")
    if launch == "torchrun" and outer_rank != 0:
        print(f"rank {outer_rank}: the probes run in fresh torchrun process groups started by rank 0", flush=True)
        return 0
    nproc = args.nproc or (outer_world if outer_world > 1 else 2)
    if launch == "inprocess":
        nproc = outer_world
    main_rank = outer_rank == 0
    tiny = args.tiny
    device = "cpu" if tiny else "cuda"
    seq = args.seq or (32 if tiny else 2048)
    vocab = VOCAB_TINY if tiny else VOCAB_70B
    cap = (args.cap_gib if args.cap_gib is not None else 0.01) if tiny else None
    if not tiny and args.cap_gib is not None:
        ap.error("--cap-gib simulates memory in --tiny mode only (the GPU's own memory is the limit)")
    max_layers = args.max_layers or (64 if tiny else 80)
    budget = args.budget_s or (300.0 if tiny else 510.0)
    probe_timeout = args.probe_timeout or (120.0 if tiny else 200.0)
    env_extra = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if args.expandable_segments else {}

    out = Path(args.out).resolve()
    if main_rank:
        (out / "probes").mkdir(parents=True, exist_ok=True)
        shape_path, tokens_path = out / "model_config.json", out / "tokens.bin"
        shape_path.write_text(json.dumps(TINY if tiny else LLAMA3_70B, indent=1) + "\n")
        # windows of seq + 1 tokens: 2 steps x nproc x mbs for training, validation (every 50th), with room
        write_tokens(tokens_path, vocab, 400 * (seq + 1))
    shape_path, tokens_path = out / "model_config.json", out / "tokens.bin"
    if launch == "inprocess":
        import torch
        import torch.distributed as dist

        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("gloo" if device == "cpu" else "nccl")
        if device == "cpu":
            torch.set_num_threads(1)
        dist.barrier()  # rank 0 wrote the shape and token files
    if main_rank:
        say(f"fsdp_max_model: {'tiny (CPU, simulated cap ' + str(cap) + ' GiB)' if tiny else 'Llama-3-70B layers'}, "
            f"{nproc} ranks, launch {launch}, optimizers {', '.join(optimizers)}, budget {budget:.0f} s")
    layer_params, fixed_params = model_params(shape_path, vocab)
    if main_rank:
        say(f"parameters: {layer_params / 1e6:.1f}M per layer + {fixed_params / 1e6:.1f}M outside the layers")

    from fp8kit.base.runtime import versions

    doc = {
        "benchmark": "fsdp_max_model",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": shlex.join([sys.executable, *sys.argv]) if outer_world == 1 else
        f"torchrun --nproc_per_node {outer_world} " + shlex.join(sys.argv),
        "mode": "tiny: CPU gloo, simulated memory cap (counted parameter+gradient+state bytes per rank)" if tiny
        else "gpu",
        "device": None,
        "world_size": nproc,
        "versions": versions(),
        "model": {"shape": TINY if tiny else LLAMA3_70B, "vocab_size": vocab, "seq_length": seq,
                  "micro_batch_size": args.mbs, "params_per_layer": layer_params, "params_outside_layers": fixed_params},
        "settings": {
            "optimizers": optimizers, "optimizer_sets": {o: OPTIMIZERS[o] for o in optimizers},
            "launch": launch, "budget_s": budget, "probe_timeout_s": probe_timeout, "max_layers": max_layers,
            "start_layers": args.start_layers, "cap_gib": cap,
            "pytorch_cuda_alloc_conf": env_extra.get("PYTORCH_CUDA_ALLOC_CONF",
                                                     os.environ.get("PYTORCH_CUDA_ALLOC_CONF")),
            "fit_metric": "counted_gib (largest rank)" if tiny else "peak_reserved_gib (largest rank, set-up and steps)",
            "common_sets": probe_sets(shape_path=shape_path, tokens_path=tokens_path, cache=out / "cache",
                                      n_layers=0, optimizer=optimizers[0], seq=seq, mbs=args.mbs, vocab=vocab,
                                      device=device)[:-len(OPTIMIZERS[optimizers[0]])],
        },
        "limit_gib": cap,
        "probes": [],
        "summary": {},
    }
    stopped: dict[str, str | None] = {}
    deadline = _T0 + budget
    slowest = 0.0
    for opt in optimizers:
        history: list[dict] = []
        slope_guess = None
        stopped[opt] = None
        while True:
            n = plan_next(history, limit=doc["limit_gib"] or math.inf, start=args.start_layers,
                          max_layers=max_layers, slope_guess=slope_guess)
            if n is None:
                break
            left = deadline - time.time()
            if rank0_decides(launch, left < max(slowest * 1.2, 5.0)):
                stopped[opt] = f"budget: {left:.0f} s left before probing {n} layers (slowest probe {slowest:.0f} s)"
                if main_rank:
                    say(f"{opt}: stop, {stopped[opt]}")
                break
            name = f"{opt}_L{n:03d}"
            spec = {
                "sets": probe_sets(shape_path=shape_path, tokens_path=tokens_path, cache=out / "cache",
                                   n_layers=n, optimizer=opt, seq=seq, mbs=args.mbs, vocab=vocab, device=device),
                "device": device, "cap_gib": cap, "run_dir": str(out / "probes" / name / "run"),
                "result_dir": str(out / "probes" / name),
            }
            if main_rank:
                say(f"{opt}: probing {n} layers ({_count(fixed_params + n * layer_params)} parameters)")
            t0 = time.time()
            if launch == "torchrun":
                rec = launch_torchrun(spec, out / "probes" / name, nproc, min(probe_timeout, left), env_extra)
            else:
                rec = launch_inprocess(spec)
            rec = {"optimizer": opt, "n_layers": n, "params_est": fixed_params + n * layer_params,
                   "params_b": (rec.get("params") or fixed_params + n * layer_params) / 1e9,
                   "probe_s": time.time() - t0, **rec}
            slowest = max(slowest, rec["probe_s"])
            doc["probes"].append(rec)
            if doc["device"] is None and rec.get("device"):
                doc["device"] = rec["device"]
                doc["versions"] = rec.get("versions") or doc["versions"]
            if not tiny and rec["status"] == "ok" and rec.get("device_total_gib") is not None:
                usable = rec["device_total_gib"] - (rec.get("nonpytorch_gib") or 0.0)
                doc["limit_gib"] = usable if doc["limit_gib"] is None else min(doc["limit_gib"], usable)
            metric = rec.get("counted_gib") if tiny else rec.get("peak_reserved_gib")
            if main_rank:
                peak = "-" if rec.get("peak_reserved_gib") is None else f"{rec['peak_reserved_gib']:.1f} GiB reserved"
                counted = "" if rec.get("counted_gib") is None else f", counted {rec['counted_gib']:.4f} GiB/rank"
                err = f": {rec['error'][:240]}" if rec.get("error") else ""
                say(f"{opt}: {n} layers -> {rec['status']} ({rec.get('phase') or '-'}) in {rec['probe_s']:.0f} s, "
                    f"peak {peak}{counted}, steps {rec.get('step_s')}{err}")
            if rec["status"] not in ("ok", "oom"):
                stopped[opt] = f"{rec['status']} at {n} layers: {rec.get('error')}"
                history.append({"n": n, "status": "error", "metric": None})
                doc["summary"] = summarize(doc["probes"], optimizers, layer_params, fixed_params, stopped, max_layers)
                if main_rank:
                    write_doc(out, doc)
                break
            history.append({"n": n, "status": rec["status"], "metric": metric})
            if slope_guess is None and rec["status"] == "ok":
                bpp = rec.get("measured_bytes_per_param") or 16.0
                # per-rank state of one more layer, with room for transients and activations
                slope_guess = 1.5 * bpp * layer_params / nproc / GIB
            doc["summary"] = summarize(doc["probes"], optimizers, layer_params, fixed_params, stopped, max_layers)
            if main_rank:
                write_doc(out, doc)
    doc["summary"] = summarize(doc["probes"], optimizers, layer_params, fixed_params, stopped, max_layers)
    doc["wall_s"] = time.time() - _T0
    if main_rank:
        write_doc(out, doc)
        table = markdown(doc)
        (out / "fsdp_max_model.md").write_text(table)
        print("\n" + table, flush=True)
        say(f"wrote {out / 'fsdp_max_model.json'}")
    if launch == "inprocess":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
