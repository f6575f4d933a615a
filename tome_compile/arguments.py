"""Argument types of the command lines: a bad number is refused by argparse in one line (exit 2)
before any model is built, never a traceback after minutes of work.

    parser.add_argument("--repeats", type=positive_int, default=3)
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

__all__ = ["dataclass_from_args", "image_size", "parse_command_line", "parse_field", "positive_int"]

T = TypeVar("T")


def positive_int(text: str) -> int:
    """A whole number >= 1 (steps, seeds, batches, repeats, rounds, frames)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1; give a whole number >= 1")
    return value


def image_size(text: str) -> int:
    """An image side in pixels: >= 8 and a multiple of 8 (the VAE's latent is 1/8 of the image)."""
    value = positive_int(text)
    if value % 8:
        raise argparse.ArgumentTypeError(
            f"{value} is not a multiple of 8 (the latent is 1/8 of the image); "
            f"use e.g. {max(8, value // 8 * 8)}"
        )
    return value


def dataclass_from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """``cls`` (a dataclass) from the parsed command line: every field the parser has a flag of the
    same name for (``--seq-len`` -> ``seq_len``), then ``overrides`` (inverted flags, derived
    values). A flag left at ``None`` keeps a field's non-None default. No field copied by hand."""
    values = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in vars(args):
            continue
        value = getattr(args, f.name)
        if value is None and f.default is not None and f.default is not dataclasses.MISSING:
            continue
        values[f.name] = value
    return cls(**{**values, **overrides})


def parse_field(cls: type, name: str, text: str) -> Any:
    """``text`` (a string from ``serve run key=value`` or a config file) as field ``name`` of the
    dataclass ``cls``, by its type hint (``int | None``, ``tuple[int, ...]``, ``float``, ``str``)."""
    hint = typing.get_type_hints(cls)[name]
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is \
        typing.Union else (hint,)
    if text.lower() == "none" and type(None) in options:
        return None
    kind = next(o for o in options if o is not type(None))
    if typing.get_origin(kind) is tuple:  # tuple[int, ...] / tuple[float, ...]: "32,64"
        item = typing.get_args(kind)[0]
        return tuple(item(v) for v in text.split(",") if v)
    if kind is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{name}={text!r}: give true or false")
        return text.lower() in ("true", "1")
    return kind(text) if kind in (int, float) else text


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    """``parser.parse_args(argv)``, or the exit code argparse chose (2 after its one-line error on
    stderr, 0 after ``--help``): a ``main(argv) -> int`` returns it instead of raising SystemExit."""
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
