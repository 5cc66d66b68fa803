"""Token stream -> packed sequences -> train/validation split -> deterministic, resumable batches.

Packing (nanoGPT style): the token stream (documents joined by EOS) is cut into non-overlapping
windows of ``seq_length + 1`` tokens; a window gives inputs ``w[:-1]`` and labels ``w[1:]``.

Split: every k-th window (``k = round(1 / val_fraction)``) is held out for validation, so the
validation set is spread over the whole corpus and independent of the seed.

Order: the training windows are visited in a permutation drawn from ``seed`` and the epoch number
(``torch.randperm`` with its own generator), epoch after epoch. The position is two integers
``(epoch, cursor)``: saving and restoring them resumes the exact batch sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fp8kit.base.errors import DataError


@dataclass
class LoaderState:
    """Resumable position in the training order."""

    epoch: int = 0
    cursor: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}


def restore_state(state: dict[str, int], num_train: int, what: str) -> LoaderState:
    """The :class:`LoaderState` of a saved ``to_dict()``, checked against the ``num_train`` training ``what``
    (rows, sequences) of the data it resumes.

    Raises:
        DataError: the saved position is not one of this data's (a cursor at or past ``num_train``): the
            data changed since the state was saved.
    """
    epoch, cursor = int(state["epoch"]), int(state["cursor"])
    if epoch < 0 or not 0 <= cursor < num_train:
        raise DataError(
            f"the saved data cursor {cursor} (epoch {epoch}) is not a position of this data's {num_train} training "
            f"{what}: the run's data (data.paths, or data.seq_length / data.val_fraction) changed since the "
            f"checkpoint; resume with the data it was saved with"
        )
    return LoaderState(epoch, cursor)


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The training order of epoch ``epoch``: a permutation of ``range(n)`` (``torch.randperm`` with its own
    generator seeded from ``seed`` and ``epoch``; the same on every machine and rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).numpy()


class PackedData:
    """Packed windows of one token stream with a train/validation split.

    Args:
        tokens: 1-D integer array (any numpy integer dtype, may be a memmap).
        seq_length: tokens per training sequence (a window holds ``seq_length + 1``).
        val_fraction: share of windows held out (every k-th).
        micro_batch_size: sequences per batch (checked against the corpus size).
        seed: seed of the training order.

    Raises:
        DataError: the corpus is too small for one validation window plus ``micro_batch_size``
            training windows of this sequence length.
    """

    def __init__(self, tokens: np.ndarray, seq_length: int, val_fraction: float, micro_batch_size: int, seed: int):
        self.tokens = tokens
        self.seq_length = seq_length
        self.window = seq_length + 1
        self.seed = seed
        n_windows = len(tokens) // self.window
        self.stride = max(2, round(1.0 / val_fraction))
        all_idx = np.arange(n_windows)
        is_val = (all_idx % self.stride) == (self.stride - 1)
        self.val_windows = all_idx[is_val]
        self.train_windows = all_idx[~is_val]
        need = micro_batch_size + 1
        if len(self.val_windows) < 1 or len(self.train_windows) < micro_batch_size:
            raise DataError(
                f"data.seq_length = {seq_length} is too long for the corpus: its {len(tokens)} tokens make "
                f"{n_windows} sequences of {self.window} tokens, and training needs at least {need} "
                f"(micro_batch_size {micro_batch_size} for training plus validation; every "
                f"{self.stride}th is held out). Use a shorter data.seq_length or more data."
            )
        self.state = LoaderState()
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    # -- training order ---------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            self._perm = epoch_permutation(self.seed, epoch, len(self.train_windows))
            self._perm_epoch = epoch
        return self._perm

    def _window(self, index: int) -> np.ndarray:
        start = index * self.window
        return np.asarray(self.tokens[start : start + self.window], dtype=np.int64)

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """The next ``[batch_size, seq_length + 1]`` int64 tensor of training windows."""
        rows = []
        while len(rows) < batch_size:
            perm = self._permutation(self.state.epoch)
            rows.append(self._window(int(self.train_windows[perm[self.state.cursor]])))
            self.state.cursor += 1
            if self.state.cursor == len(perm):
                self.state = LoaderState(self.state.epoch + 1, 0)
        return torch.from_numpy(np.stack(rows))

    def state_dict(self) -> dict[str, int]:
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved :meth:`state_dict`.

        Raises:
            DataError: the saved cursor is past this data's training windows (the data changed since it was saved).
        """
        self.state = restore_state(state, len(self.train_windows), "sequences")

    # -- validation --------------------------------------------------------------------------------
    def val_batches(self, batch_size: int, max_batches: int) -> list[torch.Tensor]:
        """The first ``max_batches`` validation batches, always the same windows in the same order."""
        idx = self.val_windows[: batch_size * max_batches]
        return [
            torch.from_numpy(np.stack([self._window(int(i)) for i in idx[s : s + batch_size]]))
            for s in range(0, len(idx), batch_size)
        ]

    @property
    def epoch_fraction(self) -> float:
        return self.state.epoch + self.state.cursor / max(1, len(self.train_windows))
