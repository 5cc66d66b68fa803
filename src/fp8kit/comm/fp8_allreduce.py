"""FP8 gradient all-reduce with automatic scaling (FP8-LM), standalone and as a DDP communication hook.

FP8-LM (Peng et al. 2023, arXiv:2310.18313, section 2, "FP8 gradient and all-reduce communication";
the paper's code is Microsoft's MS-AMP) sends gradients in FP8. Summing FP8 values across N ranks overflows
(post-scaling, ``(g_1 + ... + g_N) / N``) and dividing first underflows (pre-scaling,
``g_1/N + ... + g_N/N``); the paper's fix is a shared factor ``mu`` (auto-scaling, ``g'_i = mu * g_i``)
and one scale for all ranks (scale unification, ``s'_g = min(s'_1, ..., s'_N)``). Two reduction algorithms
(``algorithm=``) share the scale and the quantize pass. Per call, on every rank (``f32`` = rounded to float32;
all elementwise math in float32), "scatter"::

    stats  = amax |mu g|, #(|mu g| > FP8_MAX), #(not finite)         pass 1: reads g        (comm.unify)
    cand   = mu * backoff if frac(|mu g| > FP8_MAX) > delta else mu   (auto-scaling rule, paper)
    all-reduce MIN of [cand, -frac, -amax, -nonfinite]  -> mu_g       one collective of 4 float64:
                                             mu halves when any rank saturates, on every rank alike
    q      = FP8(saturate(f32(g) * f32(mu_g)))  [N * chunk], zero-padded   pass 2: reads g, writes q
    all_to_all_single(q as uint8)            rank r receives chunk r of every rank   [N, chunk] fp8
    m_r    = FP8(saturate((q_0[r] + ... + q_{N-1}[r]) * f32(1/N)))   pass 3: float32 sum in rank order, no FP8
                                                                      sum: no overflow, |m| <= max_i |q_i|
    all_gather(m_r as uint8)                 [N * chunk] fp8 (NCCL: in place, m_r written into its slot)
    g      = f32(m) / f32(mu_g)              pass 4: dequantized into ``tensor`` (its dtype), NaN if bad

"gather" (the same stats, scalar all-reduce and mu_g)::

    q      = FP8(saturate(f32(g) * f32(mu_g)))  [L], L = n rounded up to 16, zero-padded   pass 2
    all_gather(q as uint8)                   [N, L] fp8: every rank's whole tensor (NCCL: in place)
    g      = ((q_0 + ... + q_{N-1}) * f32(1/N)) / f32(mu_g)   pass 3: float32 sum in rank order over the first n
                                             columns, dequantized into ``tensor`` (its dtype), NaN if bad

Delayed scaling (``AutoScaleState(scaling="delayed")``, see :mod:`fp8kit.comm.autoscale`): once the key is
initialised, the stats pass, the scalar all-reduce and the bookkeeping program leave the critical path::

    q, vec = FP8(saturate(f32(g) * f32(mu))), stats of the same products     one pass (quantize_stats)
    gather:  all_gather([q | vec])       each row carries its rank's float64[4] statistics (32 bytes)
             mu_next, out_scale = update(MIN of the N vecs), f32(mu) or NaN    one single-thread program
             g = ((q_0 + ... + q_{N-1}) * f32(1/N)) / out_scale                as above
    scatter: all_to_all(q), then all-reduce MIN of vec (queued behind it), then as above with out_scale

so the transfer starts right after one pass over ``g``; ``mu`` for the next call follows the same rule.

The paper's ``g = g''_1 + ... + g''_N, s = N * s'_g`` (sum in FP8, divide by the scale) is done here with a
float32 sum, so it cannot overflow FP8 for any N: "scatter" reduce-scatters (all-to-all, float32 sum) and
requantizes the mean with the unified scale for its all-gather (two FP8 roundings); "gather" all-gathers the
quantized tensors and sums them on every rank (one FP8 rounding; the fixed rank order gives every rank the same
bits). Bytes per rank (``fp8_allreduce_bytes(n, N, algorithm)``): scatter ``2 (N-1)/N`` of the FP8 buffer,
gather ``(N-1)`` of it, both plus 32 bytes; at ``N = 2`` both send one FP8 buffer, half of a BF16 ring
all-reduce (``ring_allreduce_bytes``). ``algorithm="auto"`` (the default) takes gather at ``N = 2`` (the same
bytes in one collective instead of two, whose latency dominates at small sizes, and one rounding instead of
two) and scatter above (gather would send ``N/2`` times the bytes). Measured on 2 x H200 over NVLink
(docs/benchmarks.md, "FP8 gradient all-reduce"): gather with delayed scaling (the defaults) 0.84-1.18x the bf16
all-reduce's time at 32M-256M elements and 0.97-1.12x at 512M-1G; with current scaling 1.06-1.48x at 32M-256M,
where the pre-transfer statistics and scalar all-reduce serialize ahead of the transfer.
The casts are ``fp8kit.fp8.scaling.quantize``'s (multiply in float32, saturate, round to nearest even: no inf).

Fused path. The passes (four for scatter, three for gather), and the float64 bookkeeping around the scalar
all-reduce, are ``torch.library`` ops (:mod:`fp8kit.comm.allreduce_ops`): on CUDA each pass is one Triton kernel
(:mod:`fp8kit.comm.allreduce_triton`) that reads its input once and writes straight into the collective's buffer
(the gradient is never copied to float32), and the bookkeeping two single-program kernels (instead of ~40 tiny
torch launches); elsewhere, and with ``reference=True`` on CUDA, the plain PyTorch references run; both give the
same bits. HBM traffic per element for a bf16 gradient, scatter: 2 + 3 (passes 1, 2) + 1.5 (pass 3, per rank's
share) + 3 (pass 4) bytes; gather: 2 + 3 (passes 1, 2) + N + 2 (pass 3); against ~90 for the unfused passes.
The collectives are asynchronous: with ``pipeline_chunks`` > 1 the padded tensor is exchanged in pieces
(scatter: each ``N * c`` elements, rank r reducing chunk r of each piece; gather: elements ``[o, o + c)`` of
every rank's tensor) and piece i+1 is quantized while piece i is on the wire; the result is the same bit for
bit (every pass is elementwise, mu_g is the whole tensor's).

Non-finite gradients: if any rank holds an inf or NaN, the result is NaN everywhere on every rank (a
saturating cast would otherwise turn an inf into a finite FP8_MAX and hide it from AMP's GradScaler) and
mu and the counters are left unchanged for that step. (The test is on ``mu * g`` in float32, so a finite
gradient above ``3.4e38 / mu`` counts as non-finite too.)

World size 1: exact passthrough (no quantization, no collective, the state is not touched), since the
mean over one rank is the tensor itself. An empty tensor is also returned untouched.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects, not strings.
from types import SimpleNamespace

import torch
import torch.distributed as dist

from fp8kit.comm import allreduce_ops as ops
from fp8kit.comm import eager
from fp8kit.comm.autoscale import (
    ALGORITHMS,
    VEC_BYTES,
    AutoScaleState,
    fp8_allreduce_bytes,
    gather_row_bytes,
    pick_algorithm,
    ring_allreduce_bytes,
)
from fp8kit.comm.unify import params_tensor, unify_scale

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# torch >= 2.13 names it all_gather_single; all_gather_into_tensor is the older (deprecated) name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_initial_mu = ops.initial_mu  # the name the tests import

#: The fused passes (``torch.ops.fp8kit.comm_*``: Triton on CUDA, the references elsewhere; in eager mode on CUDA
#: launched without the dispatcher, :mod:`fp8kit.comm.eager`) and the plain PyTorch references
#: (``reference=True``): the same math, the same bits.
_FUSED = SimpleNamespace(quantize=eager.quantize, sum_requant=eager.sum_requant, dequantize=eager.dequantize,
                         gather_mean=eager.gather_mean, quantize_stats=eager.quantize_stats,
                         update_delayed=eager.update_delayed)
_REFERENCE = SimpleNamespace(quantize=ops.quantize_ref, sum_requant=ops.sum_requant_ref, dequantize=ops.dequantize_ref,
                             gather_mean=ops.gather_mean_ref, quantize_stats=ops.quantize_stats_ref,
                             update_delayed=ops.scale_update_delayed_ref)

#: Pipeline pieces (``pipeline_chunks=None``, fused path on CUDA): one piece per this many bytes of the
#: tensor, at most ``AUTO_MAX_PIECES``; a piece's chunk is a multiple of ``PIECE_ALIGN`` elements (aligned loads).
#: Measured on 2 x H200 over NVLink (docs/benchmarks.md, 2026-11-23): 4 pieces were slower than one at every size
#: from 32M to 1G elements (e.g. 512M e5m2: 4.94 vs 3.93 ms): the pieces' extra scalar reductions and launches
#: cost more than the overlap gains, so the default is one piece; ``pipeline_chunks=k`` still pipelines.
AUTO_PIECE_BYTES = 64 << 20
AUTO_MAX_PIECES = 1
PIECE_ALIGN = 1024


def fp8_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    state: AutoScaleState | None = None,
    key: str | int = "default",
    *,
    pipeline_chunks: int | None = None,
    reference: bool = False,
    algorithm: str = "auto",
) -> torch.Tensor:
    """Average ``tensor`` over the ranks of ``group`` through FP8, in place; returns ``tensor``.

    The result is the mean over ranks (all-reduce SUM then ``/ world_size``) up to FP8 rounding: two
    roundings (algorithm "scatter") or one ("gather") to ``state.fp8_dtype`` with the unified scale ``mu`` (each
    at most 2^-3 relative for E5M2, 2^-4 for E4M3; values below ``min_subnormal / mu`` flush to zero; values above
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
        pipeline_chunks: split the FP8 exchange into this many pieces, so that the kernels of one piece
            overlap the collectives of another (same result bit for bit, same bytes; one mu for the whole
            tensor). ``None``: one piece per ``AUTO_PIECE_BYTES`` of ``tensor``, at most ``AUTO_MAX_PIECES``,
            on CUDA with the fused kernels; one piece otherwise.
        reference: run the plain PyTorch passes (``allreduce_ops.*_ref``) instead of the fused ops, also on
            CUDA (the unfused path, for benchmarks and tests; same bits).
        algorithm: ``"scatter"`` (all-to-all, float32 sum, requantize, all-gather of the means),
            ``"gather"`` (all-gather of every rank's FP8 tensor, float32 sum and dequantize on every rank), or
            ``"auto"``: gather for 2 ranks (the same bytes, one collective and one FP8 rounding less), scatter
            otherwise (``autoscale.pick_algorithm``). Both use the same ``mu`` and state rules, and every rank
            ends with the same bits; the results of the two differ by the second rounding.

    Returns:
        ``tensor``, overwritten with the mean.

    Raises:
        ValueError: ``tensor`` is not a tensor of one of the dtypes above, ``state`` is not an
            ``AutoScaleState``, ``key`` is not a str or int, ``pipeline_chunks`` is not None or an int >= 1 (or > 1 with a delayed-scaling state), or
            ``algorithm`` is not "auto", "scatter" or "gather".
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    _check_args(tensor, state, key, pipeline_chunks, algorithm)
    if group is None and state is not None:
        group = state.process_group
    world = dist.get_world_size(group)
    n = tensor.numel()
    if world == 1 or n == 0:
        return tensor
    algorithm = pick_algorithm(algorithm, world)
    st = state if state is not None else AutoScaleState(process_group=group)
    fp8 = st.dtype
    impl = _REFERENCE if reference else _FUSED
    contiguous = tensor.is_contiguous()
    src = tensor.view(-1) if contiguous else tensor.reshape(-1).contiguous()  # [n], also the output
    inplace = tensor.is_cuda and "nccl" in str(dist.get_backend(group))  # NCCL: in-place all-gather

    if st._delayed_ready(key, n):  # delayed scaling: quantize with mu now, this call's statistics ride along
        values, params = st._values(key, n, src.device), params_tensor(st, src.device)
        exchange_delayed = _gather_delayed if algorithm == "gather" else _scatter_delayed
        new_values = exchange_delayed(src, values, params, fp8, impl, group, world, inplace)
        if not contiguous:
            tensor.copy_(src.view(tensor.shape))
        st._store(key, new_values, fp8_allreduce_bytes(n, world, algorithm, "delayed"),
                  ring_allreduce_bytes(n, world, 2))
        return tensor

    # --- stats of mu * g and one scalar all-reduce: the unified scale mu_g (comm.unify) ------------------
    # scale = f32(mu_g); out_scale = f32(mu_g) or NaN if any rank saw inf/NaN; new_values: the key after the call
    scale, out_scale, new_values = unify_scale(src, st, key, group, reference=reference)

    # --- the FP8 exchange, in pipeline pieces ------------------------------------------------------------
    auto_bytes = n * tensor.element_size() if tensor.is_cuda and not reference else 0
    exchange = _gather_exchange if algorithm == "gather" else _scatter_exchange
    exchange(src, scale, out_scale, fp8, impl, group, world, pipeline_chunks, auto_bytes, inplace)
    if not contiguous:
        tensor.copy_(src.view(tensor.shape))

    # --- auto-scale state (computed by unify_scale from all-reduced values only: the same on every rank) --
    st._store(key, new_values, fp8_allreduce_bytes(n, world, algorithm), ring_allreduce_bytes(n, world, 2))
    return tensor


def _scatter_exchange(src: torch.Tensor, scale: torch.Tensor, out_scale: torch.Tensor, fp8: torch.dtype,
                      impl: SimpleNamespace, group: dist.ProcessGroup | None, world: int,
                      pipeline_chunks: int | None, auto_bytes: int, inplace: bool) -> None:
    """Algorithm "scatter": FP8 reduce-scatter (all-to-all + float32 sum, requantized) and all-gather of the
    means, then ``src = m / out_scale``. ``src`` contiguous ``[n]``, input and output."""
    n = src.numel()
    rank = dist.get_rank(group)
    chunk = -(-n // world)  # the padded tensor [N * chunk]: rank r reduces chunk r of each piece
    pieces = _pieces(chunk, pipeline_chunks, auto_bytes)
    q = torch.empty(world * chunk, dtype=torch.uint8, device=src.device)  # send, then all-gather output
    recv = torch.empty(world * chunk, dtype=torch.uint8, device=src.device)
    means = None if inplace else torch.empty(chunk, dtype=torch.uint8, device=src.device)

    def send(off: int, c: int) -> dist.Work:
        lo = world * off
        impl.quantize(src[lo : min(n, lo + world * c)], scale, q[lo : lo + world * c], fp8)  # FP8(sat(mu_g g))
        return dist.all_to_all_single(recv[lo : lo + world * c], q[lo : lo + world * c], group=group, async_op=True)

    def reduce(off: int, c: int) -> dist.Work:
        lo = world * off
        slot = q[lo + rank * c : lo + (rank + 1) * c] if inplace else means[off : off + c]
        impl.sum_requant(recv[lo : lo + world * c], slot, world, fp8)  # FP8(sum_i q_i / N), |m| <= FP8_MAX
        return _all_gather_single(q[lo : lo + world * c], slot, group=group, async_op=True)

    def finish(off: int, c: int) -> None:
        lo = world * off
        out = src[lo : min(n, lo + world * c)]
        if out.numel():
            impl.dequantize(q[lo : lo + world * c], out_scale, out, fp8)  # g = m / mu_g (NaN if bad)

    # piece p + 1 is quantized and sent while piece p is summed; piece p - 1 is dequantized after p's
    # all-gather was queued (the collectives run in order on the process group's stream)
    sent = {0: send(*pieces[0])}
    gathered: dict[int, dist.Work] = {}
    for p in range(len(pieces)):
        if p + 1 < len(pieces):
            sent[p + 1] = send(*pieces[p + 1])
        sent.pop(p).wait()
        gathered[p] = reduce(*pieces[p])
        if p >= 1:
            gathered.pop(p - 1).wait()
            finish(*pieces[p - 1])
    gathered.pop(len(pieces) - 1).wait()
    finish(*pieces[-1])


def _gather_exchange(src: torch.Tensor, scale: torch.Tensor, out_scale: torch.Tensor, fp8: torch.dtype,
                     impl: SimpleNamespace, group: dist.ProcessGroup | None, world: int,
                     pipeline_chunks: int | None, auto_bytes: int, inplace: bool) -> None:
    """Algorithm "gather": all-gather of every rank's FP8 tensor (padded to ``L``), then on every rank
    ``src = (sum_i q_i * f32(1/N)) / out_scale`` (one pass, rank order). ``src`` contiguous ``[n]``, input and
    output. Piece ``(o, c)`` (elements ``[o, o + c)`` of every rank's row) is gathered into
    ``rows[N o, N (o + c))`` viewed as ``[N, c]``."""
    n = src.numel()
    rank = dist.get_rank(group)
    row = gather_row_bytes(n)  # [L], L a multiple of 16: aligned rows for the fused pass
    pieces = _pieces(row, pipeline_chunks, auto_bytes)
    rows = torch.empty(world * row, dtype=torch.uint8, device=src.device)  # all-gather output
    q = None if inplace else torch.empty(row, dtype=torch.uint8, device=src.device)  # gloo: a separate send buffer

    def send(o: int, c: int) -> dist.Work:
        slot = rows[world * o + rank * c : world * o + (rank + 1) * c] if inplace else q[o : o + c]
        impl.quantize(src[o : min(n, o + c)], scale, slot, fp8)  # FP8(sat(mu_g g)), zeros past n
        return _all_gather_single(rows[world * o : world * (o + c)], slot, group=group, async_op=True)

    def finish(o: int, c: int) -> None:
        out = src[o : min(n, o + c)]
        if out.numel():
            impl.gather_mean(rows[world * o : world * (o + c)], out_scale, out, world, fp8)  # mean / mu_g (NaN if bad)

    # piece p + 1 is quantized and sent before piece p is summed into src (disjoint elements of src)
    sent = {0: send(*pieces[0])}
    for p in range(len(pieces)):
        if p + 1 < len(pieces):
            sent[p + 1] = send(*pieces[p + 1])
        sent.pop(p).wait()
        finish(*pieces[p])


def _gather_delayed(src: torch.Tensor, values: torch.Tensor, params: torch.Tensor, fp8: torch.dtype,
                    impl: SimpleNamespace, group: dist.ProcessGroup | None, world: int, inplace: bool) -> torch.Tensor:
    """Algorithm "gather" with delayed scaling; returns the key's next values. Each rank's row is its FP8 tensor
    ``[L]`` (quantized with ``f32(mu)``) followed by its float64[4] statistics (:data:`VEC_BYTES`): one pass over
    ``src``, one all-gather, one tiny program taking the MIN of the N statistics, one summing pass."""
    n = src.numel()
    rank = dist.get_rank(group)
    row = gather_row_bytes(n)
    stride = row + VEC_BYTES  # a multiple of 16: the statistics are 8-byte aligned float64
    rows = torch.empty(world * stride, dtype=torch.uint8, device=src.device)
    slot = rows[rank * stride : (rank + 1) * stride] if inplace else torch.empty(stride, dtype=torch.uint8,
                                                                                   device=src.device)
    impl.quantize_stats(src, values, params, slot[:row], slot[row:].view(torch.float64), fp8)
    _all_gather_single(rows, slot, group=group)
    vecs = rows.view(world, stride)[:, row:].view(torch.float64)  # [N, 4], row stride stride / 8
    out_scale, new_values = impl.update_delayed(vecs, values, params, fp8)
    impl.gather_mean(rows, out_scale, src, world, fp8)  # rows of `stride` bytes, the first n columns summed
    return new_values


def _scatter_delayed(src: torch.Tensor, values: torch.Tensor, params: torch.Tensor, fp8: torch.dtype,
                     impl: SimpleNamespace, group: dist.ProcessGroup | None, world: int, inplace: bool) -> torch.Tensor:
    """Algorithm "scatter" with delayed scaling; returns the key's next values. The statistics' MIN all-reduce is
    queued after the all-to-all (nothing waits for it before the transfer)."""
    n = src.numel()
    rank = dist.get_rank(group)
    chunk = -(-n // world)
    q = torch.empty(world * chunk, dtype=torch.uint8, device=src.device)
    recv = torch.empty_like(q)
    vec = torch.empty(4, dtype=torch.float64, device=src.device)
    impl.quantize_stats(src, values, params, q, vec, fp8)
    sent = dist.all_to_all_single(recv, q, group=group, async_op=True)
    dist.all_reduce(vec, op=dist.ReduceOp.MIN, group=group)
    sent.wait()
    out_scale, new_values = impl.update_delayed(vec.view(1, 4), values, params, fp8)
    slot = q[rank * chunk : (rank + 1) * chunk] if inplace else torch.empty(chunk, dtype=torch.uint8,
                                                                             device=src.device)
    impl.sum_requant(recv, slot, world, fp8)
    _all_gather_single(q, slot, group=group)
    impl.dequantize(q, out_scale, src, fp8)
    return new_values


def _pieces(chunk: int, pipeline_chunks: int | None, auto_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each piece of the per-rank chunk ``[0, chunk)``; with "scatter" piece ``(o, c)``
    covers elements ``[N o, N (o + c))`` of the padded tensor, with "gather" (``chunk`` = the row ``L``) elements
    ``[o, o + c)`` of every rank's tensor. ``auto_bytes`` > 0 enables the automatic count."""
    if pipeline_chunks is None:
        pipeline_chunks = min(AUTO_MAX_PIECES, max(1, auto_bytes // AUTO_PIECE_BYTES)) if auto_bytes else 1
    size = -(-chunk // pipeline_chunks)
    if pipeline_chunks > 1:
        size = -(-size // PIECE_ALIGN) * PIECE_ALIGN
    return [(o, min(size, chunk - o)) for o in range(0, chunk, size)]


def fp8_allreduce_hook(state: AutoScaleState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``ddp_model.register_comm_hook(AutoScaleState(), fp8_allreduce_hook)``.

    Averages the bucket's flat gradient buffer (``bucket.buffer()``: 1-D, the gradients' dtype) with
    ``fp8_all_reduce(buffer, state.process_group, state, key)`` (its default ``algorithm="auto"``: gather for 2
    ranks, scatter otherwise; a hook of your own can pass another) and returns it in an already completed
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


def _check_args(tensor: object, state: object, key: object, pipeline_chunks: object = None,
                algorithm: object = "auto") -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _INPUT_DTYPES:
        what = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"fp8_all_reduce: tensor must be float32, bfloat16, float16 or float64, got {what}")
    if state is not None and not isinstance(state, AutoScaleState):
        raise ValueError(
            f"fp8_all_reduce: state must be an AutoScaleState or None, got {type(state).__name__}"
        )
    if isinstance(key, bool) or not isinstance(key, str | int):
        raise ValueError(f"fp8_all_reduce: key must be a str or int, got {key!r}")
    if pipeline_chunks is not None and (
        isinstance(pipeline_chunks, bool) or not isinstance(pipeline_chunks, int) or pipeline_chunks < 1
    ):
        raise ValueError(f"fp8_all_reduce: pipeline_chunks must be None or an int >= 1, got {pipeline_chunks!r}")
    if not isinstance(algorithm, str) or algorithm not in ALGORITHMS:
        raise ValueError(f"fp8_all_reduce: algorithm must be 'auto', 'scatter' or 'gather', got {algorithm!r}")
    if state is not None and state.scaling == "delayed" and pipeline_chunks not in (None, 1):
        raise ValueError(f"fp8_all_reduce: pipeline_chunks={pipeline_chunks} needs the state's scaling='current' "
                         "(delayed scaling measures the whole tensor in the pass that quantizes it: one piece)")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "fp8_all_reduce: torch.distributed is not initialized (call dist.init_process_group)"
        )
