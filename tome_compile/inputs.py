"""The graph contract of a rewritten U-Net: the names of its extra inputs and outputs and how each
is drawn, described once (STYLE.md habit 16). The pass, the follow-up passes, the backend, the
export and ``ToMeSession`` read the names and the draw kinds from here, nowhere else.

The pass appends inputs to the graph (the random destination partition, the importance map, ...)
and returns one :class:`ToMeInputSpec` per input. Everything that feeds a rewritten graph — the
``torch.compile`` backend, the ONNX export (its example values and its metadata) and
``ToMeSession`` — reads these specs and draws the values with :func:`draw_tome_inputs`, so the
compiled and the ONNX paths see the same numbers call by call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from tome_compile.sampler import PartitionSampler

__all__ = ["DRAWS", "DST_KEY_INPUT", "FED_BACK_SUFFIX", "HAS_MAP_INPUT", "IMPORTANCE_INPUT", "INPUT_NAMES",
           "PARTITION_INPUT", "PLAN_SLOTS", "PLAN_WEIGHTS", "REUSE_INPUT", "SEED_INPUT", "ToMeInputSpec",
           "draw_tome_inputs", "partition_spec"]

# How each kind of input is drawn per U-Net call; ``map`` is the importance map (or None).
#   partition  [sum(h*w of cells)] int64  one destination choice per sx*sy cell; drawn when there is no map
#   importance [P, H, W] float32          the guidance map of the previous call (zeros: none yet)
#   has_map    [] bool                    whether ``importance`` holds a map (picks the plan in-graph)
#   dst_key    [P, M] float32             uniform keys for importance's destination draw, when there is a map
#   seed       [] int64                   in-graph random form (ONNX deployment): the graph hashes
#                                         partition / keys from it and the timestep; fed the sampler's seed
#   plan_slot  [B, sum N] int64           plan_every: the plans of an earlier call (``pack_plans``),
#   plan_weight [B, sum (N - r)] float32    fed back from that call's extra outputs
#   reuse      [] bool                    plan_every, one-graph form (ONNX): reuse the fed plans
DRAWS = ("partition", "importance", "has_map", "dst_key", "seed", "plan_slot", "plan_weight", "reuse")

# The graph input of each draw kind, by name (the ONNX export's input names too)
PARTITION_INPUT = "tome_partition"
IMPORTANCE_INPUT = "tome_importance"
HAS_MAP_INPUT = "tome_has_map"
DST_KEY_INPUT = "tome_dst_key"
SEED_INPUT = "tome_seed"
PLAN_SLOTS = "tome_plan_slots"  # plan_every: the packed plans of a call, an output fed back as an input
PLAN_WEIGHTS = "tome_plan_weights"
REUSE_INPUT = "tome_reuse_plan"
INPUT_NAMES = {"partition": PARTITION_INPUT, "importance": IMPORTANCE_INPUT, "has_map": HAS_MAP_INPUT,
               "dst_key": DST_KEY_INPUT, "seed": SEED_INPUT, "plan_slot": PLAN_SLOTS,
               "plan_weight": PLAN_WEIGHTS, "reuse": REUSE_INPUT}

_DEFAULT = {"importance": "zeros", "has_map": "zeros", "seed": "zeros", "reuse": "zeros",
            "plan_slot": "empty", "plan_weight": "empty"}
FED_BACK_SUFFIX = "_out"  # plan_every: the output ``NAME_out`` is fed back to the input ``NAME``

_DTYPES = {"int64": torch.int64, "float32": torch.float32, "bool": torch.bool}


@dataclass(frozen=True)
class ToMeInputSpec:
    """One graph input appended by the pass: its name, shape, dtype and how it is drawn.

    ``cells`` (partition only) is the destination grid ``(h // sy, w // sx)`` of every random
    site in execution order, ``choices`` the ``sx * sy`` tokens a cell can pick from.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    draw: str
    cells: tuple[tuple[int, int], ...] = ()
    choices: int = 0

    def __post_init__(self) -> None:
        if self.draw not in DRAWS:
            raise ValueError(f"draw={self.draw!r} is not one of {DRAWS}")

    @classmethod
    def of(cls, draw: str, shape: tuple[int, ...], dtype: torch.dtype, **grid: Any) -> ToMeInputSpec:
        """The input of kind ``draw`` under its contract name (:data:`INPUT_NAMES`)."""
        return cls(INPUT_NAMES[draw], tuple(shape), dtype, draw, **grid)

    @property
    def default(self) -> str | None:
        """What the exported graph takes when the caller feeds nothing: ``"zeros"`` (seed 0, no map
        yet, do not reuse), ``"empty"`` (no plans yet: no rows along the batch axis of a dynamic
        export), or ``None`` (must be fed: the partition, the destination keys)."""
        return _DEFAULT.get(self.draw)

    @property
    def batch_axis(self) -> int | None:
        """The axis that grows with the batch (plan state: batch-major, flattened; the map and the
        keys: one row per image), or ``None``."""
        return 0 if self.draw in ("importance", "dst_key", "plan_slot", "plan_weight") else None

    @property
    def fed_from(self) -> str | None:
        """The graph output whose value the next calls feed back here (plan_every's plans)."""
        return self.name + FED_BACK_SUFFIX if self.draw in ("plan_slot", "plan_weight") else None

    def at_latent(self, height: int, width: int) -> ToMeInputSpec:
        """This input for a call whose latent is ``height x width`` (an export for every image size:
        the importance map follows the latent; the other inputs of such an export have no size)."""
        if self.draw == "importance":
            return replace(self, shape=(self.shape[0], height, width))
        return self

    def with_rows(self, rows: int) -> ToMeInputSpec:
        """This input for a call with ``rows`` along its batch axis (an importance export in CFG
        pairs: the map's rows are the call's pairs); unchanged where it has no batch axis."""
        axis = self.batch_axis
        if axis is None or self.shape[axis] == rows:
            return self
        return replace(self, shape=(*self.shape[:axis], rows, *self.shape[axis + 1:]))

    def zeros(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A placeholder value of the right shape and dtype (tracing, "nothing drawn")."""
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    def to_json(self) -> dict[str, Any]:
        dtype = next(k for k, v in _DTYPES.items() if v == self.dtype)
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype, "draw": self.draw,
                "cells": [list(c) for c in self.cells], "choices": self.choices}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ToMeInputSpec:
        return cls(name=data["name"], shape=tuple(data["shape"]), dtype=_DTYPES[data["dtype"]],
                   draw=data["draw"], cells=tuple((int(a), int(b)) for a, b in data.get("cells", ())),
                   choices=int(data.get("choices", 0)))


def partition_spec(cells: tuple[tuple[int, int], ...], choices: int) -> ToMeInputSpec:
    """The ``tome_partition`` input: for each block that makes a plan, its ``rows x cols`` cells
    (one destination each, ``choices`` tokens to pick it from), concatenated in block order."""
    return ToMeInputSpec.of("partition", (sum(a * b for a, b in cells),), torch.int64, cells=cells,
                            choices=choices)


def draw_tome_inputs(specs: Sequence[ToMeInputSpec], sampler: PartitionSampler,
                     importance: torch.Tensor | None, device: torch.device | str,
                     plans: tuple[torch.Tensor, torch.Tensor] | None = None, *, random: bool = True
                     ) -> list[torch.Tensor]:
    """Values for ``specs`` (in order) for one U-Net call.

    Without a map (``importance=None``: ToMe, or importance's fallback step) the partition is
    drawn, in tomesd's order; with a map the destination keys are drawn instead. ``plans`` (the
    packed plans of an earlier call, ``plan_every``) means this call reuses them: nothing is
    drawn. ``random=False`` (tomesd's rule for an odd batch) feeds the fixed destinations (every
    cell's first token) to a graph that takes a partition. Only what the call uses is drawn, so the
    backend and ``ToMeSession`` advance their generators identically.
    """
    device = torch.device(device)
    values = []
    reuse = plans is not None
    for spec in specs:
        if spec.draw in ("plan_slot", "plan_weight"):
            value = (plans[spec.draw == "plan_weight"].to(device) if plans is not None
                     else spec.zeros(device))
        elif spec.draw == "reuse":
            value = torch.tensor(reuse, device=device)
        elif spec.draw == "partition":
            value = (sampler.draw(list(spec.cells), spec.choices, device)
                     if importance is None and not reuse and random else spec.zeros(device))
        elif spec.draw == "importance":
            value = spec.zeros(device) if importance is None else importance.to(device, torch.float32)
        elif spec.draw == "has_map":
            value = torch.tensor(importance is not None, device=device)
        elif spec.draw == "seed":
            value = torch.tensor(sampler.seed or 0, dtype=torch.int64, device=device)
        else:  # dst_key
            value = (sampler.draw_keys(spec.shape[0], spec.shape[1], device)
                     if importance is not None and not reuse else spec.zeros(device))
        # dense: a compiled graph asserts its inputs' strides (expanded keys have stride 0 on dim 0)
        values.append(value.contiguous())
    return values
