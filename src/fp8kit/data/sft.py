"""Fine-tuning samples -> rows of ``seq_length`` tokens with labels, a train/validation split and the batch order.

A sample of ``L`` tokens (one conversation, :mod:`fp8kit.data.chat`) gives ``L - 1`` positions: inputs
``ids[:-1]``, labels ``ids[1:]`` where the label token is an assistant token and ``-100`` elsewhere (prompt,
template, padding: ``F.cross_entropy``'s ``ignore_index``). A sample longer than ``seq_length + 1`` tokens is
cut to its first ``seq_length + 1`` (and dropped when no assistant label is left); the caller counts both.

Rows (``data.pack``):

* ``pack = true``: samples are packed into rows of ``seq_length`` positions, best-fit decreasing (longest
  sample first, into the fullest row it still fits; TRL's ``bfd`` strategy, LLaMA-Factory's greedy knapsack).
  The position ids restart at 0 at every sample (and at the row's padding), and that is what keeps the
  samples apart: ``transformers`` (v5 ``masking_utils.find_packed_sequence_indices``) turns restarting
  position ids into a block-diagonal causal mask for the ``sdpa``/``eager`` attention of every model it
  builds, so no token attends to another sample, and RoPE sees each sample from position 0. No label
  crosses a sample boundary (the last token of a sample predicts nothing). Packed output equals per-sample
  output (``tests/test_chat_data.py``).
* ``pack = false``: one sample per row, padded at the end; no position ids are passed (the model's default
  ``0..T-1``), attention is plain causal (padding only follows the sample).

Split: every k-th sample (``k = max(2, round(1 / val_fraction))``, file order) is held out; training rows and
validation rows are built apart. Order: the training rows in a permutation drawn from ``seed`` and the epoch
(:func:`fp8kit.data.loader.epoch_permutation`), resumable from ``(epoch, cursor)`` as for pretraining.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from fp8kit.base.errors import DataError
from fp8kit.data.loader import LoaderState, epoch_permutation, restore_state

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index


@dataclass
class SFTBatch:
    """One batch of fine-tuning rows.

    Attributes:
        input_ids: ``[B, T]`` int64.
        labels: ``[B, T]`` int64, the next token where it is learnt, ``-100`` elsewhere.
        position_ids: ``[B, T]`` int64 restarting at every packed sample, or None (unpacked rows).
        num_supervised: labels that are not ``-100`` (counted on the host when the batch is built).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None
    num_supervised: int

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, rows: slice) -> SFTBatch:
        """The rows ``rows`` (a slice), like slicing a ``[B, T]`` tensor."""
        labels = self.labels[rows]
        pos = None if self.position_ids is None else self.position_ids[rows]
        return SFTBatch(self.input_ids[rows], labels, pos, int((labels != IGNORE_INDEX).sum()))

    def apply(self, fn) -> SFTBatch:
        """The batch with ``fn`` (tensor -> tensor, e.g. a device copy) applied to each of its tensors."""
        pos = None if self.position_ids is None else fn(self.position_ids)
        return SFTBatch(fn(self.input_ids), fn(self.labels), pos, self.num_supervised)

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """Keyword arguments for the model besides ``input_ids`` (``position_ids`` when packed)."""
        return {} if self.position_ids is None else {"position_ids": self.position_ids}


def pack_best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing bin packing: rows of sample indices whose lengths sum to at most ``capacity``.

    Samples are taken longest first (ties: lower index first) and each goes into the row with the least
    room that still holds it, else a new row; deterministic. ``O(n log n)``.
    """
    rows: list[list[int]] = []
    room_sorted: list[int] = []  # distinct room sizes that some row has
    rows_with_room: dict[int, list[int]] = defaultdict(list)
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        n = lengths[i]
        j = bisect_left(room_sorted, n)
        if j == len(room_sorted):
            rows.append([i])
            b, left = len(rows) - 1, capacity - n
        else:
            room = room_sorted[j]
            b = rows_with_room[room].pop()
            if not rows_with_room[room]:
                room_sorted.pop(j)
            rows[b].append(i)
            left = room - n
        if left > 0:
            if not rows_with_room[left]:
                insort(room_sorted, left)
            rows_with_room[left].append(b)
    return rows


class SFTData:
    """Fine-tuning rows, split and batch order (module docstring); the interface of
    :class:`fp8kit.data.loader.PackedData` (``next_batch``, ``val_batches``, ``state_dict``, ...).

    Args:
        samples: per sample ``(ids [L] int64, assistant [L] bool)``, ``2 <= L <= seq_length + 1``, each with
            at least one assistant token after its first.
        seq_length: positions per row.
        val_fraction: share of samples held out (every k-th).
        micro_batch_size: rows per batch (checked against the data size).
        seed: seed of the training order.
        pack: pack several samples per row (True) or one per row (False).
        pad_id: token id of the padding inputs (never a label).
        cut_away: records the caller dropped because the cut to ``seq_length + 1`` tokens left them no
            assistant token (when they are half or more of all, the size error says to raise
            ``data.seq_length``).

    Raises:
        DataError: too few samples for one validation row plus ``micro_batch_size`` training rows.
    """

    def __init__(self, samples: list[tuple[np.ndarray, np.ndarray]], seq_length: int, val_fraction: float,
                 micro_batch_size: int, seed: int, pack: bool, pad_id: int, cut_away: int = 0):
        self.seq_length, self.seed, self.pack, self.pad_id = seq_length, seed, pack, pad_id
        lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int64)
        if len(samples) and (lengths.min() < 2 or lengths.max() > seq_length + 1):
            raise ValueError(f"sample lengths must lie in [2, {seq_length + 1}], got {lengths.min()}..{lengths.max()}")
        self._off = np.concatenate([[0], np.cumsum(lengths)])
        self._ids = np.concatenate([ids for ids, _ in samples]) if samples else np.zeros(0, np.int64)
        self._sup = np.concatenate([m for _, m in samples]) if samples else np.zeros(0, bool)
        self.stride = max(2, round(1.0 / val_fraction))
        idx = np.arange(len(samples))
        is_val = (idx % self.stride) == (self.stride - 1)
        need = (lengths - 1).tolist()
        self.train_rows = self._rows(idx[~is_val], need)
        self.val_rows = self._rows(idx[is_val], need)
        if len(self.val_rows) < 1 or len(self.train_rows) < micro_batch_size:
            raise DataError(self._too_small(len(samples), micro_batch_size, cut_away))
        used = int(sum(need))
        self.fill = used / ((len(self.train_rows) + len(self.val_rows)) * seq_length)
        self.state = LoaderState()
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    def _too_small(self, n: int, micro_batch_size: int, cut_away: int) -> str:
        """The size error's message, with the advice that helps: a longer ``seq_length`` when the cut dropped
        half the records or more, else more data or smaller rows / batches."""
        t = self.seq_length
        if cut_away and not n:
            return (f"all {cut_away} records with an assistant turn lost it to the cut at data.seq_length = {t} "
                    f"(no assistant token in their first {t + 1} tokens): raise data.seq_length")
        rows = (f"{n} samples make {len(self.train_rows)} training and {len(self.val_rows)} validation rows of {t} "
                f"tokens (every {self.stride}th sample is held out), and training needs micro_batch_size "
                f"{micro_batch_size} training rows and one validation row")
        if cut_away and cut_away >= n:
            return (f"the chat data is too small: {cut_away} of its {cut_away + n} records lost their assistant "
                    f"turn to the cut at data.seq_length = {t}, and the {rows}; raise data.seq_length")
        smaller = ("data.seq_length / train.micro_batch_size" if self.pack
                   else "train.micro_batch_size (data.pack = false: one sample per row)")
        return f"the chat data is too small: its {rows}; add data or lower {smaller}"

    def _rows(self, sample_idx: np.ndarray, need: list[int]) -> list[list[int]]:
        if not self.pack:
            return [[int(i)] for i in sample_idx]
        return [[int(sample_idx[k]) for k in row] for row in pack_best_fit([need[i] for i in sample_idx],
                                                                           self.seq_length)]

    # PackedData's names, used by the training loop and the run info
    @property
    def train_windows(self) -> np.ndarray:
        return np.arange(len(self.train_rows))

    @property
    def val_windows(self) -> np.ndarray:
        return np.arange(len(self.val_rows))

    def _batch(self, rows: list[list[int]]) -> SFTBatch:
        b, t = len(rows), self.seq_length
        ids = np.full((b, t), self.pad_id, dtype=np.int64)
        labels = np.full((b, t), IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros((b, t), dtype=np.int64)
        for r, row in enumerate(rows):
            c = 0
            for s in row:
                lo, hi = int(self._off[s]), int(self._off[s + 1])
                n = hi - lo - 1
                ids[r, c : c + n] = self._ids[lo : hi - 1]
                labels[r, c : c + n] = np.where(self._sup[lo + 1 : hi], self._ids[lo + 1 : hi], IGNORE_INDEX)
                pos[r, c : c + n] = np.arange(n)
                c += n
            pos[r, c:] = np.arange(t - c)  # the padding is a sample of its own: nothing real attends to it
        labels_t = torch.from_numpy(labels)
        return SFTBatch(torch.from_numpy(ids), labels_t, torch.from_numpy(pos) if self.pack else None,
                        int((labels_t != IGNORE_INDEX).sum()))

    def next_batch(self, batch_size: int) -> SFTBatch:
        """The next ``batch_size`` training rows (``[batch_size, seq_length]`` tensors)."""
        rows = []
        while len(rows) < batch_size:
            if self._perm_epoch != self.state.epoch:
                self._perm = epoch_permutation(self.seed, self.state.epoch, len(self.train_rows))
                self._perm_epoch = self.state.epoch
            rows.append(self.train_rows[int(self._perm[self.state.cursor])])
            self.state.cursor += 1
            if self.state.cursor == len(self._perm):
                self.state = LoaderState(self.state.epoch + 1, 0)
        return self._batch(rows)

    def state_dict(self) -> dict[str, int]:
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved :meth:`state_dict`.

        Raises:
            DataError: the saved cursor is past this data's training rows (the data changed since it was saved).
        """
        self.state = restore_state(state, len(self.train_rows), "rows")

    def val_batches(self, batch_size: int, max_batches: int) -> list[SFTBatch]:
        """The first ``max_batches`` validation batches, always the same rows in the same order."""
        rows = self.val_rows[: batch_size * max_batches]
        return [self._batch(rows[s : s + batch_size]) for s in range(0, len(rows), batch_size)]

    @property
    def epoch_fraction(self) -> float:
        return self.state.epoch + self.state.cursor / max(1, len(self.train_rows))
