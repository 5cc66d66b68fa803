"""Module-name patterns for ``fp8.include`` / ``fp8.exclude``, matched on whole dotted parts.

A fully qualified name (FQN) such as ``model.layers.20.mlp.down_proj`` is a sequence of parts. A
pattern matches when it matches a contiguous run of whole parts, never a bare substring:

- glob (default): the pattern is split on dots and each piece is matched against one part with
  ``fnmatch`` (``*`` stays inside a part). ``layers.2`` matches ``model.layers.2.mlp`` but not
  ``model.layers.20.mlp``; ``layers.*.mlp`` matches any layer's MLP; ``*_proj`` any projection.
- regex (prefix ``re:``): the regex must match a run of whole parts, i.e. it is anchored at part
  boundaries: ``re:layers\\.(1|2)`` matches ``layers.1`` and ``layers.2`` but not ``layers.12``.

The reference trainers match bare substrings (``"experts" in fqn``); DESIGN.md lists that as a bug to
avoid, because ``layers.2`` would also select ``layers.20``..``layers.29``.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from fp8kit.base.errors import ConfigError


@dataclass(frozen=True)
class FqnPattern:
    """One compiled pattern. ``text`` is what the user wrote (shown in conversion reasons)."""

    text: str
    regex: re.Pattern[str] | None
    parts: tuple[str, ...]

    def matches(self, fqn: str) -> bool:
        """True when the pattern matches a contiguous run of whole dotted parts of ``fqn``."""
        if self.regex is not None:
            return self.regex.search(fqn) is not None
        names = fqn.split(".")
        n = len(self.parts)
        for start in range(len(names) - n + 1):
            if all(fnmatch.fnmatchcase(names[start + i], self.parts[i]) for i in range(n)):
                return True
        return False


def compile_pattern(text: str, where: str = "pattern") -> FqnPattern:
    """Compile one pattern.

    Raises:
        ConfigError: the pattern is empty, has an empty dotted part, or is an invalid regex.
    """
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: empty pattern")
    if text.startswith("re:"):
        body = text[3:]
        if not body:
            raise ConfigError(f"{where}: empty regex in pattern {text!r}")
        try:
            # Anchored at part boundaries: start of name or after a dot; end of name or before a dot.
            rx = re.compile(rf"(?:^|(?<=\.))(?:{body})(?=\.|$)")
        except re.error as e:
            raise ConfigError(f"{where}: invalid regex {body!r}: {e}") from None
        return FqnPattern(text, rx, ())
    parts = tuple(text.split("."))
    if any(p == "" for p in parts):
        raise ConfigError(f"{where}: pattern {text!r} has an empty dotted part")
    return FqnPattern(text, None, parts)


def compile_patterns(texts: list[str], where: str) -> list[FqnPattern]:
    """Compile a list of patterns (see :func:`compile_pattern`)."""
    return [compile_pattern(t, f"{where}[{i}]") for i, t in enumerate(texts)]


def first_match(patterns: list[FqnPattern], fqn: str) -> FqnPattern | None:
    """The first pattern matching ``fqn``, or None."""
    for p in patterns:
        if p.matches(fqn):
            return p
    return None
