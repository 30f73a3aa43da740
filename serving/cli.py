"""One way to drive every command: a config file, flags, dotted overrides, ``--describe`` and one
error format, over the settings dataclass of the command (``serving.config`` does the loading).

    CLI = Command("serve", ServeConfig, __doc__, flags=[
        Flag("--router", "router"),
        Flag("--target", "target_address"),
        Flag("--no-cpu-kernels", "engine.cpu_kernels", const=False),
    ])

    def main(argv: list[str] | None = None) -> int:
        return CLI.main(argv, run)  # run(cfg: ServeConfig, args: argparse.Namespace) -> int

Every command then reads

    COMMAND [--config FILE] [--FLAG VALUE ...] [key=value ...]
    COMMAND --describe            # every key with its type, default and doc (alias: --show-config)

and builds its settings from, later ones winning: the dataclass's defaults, the YAML file, the
flags (each one a shorthand for one dotted key: ``--batch-size 4`` is ``engine.max_batch_size=4``),
the ``key=value`` overrides. A bad setting, wherever it came from, is one line
``COMMAND: error: MESSAGE`` on stderr and exit status 2, with no traceback; argparse's own usage
errors (an unknown flag) look and exit the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Generic, Literal, Sequence, TypeVar, Union

import yaml

from serving.config import ConfigError, _type_name, describe, load_config

T = TypeVar("T")

_VALUE = object()  # Flag.const's default: the flag takes a value


@dataclass(frozen=True)
class Flag:
    """A command-line flag that sets one dotted config key.

    names: the flag and its aliases ("--batch-size", "--max-batch-size").
    key: the dotted key it sets ("engine.max_batch_size").
    const: a switch without a value that sets the key to this (``--no-cpu-kernels``: False).
    repeat: may be given several times; the values make the key's list (``--stop``).
    sep: one value holds a list split at this separator (``--domains code,chat``).
    help: shown by ``--help``; default: the key's own doc.
    """

    names: str | tuple[str, ...]
    key: str
    const: Any = _VALUE
    repeat: bool = False
    sep: str | None = None
    help: str | None = None

    @property
    def all_names(self) -> tuple[str, ...]:
        return (self.names,) if isinstance(self.names, str) else tuple(self.names)


class Command(Generic[T]):
    """The argument parser of one command over its settings dataclass ``cls``. ``parser`` is an
    ordinary ``argparse.ArgumentParser``: a command adds its own non-setting arguments to it
    (``--resume``, ``--shard``), which ``run`` then finds on ``args``."""

    def __init__(
        self,
        prog: str,
        cls: type[T],
        doc: str | None = None,
        *,
        flags: Sequence[Flag] = (),
        errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        """``errors``: exception types, besides ``ConfigError``, that ``run`` may raise for a
        mistake of the user's (a missing file, a prompt too long): reported in the one format."""
        self.prog, self.cls, self.flags, self.errors = prog, cls, tuple(flags), errors
        first, _, rest = (doc or "").strip().partition("\n")
        self.parser = argparse.ArgumentParser(
            prog=prog, description=first or None, epilog=rest.strip("\n") or None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        self.parser.add_argument("--config", metavar="FILE", help="YAML file of settings; every key: --describe")
        self.parser.add_argument("--describe", "--show-config", action="store_true",
                                 help="print every setting with its type, default and doc, and exit")  # fmt: skip
        for i, flag in enumerate(self.flags):
            self._add_flag(i, flag)
        self.parser.add_argument("overrides", nargs="*", metavar="key=value",
                                 help="dotted settings, applied last (e.g. engine.max_batch_size=4)")  # fmt: skip

    def _add_flag(self, i: int, flag: Flag) -> None:
        f, hint = setting(self.cls, flag.key)
        doc = flag.help or f.metadata.get("doc", "")
        if flag.const is not _VALUE:
            self.parser.add_argument(*flag.all_names, dest=f"_flag{i}", action="store_const", const=flag.const, default=None,
                                     help=f"{doc} (sets {flag.key}={flag.const!r})".lstrip())  # fmt: skip
            return
        item = _item_hint(hint) if flag.repeat or flag.sep else hint
        parse = _value_parser(item)
        if flag.sep:
            sep = flag.sep
            convert = lambda text: [parse(x.strip()) for x in text.split(sep) if x.strip()]  # noqa: E731
        else:
            convert = parse
        choices = f" ({_type_name(_strip_none(item))})" if typing.get_origin(_strip_none(item)) is Literal else ""
        self.parser.add_argument(
            *flag.all_names, dest=f"_flag{i}", type=convert, default=None, action="append" if flag.repeat else "store",
            metavar=flag.key.rsplit(".", 1)[-1].upper(), help=f"{doc}{choices} (sets {flag.key})".lstrip(),
        )  # fmt: skip

    def load(self, args: argparse.Namespace) -> T:
        """The settings of parsed arguments: defaults, ``--config``, flags, then overrides."""
        values = {}
        for i, flag in enumerate(self.flags):
            value = getattr(args, f"_flag{i}")
            if value is not None:
                values[flag.key] = value
        return load_config(self.cls, args.config, args.overrides, values)

    def main(
        self,
        argv: Sequence[str] | None,
        run: Callable[[T, argparse.Namespace], int | None],
        *,
        early: Callable[[argparse.Namespace], int | None] | None = None,
    ) -> int:
        """Parse, answer ``--describe``, load the settings and call ``run(cfg, args)``; its result
        is the exit status. ``early(args)``, if given, runs before the settings load and ends the
        command when it returns a status (``collect-router-data --merge`` needs no settings)."""
        try:
            args = self.parser.parse_intermixed_args(argv)
            if args.describe:
                print(describe(self.cls))
                return 0
            if early is not None and (status := early(args)) is not None:
                return status
            return run(self.load(args), args) or 0
        except (ConfigError, *self.errors) as e:
            return self.fail(e)

    def fail(self, error: BaseException | str) -> int:
        """Report a user's mistake in the one format; returns the exit status 2."""
        print(f"{self.prog}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2


def setting(cls: type, key: str) -> tuple[dataclasses.Field, Any]:
    """The field and type hint of a dotted key of a settings dataclass."""
    node, parts = cls, key.split(".")
    for n, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(node)}
        if part not in fields:
            raise KeyError(f"{cls.__name__} has no setting {key!r}")
        hint = typing.get_type_hints(node)[part]
        if n == len(parts) - 1:
            return fields[part], hint
        node = hint
    raise KeyError(key)


def _strip_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return hint


def _item_hint(hint: Any) -> Any:
    args = typing.get_args(_strip_none(hint))
    return args[0] if args else Any


def _value_parser(hint: Any) -> Callable[[str], Any]:
    """A text setting takes the flag's value verbatim (a prompt such as ``x: 1`` or ``1e3`` stays
    text); any other is read as YAML like a ``key=value`` override, and ``load_config`` checks it."""
    if _strip_none(hint) is str:
        return str

    def parse(text: str) -> Any:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text  # the loader then names the key and the type it wants

    return parse
