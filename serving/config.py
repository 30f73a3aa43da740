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
name the full dotted key and the file, so the fix is obvious. A key that was renamed or moved is
listed in the top-level class's ``RENAMED`` (old dotted key -> new dotted key): using the old name
is an error that names the new one, never a silent default.

A nested section keeps the defaults of its field's ``default_factory`` (``engine:
EngineSettings = field(default_factory=lambda: EngineSettings(max_batch_size=8))``): the file and
the overrides replace only the keys they name. The command lines are built on this in
``serving.cli``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    pass


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    values: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` from a YAML file (optional), then ``values`` (dotted key -> value, already
    parsed: what command-line flags set), then dotted ``key=value`` overrides (applied last;
    values are parsed as YAML, so ``k=4``, ``lr=1e-4``, ``names=[a, b]`` and ``x=null`` work)."""
    raw: dict = {}
    source = ""  # errors name the file a key came from; overrides alone need no prefix
    if path is not None:
        source = f"{path}: "
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of keys to values, not {type(raw).__name__}")
    for key, value in (values or {}).items():
        _set_dotted(raw, key, value)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. optim.lr=1e-4)")
        try:
            parsed = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            raise ConfigError(f"override {item!r}: {value!r} is not a valid YAML value (quote it)") from None
        _set_dotted(raw, key.strip(), parsed)
    _check_renamed(raw, getattr(cls, "RENAMED", {}), source)
    return _build(cls, raw, prefix="", source=source)


def to_dict(config: Any) -> dict:
    """The config as plain data (for saving next to checkpoints and reports)."""
    return dataclasses.asdict(config)


def describe(cls: type) -> str:
    """One line per key with its type, default and doc: the reference for a config file. A nested
    section shows the defaults its field gives it (see ``field_default``)."""
    return "\n".join(_describe(cls, None))


def _describe(cls: type, defaults: Any) -> list[str]:
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        default = getattr(defaults, f.name) if defaults is not None else field_default(f)
        if dataclasses.is_dataclass(hint):
            nested = default if dataclasses.is_dataclass(default) else None
            lines += [f"{f.name}.{line}" for line in _describe(hint, nested)]
            continue
        lines.append(f"{f.name}: {_type_name(hint)} = {default!r}  # {f.metadata.get('doc', '')}".rstrip(" #"))
    return lines


def field_default(f: dataclasses.Field) -> Any:
    """A field's default value ("required" when it has none)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "required"


def _check_renamed(raw: dict, renamed: Mapping[str, str], source: str) -> None:
    """An old key name is an error that names its new one (a silent default would hide it); an old
    file gets every rename it needs in one message."""
    found = []
    for old, new in renamed.items():
        node: Any = raw
        for part in old.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            found.append((old, new))
    if len(found) == 1:
        raise ConfigError(f"{source}{found[0][0]} was renamed to {found[0][1]}: use that key instead")
    if found:
        raise ConfigError(f"{source}keys were renamed: {', '.join(f'{old} -> {new}' for old, new in found)}; use the new keys")


def _set_dotted(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {part!r} is a value, not a section")
    node[parts[-1]] = value


def _build(cls: type, raw: dict, prefix: str, source: str, base: Any = None) -> Any:
    """``cls`` from ``raw``; with ``base`` (the field's default section), only the keys in ``raw``
    replace its values."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}unknown key {prefix}{unknown[0]!r}; valid keys under {prefix.rstrip('.') or 'the top level'}: "
            f"{', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in raw.items():
        nested = dataclasses.is_dataclass(hints[name]) and fields[name].default_factory is not dataclasses.MISSING
        section = getattr(base, name) if base is not None else (fields[name].default_factory() if nested else None)
        if nested and dataclasses.is_dataclass(section):
            kwargs[name] = _build(hints[name], value, f"{prefix}{name}.", source, base=section)
        else:
            kwargs[name] = _convert(hints[name], value, f"{prefix}{name}", source)
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise ConfigError(f"{source}{prefix.rstrip('.') or 'config'}: {e}") from None
    except ValueError as e:
        raise ConfigError(f"{source}{prefix}{e}") from None


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
        raise ConfigError(f"{source}{key}={value!r} is not a {_type_name(hint)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{source}{key}={value!r} must be one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}{key}={value!r} must be a list")
        item = args[0] if args else Any
        items = [_convert(item, v, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{source}{key}={value!r} must be a mapping")
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
        raise ConfigError(f"{source}{key}={value!r} must be {_type_name(hint)}")
    return value


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return " | ".join(map(repr, args))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if hint is type(None):
        return "None"
    if origin in (list, tuple, dict) and args:
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
