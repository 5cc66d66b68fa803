"""Blockwise FP8 (the DeepSeek-V3 recipe): the reference quantization, the layouts, the emulated GEMM.

This module is the numerics of fp8kit's blockwise linear (:mod:`fp8kit.fp8.linear`). It runs on any
device in plain PyTorch; it is what CI tests, what the CPU runs, and what the Triton kernels of
:mod:`fp8kit.fp8.kernels.blockwise_triton` must reproduce bit for bit on CUDA.

Source: DeepSeek-V3 Technical Report, arXiv:2412.19437, section 3.3 ("FP8 training": fine-grained
quantization 1x128 for activations and 128x128 for weights, E4M3 everywhere, scales from the online
amax of each block, FP32 accumulation with per-block scale promotion). Layouts follow what cuBLAS asks
of ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` / ``BlockWise128x128``
(torch >= 2.10; cuBLAS "scaling factors layouts"), as torchao's
``prototype/blockwise_fp8_training`` shows.

Format
    Every operand (input ``x``, weight ``w``, output gradient ``dy``) is E4M3 (``torch.float8_e4m3fn``,
    max 448): with one scale per 128 elements the gradients need no E5M2 range (DeepSeek-V3 3.3.2;
    Transformer Engine's ``Float8BlockScaling`` also defaults to E4M3 for all tensors).

Scale
    Per block ``b``: ``amax_b = max |x|`` over the block, ``scale_b = 448 / max(amax_b, 1e-12)`` in
    float32 (:func:`fp8kit.fp8.scaling.scale_from_amax`, the one formula of fp8kit), data
    ``q = E4M3(clamp(x * scale_b, -448, 448))`` rounded to nearest even
    (:func:`fp8kit.fp8.scaling.quantize`). What is stored next to ``q`` is the *decoding* scale
    ``scale_inv_b = 1 / scale_b`` (float32, as Transformer Engine's ``scale_inv``): cuBLAS multiplies by
    it, so ``x ~= q * scale_inv_b``. An all-zero block gets ``scale = 448 / 1e-12`` and zeros. Bit-level
    detail the Triton kernels reproduce: PyTorch evaluates ``448 / a`` (a Python scalar over a tensor) as
    ``reciprocal(a) * 448``, two float32 roundings, not one IEEE division.

    Scales are NOT rounded to powers of two. DeepSeek-V3 uses plain FP32 scales and so does torchao's
    blockwise prototype (our speed baseline), so the two recipes are the same function. With an exact
    ``448 / amax`` the block's largest element lands on 448 exactly and the top binade of E4M3 is
    used; a power of two would map amax into [224, 448] and lose up to one binade at the bottom of
    the block (more flush-to-zero of small elements). The price, an ``x * scale`` product rounded once
    in float32 before the E4M3 rounding, is 2^-24 relative: far below E4M3's 2^-4. (Power-of-two
    scales pay off where a format needs them: MX's E8M0 on Blackwell, rowwise recipes that fold scales
    into a transposed copy.)

Granularity per GEMM (``y = x @ w^T``; M tokens, K input features, N output features)

    ======  ========================  ======================  ===============================  ==========
    GEMM    computes                  left operand            right operand                    reduction
    ======  ========================  ======================  ===============================  ==========
    fprop   y[M,N]  = x @ w^T         x: 1x128 along K        w: 128x128                        K
    dgrad   dx[M,K] = dy @ w          dy: 1x128 along N       w^T: the same 128x128 blocks      N
    wgrad   dw[N,K] = dy^T @ x        dy^T: 1x128 along M     x: 128x1 (1x128 along M of x^T)   M
    ======  ========================  ======================  ===============================  ==========

    Every block lies along the reduction dimension of the GEMM that uses it (or is a square that does
    for both fprop and dgrad), so the GEMM applies one scale per 128-step of the reduction.

    ``wgrad_x = "128x128"`` (``fp8.blockwise_wgrad_x``; not DeepSeek-V3's choice, the default is ``"128x1"``): the
    wgrad GEMM's copy of ``x`` takes one scale per 128 tokens x 128 input features, as a weight does, instead of
    one per 128 tokens of each feature. cuBLAS then runs its 1x128 x 128x128 kernel, the fprop one, instead of
    the 1x128 x 1x128 kernel, which reaches only about 950 TFLOP/s on the H100 (1140-1200 for the same wgrad
    GEMMs with this layout; ``docs/benchmarks.md`` section 6). The same freedom as Transformer Engine's
    ``Float8BlockScaling(x_block_scaling_dim=2)``, for the wgrad copy only. The price: a 128x128 block shares
    the scale of its largest element, so the other features of a block holding an outlier feature are scaled
    down by the outlier's ratio and their small elements fall into E4M3's subnormals or to zero, which costs
    their weight-gradient columns precision (``tests/test_blockwise_wgrad_x.py`` measures it at ratios 1e3 and 1e5).

Where each cast happens
    forward: ``x`` is read once by the fused activation kernel, which writes its 1x128 copy (fprop) and
    its 128x1 copy, transposed to ``x^T[K, M]`` (wgrad). Only the FP8 ``x^T`` copy is saved for the
    backward (1 byte per element instead of BF16's 2). ``w`` is quantized once per weight version to
    128x128 blocks in two layouts, ``w[N, K]`` (fprop) and ``w^T[K, N]`` (dgrad), same values, same
    scales, and cached across micro-batches (:mod:`fp8kit.fp8.kernels.ops`).
    backward: ``dy`` goes through the same fused kernel: 1x128 along N (dgrad) and ``dy^T[N, M]``
    1x128 along M (wgrad). With ``wgrad_x = "128x128"`` the same read of ``x`` writes ``x^T`` with one scale
    per 128x128 tile (the tile the kernel reads anyway).

Layouts (what :func:`quantize_act` and :func:`quantize_weight` return; Triton writes the same)
    ``M`` is padded with zero rows to ``Mp = ceil(M / 128) * 128`` so the wgrad reduction is whole
    blocks and the fprop / dgrad outputs are sliced back to ``M`` rows (a view).

    - activation ``x[M, K]`` -> ``q[Mp, K]``, ``s_t[K/128, Mp]`` (1x128 scale of row m, block kb at
      ``[kb, m]``), ``qt[K, Mp]`` (``x^T``), ``st[Mp/128, K]`` (128x1 scale of column k, block mb at
      ``[mb, k]``); with ``wgrad_x = "128x128"``, ``st[K/128, L4(Mp/128)]`` instead (the weight layout of
      ``x^T``: block ``(kb, mb)`` at ``[kb, mb]``, padding 1.0).
    - weight ``w[N, K]`` -> ``wq[N, K]``, ``ws[N/128, L4(K/128)]``, ``wtq[K, N]``, ``wts[K/128,
      L4(N/128)]`` where ``L4(n)`` rounds up to a multiple of 4 (cuBLAS wants the 128x128 scale
      columns 16-byte aligned); the padding holds 1.0 and is never read as a scale.

GEMM
    CUDA: cuBLAS through ``F.scaled_mm`` (FP32 accumulation with the block scales applied per
    128-wide reduction step). CPU, and ``fp8.emulate``: :func:`blockwise_mm_emulated`, the same
    quantized operands dequantized (``q * scale_inv``) and multiplied in float32, then cast to the
    output dtype.
"""

from __future__ import annotations

import torch

from fp8kit.fp8.scaling import quantize, scale_from_amax

#: Block edge of the recipe (DeepSeek-V3: 1x128 activation tiles, 128x128 weight blocks).
BLOCK = 128
#: Storage format of every operand.
FP8 = torch.float8_e4m3fn
#: How the wgrad GEMM's copy of the input, ``x^T``, is blocked (module docstring): DeepSeek-V3's ``"128x1"`` (the
#: default) or ``"128x128"``.
WGRAD_X_BLOCKS = ("128x1", "128x128")


def check_wgrad_x(wgrad_x: str, where: str) -> None:
    """Raise unless ``wgrad_x`` is one of :data:`WGRAD_X_BLOCKS`.

    Raises:
        ValueError: naming ``where``, the value and the choices.
    """
    if wgrad_x not in WGRAD_X_BLOCKS:
        raise ValueError(f"{where}: wgrad_x must be one of {', '.join(WGRAD_X_BLOCKS)}, got {wgrad_x!r}")


def wgrad_x_block(wgrad_x: str) -> int:
    """The ``b_block`` the wgrad GEMM passes for its ``x^T`` operand (``kernels.ops.blockwise_mm``): :data:`BLOCK`
    for ``"128x128"`` tiles, 1 for DeepSeek-V3's ``"128x1"`` blocks (1x128 along the tokens of ``x^T``)."""
    return BLOCK if wgrad_x == "128x128" else 1


def padded_rows(m: int) -> int:
    """``m`` rounded up to a multiple of :data:`BLOCK` (the token dimension of the FP8 copies)."""
    return -(-m // BLOCK) * BLOCK


def round_up4(n: int) -> int:
    """``n`` rounded up to a multiple of 4 (the leading dimension of cuBLAS's 128x128 scale tensors)."""
    return -(-n // 4) * 4


def check_linear_shape(out_features: int, in_features: int, where: str) -> None:
    """Raise unless both features of a ``[N, K]`` weight are multiples of :data:`BLOCK`.

    Raises:
        ValueError: naming ``where`` and the shape; such a layer must stay in BF16.
    """
    if out_features % BLOCK or in_features % BLOCK:
        raise ValueError(
            f"{where}: blockwise FP8 needs in_features and out_features to be multiples of {BLOCK}, got "
            f"weight shape (out_features={out_features}, in_features={in_features}); keep this layer in BF16"
        )


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D tensor to E4M3 with one scale per 128 consecutive elements of each row.

    Args:
        x: ``[R, C]`` float tensor, ``C`` a multiple of 128.

    Returns:
        ``(q, scale_inv)``: ``q`` E4M3 ``[R, C]``, ``scale_inv`` float32 ``[R, C / 128]`` (decoding scales).
    """
    r, c = x.shape
    xb = x.reshape(r, c // BLOCK, BLOCK)
    scale = scale_from_amax(xb.abs().amax(dim=2), FP8)
    q = quantize(xb, scale[:, :, None], FP8).reshape(r, c)
    return q, 1.0 / scale


def empty_act_outputs(like: torch.Tensor, m, k: int, wgrad_x: str = "128x1") -> tuple[torch.Tensor, ...]:
    """Uninitialised ``(q, s_t, qt, st)`` in :func:`quantize_act`'s layout for an ``[m, k]`` input, on ``like``'s
    device: what the Triton casts fill, and the shapes the ops' fake implementations give ``torch.compile``."""
    mp = padded_rows(m)
    f32 = torch.float32
    st = (like.new_empty(k // BLOCK, round_up4(mp // BLOCK), dtype=f32) if wgrad_x == "128x128"
          else like.new_empty(mp // BLOCK, k, dtype=f32))
    return like.new_empty(mp, k, dtype=FP8), like.new_empty(k // BLOCK, mp, dtype=f32), like.new_empty(k, mp, dtype=FP8), st


def quantize_act(x: torch.Tensor, wgrad_x: str = "128x1") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused activation / output-gradient quantization: both FP8 copies of ``x`` (reference).

    Args:
        x: ``[M, K]`` bf16 / fp16 / fp32 activation (or output gradient ``dy[M, N]``), ``K`` a multiple
            of 128, any ``M``.
        wgrad_x: the blocks of the ``x^T`` copy, ``"128x1"`` or ``"128x128"`` (:func:`quantize_act_wgrad`).

    Returns:
        ``(q, s_t, qt, st)``: ``q`` E4M3 ``[Mp, K]`` (1x128 blocks along K, for fprop / dgrad),
        ``s_t`` float32 ``[K/128, Mp]``, ``qt`` E4M3 ``[K, Mp]`` (``x^T``, 1x128 blocks along M, for
        wgrad), ``st`` float32 ``[Mp/128, K]`` (``"128x128"``: ``[K/128, L4(Mp/128)]``);
        ``Mp = padded_rows(M)``, pad rows zero. All contiguous.
    """
    xp = _pad_rows(x)  # once: both halves see Mp rows already and do not pad again
    return (*quantize_act_fprop(xp), *quantize_act_wgrad(xp, wgrad_x))


def quantize_act_fprop(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fprop copy of :func:`quantize_act` alone: ``(q, s_t)``, its first two outputs, the same bits (what the
    blockwise linear's forward needs when it keeps no ``x^T`` copy for the backward).

    Returns:
        ``q`` E4M3 ``[Mp, K]`` (1x128 blocks along K) and ``s_t`` float32 ``[K/128, Mp]``.
    """
    q, s = quantize_1x128(_pad_rows(x))
    return q, s.t().contiguous()


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    mp = padded_rows(m)
    return x if mp == m else torch.cat([x, x.new_zeros(mp - m, k)])


def quantize_act_wgrad(x: torch.Tensor, wgrad_x: str = "128x1") -> tuple[torch.Tensor, torch.Tensor]:
    """The wgrad copy of :func:`quantize_act` alone: ``(qt, st)``, its last two outputs, the same bits.

    Plain PyTorch on purpose: the blockwise linear with ``keep_input_copy=False`` casts its input again in the
    backward with it, so ``torch.compile`` sees ordinary ops it may recompute from what the step saves anyway
    (the RMSNorm input, the SwiGLU's gate and up) and fuse into one kernel, as it does for the per-tensor
    recipes' casts; a custom op there would be computed in the forward and its FP8 output saved. Eagerly the
    bits equal the forward's cast; compiled, Inductor keeps the recomputed ``x`` in float32 inside the fused
    kernel (it does not round fused intermediates to bf16: ``emulate_precision_casts`` is off), so some elements
    round to a neighbouring E4M3 value (measured on the CPU: the weight gradient at 29.58 dB against float64,
    29.57 dB from the cast of the stored input).

    Args:
        x: ``[M, K]`` float tensor, ``K`` a multiple of 128.
        wgrad_x: ``"128x1"``: one scale per 128 rows of each column (DeepSeek-V3); ``"128x128"``: one scale per
            128x128 tile, the layout :func:`quantize_weight` gives ``w^T`` (module docstring).

    Returns:
        ``qt`` E4M3 ``[K, Mp]`` (``x^T``, 1x128 blocks along M) and ``st`` float32 ``[Mp/128, K]``;
        ``"128x128"``: ``qt`` with 128x128 blocks and ``st`` ``[K/128, L4(Mp/128)]`` (padding 1.0).

    Raises:
        ValueError: ``wgrad_x`` is not one of :data:`WGRAD_X_BLOCKS`.
    """
    check_wgrad_x(wgrad_x, "quantize_act_wgrad")
    if wgrad_x == "128x128":
        return quantize_weight(_pad_rows(x))[2:]
    qt, st = quantize_1x128(_pad_rows(x).t().contiguous())
    return qt, st.t().contiguous()


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a weight to E4M3 with one scale per 128x128 block, in the fprop and dgrad layouts (reference).

    Args:
        w: ``[N, K]`` float weight, both dimensions multiples of 128.

    Returns:
        ``(wq, ws, wtq, wts)``: ``wq`` E4M3 ``[N, K]``, ``ws`` float32 ``[N/128, L4(K/128)]`` (block
        ``(nb, kb)`` at ``[nb, kb]``), ``wtq = wq^T`` contiguous ``[K, N]``, ``wts`` float32
        ``[K/128, L4(N/128)]`` (block ``(nb, kb)`` at ``[kb, nb]``); scale padding is 1.0.
    """
    n, k = w.shape
    nb, kb = n // BLOCK, k // BLOCK
    blocks = w.reshape(nb, BLOCK, kb, BLOCK)
    scale = scale_from_amax(blocks.abs().amax(dim=(1, 3)), FP8)
    wq = quantize(blocks, scale[:, None, :, None], FP8).reshape(n, k)
    inv = 1.0 / scale
    ws = torch.ones(nb, round_up4(kb), dtype=torch.float32, device=w.device)
    ws[:, :kb] = inv
    wts = torch.ones(kb, round_up4(nb), dtype=torch.float32, device=w.device)
    wts[:, :nb] = inv.t()
    return wq, ws, wq.t().contiguous(), wts


def dequantize_rows(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``q * scale_inv`` in float32 for 1x128 blocks: ``q[R, C]``, ``scale_inv[R, C/128]``."""
    return q.float() * scale_inv.repeat_interleave(BLOCK, dim=1)


def blockwise_mm_emulated(
    a: torch.Tensor, a_scale_t: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, b_block: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a @ b^T`` of two blockwise-quantized operands, dequantized and multiplied in float32.

    The same contract as the cuBLAS path of :func:`fp8kit.fp8.kernels.ops.blockwise_mm`.

    Args:
        a: E4M3 ``[M, K]`` (K contiguous), 1x128 blocks along K.
        a_scale_t: float32 ``[K/128, M]`` decoding scales of ``a``.
        b: E4M3 ``[N, K]`` (K contiguous).
        b_scale: float32 decoding scales of ``b``: ``[N/128, >=K/128]`` for ``b_block=128`` (128x128
            blocks), ``[K/128, N]`` for ``b_block=1`` (1x128 blocks along K).
        b_block: 128 or 1, see ``b_scale``.
        out_dtype: dtype of the result.

    Returns:
        ``[M, N]`` tensor of ``out_dtype``.
    """
    k = a.shape[1]
    da = dequantize_rows(a, a_scale_t.t())
    if b_block == BLOCK:
        s = b_scale[:, : k // BLOCK].repeat_interleave(BLOCK, dim=0)
        db = dequantize_rows(b, s)
    else:
        db = dequantize_rows(b, b_scale.t())
    return (da @ db.t()).to(out_dtype)
