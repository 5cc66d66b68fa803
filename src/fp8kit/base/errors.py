"""Error types of fp8kit.

Every error a user can cause by bad input is an :class:`Fp8kitError` (or a subclass) whose message
is one line naming what is wrong and where (the file, the config key, the module). The command line
prints that line and exits with status 2, having written nothing (see ``cli.py``).
"""

from __future__ import annotations


class Fp8kitError(Exception):
    """Base class for user-facing errors: the message is one self-contained line."""


class ConfigError(Fp8kitError):
    """A config file, a ``--set`` override or a config value is invalid."""


class DataError(Fp8kitError):
    """A data path, corpus, tokenizer or token file is missing, empty or too small."""


class CheckpointError(Fp8kitError):
    """A checkpoint is missing, unreadable, or does not fit the model being trained."""


class PolicyError(Fp8kitError):
    """A selective-FP8 policy or benchmark report is invalid (names the file and the key path)."""


class CapabilityError(Fp8kitError):
    """The device cannot run what the config asks for (for example FP8 on a pre-Ada GPU)."""
