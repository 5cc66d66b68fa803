"""The base of every config section: strict pydantic models whose errors are one-line ``ConfigError``s."""

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from fp8kit.config.messages import ModelConfigError, error_line


class ConfigModel(BaseModel):
    """Base of every config model: strict types, no unknown keys, one-line :class:`ConfigError`."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True, allow_inf_nan=False)
    section: ClassVar[str | None] = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise self._error(e, data) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise self._error(e, {name: value}) from None

    @classmethod
    def _error(cls, e: ValidationError, data: dict[str, Any]) -> ModelConfigError:
        from fp8kit.config.schema import RunConfig  # the whole schema, for messages naming its keys

        root = (cls.section,) if cls.section else ()
        line = error_line(e, cls, data, default_where=cls.__name__, root=root, run_model=RunConfig)
        return ModelConfigError(line, e, cls, data, root)
