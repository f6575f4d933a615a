"""The one configuration object: :class:`ToMeConfig` (tomesd's names and defaults)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Literal

from tome_compile.errors import ToMeConfigError
from tome_compile.guidance import GUIDANCE

__all__ = ["METHODS", "ToMeConfig", "format_blocks", "parse_blocks"]

METHODS = ("tome", "importance", "todo")
# torch interpolation modes ToDo may downsample with (the reference code names the same)
DOWNSAMPLE_METHODS = ("nearest", "nearest-exact", "bilinear", "bicubic", "area")
_MAX_DOWNSAMPLE = (1, 2, 4, 8)


@dataclass(frozen=True)
class ToMeConfig:
    """What to merge, and how much.

    Args:
        ratio: share of the tokens of each rewritten block that is merged away. The most is
            ``1 - 1/(sx*sy)`` (0.75 with the default stride); 0.5 or less is recommended (tomesd).
            ``0`` leaves the graph untouched.
        max_downsample: rewrite blocks with at most this much downsampling (1, 2, 4 or 8).
            1 = only the highest-resolution blocks (4096 tokens at SD 1.5 512²). SDXL has no
            attention at full resolution: use 2 there.
        sx, sy: stride of the destination grid: one destination per ``sx × sy`` cell.
        use_rand: pick each cell's destination at random (the same pick for the whole batch);
            off = always the top-left token of each cell.
        merge_attn, merge_crossattn, merge_mlp: merge before self-attention (recommended),
            cross-attention (not recommended), the feed-forward (very not recommended).
        seed: seed of the dedicated generator that draws the destination partition; ``None``
            seeds it from the OS (the global torch RNG is never read nor advanced).
        method: ``"tome"`` (ToMe for SD), ``"importance"`` (keep the tokens with the largest
            classifier-free-guidance magnitude; falls back to ``"tome"`` on steps without a map)
            or ``"todo"`` (token downsampling, ToDo: the keys and values of each selected
            self-attention read the token grid downsampled by ``downsample_factor`` per axis; every
            query is kept, nothing is planned or unmerged; ``ratio`` is not used).
        downsample_factor: ToDo only: the token grid's downsampling per axis for keys and values
            (2: a quarter of the tokens); 1 leaves the graph untouched.
        downsample_method: ToDo only: the interpolation (``torch.nn.functional.interpolate``'s
            mode; the reference code's default ``"nearest"``).
        pool_factor: importance only: the important pool holds ``int((N - r) * pool_factor)``
            tokens.
        dst_fraction: importance only: ``int(N * dst_fraction)`` destinations are drawn from
            the pool.
        share_plan: one plan per resolution level per U-Net call: made at the first rewritten
            block of a token count (its metric), reused by the other blocks with that count.
            Off by default (tomesd makes a plan per block); saves the matching of the others.
        plan_every: make the plans on every ``plan_every``-th U-Net call of a generation and reuse
            them in between (the plans are state of the compiled model, like the importance map:
            a graph output fed back as an input). ``1`` (default, tomesd) plans every call. A new
            generation (the timestep goes back up, another latent shape, ``reset()``) and
            importance's first step with a map always plan afresh.
        blocks: only these transformer blocks, by index in execution order among the model's
            (spatial) self-attention blocks, e.g. ``range(7, 21)`` — what a DiT needs, whose
            blocks all share one token grid so ``max_downsample`` selects all of them (PixArt-α:
            block k is ``transformer_blocks.k``; the released importance code merges 7-20 there).
            ``None`` (default): every block ``max_downsample`` allows.
        guidance: which rows of a batch belong to one image, for importance merging's map and
            plans: ``"cfg"`` ``[uncond; cond]``, ``"pix2pix"`` ``[text; image; uncond]``, ``"pag"``
            ``[uncond; cond; perturbed]``, ``"none"``; ``"auto"`` (default) reads ``"cfg"`` from an
            even batch and ``"none"`` from an odd one — name ``"pix2pix"`` / ``"pag"`` for a
            three-way batch. :func:`tome_compile.apply` sets it from the pipeline.
    """

    ratio: float = 0.5
    max_downsample: int = 1
    sx: int = 2
    sy: int = 2
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    seed: int | None = None
    method: Literal["tome", "importance", "todo"] = "tome"
    pool_factor: float = 1.4
    dst_fraction: float = 0.25
    share_plan: bool = False
    plan_every: int = 1
    blocks: tuple[int, ...] | None = None
    guidance: str = "auto"
    downsample_factor: int = 2
    downsample_method: str = "nearest"

    def __post_init__(self) -> None:
        if isinstance(self.blocks, (range, list)) or hasattr(self.blocks, "tolist"):  # range(7, 21), arrays:
            blocks = self.blocks.tolist() if hasattr(self.blocks, "tolist") else self.blocks  # a tuple
            object.__setattr__(self, "blocks", tuple(blocks))  # (hashable, JSON)
        for f in dataclasses.fields(self):  # NumPy numbers (np.float32(0.5), np.int64(2)) as Python's
            value = getattr(self, f.name)
            if type(value).__module__ == "numpy":
                python = value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else value
                object.__setattr__(self, f.name, python)
            elif f.name == "blocks" and isinstance(value, tuple):
                object.__setattr__(self, f.name, tuple(v.item() if type(v).__module__ == "numpy" else v
                                                       for v in value))
        for reason in self.problems():
            raise ToMeConfigError(reason)

    def problems(self) -> list[str]:
        """Every invalid value, one sentence each (value, limit, fix); empty when valid."""
        out: list[str] = []
        for name in ("sx", "sy", "max_downsample", "plan_every", "downsample_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                out.append(f"{name}={value!r} must be an int")
        for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp", "share_plan"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name}={getattr(self, name)!r} must be True or False")
        if out:
            return out
        if self.sx < 1 or self.sy < 1:
            out.append(f"sx={self.sx}, sy={self.sy}: the destination stride must be >= 1 in both directions")
            return out
        if self.plan_every < 1:
            out.append(f"plan_every={self.plan_every} must be >= 1 (1 = a new plan every U-Net call, "
                       "as tomesd; 2 or 3 reuse each plan for that many calls)")
        if self.max_downsample not in _MAX_DOWNSAMPLE:
            out.append(
                f"max_downsample={self.max_downsample} is not one of {_MAX_DOWNSAMPLE}; "
                "use 1 (highest-resolution blocks only) or 2 (SDXL)"
            )
        limit = 1.0 - 1.0 / (self.sx * self.sy)
        if not _real(self.ratio):
            out.append(f"ratio={self.ratio!r} must be a number in [0, {limit:g}]")
        elif not (0.0 <= self.ratio <= limit):
            out.append(
                f"ratio={self.ratio} is outside [0, 1 - 1/(sx*sy)] = [0, {limit:g}] for sx={self.sx}, "
                f"sy={self.sy}; pick a ratio in that range (<= 0.5 recommended) or a larger stride"
            )
        if self.blocks is not None and (not isinstance(self.blocks, tuple) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in self.blocks)):
            out.append(f"blocks={self.blocks!r} must be None or block indices >= 0 (e.g. range(7, 21))")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            out.append(f"seed={self.seed!r} must be an int or None")
        elif self.seed is not None and not 0 <= self.seed < 2 ** 63:
            out.append(f"seed={self.seed} is outside [0, 2**63 - 1]; use a smaller seed (e.g. seed % 2**63)")
        if self.guidance not in GUIDANCE:
            out.append(f"guidance={self.guidance!r} is unknown; use one of {tuple(GUIDANCE)}")
        if self.method not in METHODS:
            out.append(f"method={self.method!r} is unknown; use one of {METHODS}")
        if not (_real(self.pool_factor) and 1.0 <= self.pool_factor <= 64.0):
            out.append(f"pool_factor={self.pool_factor!r} must be a finite number in [1, 64] (default 1.4; "
                       "the pool never holds more than every token anyway)")
        if not (_real(self.dst_fraction) and 0.0 < self.dst_fraction < 1.0):
            out.append(f"dst_fraction={self.dst_fraction!r} must be in (0, 1) (default 0.25)")
        if self.downsample_factor < 1:
            out.append(f"downsample_factor={self.downsample_factor} must be >= 1 (2: keys and values "
                       "read a quarter of the tokens; 1: no downsampling)")
        if self.downsample_method not in DOWNSAMPLE_METHODS:
            out.append(f"downsample_method={self.downsample_method!r} is unknown; use one of "
                       f"{DOWNSAMPLE_METHODS}")
        if self.method == "todo":
            out.extend(self._todo_problems())
        if (
            not out
            and self.method == "importance"
            and (1.0 - self.ratio) * self.pool_factor < self.dst_fraction
        ):
            most = 1.0 - self.dst_fraction / self.pool_factor
            out.append(
                f"ratio={self.ratio} leaves a pool of (1 - ratio) * pool_factor = "
                f"{(1.0 - self.ratio) * self.pool_factor:.3f} of the tokens, smaller than "
                f"dst_fraction={self.dst_fraction}; with these settings ratio must be <= {most:.3f}, "
                "or raise pool_factor / lower dst_fraction"
            )
        return out

    def _todo_problems(self) -> list[str]:
        """What ToDo does not combine with: ToMe's amount and targets, plans to reuse or share."""
        out = []
        default = ToMeConfig.__dataclass_fields__["ratio"].default
        if self.ratio != default:
            out.append(f"ratio={self.ratio} is not used by method='todo' (it downsamples keys and values "
                       f"by downsample_factor={self.downsample_factor} per axis); leave ratio at its "
                       "default, or use method='tome' to merge a share of the tokens")
        if self.merge_crossattn or self.merge_mlp:
            out.append("merge_crossattn / merge_mlp are ToMe's: method='todo' shortens the keys and values "
                       "of self-attention only; turn them off")
        if self.plan_every != 1 or self.share_plan:
            out.append("plan_every / share_plan reuse plans; method='todo' makes none (nothing to plan); "
                       "leave them at 1 / False")
        return out

    @property
    def enabled(self) -> bool:
        """False when nothing would be rewritten (ratio 0, ToDo's factor 1, or every target off)."""
        if self.method == "todo":
            return self.downsample_factor > 1 and self.merge_attn
        return self.ratio > 0 and (self.merge_attn or self.merge_crossattn or self.merge_mlp)

    @property
    def reuses_plans(self) -> bool:
        """Plans outlive their call (``plan_every`` > 1): graphs keep, take or choose plan state."""
        return self.plan_every > 1

    def replace(self, **changes: Any) -> ToMeConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_options(cls, ratio: float | ToMeConfig | None = None, **options: Any) -> ToMeConfig:
        """Build from ``tome_backend``-style arguments; unknown option names are an error."""
        if isinstance(ratio, ToMeConfig):
            return ratio.replace(**options) if options else ratio
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ToMeConfigError(
                f"unknown option(s) {unknown}; valid options are {sorted(names)}"
            )
        if ratio is not None:
            options["ratio"] = ratio
        return cls(**options)


def _real(value: Any) -> bool:
    """A finite real number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def parse_blocks(text: str) -> tuple[int, ...]:
    """``"7-20"`` / ``"0,2,5-9"`` -> block indices (the command lines' ``--blocks``)."""
    out: list[int] = []
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            out.extend(range(int(first), int(last or first) + 1))
    except ValueError:
        raise ToMeConfigError(f"blocks {text!r}: give indices and ranges like 7-20 or 0,2,5-9") from None
    if not out or min(out) < 0:
        raise ToMeConfigError(f"blocks {text!r}: give indices >= 0 and ranges like 7-20 or 0,2,5-9")
    return tuple(out)


def format_blocks(values: tuple[int, ...]) -> str:
    """The inverse of :func:`parse_blocks`: (7, 8, ..., 20) -> "7-20"; (1, 3, 4) -> "1,3-4"."""
    parts: list[tuple[int, int]] = []
    for v in sorted(set(values)):
        if parts and parts[-1][1] == v - 1:
            parts[-1] = (parts[-1][0], v)
        else:
            parts.append((v, v))
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in parts)
