"""Loading the run config: TOML / YAML files, ``--set section.key=value`` overrides, resolved_config.toml.

A config is built in four steps, each with one-line :class:`~fp8kit.base.errors.ConfigError` messages
naming the file or the ``--set`` argument and the key:

1. read the file (TOML through ``tomllib``, YAML through ``yaml.safe_load``: no object construction),
2. parse each ``--set`` value by its key's declared type (``true``/``off``, ``1_000``, ``a,b`` or a TOML
   list, a TOML inline table, ``none``); unknown sections and keys get the closest valid key,
3. move the ``[selective]`` keys still written under ``[fp8]`` (their old place) to ``[selective]``,
   with a note in :attr:`RunConfig.notes`; the same key in both places with different values is an error,
4. validate the result against :class:`~fp8kit.config.schema.RunConfig` (pydantic, strict types) and
   turn the first problem into one line (``fp8kit.config.messages``).
"""

from __future__ import annotations

import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from fp8kit.base.errors import ConfigError
from fp8kit.config.messages import (
    ModelConfigError,
    Origin,
    error_line,
    expected,
    unknown_key_message,
    unknown_section_message,
    unwrap_optional,
)
from fp8kit.config.pretrained import resolve_pretrained
from fp8kit.config.schema import NONE_REFUSED, RunConfig, SelectiveConfig, section_class, section_names

#: ``[selective]`` keys that are still accepted under ``[fp8]`` (where they were before the split).
MOVED_TO_SELECTIVE: tuple[str, ...] = tuple(SelectiveConfig.model_fields)
#: Removed keys still accepted at the value that meant "off" (old configs and run directories' resolved
#: configs load, with a note): ``(section, key) -> (that value, why the key went)``.
REMOVED: dict[tuple[str, str], tuple[Any, str]] = {
    ("distributed", "etp"): (1, "expert tensor parallelism is not supported, every rank holds whole experts "
                                "(docs/distributed.md)"),
}


def _removed(section: str, key: str, value: Any, where: str, notes: list[str]) -> bool:
    """Whether ``section.key`` is a :data:`REMOVED` key (then noted, and to be skipped).

    Raises:
        ConfigError: the key is set to anything but its old "off" value.
    """
    if (section, key) not in REMOVED:
        return False
    off, why = REMOVED[section, key]
    if value != off:
        raise ConfigError(f"{where}: {section}.{key} = {_show(value)}: {why}; remove the key")
    notes.append(f"{where}: {section}.{key} = {_show(off)} is ignored (the key was removed: {why})")
    return True


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a TOML or YAML config file into a dict of sections (no validation yet).

    Raises:
        ConfigError: the file is missing, unreadable, of an unknown extension, or not valid TOML/YAML.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e}") from None
    if suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    elif suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            msg = " ".join(str(e).split())
            raise ConfigError(f"{p}: invalid YAML: {msg}") from None
        data = {} if data is None else data
    else:
        raise ConfigError(f"config file {str(p)!r}: unknown extension {suffix!r}; use .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a table of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, str, str]:
    """Split ``section.key=value`` into its three parts.

    Raises:
        ConfigError: the override has no ``=`` or no ``section.`` prefix.
    """
    where = f"--set {text}"
    if "=" not in text:
        raise ConfigError(f"{where}: expected section.key=value")
    dotted, value = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"{where}: the key must be section.key (for example train.lr)")
    return parts[0], parts[1], value


def parse_override_value(text: str, tp: Any, where: str) -> Any:
    """Parse the text of ``--set key=TEXT`` into the field type ``tp`` (element types are checked later).

    Raises:
        ConfigError: ``WHERE: expected an integer, got 'ten'``.
    """
    base, optional = unwrap_optional(tp)
    raw = text.strip()
    if optional and raw.lower() in ("none", "null"):
        return None
    origin = typing.get_origin(base)
    try:
        if base is bool:
            low = raw.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
        elif base is int:
            return int(raw.replace("_", ""))
        elif base is float:
            return float(raw)
        elif base is str or origin is Literal:
            if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
                return raw[1:-1]
            return raw
        elif origin is list:
            if raw.startswith("["):
                try:
                    return tomllib.loads(f"v = {raw}")["v"]
                except tomllib.TOMLDecodeError:
                    # [fprop,dgrad]: bare words in brackets, as a shell passes the quoted TOML form unquoted; each
                    # part one word (no quotes, brackets, inner spaces), none empty: "[,]" is a typo, not []
                    parts = [part.strip() for part in raw[1:-1].split(",")] if raw.endswith("]") else [""]
                    if not all(p and not any(c in p for c in "'\"[]{} \t") for p in parts):
                        raise
                    return parts
            return [part.strip() for part in raw.split(",") if part.strip()]
        elif origin is dict and raw.startswith("{"):
            return tomllib.loads(f"v = {raw}")["v"]
    except (ValueError, tomllib.TOMLDecodeError):
        pass
    raise ConfigError(f"{where}: {expected(tp)}, got {text!r}")


def _target(section: str, key: str, where: str) -> str:
    """The dotted key that ``section.key`` sets (an old ``fp8.<selective key>`` -> ``selective.<key>``)."""
    if key in section_class(section).model_fields:
        return f"{section}.{key}"
    if section == "fp8" and key in MOVED_TO_SELECTIVE:
        return f"selective.{key}"
    raise ConfigError(unknown_key_message(section, key, where, RunConfig))


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _desc(origin: Origin, value: Any) -> str:
    return origin.where if origin.where.startswith("--set") else f"{origin.where}: {origin.key} = {_show(value)}"


class _Layer:
    """The values one source sets (a file, or all ``--set`` arguments), keyed by their dotted key."""

    def __init__(self, notes: list[str]) -> None:
        self.values: dict[str, tuple[Any, Origin]] = {}
        self.notes = notes

    def put(self, target: str, value: Any, origin: Origin) -> None:
        """Set ``target``; a later value of the same spelling wins, a differing one of the other spelling
        (old ``[fp8]`` vs new ``[selective]`` place) is an error."""
        if origin.key != target:
            where = origin.where if origin.where.startswith("--set") else f"{origin.where}: {origin.key}"
            self.notes.append(f"{where}: moved to {target} (the [fp8] place of this key is deprecated)")
        old = self.values.get(target)
        if old is not None and old[1].key != origin.key and old[0] != value:
            raise ConfigError(
                f"{_desc(origin, value)} conflicts with {_desc(old[1], old[0])}; set {target} once "
                f"([fp8] is its old place)"
            )
        self.values[target] = (value, origin)


def build_config(
    data: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), *, source: str = "config"
) -> RunConfig:
    """Build and validate a :class:`RunConfig` from parsed sections plus ``--set`` overrides.

    Args:
        data: sections as read by :func:`read_config_file` (``{}`` for the defaults).
        overrides: ``section.key=value`` strings, applied in order after the file.
        source: the file's name in messages.

    Raises:
        ConfigError: an unknown section or key (with the closest valid key), a value of the wrong
            type, a value out of range, or a key set in its old and new place with different values;
            the message names the file or the ``--set`` argument and the key.
    """
    notes: list[str] = []
    in_file, on_line = _Layer(notes), _Layer(notes)
    for section, body in data.items():
        if section not in section_names():
            raise ConfigError(unknown_section_message(section, source, RunConfig))
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: [{section}]: expected a table of keys, got {type(body).__name__}")
        for key, value in body.items():
            if not _removed(section, key, value, source, notes):
                in_file.put(_target(section, key, source), value, Origin(source, f"{section}.{key}"))
    for text in overrides:
        section, key, raw = parse_override(text)
        where = f"--set {text}"
        if section not in section_names():
            raise ConfigError(unknown_section_message(section, where, RunConfig))
        if (section, key) in REMOVED:
            off = REMOVED[section, key][0]
            if _removed(section, key, parse_override_value(raw, type(off), where), where, notes):
                continue
        target = _target(section, key, where)
        tsec, tkey = target.split(".")
        value = parse_override_value(raw, section_class(tsec).model_fields[tkey].annotation, where)
        on_line.put(target, value, Origin(where, f"{section}.{key}", raw))
    sections: dict[str, dict[str, Any]] = {}
    origins: dict[str, Origin] = {}
    for target, (value, origin) in {**in_file.values, **on_line.values}.items():
        tsec, tkey = target.split(".")
        refused = (section_class(tsec).model_fields[tkey].json_schema_extra or {}).get(NONE_REFUSED)
        if value is None and refused:  # a written none / null where unset and none mean different things
            raise ConfigError(f"{origin.where}: {origin.key}: {refused}")
        sections.setdefault(tsec, {})[tkey] = value
        origins[target] = origin
    try:
        cfg = RunConfig(**sections)
    except ModelConfigError as e:  # raised by the first section (or RunConfig's rules) that fails
        line = error_line(e.exc, e.model, e.data, origins, root=e.root, run_model=RunConfig)
        raise ConfigError(line) from None
    cfg.notes.extend(notes)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), *,
                resolve: bool = True) -> RunConfig:
    """Load a config file (or the defaults when ``path`` is None) and apply ``--set`` overrides.

    With ``model.pretrained`` set, ``data.vocab_size`` and ``data.tokenizer`` come from that directory
    (:func:`fp8kit.config.pretrained.resolve_pretrained`); ``resolve=False`` leaves that to the caller (a resume
    may rebuild from its run's own files when the directory is gone: ``fp8kit.train.export.from_run_files``).

    Raises:
        ConfigError: see :func:`read_config_file`, :func:`build_config` and ``resolve_pretrained``.
    """
    data = read_config_file(path) if path is not None else {}
    cfg = build_config(data, overrides, source=str(path) if path is not None else "defaults")
    # model.pretrained fixes data.vocab_size and data.tokenizer (fp8kit.config.pretrained)
    return resolve_pretrained(cfg) if resolve else cfg


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as TOML in the current layout (``None`` values omitted, so that they
    load back as defaults); :func:`load_config` of the file gives a config equal to ``cfg``."""
    import tomli_w

    Path(path).write_text(tomli_w.dumps(cfg.to_dict()), encoding="utf-8")
