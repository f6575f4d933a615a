"""The demo's picture: a grid of images with its rows and columns labelled (Pillow)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

__all__ = ["bare_grid", "labelled_grid"]

_BACKGROUND = (255, 255, 255)
_INK = (20, 20, 20)
_PAD = 6


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1 with FreeType: a scalable font
    except TypeError:  # pragma: no cover - older Pillow: the fixed bitmap font
        return ImageFont.load_default()


def bare_grid(rows: Sequence[torch.Tensor], scale: int = 1) -> Image.Image:
    """``rows`` of ``[N, 3, H, W]`` images in ``[0, 1]`` side by side, rows stacked; no labels."""
    grid = np.concatenate(
        [
            np.concatenate(list((r.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)), 1)
            for r in rows
        ],
        0,
    )
    picture = Image.fromarray(grid)
    if scale > 1:
        picture = picture.resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST)
    return picture


def _text_size(draw: ImageDraw.ImageDraw, text: str, font: ImageFont.ImageFont) -> tuple[int, int]:
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    return right - left, bottom - top


def labelled_grid(rows: Sequence[tuple[list[str], torch.Tensor]], columns: Sequence[list[str]],
                  scale: int = 1, font_size: int = 13) -> Image.Image:
    """The grid with a label block left of each row and a header above each column.

    Args:
        rows: ``(label lines, images [N, 3, H, W])`` per row, e.g. ``(["tome 0.5", "1.14x", "28.5 dB"], x)``.
        columns: label lines per column, e.g. ``["red circle", "seed 0"]``.
    """
    grid = bare_grid([images for _, images in rows], scale)
    font = _font(font_size)
    probe = ImageDraw.Draw(grid)
    line_h = max(_text_size(probe, "Ag", font)[1], font_size) + 3
    row_w = max(_text_size(probe, line, font)[0] for label, _ in rows for line in label) + 2 * _PAD
    head_h = max(len(c) for c in columns) * line_h + 2 * _PAD
    cell_w, cell_h = grid.width // len(columns), grid.height // len(rows)
    canvas = Image.new("RGB", (row_w + grid.width, head_h + grid.height), _BACKGROUND)
    canvas.paste(grid, (row_w, head_h))
    draw = ImageDraw.Draw(canvas)
    for i, label in enumerate(columns):
        for j, line in enumerate(label):
            while len(line) > 1 and _text_size(draw, line, font)[0] > cell_w - 2:  # long free-text prompts
                line = line[:-2] + "…"
            width = _text_size(draw, line, font)[0]
            draw.text(
                (row_w + i * cell_w + (cell_w - width) // 2, _PAD + j * line_h), line, fill=_INK, font=font
            )
    for i, (label, _) in enumerate(rows):
        top = head_h + i * cell_h + (cell_h - len(label) * line_h) // 2
        for j, line in enumerate(label):
            draw.text((_PAD, top + j * line_h), line, fill=_INK, font=font)
    return canvas
