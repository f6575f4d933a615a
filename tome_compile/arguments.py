"""Argument types of the command lines: a bad number is refused by argparse in one line (exit 2)
before any model is built, never a traceback after minutes of work.

    parser.add_argument("--repeats", type=positive_int, default=3)
"""

from __future__ import annotations

import argparse

__all__ = ["image_size", "positive_int"]


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
