"""The config reference (``docs/config.md``), generated from the section models of ``fp8kit.config.schema``.

Each key's row shows its type and default as written in a TOML file, its ``Field(description=...)``,
its allowed values (``Literal`` choices) and its range (``Field`` bounds). ``fp8kit config-docs`` prints
it and ``make docs`` writes it; ``tests/test_config.py`` checks that ``docs/config.md`` is current.
"""

from __future__ import annotations

from typing import Any

from fp8kit.config.messages import choices_of, range_text, type_name
from fp8kit.config.schema import section_class, section_names


def _default_text(default: Any) -> str:
    if default is None:
        return "none"
    if isinstance(default, bool):
        return str(default).lower()
    return repr(default).replace("'", '"')


def config_reference_markdown() -> str:
    """The reference of every config key (type, default, meaning) as Markdown, one table per section."""
    lines = [
        "# Config reference",
        "",
        "Generated from the pydantic models in `src/fp8kit/config/schema.py` by `fp8kit config-docs`; do not",
        "edit by hand (a test checks that this file is current). Every key can be set in a TOML or YAML file",
        "(`[section]` then `key = value`) or on the command line with `--set section.key=value`. A list on the",
        "command line is TOML (`--set 'fp8.fast_accum=[\"fprop\", \"dgrad\"]'`), bare words in brackets",
        "(`fp8.fast_accum=[fprop,dgrad]`; zsh needs it quoted) or comma-separated (`fp8.fast_accum=fprop,dgrad`).",
        "",
    ]
    for section in section_names():
        cls = section_class(section)
        doc = " ".join((cls.__doc__ or "").split())
        lines += [f"## `[{section}]`", "", doc, ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for name, field in cls.model_fields.items():
            default = field.get_default(call_default_factory=True)
            meaning = (field.description or "").replace("|", "\\|")
            choices = choices_of(field.annotation)
            if choices:
                meaning += f" One of: {', '.join(f'`{c}`' for c in choices)}."
            bounds = range_text(field)
            if bounds:
                meaning += f" Must be {bounds}."
            lines.append(f"| `{name}` | {type_name(field.annotation)} | `{_default_text(default)}` | {meaning} |")
        lines.append("")
    return "\n".join(lines)
