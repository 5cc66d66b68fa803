"""FP8 gradient all-reduce with automatic scaling (FP8-LM), standalone and as a DDP communication hook.

FP8-LM (Peng et al. 2023, arXiv:2310.18313, section 2, "FP8 gradient and all-reduce communication";
the paper's code is Microsoft's MS-AMP) sends gradients in FP8. Summing FP8 values across N ranks overflows
(post-scaling, ``(g_1 + ... + g_N) / N``) and dividing first underflows (pre-scaling,
``g_1/N + ... + g_N/N``); the paper's fix is a shared factor ``mu`` (auto-scaling, ``g'_i = mu * g_i``)
and one scale for all ranks (scale unification, ``s'_g = min(s'_1, ..., s'_N)``). Per call, on every rank::

    y      = mu * g                          float32, padded to a multiple of N      [N * chunk]
    cand   = mu * backoff if frac(|y| > FP8_MAX) > delta else mu      (auto-scaling rule, paper)
    all-reduce MIN of [cand, -frac, -amax, -nonfinite]  -> mu_g       one collective of 4 float64:
                                             mu halves when any rank saturates, on every rank alike
    q      = FP8(saturate(mu_g * g))                                  (scale unification, paper)
    all_to_all_single(q as uint8)            rank r receives chunk r of every rank   [N, chunk] fp8
    m_r    = FP8(sum_i q_i[r] (float32) / N) with the same mu_g       (no FP8 sum: no overflow, the mean's
                                                                      |m| <= max_i |q_i| <= FP8_MAX)
    all_gather(m_r as uint8)                                          [N * chunk] fp8
    g      = m / mu_g                        dequantized into ``tensor`` (its dtype)

The paper's ``g = g''_1 + ... + g''_N, s = N * s'_g`` (sum in FP8, divide by the scale) is done here as a
reduce-scatter whose sum runs in float32 and whose mean is requantized with the unified scale, so the
sum cannot overflow FP8 for any N. Bytes per rank: ``2 (N-1)/N`` of the FP8 buffer plus 32 bytes,
about half of a BF16 ring all-reduce (``fp8_allreduce_bytes`` vs ``ring_allreduce_bytes``).
The quantize / dequantize steps are ``fp8kit.fp8.scaling``'s (saturating cast, no inf).

Non-finite gradients: if any rank holds an inf or NaN, the result is NaN everywhere on every rank (a
saturating cast would otherwise turn an inf into a finite FP8_MAX and hide it from AMP's GradScaler) and
mu and the counters are left unchanged for that step. (The test is on ``mu * g`` in float32, so a finite
gradient above ``3.4e38 / mu`` counts as non-finite too.)

World size 1: exact passthrough (no quantization, no collective, the state is not touched), since the
mean over one rank is the tensor itself. An empty tensor is also returned untouched.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, not strings.
import math

import torch
import torch.distributed as dist

from fp8kit.comm.autoscale import (
    GROWTHS,
    HALVINGS,
    INITIALIZED,
    LAST_SATURATION,
    MU,
    STEPS_BELOW,
    AutoScaleState,
    fp8_allreduce_bytes,
    ring_allreduce_bytes,
)
from fp8kit.fp8.scaling import DTYPE_MAX, clamp_amax, dequantize, quantize, scale_from_amax

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# torch >= 2.13 names it all_gather_single; all_gather_into_tensor is the older (deprecated) name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def fp8_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    state: AutoScaleState | None = None,
    key: str | int = "default",
) -> torch.Tensor:
    """Average ``tensor`` over the ranks of ``group`` through FP8, in place; returns ``tensor``.

    The result is the mean over ranks (all-reduce SUM then ``/ world_size``) up to FP8 rounding: two
    roundings to ``state.fp8_dtype`` with the unified scale ``mu`` (each at most 2^-3 relative for
    E5M2, 2^-4 for E4M3; values below ``min_subnormal / mu`` flush to zero; values above
    ``FP8_MAX / mu`` are clipped: at most a fraction ``delta`` per rank on a step where mu is not
    halved, any fraction that still exceeds it after a halving). Every rank ends with the same values
    and the same ``state``. See the module docstring for the algorithm and its
    sources (FP8-LM section 2: auto-scaling ``g' = mu g``, scale unification ``min_i s'_i``).

    Args:
        tensor: float32, bfloat16, float16 or float64 (computed in float32), any shape, same shape on
            every rank, on the device of the group's backend (CPU for gloo, CUDA for NCCL).
        group: the process group (default: ``state.process_group``, else the default group).
        state: the ``AutoScaleState`` keeping ``mu`` for ``key``; ``None`` for a one-shot call whose mu
            is ``FP8_MAX / global_amax`` (E5M2, nothing kept).
        key: which ``mu`` of ``state`` (str or int); a key seen with another numel is re-initialised.

    Returns:
        ``tensor``, overwritten with the mean.

    Raises:
        ValueError: ``tensor`` is not a tensor of one of the dtypes above, ``state`` is not an
            ``AutoScaleState``, or ``key`` is not a str or int.
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    _check_args(tensor, state, key)
    if group is None and state is not None:
        group = state.process_group
    world = dist.get_world_size(group)
    n = tensor.numel()
    if world == 1 or n == 0:
        return tensor
    st = state if state is not None else AutoScaleState(process_group=group)
    fp8 = st.dtype
    fp8_max = DTYPE_MAX[fp8]
    s = st._values(key, n, tensor.device)  # float64[6]: mu, steps_below, halvings, growths, init, sat
    mu, init = s[MU], s[INITIALIZED] > 0

    # --- local: y = mu * g (float32, zero-padded), saturation fraction, amax --------------------------
    chunk = -(-n // world)
    src = tensor.reshape(-1)
    y = torch.empty(world * chunk, dtype=torch.float32, device=tensor.device)  # [N * chunk]
    y[:n].copy_(src)
    y[n:].zero_()
    y.mul_(mu)  # g'_i = mu * g_i (paper: auto-scaling)
    a = y.abs()
    # amax of mu * g: NaN / inf if any value is; the global amax of g itself where it is needed (an
    # uninitialised key, whose placeholder mu is 1)
    amax = a.amax().to(torch.float64)
    nonfinite = ~torch.isfinite(amax)
    frac = torch.count_nonzero(a > fp8_max).to(torch.float64) / n  # saturated fraction of g'_i
    del a
    cand = torch.where(init, torch.where(frac > st.delta, mu * st.backoff, mu), math.inf)

    # --- one scalar all-reduce: unified mu (MIN), max fraction, global amax, any non-finite ------------
    vec = torch.stack([cand, -frac, -torch.where(nonfinite, 0.0, amax), -nonfinite.to(torch.float64)])
    dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=group)
    cand_g, frac_max, gamax, bad = vec[0], -vec[1], -vec[2], vec[3] < 0
    mu0 = _initial_mu(gamax, fp8)
    mu_g = torch.where(init, cand_g, mu0)  # the unified scale of this call

    # --- FP8 reduce-scatter (all-to-all + float32 sum) and all-gather --------------------------------
    q = quantize(y, mu_g / mu, fp8)  # = FP8(saturate(mu_g * g)); the ratio is 1, backoff or mu0 / 1
    del y
    recv = torch.empty(world * chunk, dtype=torch.uint8, device=tensor.device)
    dist.all_to_all_single(recv, q.view(torch.uint8), group=group)  # gloo/NCCL have no float8 dtypes
    total = recv.view(fp8).view(world, chunk).float().sum(0)  # [chunk], in units of mu_g
    mean = quantize(total, 1.0 / world, fp8)  # |mean| <= FP8_MAX: no saturation
    gathered = torch.empty(world * chunk, dtype=torch.uint8, device=tensor.device)
    _all_gather_single(gathered, mean.view(torch.uint8), group=group)
    out_scale = torch.where(bad, math.nan, mu_g)  # any inf/NaN on any rank -> NaN result
    tensor.copy_(dequantize(gathered.view(fp8)[:n], out_scale).view(tensor.shape))

    # --- auto-scale update (the same on every rank: it reads only all-reduced values) ---------------
    halve = init & (cand_g < mu) & ~bad
    initializing = ~init & ~bad & (gamax > 0)
    quiet = ~bad & ~halve & (init | initializing)
    steps = torch.where(halve, 0.0, torch.where(quiet, s[STEPS_BELOW] + 1, s[STEPS_BELOW]))
    grow = quiet & init & (steps > st.growth_interval)
    mu_next = torch.where(halve, cand_g, torch.where(initializing, mu0, mu))
    mu_next = torch.where(grow, (mu_next * st.growth_factor).clamp(max=st.mu_max), mu_next)
    new = torch.stack(
        [
            mu_next,
            steps,
            s[HALVINGS] + halve.to(torch.float64),
            s[GROWTHS] + grow.to(torch.float64),
            (init | initializing).to(torch.float64),
            torch.where(init & ~bad, frac_max, s[LAST_SATURATION]),
        ]
    )
    st._store(key, new, fp8_allreduce_bytes(n, world), ring_allreduce_bytes(n, world, 2))
    return tensor


def fp8_allreduce_hook(state: AutoScaleState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``ddp_model.register_comm_hook(AutoScaleState(), fp8_allreduce_hook)``.

    Averages the bucket's flat gradient buffer (``bucket.buffer()``: 1-D, the gradients' dtype) with
    ``fp8_all_reduce(buffer, state.process_group, state, key)`` and returns it in an already completed
    Future. The collectives run synchronously inside the hook: in this version communication does not
    overlap the rest of the backward pass (on CUDA the host does not wait, but the compute stream
    waits for each collective).

    The key is ``f"{bucket.index()}:{numel}"``, the bucket index *and* its size: DDP rebuilds its
    buckets after the first iteration (in torch 2.13, without ``find_unused_parameters``, the first
    iteration reduces the whole model as one bucket 0), so the index alone would mix two layouts; with
    the size in the key the first-iteration buckets keep their own mu, and after a resume the rebuilt
    buckets continue with their saved mu.

    Save ``state.state_dict()`` with the model's checkpoint and ``load_state_dict`` it on resume.
    """
    buf = bucket.buffer()
    fp8_all_reduce(buf, group=state.process_group, state=state, key=f"{bucket.index()}:{buf.numel()}")
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _initial_mu(amax: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``mu0 = FP8_MAX / max(amax, eps)`` (``scale_from_amax``) as float64, float32-representable.

    Rounded down by one float32 ulp when ``mu0 * amax`` rounds above FP8_MAX in float32 (one step is
    enough: then ``mu0 <= FP8_MAX / amax`` exactly), so the first call saturates nothing.
    """
    mu0 = scale_from_amax(amax, fp8)
    mu0 = torch.where(mu0 * clamp_amax(amax) > DTYPE_MAX[fp8], torch.nextafter(mu0, torch.zeros_like(mu0)), mu0)
    return mu0.to(torch.float64)


def _check_args(tensor: object, state: object, key: object) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _INPUT_DTYPES:
        what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"fp8_all_reduce: tensor must be float32, bfloat16, float16 or float64, got {what}")
    if state is not None and not isinstance(state, AutoScaleState):
        raise ValueError(
            f"fp8_all_reduce: state must be an AutoScaleState or None, got {type(state).__name__}"
        )
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise ValueError(f"fp8_all_reduce: key must be a str or int, got {key!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fp8_all_reduce: torch.distributed is not initialized (call dist.init_process_group)"
        )
