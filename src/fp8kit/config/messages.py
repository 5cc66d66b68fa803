"""One-line config error messages: pydantic ``ValidationError`` -> :class:`~fp8kit.base.errors.ConfigError`.

pydantic reports every problem of a model as a multi-line dump with its own wording. fp8kit shows ONE
line per error, naming where the value came from (the file or the ``--set`` argument) and the key, in
the words of the config reference: ``expected an integer, got '3' (str)``, ``unknown value 'rowwize'
(did you mean 'rowwise'?); choose one of ...``, ``must be > 0, got 0``, ``unknown key 'train.lr_'; did
you mean 'train.lr'?``. The type names and value ranges shown here are also those of ``docs/config.md``.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from fp8kit.base.errors import ConfigError


class FieldProblem(ValueError):
    """Raised by a model validator for a rule on ``key`` (dotted, e.g. ``fp8.bf16_cooldown_steps``)
    whose location pydantic cannot know; :func:`error_line` names that key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


class ModelConfigError(ConfigError):
    """The one-line error of constructing a config model directly; it keeps the pydantic error, the model,
    its input and its section so that the loader can word it again with the file or ``--set`` origins
    (pydantic builds nested sections through their ``__init__``, which raises this)."""

    def __init__(self, line: str, exc: ValidationError, model: type[BaseModel], data: Any,
                 root: tuple[str, ...]) -> None:
        super().__init__(line)
        self.exc, self.model, self.data, self.root = exc, model, data, root


@dataclass(frozen=True)
class Origin:
    """Where one key's value came from: ``where`` is a file path, ``--set section.key=value`` or
    ``defaults``; ``key`` is the key as the user spelled it (an old ``fp8.selective_fp8`` moved to
    ``selective.selective_fp8`` keeps its spelling); ``text`` is the raw ``--set`` value text."""

    where: str
    key: str
    text: str | None = None


# ----------------------------------------------------------------------------------------------
# Types and ranges in words


def unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> ``(X, True)``; any other type -> ``(type, False)``. ``Annotated`` is stripped."""
    if typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return unwrap_optional(args[0])[0], True
    return tp, False


def choices_of(tp: Any) -> tuple[str, ...] | None:
    """The allowed values of a ``Literal[...]`` (or ``list[Literal[...]]``) field type, else None."""
    base, _ = unwrap_optional(tp)
    if typing.get_origin(base) is list and typing.get_args(base):
        base = typing.get_args(base)[0]
    return tuple(typing.get_args(base)) if typing.get_origin(base) is Literal else None


def type_name(tp: Any) -> str:
    """A field type in words: ``integer``, ``float or none``, ``list of strings``, ``table of integers``."""
    base, optional = unwrap_optional(tp)
    origin = typing.get_origin(base)
    if origin is Literal:
        name = "string"
    elif origin is list:
        name = "list of " + _plural(typing.get_args(base)[0])
    elif origin is dict:
        name = "table of " + _plural(typing.get_args(base)[1])
    else:
        name = {int: "integer", float: "float", bool: "boolean", str: "string"}.get(base, str(base))
    return f"{name} or none" if optional else name


def _plural(tp: Any) -> str:
    return {"integer": "integers", "string": "strings", "float": "floats"}.get(type_name(tp), type_name(tp))


def expected(tp: Any) -> str:
    """``expected an integer`` / ``expected a float or none`` for a field type."""
    name = type_name(tp)
    return f"expected {'an' if name[0] in 'aeiou' else 'a'} {name}"


def range_text(field: FieldInfo) -> str | None:
    """The numeric range of a field's ``Field(gt=, ge=, lt=, le=)`` bounds: ``> 0``, ``in [0, 1)``."""
    lo = hi = None
    for m in field.metadata:
        if isinstance(m, Gt | Ge):
            lo = ("(", m.gt) if isinstance(m, Gt) else ("[", m.ge)
        elif isinstance(m, Lt | Le):
            hi = (")", m.lt) if isinstance(m, Lt) else ("]", m.le)
    if lo and hi:
        return f"in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {lo[1]}"
    if hi:
        return f"{'<' if hi[0] == ')' else '<='} {hi[1]}"
    return None


# ----------------------------------------------------------------------------------------------
# Unknown sections and keys


def unknown_key_message(section: str, key: str, where: str, model: type[BaseModel]) -> str:
    """``WHERE: unknown key 'train.recipe'; did you mean 'fp8.recipe'?`` (same key in another section
    first, then the closest dotted key)."""
    all_keys = [f"{s}.{k}" for s, f in model.model_fields.items() for k in f.annotation.model_fields]
    dotted = f"{section}.{key}"
    other = [k for k in all_keys if k.split(".", 1)[1] == key]
    if other:
        return f"{where}: unknown key {dotted!r}; did you mean {other[0]!r}?"
    close = difflib.get_close_matches(dotted, all_keys, n=1, cutoff=0.6)
    if not close:
        keys_here = [k for k in all_keys if k.startswith(f"{section}.")]
        close = difflib.get_close_matches(dotted, keys_here, n=1, cutoff=0.0)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{where}: unknown key {dotted!r}{hint}"


def unknown_section_message(section: str, where: str, model: type[BaseModel]) -> str:
    """``WHERE: unknown section [trian]; did you mean [train]?``"""
    names = list(model.model_fields)
    close = difflib.get_close_matches(str(section), names, n=1, cutoff=0.5)
    hint = f"; did you mean [{close[0]}]?" if close else f"; sections are {', '.join(names)}"
    return f"{where}: unknown section [{section}]{hint}"


# ----------------------------------------------------------------------------------------------
# ValidationError -> one line


_TYPE_ERRORS = ("_type", "_parsing", "int_from_float", "none_required")


def error_line(
    exc: ValidationError,
    model: type[BaseModel],
    data: Any,
    origins: dict[str, Origin] | None = None,
    default_where: str = "defaults",
    root: tuple[str, ...] = (),
    run_model: type[BaseModel] | None = None,
) -> str:
    """The one line for the first problem of ``exc`` (unknown keys and wrong types before values).

    Args:
        exc: raised by validating ``data`` against ``model``.
        model: the validated model class (``RunConfig`` or one section).
        data: the validated input (a dict of sections, or a section's keyword arguments).
        origins: dotted key -> :class:`Origin` of each value that was set.
        default_where: the origin of keys without an entry (``defaults``, a file, a class name).
        root: the sections above ``model`` (``("fp8",)`` when validating ``FP8Config`` alone).
        run_model: the whole config's class, for "did you mean" across sections (default ``model``).
    """
    errors = exc.errors()
    rank = {"extra_forbidden": 0}
    errors.sort(key=lambda e: rank.get(e["type"], 1 if e["type"].endswith(_TYPE_ERRORS) else 2))
    err = errors[0]
    loc = tuple(str(p) for p in err["loc"])
    origins = origins or {}
    problem = err.get("ctx", {}).get("error")
    if isinstance(problem, FieldProblem):
        loc = tuple(problem.key.split("."))[len(root):]
    full = root + loc
    if err["type"] == "extra_forbidden":
        if len(full) == 1:
            return unknown_section_message(full[0], default_where, model)
        where = origins.get(".".join(full), Origin(default_where, ""))
        return unknown_key_message(full[0], full[1], where.where, run_model or model)
    key = ".".join(full[:2])
    origin = origins.get(key, Origin(default_where, key))
    field = _field(model, loc[: 2 - len(root)]) if len(full) >= 2 else None
    value = _value_at(data, loc[: 2 - len(root)])
    if len(full) == 1 and err["type"].endswith(_TYPE_ERRORS):
        message = f"[{full[0]}]: expected a table of keys, got {type(err['input']).__name__}"
        return f"{default_where}: {message}"
    if len(full) < 2 or field is None:
        message = str(problem) if problem is not None else err["msg"]
    elif err["type"] == "literal_error" and isinstance(err["input"], str):
        message = _unknown_value(err["input"], choices_of(field.annotation) or ())
    elif err["type"].endswith(_TYPE_ERRORS) or err["type"] == "literal_error":
        got = repr(origin.text) if origin.text is not None else f"{value!r} ({type(value).__name__})"
        return _place(origin, key, f"{expected(field.annotation)}, got {got}")  # names the whole value
    elif err["type"] == "finite_number":
        message = f"must be a finite number, got {err['input']}"
    elif err["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        bounds = range_text(field) if len(full) == 2 else None
        message = f"must be {bounds or _ctx_bound(err)}, got {err['input']}"
    else:
        message = str(problem) if problem is not None else err["msg"]
    return _place(origin, ".".join(full), message)


def _place(origin: Origin, dotted: str, message: str) -> str:
    """Prefix ``message`` with where the value came from and the key (as the user spelled it)."""
    parts = dotted.split(".")
    spelled = ".".join([origin.key or ".".join(parts[:2]), *parts[2:]])
    if origin.where.startswith("--set"):
        return f"{origin.where}: {spelled}: {message}" if len(parts) > 2 else f"{origin.where}: {message}"
    if message.startswith(spelled) or message.startswith(dotted):
        return f"{origin.where}: {message}"
    return f"{origin.where}: {spelled}: {message}"


def _unknown_value(value: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.5)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown value {value!r}{hint}; choose one of {', '.join(choices)}"


def _ctx_bound(err: dict) -> str:
    ctx = err.get("ctx", {})
    for name, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if name in ctx:
            return f"{op} {ctx[name]}"
    return "in range"


def _field(model: type[BaseModel], loc: tuple[str, ...]) -> FieldInfo | None:
    """The FieldInfo at ``loc`` (``(section, key)`` from RunConfig or ``(key,)`` from a section)."""
    field = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        field = fields[part]
        model = field.annotation
    return field


def _value_at(data: Any, loc: tuple[str, ...]) -> Any:
    for part in loc:
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data
