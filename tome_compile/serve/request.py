"""What a ``POST /generate`` may ask for, checked before it reaches a replica (no Ray needed here).

A request is a JSON object ``{"prompt": str, "seed": int, "steps": int, "guidance_scale": float,
"ratio": float, "size": int}``; only ``prompt`` is required (``"guidance"`` is the CFG scale's older
name, still taken). Every limit is a field of
:class:`Limits`, set from the served model, and every refusal names the field, the value and the
limit (the server answers it with ``422 {"error": ...}``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tome_compile.errors import ToMeError

__all__ = ["FIELDS", "Job", "Limits", "RequestError", "Settings", "parse_job"]

FIELDS = ("prompt", "seed", "steps", "guidance_scale", "ratio", "size")
ALIASES = {"guidance": "guidance_scale"}  # older field names, still taken
MAX_SEED = 2 ** 63 - 1


class RequestError(ToMeError, ValueError):
    """A request the server refuses (HTTP 422); ``field`` names what is wrong."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class Settings:
    """What the requests of one denoising loop share (they are batched only with equal settings)."""

    steps: int
    guidance_scale: float  # classifier-free guidance scale
    ratio: float
    size: int


@dataclass(frozen=True)
class Job:
    """One picture to make: its own prompt and seed, and the loop's settings."""

    prompt: str
    seed: int
    settings: Settings


@dataclass(frozen=True)
class Limits:
    """What this server accepts; the defaults fill a request's missing fields."""

    ratios: tuple[float, ...]
    default_ratio: float
    sizes: tuple[int, ...]
    default_size: int
    default_steps: int
    default_guidance_scale: float
    max_steps: int = 100
    max_guidance_scale: float = 30.0
    max_prompt: int = 300
    # raises ValueError (shapes: vocabulary)
    check_prompt: Any = field(default=None, compare=False, repr=False)


def _integer(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"{value!r} must be an integer in [{low}, {high}]")
    if not low <= value <= high:
        raise RequestError(name, f"{value} is outside [{low}, {high}]")
    return value


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(name, f"{value!r} must be a finite number in [{low:g}, {high:g}]")
    if not low <= value <= high:
        raise RequestError(name, f"{value:g} is outside [{low:g}, {high:g}]")
    return float(value)


def parse_job(body: Any, limits: Limits) -> Job:
    """The :class:`Job` a request body asks for, or a :class:`RequestError` naming the field."""
    if not isinstance(body, dict):
        raise RequestError(
            "body", f"must be a JSON object with the fields {list(FIELDS)}, not {type(body).__name__}"
        )
    for old, new in ALIASES.items():
        if old in body:
            if new in body:
                raise RequestError(old, f"give {new} or its older name {old}, not both")
            body = {**{k: v for k, v in body.items() if k != old}, new: body[old]}
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"unknown field (the fields are {list(FIELDS)})")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestError("prompt", "required: a non-empty string")
    if len(prompt) > limits.max_prompt:
        raise RequestError("prompt", f"{len(prompt)} characters, more than {limits.max_prompt}")
    if limits.check_prompt is not None:
        try:
            limits.check_prompt(prompt)
        except ValueError as e:
            raise RequestError("prompt", str(e)) from None
    seed = _integer(body, "seed", 0, 0, MAX_SEED)
    steps = _integer(body, "steps", limits.default_steps, 1, limits.max_steps)
    guidance_scale = _number(body, "guidance_scale", limits.default_guidance_scale, 0.0,
                             limits.max_guidance_scale)
    ratio = _number(body, "ratio", limits.default_ratio, 0.0, 1.0)
    if not any(math.isclose(ratio, r, abs_tol=1e-9) for r in limits.ratios):
        raise RequestError(
            "ratio",
            f"{ratio:g} is not served here; this server merges at {list(limits.ratios)} "
            "(0 = the plain model)",
        )
    size = _integer(body, "size", limits.default_size, min(limits.sizes), max(limits.sizes))
    if size not in limits.sizes:
        raise RequestError("size", f"{size} is not served here; sizes are {list(limits.sizes)}")
    ratio = next(r for r in limits.ratios if math.isclose(ratio, r, abs_tol=1e-9))
    return Job(
        prompt=prompt, seed=seed, settings=Settings(steps=steps, guidance_scale=guidance_scale, ratio=ratio,
                                                 size=size)
    )
