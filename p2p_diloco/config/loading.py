"""Building a :class:`~p2p_diloco.config.Config` from a TOML file and ``--set section.key=value`` items.

Precedence (lowest to highest): dataclass defaults < TOML file < ``--set`` overrides < explicit CLI flags.
The CLI applies flags through :func:`apply_overrides` last, so they win.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, get_args, get_origin

from ..errors import ConfigError
from .checks import validate
from .schema import Config, field_types


def _coerce(where: str, annotation: Any, value: Any) -> Any:
    """Check ``value`` against a field's type, converting where it is lossless.

    A ``Literal[...]`` field is read as a string here; :func:`~p2p_diloco.config.checks.validate` checks its choices
    (also on a config built in code, which never comes through here).
    """
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if get_origin(annotation) is list:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ConfigError(f"{where} must be a list of strings, got {value!r}")
    if get_origin(annotation) is Literal and isinstance(value, bool) and str(value).lower() in get_args(annotation):
        return str(value).lower()  # data.streaming=false, unquoted, as a user types it (TOML reads a bool)
    if annotation is str or get_origin(annotation) is Literal:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{where} must be a string, got {value!r}")
    raise ConfigError(f"{where}: unsupported type")  # pragma: no cover - all fields are covered above


def apply_overrides(cfg: Config, overrides: Mapping[str, Mapping[str, Any]]) -> Config:
    """Apply ``{section: {key: value}}`` onto ``cfg`` in place, then check the whole config.

    Args:
        cfg: The configuration to change.
        overrides: Values by section and key, as a TOML file holds them.

    Returns:
        ``cfg`` itself.

    Raises:
        ConfigError: An unknown section or key, a value of the wrong type, or a bad config (:func:`validate`).
    """
    for section, values in overrides.items():
        if not hasattr(cfg, section) or not dataclasses.is_dataclass(getattr(cfg, section)):
            known = ", ".join(f.name for f in dataclasses.fields(Config))
            raise ConfigError(f"unknown config section [{section}] (known: {known})")
        if not isinstance(values, Mapping):
            raise ConfigError(f"[{section}] must be a table")
        obj = getattr(cfg, section)
        types = field_types(type(obj))
        for key, value in values.items():
            if key not in types:
                raise ConfigError(f"unknown config key {section}.{key} (known: {', '.join(sorted(types))})")
            setattr(obj, key, _coerce(f"{section}.{key}", types[key], value))
    validate(cfg)
    return cfg


def parse_set(item: str) -> tuple[str, str, Any]:
    """Parse one ``--set section.key=value``.

    Args:
        item: The argument, e.g. ``train.lr=3e-4``.

    Returns:
        ``(section, key, value)``; the value is read as TOML when it parses, else kept as a string.

    Raises:
        ConfigError: ``item`` is not of the form ``section.key=value``.
    """
    if "=" not in item:
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    dotted, raw = item.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set expects section.key=value, got {item!r}")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return parts[0], parts[1], value


def load_config(path: str | Path | None = None, sets: Iterable[str] = (), base: Config | None = None) -> Config:
    """Build a :class:`Config`: defaults (or ``base``), then the TOML file at ``path``, then ``--set`` items.

    Args:
        path: A TOML file; empty or None for none.
        sets: ``section.key=value`` items (:func:`parse_set`), applied after the file.
        base: Start from this config (changed in place) instead of the defaults.

    Returns:
        The checked configuration.

    Raises:
        ConfigError: A missing or unparsable file, or any error of :func:`apply_overrides`.
    """
    cfg = base if base is not None else Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot parse {p}: {e}") from None
        apply_overrides(cfg, data)
    nested: dict[str, dict[str, Any]] = {}
    for item in sets:
        section, key, value = parse_set(item)
        nested.setdefault(section, {})[key] = value
    return apply_overrides(cfg, nested)
