"""Procedural images for the project's own small diffusion model (no downloads).

A picture is one simple shape (circle, square, triangle, cross, ring) in one colour, at a random
size and position, on a smooth gradient or a textured background. Its prompt is two words from a
small vocabulary: ``"red circle"``. Everything is deterministic from a seed; shapes are drawn at
2x and box-filtered down, so edges are anti-aliased.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["COLOURS", "NULL_TOKEN", "SHAPES", "VOCAB", "Example", "render", "render_batch", "tokenize"]

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.12, 0.12),
    "green": (0.10, 0.75, 0.20),
    "blue": (0.15, 0.30, 0.95),
    "yellow": (0.95, 0.88, 0.10),
    "magenta": (0.90, 0.15, 0.85),
    "cyan": (0.10, 0.85, 0.90),
}
SHAPES = ("circle", "square", "triangle", "cross", "ring")
NULL_TOKEN = "<null>"
VOCAB: tuple[str, ...] = (NULL_TOKEN, *COLOURS, *SHAPES)


@dataclass(frozen=True)
class Example:
    image: np.ndarray  # [H, W, 3] float32 in [0, 1]
    colour: str
    shape: str

    @property
    def prompt(self) -> str:
        return f"{self.colour} {self.shape}"


def tokenize(prompt: str) -> list[int]:
    """Word ids of a prompt (``""`` = the null prompt, for classifier-free guidance)."""
    words = prompt.split() or [NULL_TOKEN, NULL_TOKEN]
    unknown = [w for w in words if w not in VOCAB]
    if unknown or len(words) != 2:
        raise ValueError(f"prompt {prompt!r} must be '<colour> <shape>' with colour in {list(COLOURS)} "
                         f"and shape in {list(SHAPES)}")
    return [VOCAB.index(w) for w in words]


def _mask(shape: str, size: int, cx: float, cy: float, radius: float, angle: float) -> np.ndarray:
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    dx, dy = x - cx, y - cy
    c, s = np.cos(angle), np.sin(angle)
    u, v = c * dx + s * dy, -s * dx + c * dy  # rotated frame
    if shape == "circle":
        return dx ** 2 + dy ** 2 <= radius ** 2
    if shape == "ring":
        d2 = dx ** 2 + dy ** 2
        return (d2 <= radius ** 2) & (d2 >= (0.55 * radius) ** 2)
    if shape == "square":
        side = radius * 0.85
        return (np.abs(u) <= side) & (np.abs(v) <= side)
    if shape == "cross":
        arm, width = radius, radius * 0.32
        return ((np.abs(u) <= arm) & (np.abs(v) <= width)) | ((np.abs(v) <= arm) & (np.abs(u) <= width))
    if shape == "triangle":  # equilateral, pointing up in the rotated frame
        h = radius * 1.5
        top, base = -radius, radius * 0.5
        inside_y = (v >= top) & (v <= base)
        half = (v - top) / h * (radius * 0.866 * 2) / 2 * 1.0
        return inside_y & (np.abs(u) <= half)
    raise ValueError(f"unknown shape {shape!r}")


def render(seed: int, size: int = 32, colour: str | None = None, shape: str | None = None) -> Example:
    """One picture, deterministic from ``seed`` (colour/shape drawn unless given)."""
    rng = np.random.default_rng(seed)
    colour = colour or str(rng.choice(list(COLOURS)))
    shape = shape or str(rng.choice(SHAPES))
    scale = 2
    big = size * scale
    # Background: a gradient between two muted colours, optionally with a soft texture.
    a, b = rng.uniform(0.2, 0.6, 3), rng.uniform(0.2, 0.6, 3)
    t = np.linspace(0, 1, big, dtype=np.float32)
    direction = rng.uniform(0, 2 * np.pi)
    ramp = (np.cos(direction) * t[None, :] + np.sin(direction) * t[:, None])
    ramp = (ramp - ramp.min()) / max(float(ramp.max() - ramp.min()), 1e-6)
    background = a[None, None, :] * (1 - ramp[..., None]) + b[None, None, :] * ramp[..., None]
    if rng.random() < 0.5:
        freq = rng.uniform(2, 6)
        phase = rng.uniform(0, 2 * np.pi, 2)
        tex = np.sin(freq * 2 * np.pi * t[None, :] + phase[0]) * np.sin(
            freq * 2 * np.pi * t[:, None] + phase[1]
        )
        background = background + 0.06 * tex[..., None]
    radius = rng.uniform(0.2, 0.36) * big
    margin = radius * 1.05
    cx, cy = rng.uniform(margin, big - margin, 2)
    mask = _mask(shape, big, cx, cy, radius, rng.uniform(0, 2 * np.pi) if shape != "circle" else 0.0)
    fill = np.asarray(COLOURS[colour], dtype=np.float32)
    image = np.where(mask[..., None], fill[None, None, :], background).astype(np.float32)
    image = image.reshape(size, scale, size, scale, 3).mean(axis=(1, 3))  # anti-aliasing box filter
    return Example(np.clip(image, 0.0, 1.0), colour, shape)


def render_batch(seeds: list[int] | range, size: int = 32) -> tuple[np.ndarray, list[str]]:
    """``[N, 3, H, W]`` float32 in ``[-1, 1]`` and the prompts."""
    examples = [render(int(s), size) for s in seeds]
    images = np.stack([e.image for e in examples]).transpose(0, 3, 1, 2) * 2.0 - 1.0
    return images.astype(np.float32), [e.prompt for e in examples]
