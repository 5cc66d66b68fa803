"""The elementwise passes of the FP8 gradient all-reduce as ``torch.library`` ops, with their PyTorch references.

:func:`fp8kit.comm.fp8_all_reduce` (and :class:`fp8kit.comm.Fp8ReduceScatter`) move the gradient through a few
passes around their collectives. Each is one op ``torch.ops.fp8kit.comm_*``: CUDA runs one Triton kernel of
:mod:`fp8kit.comm.allreduce_triton` (bf16 / fp16 / fp32 tensors), every other device (and float64, and empty
inputs) the PyTorch reference below, which is the math itself. The GPU test
(tests/test_fp8_allreduce_gpu.py) asserts the kernels give the references' bits. FP8 buffers are ``uint8``
(the bytes the collectives send: gloo and NCCL have no float8 dtypes); ``fp8`` names their format
(``torch.float8_e5m2`` or ``torch.float8_e4m3fn``). Elementwise arithmetic is float32, as in
:func:`fp8kit.fp8.scaling.quantize` (multiply by the scale, clamp to ``+-FP8_MAX``, round to nearest even); the
auto-scale bookkeeping is float64 on device scalars (``values`` = the key's ``[mu, steps_below, halvings,
growths, initialized, last_saturation]`` of :mod:`fp8kit.comm.autoscale`, ``params`` = ``[delta, backoff,
growth_factor, mu_max, growth_interval]`` of the ``AutoScaleState``):

- :func:`scale_vec` ``(g [n], values f64[6], params f64[5])`` -> ``vec f64[4]``: the statistics of
  ``y = f32(g) * f32(mu)`` (:func:`stats_ref`: ``amax = max |y|`` over the finite ``y``, ``n_sat = #(|y| > FP8_MAX)``,
  ``n_bad = #(y not finite)``; an inf counts in both) turned into the vector of the scalar all-reduce
  ``[cand, -n_sat/n, -amax (0 if n_bad), -(n_bad > 0)]`` (``cand = mu * backoff`` if ``n_sat/n > delta`` else ``mu``;
  inf for an uninitialised key). One read of ``g``, no float32 copy, no host sync.
- :func:`scale_update` ``(vec f64[4] all-reduced MIN, values, params)`` -> ``(scale f32[1], out_scale f32[1],
  new_values f64[6])``: the unified ``mu_g`` (``cand_g``, or ``mu0 = FP8_MAX / global amax`` for an
  uninitialised key), ``out_scale`` = ``mu_g`` or NaN if any rank held an inf / NaN, and the key's values after the
  auto-scaling rule (halve, initialise, count quiet steps, grow), all in float64 as the reference.
- :func:`scale_update_delayed` ``(vecs f64[N, 4], values, params)`` -> ``(out_scale f32[1], new_values f64[6])``:
  delayed scaling's bookkeeping after the transfer: ``vec`` = the element-wise MIN of the N ranks' rows (what the
  scalar all-reduce computes; ``vecs`` may be a strided view into the all-gather's buffer), the same next values
  as :func:`scale_update`, and ``out_scale`` = ``f32(mu)`` (the scale this call quantized with: the key's
  ``mu`` before the call) or NaN if any rank held an inf / NaN.
- :func:`quantize_stats_into` ``(g [k], values, params, out uint8[L], vec f64[4])``: delayed scaling's one pass:
  ``out`` as :func:`quantize_into` with ``scale = f32(values[MU])``, and ``vec`` = :func:`scale_vec` of the same
  ``g`` (the statistics of the same products), from one read of ``g``.
- :func:`quantize_into` ``(g [k], scale f32[1], out uint8[L])``: ``out[:k] = FP8(saturate(f32(g) * scale))``,
  ``out[k:] = 0`` (the padding). NaN stays NaN.
- :func:`sum_requant_into` ``(recv uint8[N * c], out uint8[c], N)``: ``t = q_0 + q_1 + ... + q_{N-1}`` in float32,
  summed in rank order (``recv`` viewed as ``[N, c]``), then ``out = FP8(saturate(t * f32(1/N)))``.
- :func:`sum_dequant_into` ``(recv uint8[N * c], scale f32[1], out [c], N, mul)``: the same sum, then
  ``out = (t * f32(mul)) / scale`` cast to ``out``'s dtype (the reduce-scatter's output, no second FP8 rounding).
- :func:`dequantize_into` ``(data uint8[>= L], scale f32[1], out [L])``: ``out = f32(data[:L]) / scale`` cast to
  ``out``'s dtype (IEEE division, round to nearest even).
- :func:`gather_mean_into` ``(rows uint8[N * L], scale f32[1], out [n], N)``, ``n <= L``: the "gather" algorithm's
  one pass after its all-gather: ``t = q_0 + ... + q_{N-1}`` in float32 in rank order over the first ``n`` bytes
  of each row ``q_i = rows[i L : i L + n]``, then ``out = (t * f32(1/N)) / scale`` cast to ``out``'s dtype (the
  dequantized mean, one FP8 rounding in all; NaN everywhere for a NaN ``scale``).

The mutating ops (``*_into``) write into ``out``, which may be a contiguous slice of a larger buffer (the
all-gather's send slot, a pipeline piece of the gradient); ``register_fake`` gives ``torch.compile`` their
shapes, so a compiled graph calls them as opaque ops (Inductor neither fuses nor reorders them).

NaN bits: the kernels and the references agree on every finite and infinite value; where a result is NaN both
give a NaN, but the hardware conversion's NaN encoding (sign, payload) may differ from torch's.
"""

from __future__ import annotations

import math

import torch

from fp8kit.base.triton_lib import triton_module
from fp8kit.comm.autoscale import GROWTHS, HALVINGS, INITIALIZED, LAST_SATURATION, MU, STEPS_BELOW
from fp8kit.fp8.scaling import DTYPE_MAX, clamp_amax, dequantize, quantize, scale_from_amax

#: FP8 formats of the wire buffers.
FP8_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)
#: Gradient dtypes the Triton kernels read and write (float64 runs the reference).
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FLOATS = (*KERNEL_DTYPES, torch.float64)
#: Lengths of the float64 vectors: the key's values (autoscale.MU ... LAST_SATURATION), the options, the all-reduced vector.
N_VALUES, N_PARAMS, N_VEC = 6, 5, 4
#: Layout of ``params``.
DELTA, BACKOFF, GROWTH_FACTOR, MU_MAX, GROWTH_INTERVAL = range(N_PARAMS)


# --------------------------------------------------------------------------- checks

def _check_1d(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...], where: str) -> None:
    if t.dim() != 1 or t.dtype not in dtypes or not t.is_contiguous():
        want = " / ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{where}: {name} must be a contiguous 1-D {want} tensor, got {t.dtype} "
                         f"{tuple(t.shape)} strides {t.stride()}")


def _check_scale(scale: torch.Tensor, device: torch.device, name: str, where: str) -> None:
    if scale.shape != (1,) or scale.dtype != torch.float32 or scale.device != device:
        raise ValueError(f"{where}: {name} must be a float32 tensor of shape (1,) on {device}, got {scale.dtype} "
                         f"{tuple(scale.shape)} on {scale.device}")


def _check_fp8(fp8: torch.dtype, where: str) -> float:
    if fp8 not in FP8_DTYPES:
        raise ValueError(f"{where}: fp8 must be torch.float8_e5m2 or torch.float8_e4m3fn, got {fp8}")
    return DTYPE_MAX[fp8]


def _check_same_device(a: torch.Tensor, b: torch.Tensor, names: str, where: str) -> None:
    if a.device != b.device:
        raise ValueError(f"{where}: {names} must be on one device, got {a.device} and {b.device}")


def _check_f64(t: torch.Tensor, n: int, device: torch.device, name: str, where: str) -> None:
    if t.shape != (n,) or t.dtype != torch.float64 or t.device != device or not t.is_contiguous():
        raise ValueError(f"{where}: {name} must be a contiguous float64 tensor of shape ({n},) on {device}, got "
                         f"{t.dtype} {tuple(t.shape)} on {t.device}")


def _check_scale_vec(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, fp8: torch.dtype) -> None:
    where = "fp8kit::comm_ar_scale_vec"
    _check_1d(g, "g", _FLOATS, where)
    if g.numel() == 0:
        raise ValueError(f"{where}: g is empty")
    _check_f64(values, N_VALUES, g.device, "values", where)
    _check_f64(params, N_PARAMS, g.device, "params", where)
    _check_fp8(fp8, where)


def _check_scale_update(vec: torch.Tensor, values: torch.Tensor, params: torch.Tensor, fp8: torch.dtype) -> None:
    where = "fp8kit::comm_ar_scale_update"
    _check_f64(vec, N_VEC, vec.device, "vec", where)
    _check_f64(values, N_VALUES, vec.device, "values", where)
    _check_f64(params, N_PARAMS, vec.device, "params", where)
    _check_fp8(fp8, where)


def _check_scale_update_delayed(vecs: torch.Tensor, values: torch.Tensor, params: torch.Tensor,
                                fp8: torch.dtype) -> None:
    where = "fp8kit::comm_ar_scale_update_delayed"
    if vecs.dim() != 2 or vecs.shape[0] < 1 or vecs.shape[1] != N_VEC or vecs.dtype != torch.float64 \
            or vecs.stride(1) != 1:
        raise ValueError(f"{where}: vecs must be a float64 [N >= 1, {N_VEC}] tensor with unit column stride, got "
                         f"{vecs.dtype} {tuple(vecs.shape)} strides {vecs.stride()}")
    _check_f64(values, N_VALUES, vecs.device, "values", where)
    _check_f64(params, N_PARAMS, vecs.device, "params", where)
    _check_fp8(fp8, where)


def _check_quantize_stats(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, out: torch.Tensor,
                          vec: torch.Tensor, fp8: torch.dtype) -> None:
    where = "fp8kit::comm_ar_quantize_stats"
    _check_1d(g, "g", _FLOATS, where)
    if g.numel() == 0:
        raise ValueError(f"{where}: g is empty")
    _check_1d(out, "out", (torch.uint8,), where)
    _check_same_device(g, out, "g and out", where)
    _check_f64(values, N_VALUES, g.device, "values", where)
    _check_f64(params, N_PARAMS, g.device, "params", where)
    _check_f64(vec, N_VEC, g.device, "vec", where)
    _check_fp8(fp8, where)
    if g.numel() > out.numel():
        raise ValueError(f"{where}: g has {g.numel()} elements, more than out's {out.numel()}")


def _check_quantize(g: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8: torch.dtype) -> None:
    where = "fp8kit::comm_ar_quantize"
    _check_1d(g, "g", _FLOATS, where)
    _check_1d(out, "out", (torch.uint8,), where)
    _check_same_device(g, out, "g and out", where)
    _check_scale(scale, g.device, "scale", where)
    _check_fp8(fp8, where)
    if g.numel() > out.numel():
        raise ValueError(f"{where}: g has {g.numel()} elements, more than out's {out.numel()}")


def _check_sum(recv: torch.Tensor, out: torch.Tensor, world: int, out_dtypes: tuple[torch.dtype, ...],
               fp8: torch.dtype, where: str) -> int:
    """The chunk length ``c`` of ``recv [world * c]``, after checking the arguments."""
    _check_1d(recv, "recv", (torch.uint8,), where)
    _check_1d(out, "out", out_dtypes, where)
    _check_same_device(recv, out, "recv and out", where)
    _check_fp8(fp8, where)
    if world < 1 or recv.numel() != world * out.numel():
        raise ValueError(f"{where}: recv must hold world * out.numel() = {world} * {out.numel()} bytes, "
                         f"got {recv.numel()}")
    return out.numel()


def _check_gather_mean(rows: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, world: int,
                       fp8: torch.dtype) -> int:
    """The row length ``L`` of ``rows [world * L]``, after checking the arguments."""
    where = "fp8kit::comm_ar_gather_mean"
    _check_1d(rows, "rows", (torch.uint8,), where)
    _check_1d(out, "out", _FLOATS, where)
    _check_same_device(rows, out, "rows and out", where)
    _check_scale(scale, rows.device, "scale", where)
    _check_fp8(fp8, where)
    if world < 1 or rows.numel() % world:
        raise ValueError(f"{where}: rows must hold world * L bytes (world = {world} >= 1 rows of L bytes), "
                         f"got {rows.numel()}")
    row = rows.numel() // world
    if out.numel() > row:
        raise ValueError(f"{where}: out has {out.numel()} elements, more than a row's {row} bytes "
                         f"(rows {rows.numel()} / world {world})")
    return row


def _check_dequantize(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8: torch.dtype) -> None:
    where = "fp8kit::comm_ar_dequant"
    _check_1d(data, "data", (torch.uint8,), where)
    _check_1d(out, "out", _FLOATS, where)
    _check_same_device(data, out, "data and out", where)
    _check_scale(scale, data.device, "scale", where)
    _check_fp8(fp8, where)
    if out.numel() > data.numel():
        raise ValueError(f"{where}: out has {out.numel()} elements, more than data's {data.numel()}")


# --------------------------------------------------------------------------- references (the math)

def stats_ref(g: torch.Tensor, mu: torch.Tensor, fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(amax f32[], counts int64[2])`` of ``y = f32(g) * mu`` (``mu`` float32 ``(1,)``): ``amax = max |y|`` over
    the finite ``y`` (0 if none), ``counts = [#(|y| > FP8_MAX), #(y inf or NaN)]``."""
    a = (g.float() * mu).abs()  # |mu * g|, float32
    finite = torch.isfinite(a)
    amax = torch.where(finite, a, 0.0).amax() if a.numel() else a.new_zeros(())
    counts = torch.stack([(a > DTYPE_MAX[fp8]).sum(), (~finite).sum()])
    return amax, counts


def scale_vec_ref(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """PyTorch reference of :func:`scale_vec`: ``[cand, -frac, -amax (0 if bad), -bad]`` float64 ``(4,)``."""
    _check_scale_vec(g, values, params, fp8)
    mu, init = values[MU], values[INITIALIZED] > 0
    amax32, counts = stats_ref(g, mu.float().reshape(1), fp8)  # of y = f32(g) * f32(mu), the auto-scaled gradient
    amax = amax32.to(torch.float64)
    nonfinite = counts[1] > 0
    # saturated fraction of g'_i = mu * g_i (paper: auto-scaling). Divided by a tensor, not a Python int: CUDA
    # torch computes `t / scalar` as `t * (1 / scalar)` (two roundings); tensor / tensor is one IEEE division
    # on every device, as the kernel's div.rn.f64.
    frac = counts[0].to(torch.float64) / torch.tensor(float(g.numel()), dtype=torch.float64, device=g.device)
    cand = torch.where(init, torch.where(frac > params[DELTA], mu * params[BACKOFF], mu), math.inf)
    return torch.stack([cand, -frac, -torch.where(nonfinite, 0.0, amax), -nonfinite.to(torch.float64)])


def initial_mu(amax: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``mu0 = FP8_MAX / max(amax, eps)`` (``scale_from_amax``) as float64, float32-representable.

    Rounded down by one float32 ulp when ``mu0 * amax`` rounds above FP8_MAX in float32 (one step is
    enough: then ``mu0 <= FP8_MAX / amax`` exactly), so the first call saturates nothing.
    """
    mu0 = scale_from_amax(amax, fp8)
    mu0 = torch.where(mu0 * clamp_amax(amax) > DTYPE_MAX[fp8], torch.nextafter(mu0, torch.zeros_like(mu0)), mu0)
    return mu0.to(torch.float64)


def scale_update_ref(vec: torch.Tensor, values: torch.Tensor, params: torch.Tensor,
                     fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`scale_update`: ``(scale f32[1], out_scale f32[1], new_values f64[6])``."""
    _check_scale_update(vec, values, params, fp8)
    mu_g, bad, new = _update_math(vec, values, params, fp8)
    return mu_g.float().reshape(1), torch.where(bad, math.nan, mu_g).float().reshape(1), new


def scale_update_delayed_ref(vecs: torch.Tensor, values: torch.Tensor, params: torch.Tensor,
                             fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`scale_update_delayed`: ``(out_scale f32[1], new_values f64[6])``."""
    _check_scale_update_delayed(vecs, values, params, fp8)
    _, bad, new = _update_math(vecs.amin(0), values, params, fp8)
    return torch.where(bad, math.nan, values[MU]).float().reshape(1), new


def _update_math(vec: torch.Tensor, values: torch.Tensor, params: torch.Tensor,
                 fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mu_g f64[], bad bool[], new_values f64[6])`` from the all-reduced ``vec`` (float64 throughout)."""
    cand_g, frac_max, gamax, bad = vec[0], -vec[1], -vec[2], vec[3] < 0
    mu, init = values[MU], values[INITIALIZED] > 0
    mu0 = initial_mu(gamax, fp8)
    mu_g = torch.where(init, cand_g, mu0)  # the unified scale of this call (paper: scale unification)
    halve = init & (cand_g < mu) & ~bad
    initializing = ~init & ~bad & (gamax > 0)
    quiet = ~bad & ~halve & (init | initializing)
    steps = torch.where(halve, 0.0, torch.where(quiet, values[STEPS_BELOW] + 1, values[STEPS_BELOW]))
    grow = quiet & init & (steps > params[GROWTH_INTERVAL])
    mu_next = torch.where(halve, cand_g, torch.where(initializing, mu0, mu))
    mu_next = torch.where(grow, torch.minimum(mu_next * params[GROWTH_FACTOR], params[MU_MAX]), mu_next)
    new = torch.stack(
        [
            mu_next,
            steps,
            values[HALVINGS] + halve.to(torch.float64),
            values[GROWTHS] + grow.to(torch.float64),
            (init | initializing).to(torch.float64),
            torch.where(init & ~bad, frac_max, values[LAST_SATURATION]),
        ]
    )
    return mu_g, bad, new


def quantize_stats_ref(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, out: torch.Tensor,
                       vec: torch.Tensor, fp8: torch.dtype) -> None:
    """PyTorch reference of :func:`quantize_stats_into`: ``quantize_ref(g, f32(mu), out)`` and ``vec = scale_vec_ref(g)``."""
    _check_quantize_stats(g, values, params, out, vec, fp8)
    quantize_ref(g, values[MU].float().reshape(1), out, fp8)
    vec.copy_(scale_vec_ref(g, values, params, fp8))


def quantize_ref(g: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8: torch.dtype) -> None:
    """PyTorch reference of :func:`quantize_into`: ``out[:k] = FP8(saturate(g * scale))``, ``out[k:] = 0``."""
    _check_quantize(g, scale, out, fp8)
    k = g.numel()
    out[:k].copy_(quantize(g, scale, fp8).view(torch.uint8))
    out[k:].zero_()


def _rank_sum(recv: torch.Tensor, world: int, c: int, fp8: torch.dtype, length: int | None = None) -> torch.Tensor:
    """``q_0 + ... + q_{world-1}`` in float32, in rank order, of ``recv`` viewed as ``[world, c]`` FP8 (of the first
    ``length`` columns, default all ``c``)."""
    rows = recv.view(fp8).view(world, c)[:, :length]
    total = rows[0].float()
    for i in range(1, world):
        total = total + rows[i].float()
    return total


def inverse_world(world: int) -> float:
    """``1 / world`` rounded to float32 (a Python float holding a float32 value): the mean's factor."""
    return torch.tensor(1.0 / world, dtype=torch.float32).item()


def sum_requant_ref(recv: torch.Tensor, out: torch.Tensor, world: int, fp8: torch.dtype) -> None:
    """PyTorch reference of :func:`sum_requant_into`: ``out = FP8(saturate(sum_i q_i * f32(1/N)))``."""
    c = _check_sum(recv, out, world, (torch.uint8,), fp8, "fp8kit::comm_ar_sum_requant")
    out.copy_(quantize(_rank_sum(recv, world, c, fp8), inverse_world(world), fp8).view(torch.uint8))


def sum_dequant_ref(recv: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, world: int, mul: float,
                    fp8: torch.dtype) -> None:
    """PyTorch reference of :func:`sum_dequant_into`: ``out = (sum_i q_i * f32(mul)) / scale``."""
    c = _check_sum(recv, out, world, _FLOATS, fp8, "fp8kit::comm_ar_sum_dequant")
    _check_scale(scale, recv.device, "scale", "fp8kit::comm_ar_sum_dequant")
    mul32 = torch.tensor(mul, dtype=torch.float32).item()
    out.copy_(dequantize(_rank_sum(recv, world, c, fp8) * mul32, scale))


def dequantize_ref(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8: torch.dtype) -> None:
    """PyTorch reference of :func:`dequantize_into`: ``out = f32(data[:L]) / scale`` in ``out``'s dtype."""
    _check_dequantize(data, scale, out, fp8)
    out.copy_(dequantize(data[: out.numel()].view(fp8), scale))


def gather_mean_ref(rows: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, world: int, fp8: torch.dtype) -> None:
    """PyTorch reference of :func:`gather_mean_into`: ``out = (sum_i q_i[:n] * f32(1/N)) / scale`` in ``out``'s dtype.

    The float32 operations of the kernel, in its order: the rank-order sum, one multiply by the float32 ``1/N``
    (a Python float holding a float32 value: one IEEE multiply on every device), one division by the ``scale``
    tensor (tensor / tensor: an IEEE division on CPU and CUDA alike), the cast of ``copy_`` (nearest even).
    """
    row = _check_gather_mean(rows, scale, out, world, fp8)
    out.copy_(dequantize(_rank_sum(rows, world, row, fp8, out.numel()) * inverse_world(world), scale))


# --------------------------------------------------------------------------- ops

def _kernels():
    """:mod:`fp8kit.comm.allreduce_triton`, or None (``base.triton_lib.triton_module``)."""
    return triton_module("fp8kit.comm.allreduce_triton", "FP8 all-reduce")


@torch.library.custom_op("fp8kit::comm_ar_scale_vec", mutates_args=())
def _scale_vec_op(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    return scale_vec_ref(g, values, params, fp8)


@_scale_vec_op.register_kernel("cuda")
def _(g, values, params, fp8):
    _check_scale_vec(g, values, params, fp8)
    k = _kernels()
    if k is None or g.dtype not in KERNEL_DTYPES:
        return scale_vec_ref(g, values, params, fp8)
    with torch.cuda.device(g.device):
        return k.scale_vec(g, values, params, DTYPE_MAX[fp8])


@_scale_vec_op.register_fake
def _(g, values, params, fp8):
    _check_scale_vec(g, values, params, fp8)
    return values.new_empty(N_VEC)


@torch.library.custom_op("fp8kit::comm_ar_scale_update", mutates_args=())
def _scale_update_op(vec: torch.Tensor, values: torch.Tensor, params: torch.Tensor,
                     fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return scale_update_ref(vec, values, params, fp8)


@_scale_update_op.register_kernel("cuda")
def _(vec, values, params, fp8):
    _check_scale_update(vec, values, params, fp8)
    k = _kernels()
    if k is None:
        return scale_update_ref(vec, values, params, fp8)
    with torch.cuda.device(vec.device):
        return k.scale_update(vec, values, params, DTYPE_MAX[fp8])


@_scale_update_op.register_fake
def _(vec, values, params, fp8):
    _check_scale_update(vec, values, params, fp8)
    return vec.new_empty(1, dtype=torch.float32), vec.new_empty(1, dtype=torch.float32), values.new_empty(N_VALUES)


@torch.library.custom_op("fp8kit::comm_ar_scale_update_delayed", mutates_args=())
def _scale_update_delayed_op(vecs: torch.Tensor, values: torch.Tensor, params: torch.Tensor,
                             fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return scale_update_delayed_ref(vecs, values, params, fp8)


@_scale_update_delayed_op.register_kernel("cuda")
def _(vecs, values, params, fp8):
    _check_scale_update_delayed(vecs, values, params, fp8)
    k = _kernels()
    if k is None:
        return scale_update_delayed_ref(vecs, values, params, fp8)
    with torch.cuda.device(vecs.device):
        _, out_scale, new = k.scale_update(vecs, values, params, DTYPE_MAX[fp8], delayed=True)
        return out_scale, new


@_scale_update_delayed_op.register_fake
def _(vecs, values, params, fp8):
    _check_scale_update_delayed(vecs, values, params, fp8)
    return vecs.new_empty(1, dtype=torch.float32), values.new_empty(N_VALUES)


@torch.library.custom_op("fp8kit::comm_ar_quantize_stats", mutates_args=("out", "vec"))
def _quantize_stats_op(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, out: torch.Tensor,
                       vec: torch.Tensor, fp8: torch.dtype) -> None:
    quantize_stats_ref(g, values, params, out, vec, fp8)


@_quantize_stats_op.register_kernel("cuda")
def _(g, values, params, out, vec, fp8):
    _check_quantize_stats(g, values, params, out, vec, fp8)
    k = _kernels()
    if k is None or g.dtype not in KERNEL_DTYPES:
        return quantize_stats_ref(g, values, params, out, vec, fp8)
    with torch.cuda.device(g.device):
        k.quantize_stats(g, values, params, out.view(fp8), vec, DTYPE_MAX[fp8])


@_quantize_stats_op.register_fake
def _(g, values, params, out, vec, fp8) -> None:
    _check_quantize_stats(g, values, params, out, vec, fp8)


@torch.library.custom_op("fp8kit::comm_ar_quantize", mutates_args=("out",))
def _quantize_op(g: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8: torch.dtype) -> None:
    quantize_ref(g, scale, out, fp8)


@_quantize_op.register_kernel("cuda")
def _(g, scale, out, fp8):
    _check_quantize(g, scale, out, fp8)
    k = _kernels()
    if k is None or out.numel() == 0 or g.dtype not in KERNEL_DTYPES:
        return quantize_ref(g, scale, out, fp8)
    with torch.cuda.device(g.device):
        k.quantize(g, scale, out.view(fp8), DTYPE_MAX[fp8])


@_quantize_op.register_fake
def _(g, scale, out, fp8) -> None:
    _check_quantize(g, scale, out, fp8)


@torch.library.custom_op("fp8kit::comm_ar_sum_requant", mutates_args=("out",))
def _sum_requant_op(recv: torch.Tensor, out: torch.Tensor, world: int, fp8: torch.dtype) -> None:
    sum_requant_ref(recv, out, world, fp8)


@_sum_requant_op.register_kernel("cuda")
def _(recv, out, world, fp8):
    _check_sum(recv, out, world, (torch.uint8,), fp8, "fp8kit::comm_ar_sum_requant")
    k = _kernels()
    if k is None or out.numel() == 0:
        return sum_requant_ref(recv, out, world, fp8)
    with torch.cuda.device(recv.device):
        k.sum_rows(recv.view(fp8), None, out.view(fp8), world, inverse_world(world), DTYPE_MAX[fp8], requant=True)


@_sum_requant_op.register_fake
def _(recv, out, world, fp8) -> None:
    _check_sum(recv, out, world, (torch.uint8,), fp8, "fp8kit::comm_ar_sum_requant")


@torch.library.custom_op("fp8kit::comm_ar_sum_dequant", mutates_args=("out",))
def _sum_dequant_op(recv: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, world: int, mul: float,
                    fp8: torch.dtype) -> None:
    sum_dequant_ref(recv, scale, out, world, mul, fp8)


@_sum_dequant_op.register_kernel("cuda")
def _(recv, scale, out, world, mul, fp8):
    _check_sum(recv, out, world, _FLOATS, fp8, "fp8kit::comm_ar_sum_dequant")
    _check_scale(scale, recv.device, "scale", "fp8kit::comm_ar_sum_dequant")
    k = _kernels()
    if k is None or out.numel() == 0 or out.dtype not in KERNEL_DTYPES:
        return sum_dequant_ref(recv, scale, out, world, mul, fp8)
    mul32 = torch.tensor(mul, dtype=torch.float32).item()
    with torch.cuda.device(recv.device):
        k.sum_rows(recv.view(fp8), scale, out, world, mul32, DTYPE_MAX[fp8], requant=False)


@_sum_dequant_op.register_fake
def _(recv, scale, out, world, mul, fp8) -> None:
    _check_sum(recv, out, world, _FLOATS, fp8, "fp8kit::comm_ar_sum_dequant")


@torch.library.custom_op("fp8kit::comm_ar_dequant", mutates_args=("out",))
def _dequant_op(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8: torch.dtype) -> None:
    dequantize_ref(data, scale, out, fp8)


@_dequant_op.register_kernel("cuda")
def _(data, scale, out, fp8):
    _check_dequantize(data, scale, out, fp8)
    k = _kernels()
    if k is None or out.numel() == 0 or out.dtype not in KERNEL_DTYPES:
        return dequantize_ref(data, scale, out, fp8)
    with torch.cuda.device(data.device):
        k.dequantize(data.view(fp8), scale, out)


@_dequant_op.register_fake
def _(data, scale, out, fp8) -> None:
    _check_dequantize(data, scale, out, fp8)


@torch.library.custom_op("fp8kit::comm_ar_gather_mean", mutates_args=("out",))
def _gather_mean_op(rows: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, world: int, fp8: torch.dtype) -> None:
    gather_mean_ref(rows, scale, out, world, fp8)


@_gather_mean_op.register_kernel("cuda")
def _(rows, scale, out, world, fp8):
    row = _check_gather_mean(rows, scale, out, world, fp8)
    k = _kernels()
    if k is None or out.numel() == 0 or out.dtype not in KERNEL_DTYPES:
        return gather_mean_ref(rows, scale, out, world, fp8)
    with torch.cuda.device(rows.device):
        k.gather_mean(rows.view(fp8), scale, out, world, row, inverse_world(world))


@_gather_mean_op.register_fake
def _(rows, scale, out, world, fp8) -> None:
    _check_gather_mean(rows, scale, out, world, fp8)


# --------------------------------------------------------------------------- entry points

def scale_vec(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """This rank's vector for the scalar MIN all-reduce, from one read of ``g`` (no host sync).

    Args:
        g: contiguous 1-D bf16 / fp16 / fp32 / fp64 gradient ``[n]``, ``n > 0``.
        values: the key's float64 ``(6,)`` (``AutoScaleState._values``); params: float64 ``(5,)``
            ``[delta, backoff, growth_factor, mu_max, growth_interval]``; both on ``g``'s device.
        fp8: the wire format (its maximum is the saturation threshold).

    Returns:
        float64 ``(4,)``: ``[cand, -n_sat/n, -amax (0 if any inf/NaN), -(any inf/NaN)]`` (module docstring).

    Raises:
        ValueError: a tensor of the wrong shape, dtype, layout or device, an empty ``g``, or an unknown ``fp8``.
    """
    return torch.ops.fp8kit.comm_ar_scale_vec(g, values, params, fp8)


def scale_update(vec: torch.Tensor, values: torch.Tensor, params: torch.Tensor,
                 fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unified scale and the key's next values from the MIN-all-reduced ``vec`` (one tiny kernel on CUDA).

    Returns:
        ``(scale, out_scale, new_values)``: float32 ``(1,)`` ``f32(mu_g)``; float32 ``(1,)`` ``f32(mu_g)`` or NaN
        when any rank held an inf or NaN; float64 ``(6,)``.

    Raises:
        ValueError: tensors of the wrong shape, dtype or device, or an unknown ``fp8``.
    """
    return torch.ops.fp8kit.comm_ar_scale_update(vec, values, params, fp8)


def scale_update_delayed(vecs: torch.Tensor, values: torch.Tensor, params: torch.Tensor,
                         fp8: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Delayed scaling's bookkeeping after the transfer, from every rank's statistics (one tiny kernel on CUDA).

    Args:
        vecs: float64 ``[N, 4]``, row ``i`` rank ``i``'s :func:`scale_vec` (unit column stride; any row stride, e.g.
            the trailers of the all-gather's rows); values: the key's float64 ``(6,)``; params: float64 ``(5,)``.

    Returns:
        ``(out_scale, new_values)``: float32 ``(1,)`` ``f32(values[MU])`` (the scale the payload was quantized with)
        or NaN when any rank held an inf or NaN; float64 ``(6,)``, :func:`scale_update`'s next values for the
        element-wise MIN of the rows.

    Raises:
        ValueError: tensors of the wrong shape, dtype, strides or device, or an unknown ``fp8``.
    """
    return torch.ops.fp8kit.comm_ar_scale_update_delayed(vecs, values, params, fp8)


def quantize_stats_into(g: torch.Tensor, values: torch.Tensor, params: torch.Tensor, out: torch.Tensor,
                        vec: torch.Tensor, fp8: torch.dtype) -> None:
    """Delayed scaling's one pass over ``g``: quantize with the key's current ``mu`` and measure the products.

    ``out[:k] = FP8(saturate(f32(g) * f32(values[MU])))`` as bytes, ``out[k:] = 0``, and ``vec`` = :func:`scale_vec`
    ``(g, values, params)`` (amax, saturated fraction and non-finite count of the same products), one read of ``g``.

    Args:
        g: contiguous 1-D bf16 / fp16 / fp32 / fp64 ``[k]``, ``k > 0``; values, params: as :func:`scale_vec`;
        out: contiguous 1-D uint8 ``[L >= k]``; vec: contiguous float64 ``(4,)`` (written; may be a view into the
        all-gather's send row); fp8: the format.

    Raises:
        ValueError: tensors of the wrong shape, dtype, layout or device, an empty ``g``, ``k > L``, unknown ``fp8``.
    """
    torch.ops.fp8kit.comm_ar_quantize_stats(g, values, params, out, vec, fp8)


def quantize_into(g: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8: torch.dtype) -> None:
    """``out[:k] = FP8(saturate(f32(g) * scale))`` as bytes, ``out[k:] = 0`` (``k = g.numel() <= out.numel()``).

    Args:
        g: contiguous 1-D bf16 / fp16 / fp32 / fp64 ``[k]``; scale: float32 ``(1,)`` on ``g``'s device;
        out: contiguous 1-D uint8 ``[L]`` (the all-to-all's send buffer or a piece of it); fp8: the format.

    Raises:
        ValueError: as :func:`scale_vec`, or ``k > L``.
    """
    torch.ops.fp8kit.comm_ar_quantize(g, scale, out, fp8)


def sum_requant_into(recv: torch.Tensor, out: torch.Tensor, world: int, fp8: torch.dtype) -> None:
    """The reduce-scatter's local step: ``out = FP8(saturate((q_0 + ... + q_{N-1}) * f32(1/N)))``.

    Args:
        recv: contiguous uint8 ``[N * c]``, FP8 chunk ``i`` from rank ``i`` (the all-to-all's receive buffer);
        out: contiguous uint8 ``[c]`` (the all-gather's send slot); world: ``N``; fp8: the format.

    Raises:
        ValueError: wrong shapes (``recv.numel() != N * out.numel()``), dtypes or devices.
    """
    torch.ops.fp8kit.comm_ar_sum_requant(recv, out, world, fp8)


def sum_dequant_into(recv: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, world: int, mul: float,
                     fp8: torch.dtype) -> None:
    """``out = ((q_0 + ... + q_{N-1}) * f32(mul)) / scale`` in ``out``'s dtype: an FP8 reduce-scatter's output.

    Args:
        recv: contiguous uint8 ``[N * c]``; scale: float32 ``(1,)`` (the unified ``mu``; NaN gives NaN);
        out: contiguous 1-D float ``[c]``; world: ``N``; mul: ``1/N`` for a mean, 1 for a sum, or a
        pre-multiplier (rounded to float32); fp8: the format.

    Raises:
        ValueError: as :func:`sum_requant_into`.
    """
    torch.ops.fp8kit.comm_ar_sum_dequant(recv, scale, out, world, mul, fp8)


def dequantize_into(data: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fp8: torch.dtype) -> None:
    """``out = f32(data[:L]) / scale`` cast to ``out``'s dtype (``L = out.numel()``).

    Args:
        data: contiguous uint8 ``[>= L]`` FP8 bytes; scale: float32 ``(1,)``; out: contiguous 1-D float ``[L]``.

    Raises:
        ValueError: wrong shapes, dtypes or devices.
    """
    torch.ops.fp8kit.comm_ar_dequant(data, scale, out, fp8)


def gather_mean_into(rows: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, world: int, fp8: torch.dtype) -> None:
    """The "gather" all-reduce's last pass: ``out = ((q_0 + ... + q_{N-1}) * f32(1/N)) / scale`` in ``out``'s dtype.

    ``q_i`` is the first ``n = out.numel()`` FP8 values of row ``i`` of ``rows`` viewed as ``[N, L]`` (rank ``i``'s
    quantized gradient, zero-padded to ``L``); the sum is float32 in rank order 0..N-1, so every rank computes the
    same bits; a NaN ``scale`` (some rank held an inf / NaN) gives NaN everywhere.

    Args:
        rows: contiguous uint8 ``[N * L]`` (the all-gather's output, or a pipeline piece of it); scale: float32
            ``(1,)`` (``mu_g``, or NaN); out: contiguous 1-D float ``[n]``, ``n <= L`` (the gradient, written in
            place); world: ``N``; fp8: the format.

    Raises:
        ValueError: wrong shapes (``rows.numel()`` not a multiple of ``N``, ``n > L``), dtypes or devices.
    """
    torch.ops.fp8kit.comm_ar_gather_mean(rows, scale, out, world, fp8)
