"""YAML + Hydra-style overrides -> typed config dataclasses, checked at load.

Only `loop/` reads YAML. Components own their config dataclasses (and check their invariants in
`__post_init__`); this module walks a YAML mapping into them, field by field, so an unknown key,
a bad type or a rejected value fails with the dotted key and the file it came from:

    ConfigError: conf/agent_rl.yaml: trainer.lrr: unknown key (known: lr, ...)

Overrides use Hydra's grammar (`trainer.lr=1e-5`, `+new.key=1`, `~key`), parsed by Hydra's own
override parser and applied to the YAML before it is checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the file and the dotted key."""


def build(cls: type[T], node: Any, path: str = "", source: str = "<config>") -> T:
    """Build dataclass `cls` from a plain mapping, strictly (unknown keys and bad types fail)."""
    where = f"{source}: {path or '<root>'}"
    if node is None:
        node = {}
    if not isinstance(node, dict):
        raise ConfigError(f"{where}: expected a mapping for {cls.__name__}, got {type(node).__name__}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in node:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(names)})"
            raise ConfigError(f"{source}: {_join(path, key)}: unknown key{hint}")
    kwargs = {k: _coerce(hints[k], v, _join(path, k), source) for k, v in node.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, AssertionError) as e:
        raise ConfigError(f"{where}: {e}") from None


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _coerce(tp: Any, value: Any, path: str, source: str) -> Any:
    where = f"{source}: {path}"
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, source)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, path, source)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{where}: {value!r} matches none of {tp}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not one of {list(get_args(tp))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item,) = get_args(tp)[:1] or (Any,)
        out = [_coerce(item, v, f"{path}[{i}]", source) for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def apply_overrides(node: dict, overrides: list[str], source: str) -> dict:
    """Apply Hydra-grammar overrides (`a.b=1`, `+a.c=x`, `~a.b`) to a nested mapping, in place."""
    if not overrides:
        return node
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except Exception as e:  # hydra raises OverrideParseException with a readable message
        raise ConfigError(f"{source}: bad override: {e}") from None
    for ov in parsed:
        keys = ov.key_or_group.split(".")
        parent = node
        for k in keys[:-1]:
            parent = parent.setdefault(k, {})
            if not isinstance(parent, dict):
                raise ConfigError(f"{source}: override {ov.input_line!r}: {k} is not a mapping")
        if ov.is_delete():
            parent.pop(keys[-1], None)
            continue
        # A key the YAML does not mention is still valid when the dataclass has it (embedded
        # defaults); `build` rejects unknown keys by name, so no struct check is needed here.
        parent[keys[-1]] = _plain(ov.value())
    return node


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def load(cls: type[T], path: str | Path, overrides: list[str] = ()) -> T:
    """Read YAML at `path`, apply overrides, build `cls`. Errors name the file and key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        node = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    apply_overrides(node, list(overrides), str(path))
    return build(cls, node, "", str(path))


def to_dict(obj: Any) -> dict:
    """The config as plain data (for MLflow params and manifests)."""
    return dataclasses.asdict(obj)


def to_yaml(obj: Any) -> str:
    """The config as YAML that `load` reads back to an equal config. (Not JSON-as-YAML: PyYAML
    reads JSON's `5e-05` as a string; lists stand for tuples.)"""
    return yaml.safe_dump(json.loads(json.dumps(to_dict(obj))), sort_keys=False)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


__all__ = ["ConfigError", "apply_overrides", "build", "flatten", "load", "to_dict", "to_yaml"]
