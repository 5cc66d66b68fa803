"""The rich console used for tables, progress and logs.

In a terminal rich sizes itself; when the output is a pipe or a file (CI logs, ``| tee``), rich would
assume 80 columns and fold every table, so we give it a wide fixed width instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console


def make_console(stderr: bool = False) -> Console:
    """A console for fp8kit's output (wide when not attached to a terminal)."""
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=180, soft_wrap=False)


@contextmanager
def stage_status(console: Console, first: str) -> Iterator[tuple[Callable[[str], None], Callable[[str], None]]]:
    """``(update, warn)`` for a long set-up of several stages.

    In a terminal ``update(message)`` shows the stage on a rich spinner. Elsewhere (a pipe, a SLURM log, where a
    spinner prints nothing) each new stage is printed once as a line, so a log shows where a long set-up is.
    ``warn(message)`` prints a yellow line at once, above the spinner.
    """

    def warn(message: str) -> None:
        console.print(f"[yellow]warning:[/yellow] {message}", highlight=False)

    if console.is_terminal:
        with console.status(first) as status:
            yield status.update, warn
        return
    console.print(f"{first} ...", highlight=False)
    last = [first]

    def update(message: str) -> None:
        if message != last[0]:
            last[0] = message
            console.print(f"  {message} ...", highlight=False)

    yield update, warn
