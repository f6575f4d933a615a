"""Where a traced U-Net takes its sample and timestep and returns its noise, and its U-Net passes:
found once per pass run (:func:`find_unet_io`), from one lookup of the passes' first convolutions,
and handed to everything that asks (the site finder, the decisions, the in-graph randomness, the
backend's call driver, the export's metadata).

A graph normally holds one U-Net pass; a wrapper may run its U-Net more than once per call
(Zero123++'s reference pass over the condition latent, then the sample). Positions (``spans``)
are of the graph as found, before any rewrite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tome_compile.passes.dataflow import (
    CONV_OPS,
    TENSOR_CONSTANT_OPS,
    TIME_EMBED_OPS,
    is_call,
    is_shape_op,
    node_shape,
)
from tome_compile.passes.sites import _static, pass_spans, pass_starts, size_hint
from torch import fx

__all__ = ["UNetIO", "UNetPass", "find_unet_io", "packed_grid"]


@dataclass(frozen=True)
class UNetPass:
    """One U-Net pass of a graph: its latent (the first convolution's input), its token grid (that
    convolution's output: the patch grid of a DiT) and its rows (B x F for a video U-Net)."""

    latent: tuple[int, int] | None
    grid: tuple[int, int] | None
    rows: int | None
    # the first convolution (its output's last two axes: ``grid``, symbolic in an export for every
    # image size): what the rewritten graph computes each block's sizes from
    conv: fx.Node | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class UNetIO:
    """Where a U-Net graph takes its sample and timestep and returns its noise prediction.

    ``timestep_index`` is the position of the timestep among the graph's inputs; when Dynamo baked
    a Python-number timestep into the graph (the first call with an int), it is None and
    ``timestep_constant`` holds the value (the graph is only called with that value: Dynamo guards
    on it). Both None: no timestep found (not a diffusion U-Net).
    """

    sample_index: int
    timestep_index: int | None
    timestep_constant: float | None
    output_index: int
    channel_axis: int = 1  # of the noise output: 1 (B C H W, AnimateDiff's B C F H W), 2 (SVD's B F C H W)
    # the noise channels of the output when it holds more (PixArt's learned sigma: eps then variance)
    noise_channels: int | None = None
    # every U-Net pass in execution order (the last one's output is the graph's), their graph
    # positions [start, stop), and the batch of the sample input (videos for a video U-Net)
    passes: tuple[UNetPass, ...] = ()
    spans: tuple[tuple[int, int], ...] = ()
    sample_batch: int | None = None

    @property
    def latent(self) -> tuple[int, int] | None:
        """The sample's latent (h, w): the input of the last pass's first convolution."""
        return self.passes[-1].latent if self.passes else None

    def timestep(self, args: Sequence[Any]) -> Any:
        """The timestep of one call, from its arguments."""
        return args[self.timestep_index] if self.timestep_index is not None else self.timestep_constant


def _sample_placeholder(conv: fx.Node | None) -> fx.Node | None:
    """The input of the first convolution (``conv_in`` of the last pass), traced back through
    shape-preserving ops and the reshapes that fold a video's frames into the batch."""
    node = conv.args[0] if conv is not None else None
    for _ in range(32):
        if not isinstance(node, fx.Node) or node.op == "placeholder":
            break
        if is_shape_op(node) and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        else:
            node = next((a for a in node.all_input_nodes if node_shape(a) == node_shape(node)), None)
    return node if isinstance(node, fx.Node) and node.op == "placeholder" else None


def _channel_axis(gm: fx.GraphModule, out: Any) -> int:
    """The channel axis of a 5-D video noise output: AnimateDiff unfolds ``[B*F, C, H, W]`` to
    ``[B, C, F, H, W]`` (a permute), SVD to ``[B, F, C, H, W]`` (a reshape only)."""
    shape = node_shape(out)
    if shape is None or len(shape) != 5:
        return 1
    convs = [n for n in gm.graph.nodes if is_call(n, CONV_OPS)]
    last = node_shape(convs[-1]) if convs else None
    if last is not None and len(last) == 4 and isinstance(shape[0], int) and shape[0] > 0:
        channels, frames = last[1], last[0] // shape[0]
        if channels != frames and (shape[1], shape[2]) in ((channels, frames), (frames, channels)):
            return 1 if shape[1] == channels else 2
    node, permuted = out, False
    for _ in range(16):  # same channel and frame counts: did the output go through a permute?
        if not isinstance(node, fx.Node) or not is_shape_op(node):
            break
        permuted |= node.target in ("permute", "transpose", torch.permute, torch.transpose,
                                    torch.ops.aten.permute.default, torch.ops.aten.transpose.int)
        node = node.args[0]
    return 1 if permuted else 2


def _ancestors(start: fx.Node, limit: int = 64) -> list[fx.Node]:
    seen: list[fx.Node] = []
    frontier = [start]
    while frontier and len(seen) < limit:
        node = frontier.pop()
        for a in node.all_input_nodes:
            if a not in seen:
                seen.append(a)
                frontier.append(a)
    return seen


def _timestep_source(gm: fx.GraphModule, sample: fx.Node | None) -> tuple[fx.Node | None, float | None]:
    """The timestep's placeholder, or the constant Dynamo baked in, from the time embedding up."""
    embed = next((n for n in gm.graph.nodes if is_call(n, TIME_EMBED_OPS)), None)
    if embed is None:
        return None, None
    ancestors = _ancestors(embed)
    for node in ancestors:  # a tensor timestep: [] or [B]
        value = node.meta.get("example_value", node.meta.get("val"))
        tensor = isinstance(value, torch.Tensor) and value.dim() <= 1
        if node.op == "placeholder" and node is not sample and tensor:
            return node, None
    for node in ancestors:  # a Python number: diffusers wraps it, torch.tensor([t])
        if is_call(node, TENSOR_CONSTANT_OPS) and node.args:
            flat = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            if len(flat) == 1 and isinstance(flat[0], fx.Node) and flat[0].op == "placeholder":
                return flat[0], None  # a symbolic int/float (Dynamo made it dynamic)
            if len(flat) == 1 and isinstance(flat[0], (int, float)) and not isinstance(flat[0], bool):
                return None, float(flat[0])  # baked in: the graph runs for this value only
    return None, None


def find_unet_io(gm: fx.GraphModule, any_size: bool = False) -> UNetIO:
    """Positions of the sample and timestep inputs and of the noise output, found by structure:
    the sample feeds the first convolution, the timestep the sinusoidal time embedding, and the
    output is the first graph output with the sample's batch and spatial size. Also the U-Net
    passes (see :func:`~tome_compile.passes.sites.pass_starts`), from one lookup."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    starts = pass_starts(gm)
    sample = _sample_placeholder(starts[-1] if starts else None)
    packed = packed_grid(gm) if not starts else None
    if packed is not None:
        sample = packed[0]
    sample_index = placeholders.index(sample) if sample in placeholders else 0
    timestep, constant = _timestep_source(gm, sample)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    want = node_shape(placeholders[sample_index]) if placeholders else None
    def like_sample(o: Any) -> bool:  # the channel count may differ (SVD: 8 in, 4 out)
        got = node_shape(o) or ()
        return (want is not None and len(want) in (4, 5) and len(got) == len(want) and got[:1] == want[:1]
                and got[-2:] == want[-2:])

    output_index = next((i for i, o in enumerate(flat) if like_sample(o)), 0)
    return UNetIO(sample_index=sample_index,
                  timestep_index=placeholders.index(timestep) if timestep is not None else None,
                  timestep_constant=constant, output_index=output_index,
                  channel_axis=_channel_axis(gm, flat[output_index]) if flat else 1,
                  noise_channels=_noise_channels(want, node_shape(flat[output_index]) if flat else None),
                  passes=(tuple(_unet_pass(conv, any_size) for conv in starts or [None]) if packed is None
                          else (_packed_pass(packed, any_size),)),
                  spans=tuple(pass_spans(gm, starts)),
                  sample_batch=_batch(node_shape(sample) if sample is not None else None))


def packed_grid(gm: fx.GraphModule | fx.Graph) -> tuple[fx.Node, fx.Node] | None:
    """A packed latent's grid (Flux: ``[B, h * w, C]``, no convolution to read ``h`` and ``w`` off):
    the sample input viewed as ``[B, h, w, C]`` and straight back (what
    :func:`tome_compile.packed.with_grid` writes into the call). Returns ``(sample, grid view)``,
    or None."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        shape = node_shape(node)
        if shape is None or len(shape) != 3:
            continue
        for view in node.users:
            grid = node_shape(view)
            if not (is_shape_op(view) and grid is not None and len(grid) == 4 and grid[0] == shape[0]
                    and grid[3] == shape[2] and grid[1] * grid[2] == shape[1]):
                continue
            if any(is_shape_op(u) and node_shape(u) == shape for u in view.users):
                return node, view
    return None


def _packed_pass(packed: tuple[fx.Node, fx.Node], any_size: bool) -> UNetPass:
    """The one pass of a packed-latent transformer: its tokens are the grid (patch 1 there)."""
    sample, view = packed
    shape = node_shape(view)
    assert shape is not None
    h, w = (size_hint(shape[1]), size_hint(shape[2])) if any_size else (shape[1], shape[2])
    grid = (int(h), int(w)) if isinstance(h, int) and isinstance(w, int) else None
    batch = node_shape(sample)
    rows = int(batch[0]) if batch and isinstance(batch[0], int) else None
    return UNetPass(latent=grid, grid=grid, rows=rows)


def _noise_channels(sample: tuple[Any, ...] | None, out: tuple[Any, ...] | None) -> int | None:
    """A 4-D output with twice the sample's channels is ``[eps; variance]`` (learned sigma, PixArt):
    the first half is the noise the guidance map is made of."""
    if sample is None or out is None or len(sample) != 4 or len(out) != 4:
        return None
    return int(sample[1]) if isinstance(sample[1], int) and out[1] == 2 * sample[1] else None


def _unet_pass(conv: fx.Node | None, any_size: bool = False) -> UNetPass:
    shape = node_shape(conv.args[0]) if conv is not None else None
    grid = node_shape(conv) if conv is not None else None
    four = shape is not None and len(shape) == 4
    four_grid = grid is not None and len(grid) == 4

    def hw(s: tuple[Any, ...]) -> tuple[int, int] | None:
        if _static(s[2:]):
            return int(s[2]), int(s[3])
        hints = size_hint(s[2]), size_hint(s[3])
        return (hints[0], hints[1]) if any_size and hints[0] is not None and hints[1] is not None else None

    return UNetPass(
        latent=hw(shape) if four else None,
        grid=hw(grid) if four_grid else None,
        rows=int(shape[0]) if four and isinstance(shape[0], int) else None,
        conv=conv if four_grid else None,
    )


def _batch(shape: tuple[Any, ...] | None) -> int | None:
    return int(shape[0]) if shape and isinstance(shape[0], int) else None
