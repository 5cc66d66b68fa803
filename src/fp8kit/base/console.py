"""The rich console used for tables, progress and logs.

In a terminal rich sizes itself; when the output is a pipe or a file (CI logs, ``| tee``), rich would
assume 80 columns and fold every table, so we give it a wide fixed width instead.
"""

from __future__ import annotations

import sys

from rich.console import Console


def make_console(stderr: bool = False) -> Console:
    """A console for fp8kit's output (wide when not attached to a terminal)."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=180, soft_wrap=False)
