"""Flat, block-aligned layout of a parameter group for the fused FP8 optimizer step.

Each parameter of a group gets a contiguous segment of one flat buffer, padded to a multiple of
``block`` elements so that no scaling block straddles two parameters. The optimizer's states (master
weights, ``m``, ``v``, FP8 gradients) live in flat buffers of this layout, and the parameters themselves
become views into one flat working buffer (as apex's and DeepSpeed's flat optimizers do), so one fused
kernel updates the whole group and writes the new working weights in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Blocks the flat length is a multiple of: the FP8AdamW kernels' blocks per program divide it
#: (``fp8kit.optim.triton_step.LAUNCH``).
ALIGN_BLOCKS = 8


@dataclass
class FlatLayout:
    """Offsets of ``len(numels)`` tensors in a flat buffer of ``total`` elements.

    Attributes:
        block: scaling block size in elements; every offset and ``total`` are multiples of it.
        numels: elements of each tensor.
        offsets: start of each tensor's segment.
        padded: segment length of each tensor (``numel`` rounded up to ``block``).
        total: buffer length.
        block_owner: ``(total // block,)`` int64 tensor, the tensor index owning each block (for
            per-tensor amax: blocks reduce to their owner).
    """

    block: int
    numels: list[int]
    offsets: list[int]
    padded: list[int]
    total: int
    block_owner: torch.Tensor

    @classmethod
    def build(cls, numels: list[int], block: int, device: torch.device,
              align_blocks: int | None = None) -> FlatLayout:
        """Lay out tensors of ``numels`` elements in order, each padded to ``block``; the last one is
        padded further so that ``total`` is a multiple of ``align_blocks`` blocks (default :data:`ALIGN_BLOCKS`;
        kernels take blocks in groups that divide it).

        Raises:
            ValueError: for ``block < 1`` or an empty tensor list.
        """
        if block < 1:
            raise ValueError(f"FlatLayout: block must be >= 1, got {block}")
        if not numels:
            raise ValueError("FlatLayout: no tensors to lay out")
        align_blocks = ALIGN_BLOCKS if align_blocks is None else align_blocks
        padded = [max(block, -(-n // block) * block) for n in numels]
        padded[-1] += (-sum(padded) // block % align_blocks) * block
        offsets, pos = [], 0
        for p in padded:
            offsets.append(pos)
            pos += p
        owner = torch.repeat_interleave(
            torch.arange(len(numels), dtype=torch.int64), torch.tensor([p // block for p in padded])
        )
        return cls(block, list(numels), offsets, padded, pos, owner.to(device))

    @property
    def num_blocks(self) -> int:
        return self.total // self.block

    def segment(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The unpadded segment of tensor ``i`` in ``flat`` (a 1-D view)."""
        return flat[self.offsets[i] : self.offsets[i] + self.numels[i]]

    def padded_segment(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """The padded segment of tensor ``i`` in ``flat`` (a 1-D view, length a multiple of ``block``)."""
        return flat[self.offsets[i] : self.offsets[i] + self.padded[i]]

    def block_range(self, i: int) -> slice:
        """The blocks of tensor ``i`` (for indexing per-block scales)."""
        return slice(self.offsets[i] // self.block, (self.offsets[i] + self.padded[i]) // self.block)
