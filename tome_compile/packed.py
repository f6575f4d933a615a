"""A packed latent's grid, given to the graph: Flux's transformer takes its latent as ``[B, h * w,
C]`` (2x2 latent patches packed into channels), so no convolution tells the pass ``h`` and ``w`` —
and ``h * w`` alone does not (32x64 and 64x32 have the same tokens). The pipeline knows them: it
builds the positions (``_prepare_latent_image_ids(batch, h, w, ...)``) of every call.

:func:`set_packed_grid` tells the transformer the grid of its next calls; its ``forward`` then
views the latent as ``[B, h, w, C]`` and straight back (:func:`with_grid`: no copy, the same
numbers). Traced, those two views are where the pass reads the grid
(:func:`tome_compile.passes.unet_io.packed_grid`), and Dynamo guards on the grid it read: another
grid is another graph, never a plan for the wrong one. ``tome_compile.apply`` does all of this for
diffusers' Flux pipelines.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from tome_compile.errors import ToMeConfigError

__all__ = ["clear_packed_grid", "follow_pipeline", "set_packed_grid", "with_grid"]

_GRID = "_tome_grid"
_FORWARD = "_tome_forward"  # the forward it replaced (None: the class's)


def with_grid(x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``[B, h * w, C]`` viewed as ``[B, h, w, C]`` and back: the same tensor, its grid in the graph."""
    return x.unflatten(1, grid).flatten(1, 2)


def _forward_with_grid(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``forward``, the latent viewed on the grid first (a method of the instance, not a forward
    pre-hook: Dynamo compiles a hook as a graph of its own, apart from the forward's; bound, so
    that the traced module paths start at the transformer as they do without it)."""
    grid = self.__dict__.get(_GRID)
    by_name = "hidden_states" in kwargs
    x = kwargs["hidden_states"] if by_name else (args[0] if args else None)
    # a latent of another token count (Kontext's reference tokens appended) keeps no grid
    if grid is not None and isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == grid[0] * grid[1]:
        x = with_grid(x, grid)
        if by_name:
            kwargs = {**kwargs, "hidden_states": x}
        else:
            args = (x, *args[1:])
    own = self.__dict__.get(_FORWARD)
    return (own or type(self).forward.__get__(self))(*args, **kwargs)


def set_packed_grid(transformer: torch.nn.Module, grid: tuple[int, int] | None) -> None:
    """The ``(h, w)`` token grid of ``transformer``'s next calls (Flux: ``height // 16, width //
    16``), or None to forget it. Compile the transformer with ``tome_backend`` after this, or
    call it again before each call of another size; ``tome_compile.apply`` does it per pipeline
    call."""
    if grid is not None:
        h, w = grid
        if not (isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0):
            raise ToMeConfigError(f"packed grid {grid!r}: give two positive ints (Flux: height // 16, "
                                  "width // 16)")
        grid = (int(h), int(w))
    transformer.__dict__[_GRID] = grid
    if _FORWARD not in transformer.__dict__:
        transformer.__dict__[_FORWARD] = transformer.__dict__.get("forward")  # an instance's own, if any
        transformer.__dict__["forward"] = types.MethodType(_forward_with_grid, transformer)


def clear_packed_grid(transformer: torch.nn.Module) -> None:
    """Undo :func:`set_packed_grid`: the grid and the forward that views it gone."""
    if _FORWARD in transformer.__dict__:
        own = transformer.__dict__.pop(_FORWARD)
        if own is None:
            transformer.__dict__.pop("forward", None)
        else:
            transformer.__dict__["forward"] = own
    transformer.__dict__.pop(_GRID, None)


def follow_pipeline(pipe: Any, transformer: torch.nn.Module) -> bool:
    """Give ``transformer`` the grid of each of ``pipe``'s calls, read where diffusers' Flux
    pipelines build the positions of the latent's tokens (``_prepare_latent_image_ids(batch,
    h, w, ...)``, a static method of each). False when ``pipe`` has none (not a packed latent)."""
    original = getattr(type(pipe), "_prepare_latent_image_ids", None)
    if original is None:
        return False

    def prepare(batch_size: Any, height: Any, width: Any, *args: Any, **kwargs: Any) -> Any:
        set_packed_grid(transformer, (int(height), int(width)))
        return original(batch_size, height, width, *args, **kwargs)

    set_packed_grid(transformer, None)
    object.__setattr__(pipe, "_prepare_latent_image_ids", prepare)
    return True
