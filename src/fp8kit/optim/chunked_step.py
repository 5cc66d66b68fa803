"""FP8AdamW's eager CPU step in cache-sized chunks of blocks: the reference math of ``optim/numerics.py``, the same
bits, about 2x faster on a CPU.

:func:`fp8kit.optim.numerics.adamw_update` evaluates the step as about a hundred elementwise tensor operations over
the whole flat group. On a CPU each of them streams its operands through DRAM: a group of 2M parameters with
per-block scales takes 174-201 ms per step on one core (85-100 ns per parameter), memory-bound. With per-block scales (``granularity =
"block"``, the one-process default) every block's update depends on that block alone, so the same function can
run on a slice of the blocks at a time: :func:`adamw_update_chunked` calls it on :data:`CHUNK_ELEMENTS`-element
slices whose temporaries stay in the core's cache. Each element goes through the same operations in the same
order, so the bits are the same (``tests/test_fp8_adamw_chunked.py`` checks them over several steps and
precisions). The stochastic rounding of ``m`` draws by the element's index in the group
(:func:`~fp8kit.optim.numerics.uniform_noise`); a chunk passes its first element's index as the noise offset.

Not chunked (the whole-group function runs): per-tensor scales (a tensor's scale needs its amax over all its
blocks first), FSDP2 shards (their amaxes are reduced over the ranks), and a bf16 master rounded stochastically
(``torch.randint_like`` draws from the global generator; drawing in pieces is not guaranteed the same stream).
"""

from __future__ import annotations

import torch

from fp8kit.optim.numerics import StateSpec, adamw_update

#: Elements per chunk: 128K (512 KB float32 temporaries; measured on the 2-core CI-like machine, one thread, 2M
#: parameters per block-scaled group: 65-85 ms per step against 174-201 ms whole; 64K 75-85 ms, 32K 95 ms).
CHUNK_ELEMENTS = 1 << 17


def chunkable(spec: StateSpec) -> bool:
    """Whether :func:`adamw_update_chunked` gives :func:`adamw_update`'s bits for groups of this ``spec``
    (per-block scales, no stochastic rounding of a bf16 master)."""
    return spec.granularity == "block" and not spec.stochastic_rounding


def adamw_update_chunked(
    grad: torch.Tensor,
    grad_scale: torch.Tensor | None,
    m: torch.Tensor,
    m_scale: torch.Tensor | None,
    m_k: torch.Tensor | None,
    v: torch.Tensor,
    v_scale: torch.Tensor | None,
    master: torch.Tensor | None,
    master_scale: torch.Tensor | None,
    work: torch.Tensor,
    hp: torch.Tensor,
    owner: torch.Tensor,
    spec: StateSpec,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> None:
    """:func:`~fp8kit.optim.numerics.adamw_update` (same arguments, in place, one process) on consecutive slices
    of about ``chunk_elements`` elements (whole blocks): the flat states sliced by element, their per-block
    scales, ``m_k`` and ``owner`` by block.

    Raises:
        ValueError: a ``spec`` that :func:`chunkable` rejects.
    """
    if not chunkable(spec):
        raise ValueError(f"adamw_update_chunked: granularity {spec.granularity!r} / stochastic_rounding "
                         f"{spec.stochastic_rounding} is not chunkable; use numerics.adamw_update")
    block = spec.block
    num_blocks = owner.numel()
    step = max(1, chunk_elements // block)
    offset = torch.zeros(spec.num_tensors, dtype=torch.int64, device=owner.device)

    def by_block(t: torch.Tensor | None, b0: int, b1: int) -> torch.Tensor | None:
        return None if t is None else t[b0:b1]

    def by_element(t: torch.Tensor | None, b0: int, b1: int) -> torch.Tensor | None:
        return None if t is None else t[b0 * block : b1 * block]

    for b0 in range(0, num_blocks, step):
        b1 = min(num_blocks, b0 + step)
        offset.fill_(b0 * block)  # the chunk's first element: the noise index is the element's index in the group
        adamw_update(
            by_element(grad, b0, b1), by_block(grad_scale, b0, b1),
            by_element(m, b0, b1), by_block(m_scale, b0, b1), by_block(m_k, b0, b1),
            by_element(v, b0, b1), by_block(v_scale, b0, b1),
            by_element(master, b0, b1), by_block(master_scale, b0, b1),
            by_element(work, b0, b1), hp, owner[b0:b1], spec, noise_delta=offset,
        )
