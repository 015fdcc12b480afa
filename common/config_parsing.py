"""Plain data (YAML, JSON, CLI flags) into frozen config dataclasses: the checks every section passes.

Every rule that fails raises `ConfigError` with a message that starts with the key it names
(`router.port: ...`). `ClusterConfig.from_dict` (common/config.py) drives these, section by section.
"""

from __future__ import annotations

import dataclasses

from engine.config import ConfigError as ConfigError  # one error type for every config class, declared below
from engine.config import check as check


def reject_unknown(raw: dict, cls, prefix: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) {[prefix + k for k in unknown]}; known: {sorted(known)}")


def build(cls, values: dict, prefix: str):
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in values.items():
        _check_type(value, str(hints[key]), f"{prefix}{key}")
    try:
        return cls(**values)
    except (ValueError, TypeError) as err:  # ConfigError, or a section's own ValueError naming its key
        raise ConfigError(f"{prefix}{err}") from None


_SCALARS = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_type(value, hint: str, key: str) -> None:
    """Plain-data values (YAML, JSON, flags) must match the field's annotation before any rule runs."""
    allowed = [part.strip() for part in hint.split("|")]
    if value is None:
        if "None" not in allowed:
            raise ConfigError(f"{key}: must not be null (expected {hint})")
        return
    for name in allowed:
        if name == "None":  # null was handled above; a non-null value must match another type
            continue
        types = _SCALARS.get(name)
        if types is None:  # a nested section, already built
            return
        if isinstance(value, bool) and name != "bool":
            continue
        if isinstance(value, types):
            return
    raise ConfigError(f"{key}: expected {hint}, got {type(value).__name__} {value!r}")
