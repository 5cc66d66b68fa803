"""Triton kernels of the blockwise FP8 recipe (CUDA): the fused activation cast and the 128x128 weight cast.

Both reproduce :mod:`fp8kit.fp8.blockwise` bit for bit (same amax; the scale of
:func:`fp8kit.fp8.scaling.scale_from_amax` with the same float32 roundings, IEEE ``div_rn`` for its
reciprocal; the same round-to-nearest-even saturating E4M3 conversion; the same ``1 / scale``); the GPU
test checks it. Layouts are documented there.

- :func:`quantize_act`: one program per 128x128 tile of ``x[M, K]`` reads the tile from HBM once and
  writes both FP8 copies: the 1x128 copy ``q[Mp, K]`` (row amax) and the 128x1 copy transposed,
  ``qt[K, Mp]`` (column amax), with their decoding scales. Rows past ``M`` read as zero. The tile is
  walked in slices of ``CHUNK`` rows (few live registers, high occupancy), keeping the running max of
  ``|x|`` element-wise so the column amax takes one reduction across warps per tile (``_quant_rows``); the
  column copy re-reads the slices while they are still in L2 (with one slice, ``CHUNK = 128``, the tile still in
  registers: no second read). With ``t2d`` (``wgrad_x = "128x128"``) the
  transposed copy takes one scale per tile (the max of the column amaxes) in the weight layout of ``x^T``.
  The tuner also tries a rows-first walk (``_rows_first_tile``): pass 1 reads the whole tile as bf16 for the row
  amax (and the tile amax) and keeps nothing, pass 2 re-reads it (L2) in slices of whole columns and writes both
  copies. At 8-16 warps it holds 40-80 registers per thread; the tuner picks it for the 128x128 copy (18-22% faster).
- The 128x1 activation cast of a bf16 input runs the Gluon kernel of :mod:`fp8kit.fp8.kernels.blockwise_gluon`
  where Triton has Gluon (:func:`gluon_applies`): 16-21% faster, the same bits; ``quantize_act(kernel=...)`` picks.
- :func:`quantize_weight`: one program per 128x128 block of ``w[N, K]`` writes ``wq[N, K]`` and
  ``wtq[K, N]`` with the block's scale in both padded scale layouts (padding included).

Both are autotuned over ``CHUNK`` and ``num_warps`` (key: the feature dimensions and the program order
``K_FIRST``), the activation cast also over a register cap and its walk (``_ACT_CONFIGS``); every configuration and
both orders compute the same bits (``tests/test_blockwise_gpu.py`` launches each config alone).

Bytes moved per element of the input: 2 read (bf16) + 2 written (two E4M3 copies) + 8/128 of scales.
Imported only on CUDA (triton is absent from CPU installs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp8kit.base.triton_lib import two_rows_if_one
from fp8kit.fp8.blockwise import BLOCK, FP8, padded_rows, round_up4
from fp8kit.fp8.scaling import AMAX_EPS, DTYPE_MAX, F32_MAX

try:  # Gluon (triton.experimental.gluon) ships with Triton >= 3.4; without it every cast runs the Triton kernels
    from fp8kit.fp8.kernels import blockwise_gluon
except ImportError:
    blockwise_gluon = None
#: whether the Gluon 128x1 activation cast is available (:func:`gluon_applies`)
GLUON = blockwise_gluon is not None

_FP8_MAX = DTYPE_MAX[FP8]


@triton.jit
def _scale_of(amax, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr):
    # fp8kit.fp8.scaling.scale_from_amax is `dtype_max / clamp(amax, eps, f32_max)` with a Python scalar
    # numerator, which PyTorch evaluates as `reciprocal(a) * dtype_max` (Tensor.__rdiv__): two float32
    # roundings. The same two here (IEEE 1/a, then the product); Triton's plain `/` would be div.full.f32.
    a = tl.minimum(tl.maximum(amax, EPS), AMAX_MAX)
    return tl.div_rn(tl.full(a.shape, 1.0, tl.float32), a) * FP8_MAX


# Tile helpers shared with the fused casts of fp8kit.fp8.kernels.swiglu_triton and fp8kit.moe.token_quant_triton.

@triton.jit
def _quant_rows(x, rows, cols, q_ptr, s_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX, abs_max,
                CHUNK: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # 1x128 along K: one scale per row -> q[Mp, K], s_t[K/128, Mp]. Returns abs_max (from _max_init) updated with
    # this slice's |x|: kept element-wise ([CHUNK, 128]) so that the reduction across warps happens once per tile
    # (_col_amax), not once per slice; with one slice (CHUNK = 128) reduced at once (a second 128x128 float32
    # tile held in registers cost more than the one reduction). max is exact, so either way gives the same bits.
    ax = tl.abs(x)
    scale_r = _scale_of(tl.max(ax, axis=1), EPS, AMAX_MAX, FP8_MAX)
    q = tl.clamp(x * scale_r[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * K + cols[None, :], q)
    tl.store(s_t_ptr + pid_k * MP + rows, tl.div_rn(tl.full((CHUNK,), 1.0, tl.float32), scale_r))
    if CHUNK == BLOCK_SIZE:
        return tl.max(ax, axis=0)
    else:
        return tl.maximum(abs_max, ax)


@triton.jit
def _max_init(CHUNK: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # the zero _quant_rows's running max starts from ([128] with one slice, [CHUNK, 128] otherwise)
    if CHUNK == BLOCK_SIZE:
        return tl.zeros((BLOCK_SIZE,), tl.float32)
    else:
        return tl.zeros((CHUNK, BLOCK_SIZE), tl.float32)


@triton.jit
def _col_amax(abs_max, CHUNK: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # The tile's column amax [128] from _quant_rows's running max.
    if CHUNK == BLOCK_SIZE:
        return abs_max
    else:
        return tl.max(abs_max, axis=0)


@triton.jit
def _quant_cols(x, rows, cols, scale_c, qt_ptr, MP, FP8_MAX):
    # 128x1 along M -> qt[K, Mp] (the tile transposed).
    qc = tl.clamp(x * scale_c[None, :], -FP8_MAX, FP8_MAX).to(qt_ptr.dtype.element_ty)
    tl.store(qt_ptr + cols[:, None] * MP + rows[None, :], tl.trans(qc))


@triton.jit
def _quant_cols_or_tile(x, rows, cols, scale_c, qt_ptr, MP, FP8_MAX, T_2D: tl.constexpr):
    # the x^T copy -> qt[K, Mp]: 128x1 column scales ([128] scale_c), or one scale per tile (scalar scale_c, T_2D)
    if T_2D:
        qc = tl.clamp(x * scale_c, -FP8_MAX, FP8_MAX).to(qt_ptr.dtype.element_ty)
        tl.store(qt_ptr + cols[:, None] * MP + rows[None, :], tl.trans(qc))
    else:
        _quant_cols(x, rows, cols, scale_c, qt_ptr, MP, FP8_MAX)


@triton.jit
def _t_scale(col_amax, st_ptr, pid_m, pid_k, cols, MP, K, ST_LD, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE: tl.constexpr,
             T_2D: tl.constexpr):
    # the x^T copy's scale(s), stored: one per tile (T_2D, a scalar) or one per column of the tile ([128])
    if T_2D:
        return _tile_scale(col_amax, st_ptr, pid_m, pid_k, MP, ST_LD, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    else:
        return _col_scale(col_amax, st_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)


@triton.jit
def _col_scale(col_amax, st_ptr, pid_m, cols, K, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE: tl.constexpr):
    scale_c = _scale_of(col_amax, EPS, AMAX_MAX, FP8_MAX)
    tl.store(st_ptr + pid_m * K + cols, tl.div_rn(tl.full((BLOCK_SIZE,), 1.0, tl.float32), scale_c))
    return scale_c


@triton.jit
def _tile_scale(col_amax, st_ptr, pid_m, pid_k, MP, ST_LD, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE: tl.constexpr):
    # One scale per 128x128 tile (the weight kernel's formula) -> st[K/128, ST_LD] at [pid_k, pid_m]; the scale
    # columns past Mp/128 (cuBLAS's 16-byte alignment) hold 1.0. Returns the (scalar) scale.
    scale_c = _scale_of(tl.max(col_amax, axis=0), EPS, AMAX_MAX, FP8_MAX)
    tl.store(st_ptr + pid_k * ST_LD + pid_m, tl.div_rn(1.0 + tl.zeros((), tl.float32), scale_c))
    if pid_m == 0:
        pad = tl.arange(0, 4)
        tl.store(st_ptr + pid_k * ST_LD + MP // BLOCK_SIZE + pad, tl.full((4,), 1.0, tl.float32),
                 mask=MP // BLOCK_SIZE + pad < ST_LD)
    return scale_c


@triton.jit
def _tile_ids(K_FIRST: tl.constexpr):
    # (row tile, column tile) of this program: the grid is (K / 128, rows / 128) with K_FIRST, else the transpose
    if K_FIRST:
        return tl.program_id(1), tl.program_id(0)
    else:
        return tl.program_id(0), tl.program_id(1)


#: Program order of the activation and weight casts: tiles along K first (grid ``(K / 128, rows / 128)``: consecutive
#: programs read consecutive tiles of the same rows) or rows first (``(rows / 128, K / 128)``). Measured on the H100
#: at Llama-3-8B shapes (``benchmarks/experiments/grid_order/bench_blockwise.py``; docs/benchmarks.md section 6,
#: session 26): K first is 3-7% faster for the fprop-only activation cast and 3.5-4% for the weight cast, and level
#: (0.997-1.018x) for the activation cast that also writes the transposed copy. The same bits either way.
_ACT_K_FIRST = True
_WEIGHT_K_FIRST = True
#: CUDA's limit on a grid's second dimension: more row tiles than this launch rows first whatever the flags say
_MAX_GRID_Y = 65535


def _grid(row_tiles: int, k_tiles: int, k_first: bool) -> tuple[tuple[int, int], bool]:
    """The launch grid and the order actually used (rows first when row tiles exceed ``_MAX_GRID_Y``)."""
    k_first = k_first and row_tiles <= _MAX_GRID_Y
    return ((k_tiles, row_tiles) if k_first else (row_tiles, k_tiles)), k_first


@triton.jit
def _rows_first_tile(x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, pid_m, pid_k, M, MP, K, stride_xm, ST_LD,
                     BLOCK_SIZE: tl.constexpr, EPS, AMAX_MAX, FP8_MAX, CS: tl.constexpr, WRITE_T: tl.constexpr,
                     T_2D: tl.constexpr):
    # The activation cast's rows-first walk of one 128x128 tile. Pass 1 reads the whole tile as bf16 (max |x| is exact
    # in bf16, so the amax is the float32 one) for the row amax, and with T_2D the tile amax (the max of the row
    # amaxes), and keeps nothing else. Pass 2 re-reads it in slices of CS whole columns (L2-resident) and writes both
    # copies with the scales already known; a 128x1 x^T copy takes its column amax from the slice (whole columns).
    offs_m = pid_m * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    rows = offs_m.to(tl.int64)
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                eviction_policy="evict_last")
    row_amax = tl.max(tl.abs(x), axis=1).to(tl.float32)
    scale_r = _scale_of(row_amax, EPS, AMAX_MAX, FP8_MAX)
    tl.store(s_t_ptr + pid_k * MP + rows, tl.div_rn(tl.full((BLOCK_SIZE,), 1.0, tl.float32), scale_r))
    scale_t = 0.0
    if WRITE_T and T_2D:
        scale_t = _tile_scale(row_amax, st_ptr, pid_m, pid_k, MP, ST_LD, EPS, AMAX_MAX, FP8_MAX, BLOCK_SIZE)
    for c in tl.static_range(0, BLOCK_SIZE, CS):
        ccols = (pid_k * BLOCK_SIZE + c + tl.arange(0, CS)).to(tl.int64)
        xs = tl.load(x_ptr + rows[:, None] * stride_xm + ccols[None, :], mask=offs_m[:, None] < M, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        q = tl.clamp(xs * scale_r[:, None], -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * K + ccols[None, :], q)
        if WRITE_T:
            if T_2D:
                _quant_cols_or_tile(xs, rows, ccols, scale_t, qt_ptr, MP, FP8_MAX, True)
            else:
                scale_c = _col_scale(tl.max(tl.abs(xs), axis=0), st_ptr, pid_m, ccols, K, EPS, AMAX_MAX, FP8_MAX, CS)
                _quant_cols(xs, rows, ccols, scale_c, qt_ptr, MP, FP8_MAX)


@triton.jit
def _one_read_tile(x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, pid_m, pid_k, M, MP, K, stride_xm, ST_LD,
                   BLOCK_SIZE: tl.constexpr, EPS, AMAX_MAX, FP8_MAX, CHUNK: tl.constexpr, WRITE_T: tl.constexpr,
                   T_2D: tl.constexpr):
    # The activation cast's walk of one 128x128 tile in CHUNK-row slices: pass 1 reads each slice from HBM (1x128 row
    # scales and the row copy, and the running column amax); pass 2 re-reads the slices (L2-resident) for the x^T
    # copy, or, with one slice (CHUNK = 128), casts it from the tile still in registers. Without WRITE_T (the fprop
    # copy alone) there is no pass 2 and qt_ptr / st_ptr are not touched.
    cols = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    abs_max = _max_init(CHUNK, BLOCK_SIZE)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
        rows = offs_m.to(tl.int64)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M, other=0.0,
                    eviction_policy="evict_last").to(tl.float32)
        # (without WRITE_T the running max is unused and compiled away)
        abs_max = _quant_rows(x, rows, cols, q_ptr, s_t_ptr, pid_k, MP, K, EPS, AMAX_MAX, FP8_MAX, abs_max, CHUNK,
                              BLOCK_SIZE)
    if WRITE_T:
        scale_c = _t_scale(_col_amax(abs_max, CHUNK, BLOCK_SIZE), st_ptr, pid_m, pid_k, cols, MP, K, ST_LD, EPS,
                           AMAX_MAX, FP8_MAX, BLOCK_SIZE, T_2D)
        if CHUNK == BLOCK_SIZE:
            # one slice: the whole tile is still in registers, so the 128x1 copy is cast from it (no second read;
            # 5-7% faster on the H200, benchmarks/experiments/act_cast_one_read, docs/benchmarks.md session 44)
            _quant_cols_or_tile(x, rows, cols, scale_c, qt_ptr, MP, FP8_MAX, T_2D)
        else:
            for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
                offs_m = pid_m * BLOCK_SIZE + c + tl.arange(0, CHUNK)
                rows = offs_m.to(tl.int64)
                x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=offs_m[:, None] < M,
                            other=0.0, eviction_policy="evict_first").to(tl.float32)
                _quant_cols_or_tile(x, rows, cols, scale_c, qt_ptr, MP, FP8_MAX, T_2D)


_CONFIGS = [triton.Config({"CHUNK": c}, num_warps=w) for c in (16, 32, 64, 128) for w in (4, 8)]
#: the activation cast also tries one slice at 4 warps capped at 168 registers per thread (ptx ``.maxnreg``): uncapped
#: it takes 223 and fits 2 programs per SM (12.5% occupancy, 41% of DRAM bandwidth, Nsight Compute); capped, 3 fit,
#: and the 128x1 cast is 9-10% faster on the H200 (the 128x128 one 30-33% slower: the tuner keeps the uncapped
#: config there). docs/benchmarks.md session 45, benchmarks/experiments/act_cast_one_read
#: and the rows-first walk (``_rows_first_tile``; ``CHUNK`` is then the width of its column slices) at 8 and 16
#: warps: for the 128x128 x^T copy it holds 40-80 registers per thread and runs at 88-93% of the H200's copy rate,
#: 18-22% faster than the one-read walk (docs/benchmarks.md session 47, benchmarks/experiments/act_cast_low_regs);
#: for the 128x1 copy it is slower (each slice reduces its columns across warps), the tuner keeps the one-read walk
#: there, and a bf16 input takes the Gluon cast anyway (gluon_applies).
_ACT_CONFIGS = [
    *(triton.Config({"CHUNK": c.kwargs["CHUNK"], "ROWS_FIRST": False}, num_warps=c.num_warps) for c in _CONFIGS),
    triton.Config({"CHUNK": 128, "ROWS_FIRST": False}, num_warps=4, maxnreg=168),
    *(triton.Config({"CHUNK": c, "ROWS_FIRST": True}, num_warps=w) for c, w in ((128, 16), (128, 8), (64, 8))),
]


@triton.autotune(configs=_ACT_CONFIGS, key=["K", "WRITE_T", "T_2D", "K_FIRST"])
@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr,
    M, MP, K, stride_xm, ST_LD,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    CHUNK: tl.constexpr, WRITE_T: tl.constexpr, T_2D: tl.constexpr, K_FIRST: tl.constexpr = False,
    ROWS_FIRST: tl.constexpr = False,
):
    # One program per 128x128 tile, walked in CHUNK-row slices (_one_read_tile) or rows first
    # (_rows_first_tile, CHUNK columns per slice of its second pass). K_FIRST: the grid is (K / 128, Mp / 128),
    # consecutive programs reading consecutive tiles of the same rows; else (Mp / 128, K / 128).
    pid_m, pid_k = _tile_ids(K_FIRST)
    if ROWS_FIRST:
        _rows_first_tile(x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, pid_m, pid_k, M, MP, K, stride_xm, ST_LD, BLOCK_SIZE,
                         EPS, AMAX_MAX, FP8_MAX, CHUNK, WRITE_T, T_2D)
    else:
        _one_read_tile(x_ptr, q_ptr, s_t_ptr, qt_ptr, st_ptr, pid_m, pid_k, M, MP, K, stride_xm, ST_LD, BLOCK_SIZE,
                       EPS, AMAX_MAX, FP8_MAX, CHUNK, WRITE_T, T_2D)


@triton.autotune(configs=_CONFIGS, key=["N", "K", "K_FIRST"])
@triton.jit
def _weight_quant_kernel(
    w_ptr, wq_ptr, ws_ptr, wtq_ptr, wts_ptr,
    N, K, stride_wn, WS_LD, WTS_LD,
    BLOCK_SIZE: tl.constexpr, EPS: tl.constexpr, AMAX_MAX: tl.constexpr, FP8_MAX: tl.constexpr,
    CHUNK: tl.constexpr, K_FIRST: tl.constexpr = False,
):
    # One program per 128x128 block: pass 1 the block amax, pass 2 (L2-resident) both layouts. K_FIRST: as in
    # _act_quant_kernel.
    pid_n, pid_k = _tile_ids(K_FIRST)
    offs_k = (pid_k * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    amax_rows = tl.zeros((CHUNK,), tl.float32)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_n = (pid_n * BLOCK_SIZE + c + tl.arange(0, CHUNK)).to(tl.int64)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], eviction_policy="evict_last")
        amax_rows = tl.maximum(amax_rows, tl.max(tl.abs(w.to(tl.float32)), axis=1))
    scale = _scale_of(tl.max(amax_rows, axis=0), EPS, AMAX_MAX, FP8_MAX)
    for c in tl.static_range(0, BLOCK_SIZE, CHUNK):
        offs_n = (pid_n * BLOCK_SIZE + c + tl.arange(0, CHUNK)).to(tl.int64)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], eviction_policy="evict_first")
        q = tl.clamp(w.to(tl.float32) * scale, -FP8_MAX, FP8_MAX).to(wq_ptr.dtype.element_ty)
        tl.store(wq_ptr + offs_n[:, None] * K + offs_k[None, :], q)
        tl.store(wtq_ptr + offs_k[:, None] * N + offs_n[None, :], tl.trans(q))
    inv = tl.div_rn(1.0 + tl.zeros((), tl.float32), scale)
    tl.store(ws_ptr + pid_n * WS_LD + pid_k, inv)
    tl.store(wts_ptr + pid_k * WTS_LD + pid_n, inv)
    # The scale tensors' padding columns (cuBLAS's 16-byte alignment) hold 1.0.
    pad = tl.arange(0, 4)
    ones = tl.full((4,), 1.0, tl.float32)
    if pid_k == 0:
        tl.store(ws_ptr + pid_n * WS_LD + K // BLOCK_SIZE + pad, ones, mask=K // BLOCK_SIZE + pad < WS_LD)
    if pid_n == 0:
        tl.store(wts_ptr + pid_k * WTS_LD + N // BLOCK_SIZE + pad, ones, mask=N // BLOCK_SIZE + pad < WTS_LD)


def quantize_act(x: torch.Tensor, wgrad_x: str = "128x1", kernel: str = "auto"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton / Gluon version of :func:`fp8kit.fp8.blockwise.quantize_act` (same outputs, bit for bit).

    Args:
        x: CUDA ``[M, K]`` bf16 / fp16 / fp32 tensor with unit stride along K, ``K % 128 == 0``.
        wgrad_x: ``"128x1"`` or ``"128x128"``, the blocks of the ``x^T`` copy.
        kernel: ``"auto"`` (the Gluon cast of :mod:`fp8kit.fp8.kernels.blockwise_gluon` where it applies:
            :func:`gluon_applies`; else the Triton one), ``"triton"`` or ``"gluon"``.

    Raises:
        ValueError: ``kernel`` is not one of the three, or ``"gluon"`` where :func:`gluon_applies` is false.
    """
    t2d = wgrad_x == "128x128"
    if kernel not in ("auto", "triton", "gluon"):
        raise ValueError(f"quantize_act: kernel must be 'auto', 'triton' or 'gluon', got {kernel!r}")
    use_gluon = gluon_applies(x, t2d)
    if kernel == "gluon" and not use_gluon:
        raise ValueError(f"quantize_act: the Gluon cast takes a CUDA bf16 input with a 128x1 x^T copy on a Triton "
                         f"with Gluon (GLUON = {GLUON}); got {x.dtype} on {x.device}, wgrad_x = {wgrad_x!r}")
    if use_gluon and kernel != "triton":
        return blockwise_gluon.quantize_act_128x1(x)
    return _act_quant(x, True, t2d)


def gluon_applies(x: torch.Tensor, t2d: bool) -> bool:
    """Whether the Gluon cast (:mod:`fp8kit.fp8.kernels.blockwise_gluon`) takes this input: Triton ships Gluon
    (:data:`GLUON`), ``x`` is a CUDA bf16 tensor (Triton's interpreter runs CPU tensors: there the Triton kernel
    runs), the ``x^T`` copy is 128x1 (the 128x128 one is faster in Triton's rows-first walk), and the row tiles
    fit a grid's second dimension."""
    return (GLUON and not t2d and x.is_cuda and x.dtype == torch.bfloat16
            and padded_rows(x.shape[0]) // BLOCK <= _MAX_GRID_Y)


def quantize_act_fprop(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first two outputs of :func:`quantize_act` (the fprop copy ``q`` and ``s_t``) alone, the same bits,
    without the 128x1 pass (:func:`fp8kit.fp8.blockwise.quantize_act_fprop`)."""
    return _act_quant(x, False)


def _act_quant(x: torch.Tensor, write_t: bool, t2d: bool = False, k_first: bool | None = None
               ) -> tuple[torch.Tensor, ...]:
    x = two_rows_if_one(x)  # Triton 3.6 miscompiles M = 1 (the helper's docstring)
    m, k = x.shape
    mp = padded_rows(m)
    q = torch.empty(mp, k, dtype=FP8, device=x.device)
    s_t = torch.empty(k // BLOCK, mp, dtype=torch.float32, device=x.device)
    qt = torch.empty(k, mp, dtype=FP8, device=x.device) if write_t else q  # not written without write_t
    st_ld = round_up4(mp // BLOCK) if t2d else k
    st_shape = (k // BLOCK, st_ld) if t2d else (mp // BLOCK, k)
    st = torch.empty(st_shape, dtype=torch.float32, device=x.device) if write_t else s_t
    if mp:
        grid, k_first = _grid(mp // BLOCK, k // BLOCK, _ACT_K_FIRST if k_first is None else k_first)
        _act_quant_kernel[grid](
            x, q, s_t, qt, st, m, mp, k, x.stride(0), st_ld,
            BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX, WRITE_T=write_t, T_2D=t2d,
            K_FIRST=k_first,
        )
    return (q, s_t, qt, st) if write_t else (q, s_t)


# The weight cast is a ``torch.library.triton_op`` launching through ``wrap_triton``: eagerly a plain launch;
# under ``torch.compile`` Inductor sees the kernel and launches it from its generated code with no Python
# custom-op call around it (the host time of those calls starved the GPU in the blockwise 8B step). The
# activation cast is called from the ``fp8kit::blockwise_quant_act`` custom op (``kernels.ops`` says why).
@torch.library.triton_op("fp8kit::blockwise_quant_weight_triton", mutates_args=())
def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`fp8kit.fp8.blockwise.quantize_weight` (same outputs, bit for bit).

    Args:
        w: CUDA ``[N, K]`` float tensor with unit stride along K, both dimensions multiples of 128.
    """
    n, k = w.shape
    nb, kb = n // BLOCK, k // BLOCK
    wq = torch.empty(n, k, dtype=FP8, device=w.device)
    wtq = torch.empty(k, n, dtype=FP8, device=w.device)
    ws = torch.empty(nb, round_up4(kb), dtype=torch.float32, device=w.device)
    wts = torch.empty(kb, round_up4(nb), dtype=torch.float32, device=w.device)
    grid, k_first = _grid(nb, kb, _WEIGHT_K_FIRST)
    torch.library.wrap_triton(_weight_quant_kernel)[grid](
        w, wq, ws, wtq, wts, n, k, w.stride(0), ws.stride(0), wts.stride(0),
        BLOCK_SIZE=BLOCK, EPS=AMAX_EPS, AMAX_MAX=F32_MAX, FP8_MAX=_FP8_MAX, K_FIRST=k_first,
    )
    return wq, ws, wtq, wts
