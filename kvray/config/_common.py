"""What every config model shares: the strict base, field types, :func:`validate` (one
:class:`~kvray.errors.ConfigError` naming each bad dotted field) and the file readers."""

from __future__ import annotations

import json
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from kvray.errors import ConfigError
from kvray.sizes import parse_size

_M = TypeVar("_M", bound=BaseModel)

GiB = 1 << 30
MiB = 1 << 20
TiB = 1 << 40

BackendName = Literal["mooncake", "yuanrong", "memcache"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @classmethod
    def misplaced(cls, field: str) -> str | None:
        """Why ``field``, unknown here, belongs in another kind of config, with the fix
        (:func:`validate` says it instead of "a typo?"); None: not known anywhere."""
        return None


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _size(value: Any) -> Any:
    # pydantic reports the field name itself; keep the message about the value.
    return parse_size(value, field="value") if isinstance(value, int | str) else value


ByteSize = Annotated[int, BeforeValidator(_size), Field(ge=0)]


def _flags(value: Any) -> Any:
    for arg in value if isinstance(value, list | tuple) else ():
        if not isinstance(arg, str) or not arg.startswith("--") or "=" not in arg:
            raise ValueError(f"each extra arg must look like '--flag=value', got {arg!r}")
    return value


ExtraArgs = Annotated[tuple[str, ...], BeforeValidator(_flags)]
"""Command-line flags passed through verbatim to a server kvray runs."""


def parse_host_port(value: str, *, field: str) -> tuple[str, int]:
    """Split ``host:port``; raise ``ValueError`` naming ``field`` if malformed."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(
            f"{field}: expected 'host:port' with a port in 1..65535, got {value!r} "
            "(for example '127.0.0.1:50051')"
        )
    return host.strip("[]"), int(port_s)


def _host_port(value: Any) -> Any:
    if isinstance(value, str):
        parse_host_port(value, field="value")
    return value


HostPort = Annotated[str, BeforeValidator(_host_port)]


def _url(scheme: tuple[str, ...]) -> Any:
    def check(value: Any) -> Any:
        if isinstance(value, str):
            head, sep, rest = value.partition("://")
            if not sep or head not in scheme:
                raise ValueError(
                    f"expected {scheme[0]}://host:port (e.g. '{scheme[0]}://127.0.0.1:5000'), "
                    f"got {value!r}"
                )
            parse_host_port(rest, field="value")
        return value

    return check


def _env_flag(env: Mapping[str, str], var: str) -> bool | None:
    """``1``/``0`` (or ``true``/``false``) as deployments write them; unset -> None."""
    if var not in env:
        return None
    value = env[var].strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{var} must be 1 or 0 (true/false), got {env[var]!r}")


def validate(model: type[_M], data: Mapping[str, Any], *, source: str) -> _M:
    """Validate ``data`` into ``model``; a failure is one :class:`ConfigError` that lists
    every bad field by its dotted path."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "<root>"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                # The fields of the section the typo is in, not of the top-level model.
                at = _model_at(model, err["loc"][:-1])
                misplaced = at.misplaced(str(err["loc"][-1])) if issubclass(at, _Strict) else None
                allowed = ", ".join(sorted(at.model_fields))
                msg = misplaced or f"unknown field (a typo?); allowed here: {allowed}"
            lines.append(f"  {loc}: {msg}")
        raise ConfigError(f"invalid {source}:\n" + "\n".join(lines)) from None


def _model_at(model: type[BaseModel], path: Sequence[int | str]) -> type[BaseModel]:
    """The model the field at ``path`` (an error's location) holds. Parts that name no
    field (list indexes, dict keys) stay inside the current field's type."""
    annotation: Any = model
    for part in path:
        current = _model_in(annotation)
        if current is not None and isinstance(part, str) and part in current.model_fields:
            annotation = current.model_fields[part].annotation
    return _model_in(annotation) or model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model in ``annotation``: itself, or inside ``X | None``, ``list[X]``, ..."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType, list, tuple, dict, Annotated):
        for arg in get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path!r}: {exc.strerror}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what}: {path!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path!r} must hold a JSON object, got {type(data).__name__}")
    return data


def read_yaml(path: str, what: str = "--config") -> dict[str, Any]:
    """A YAML file holding a mapping; errors name ``what`` (the setting that named it)."""
    import yaml  # ships with ray[default]

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {path!r}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: {path!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path!r} must hold a mapping")
    return data
