"""YAML configs mapped onto typed dataclasses, with ``key=value`` dotted overrides.

    @dataclass
    class Optim:
        lr: float = field(default=3e-4, metadata={"doc": "peak learning rate"})

    @dataclass
    class TrainConfig:
        optim: Optim = field(default_factory=Optim)
        steps: int = 100

    cfg = load_config(TrainConfig, "configs/distill_code.yaml", ["optim.lr=1e-4", "steps=50"])

Every key must be a field (an unknown key is an error that lists the valid ones), every value is
checked against the field's type (int, float, str, bool, Literal choices, Optional, list/tuple,
dict, nested dataclasses), and a dataclass's own ``__post_init__`` validation runs as usual. Errors
name the full dotted key and the file, so the fix is obvious.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Sequence, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    pass


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build ``cls`` from a YAML file (optional) and dotted ``key=value`` overrides (applied last;
    values are parsed as YAML, so ``k=4``, ``lr=1e-4``, ``names=[a, b]`` and ``x=null`` work)."""
    raw: dict = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of keys to values, not {type(raw).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. optim.lr=1e-4)")
        _set_dotted(raw, key.strip(), yaml.safe_load(value) if value.strip() else "")
    return _build(cls, raw, prefix="", source=source)


def to_dict(config: Any) -> dict:
    """The config as plain data (for saving next to checkpoints and reports)."""
    return dataclasses.asdict(config)


def describe(cls: type) -> str:
    """One line per key with its type, default and doc: the reference for a config file."""
    lines = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            lines += [f"{f.name}.{line}" for line in describe(hint).splitlines()]
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")  # fmt: skip
        lines.append(f"{f.name}: {_type_name(hint)} = {default!r}  # {f.metadata.get('doc', '')}".rstrip(" #"))
    return "\n".join(lines)


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part!r} is a value, not a section")
    node[parts[-1]] = value


def _build(cls: type, raw: dict, prefix: str, source: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key {prefix}{unknown[0]!r}; valid keys under {prefix.rstrip('.') or 'the top level'}: "
            f"{', '.join(sorted(fields))}"
        )
    kwargs = {name: _convert(hints[name], value, f"{prefix}{name}", source) for name, value in raw.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"{source}: {prefix}{e}") from None


def _convert(hint: Any, value: Any, key: str, source: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, prefix=f"{key}.", source=source)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, key, source)
            except ConfigError:
                continue
        raise ConfigError(f"{source}: {key}={value!r} is not a {_type_name(hint)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}: {key}={value!r} must be one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {key}={value!r} must be a list")
        item = args[0] if args else Any
        items = [_convert(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}={value!r} must be a mapping")
        vt = args[1] if len(args) == 2 else Any
        return {k: _convert(vt, v, f"{key}.{k}", source) for k, v in value.items()}
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # PyYAML (YAML 1.1) reads "5e-4" (no dot) as a string; it is still a float to a user
            return float(value)
        except ValueError:
            pass
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # e.g. a model name that YAML read as a number
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        raise ConfigError(f"{source}: {key}={value!r} must be {_type_name(hint)}")
    return value


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return " | ".join(map(repr, typing.get_args(hint)))
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
