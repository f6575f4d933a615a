"""Find the attention sites of a traced U-Net: checks only, no rewriting.

Find by structure, scope by module path, decide by shape (STYLE.md habit 2):

* an attention op (SDPA, or the classic ``baddbmm -> softmax -> bmm`` of diffusers'
  ``AttnProcessor``) whose q, k and v are linear projections of one tensor is self-attention;
  k/v projected from another tensor (``encoder_hidden_states``) is cross-attention;
* ``node.meta["nn_module_stack"]`` gives the attention module's region
  (``down_blocks.0.attentions.0.transformer_blocks.0.attn1``): its input is the tensor that feeds
  the projections, its output is the one node that leaves the region (to_out, before the
  residual add);
* token counts come from shape metadata (``example_value`` from Dynamo, ``val`` from
  torch.export).
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

__all__ = [
    "AttentionSite",
    "UNetIO",
    "UNetPass",
    "block_grid",
    "find_attention_sites",
    "find_unet_io",
    "latent_batch",
    "latent_size",
    "module_path",
    "node_shape",
    "norm_input",
    "pass_spans",
    "pass_starts",
    "region_exits",
    "region_nodes",
    "sample_batch",
    "temporal_reason",
    "token_grid",
    "unet_passes",
]

# Recognised op variants, one table: Dynamo (torch level) -> torch.export (aten level).
_SDPA_OPS: set[Any] = {
    torch._C._nn.scaled_dot_product_attention,  # Dynamo: F.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,  # torch.export
}
_LINEAR_OPS: set[Any] = {
    torch._C._nn.linear,  # Dynamo: F.linear / nn.Linear
    torch.nn.functional.linear,
    torch.ops.aten.linear.default,  # torch.export
}
_BMM_OPS: set[Any] = {torch.bmm, torch.ops.aten.bmm.default}  # classic AttnProcessor: probs @ v
_BADDBMM_OPS: set[Any] = {torch.baddbmm, torch.ops.aten.baddbmm.default}  # classic: q @ k^T
_SOFTMAX_OPS: set[Any] = {torch.softmax, torch.nn.functional.softmax, torch.ops.aten.softmax.int,
                          torch.ops.aten._softmax.default}
_CONV_OPS: set[Any] = {torch.conv2d, torch.nn.functional.conv2d, torch.ops.aten.conv2d.default,
                       torch.ops.aten.convolution.default}
_LAYER_NORM_OPS: set[Any] = {torch.nn.functional.layer_norm, torch.layer_norm,
                             torch.ops.aten.layer_norm.default}
# Shape-only ops that q/k/v pass through between the projection and the attention op; split/chunk
# + getitem are fused projections (``unet.fuse_qkv_projections()``: to_qkv -> split -> q, k, v).
_PASSTHROUGH_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "to", "float",
                        "half", "bfloat16", "flatten", "unflatten", "__getitem__", "split", "chunk"}
_PASSTHROUGH_FUNCS: set[Any] = {
    torch.reshape, torch.transpose, torch.permute, torch.flatten, torch.Tensor.contiguous,
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default, torch.ops.aten.contiguous.default, torch.ops.aten.clone.default,
    torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.expand.default,
    torch.ops.aten.unsqueeze.default, torch.ops.aten.t.default, operator.getitem,
    torch.split, torch.functional.split, torch.chunk,  # fused QKV: Dynamo
    torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default,
}
# The sinusoidal timestep embedding (diffusers' ``Timesteps``): the U-Net's timestep feeds it.
_TIME_EMBED_OPS: set[Any] = {torch.sin, torch.cos, torch.ops.aten.sin.default, torch.ops.aten.cos.default}
# torch.tensor([t]) of a Python-number timestep: baked (999) -> torch.tensor; symbolic -> torch._refs.tensor
_TENSOR_CONSTANT_OPS: set[Any] = {torch.tensor, torch.as_tensor, torch._refs.tensor}


def node_shape(node: Any) -> tuple[Any, ...] | None:
    """Shape of a node's value from Dynamo (``example_value``) or export (``val``) metadata."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


def _static(shape: tuple[Any, ...] | None) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape)


_DYNAMO_PREFIX = re.compile(r"^L\['self'\]\.?")
_DYNAMO_MODULES = re.compile(r"\.?__dict__\['_modules'\]\['([^']+)'\]")
_DYNAMO_INDEX = re.compile(r"\[(\d+)\]|\['([^']+)'\]")


def _normalise_path(raw: str) -> str:
    path = _DYNAMO_PREFIX.sub("", raw)
    path = _DYNAMO_MODULES.sub(r".\1", path)
    path = _DYNAMO_INDEX.sub(lambda m: "." + (m.group(1) or m.group(2)), path)
    return path.strip(".").replace("..", ".")


def module_path(node: fx.Node) -> str:
    """The innermost module that produced ``node``, as diffusers names it ('' when unknown)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    raw = list(stack.values())[-1]
    raw = raw[0] if isinstance(raw, tuple) else raw
    return _normalise_path(str(raw))


def _is_call(node: Any, ops: set[Any]) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in ops


def _projection_of(node: Any) -> fx.Node | None:
    """Walk back through shape-only ops to the linear projection that produced ``node``."""
    for _ in range(16):
        if not isinstance(node, fx.Node):
            return None
        if _is_call(node, _LINEAR_OPS):
            return node
        if _is_shape_op(node):
            node = node.args[0]
        else:
            return None
    return None


def _softmax_input(node: Any) -> Any:
    """For the classic form: probs (after optional casts) -> softmax -> baddbmm(q, k^T)."""
    for _ in range(4):
        if not isinstance(node, fx.Node):
            return None
        if _is_call(node, _SOFTMAX_OPS) or (node.op == "call_method" and node.target == "softmax"):
            return node.args[0]
        if (
            node.op == "call_method"
            and node.target in ("to", "float", "half", "bfloat16")
            or _is_call(node, {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype})
        ):
            node = node.args[0]
        else:
            return None
    return None


def _qkv(node: fx.Node) -> tuple[Any, Any, Any, str] | None:
    """(q, k, v, form) of an attention op, or None if ``node`` is not one."""
    if _is_call(node, _SDPA_OPS):
        q, k, v = (list(node.args) + [node.kwargs.get(n) for n in ("query", "key", "value")])[:3]
        return q, k, v, "sdpa"
    if _is_call(node, _BMM_OPS):
        scores = _softmax_input(node.args[0])
        if _is_call(scores, _BADDBMM_OPS):
            return scores.args[1], scores.args[2], node.args[1], "classic"
        if _is_call(scores, _BMM_OPS):
            return scores.args[0], scores.args[1], node.args[1], "classic"
    return None


@dataclass
class AttentionSite:
    """One attention op in the graph, with the edges of its module region.

    ``input`` is the tensor the q (and for self-attention k, v) projections read; ``output`` is
    the single node that leaves the region; ``tokens`` is the query token count ``N``.
    """

    path: str
    kind: str  # "self-attention" | "cross-attention"
    form: str  # "sdpa" | "classic"
    anchor: fx.Node
    input: fx.Node
    output: fx.Node | None
    nodes: list[fx.Node] = field(default_factory=list)
    tokens: int | None = None
    problem: str | None = None
    # reference attention (Zero123++'s read pass): k/v read cat([input, reference]); the reference's tokens
    reference: fx.Node | None = None
    reference_tokens: int | None = None
    unet_pass: int = 0  # which U-Net pass of the graph (a wrapper may run its U-Net twice per call)

    @property
    def block_path(self) -> str:
        return self.path.rsplit(".", 1)[0] if "." in self.path else ""


def region_nodes(graph: fx.Graph, path: str, span: tuple[int, int] | None = None) -> list[fx.Node]:
    """Nodes produced inside module ``path`` (or its children), in graph order; with ``span``, only
    those at graph positions ``[start, stop)`` (one U-Net pass of a graph that runs several)."""
    prefix = path + "."
    start, stop = span or (0, len(graph.nodes))
    return [
        n for i, n in enumerate(graph.nodes)
        if start <= i < stop and n.op not in ("placeholder", "output", "get_attr")
        and (module_path(n) == path or module_path(n).startswith(prefix))
    ]


def region_exits(nodes: list[fx.Node]) -> list[fx.Node]:
    """Nodes of a region used outside it (a well-formed region has exactly one)."""
    inside = set(nodes)
    return [n for n in nodes if any(u not in inside for u in n.users)]


_CAT_OPS: set[Any] = {torch.cat, torch.concat, torch.ops.aten.cat.default, torch.ops.aten.concat.default}


def _reference_of(kv: fx.Node, source: fx.Node) -> fx.Node | None:
    """Reference attention (Zero123++'s read pass): keys and values are projections of
    ``cat([source, reference], dim=1)``; the reference node, or None."""
    if not _is_call(kv, _CAT_OPS) or not isinstance(kv.args[0], (list, tuple)) or len(kv.args[0]) != 2:
        return None
    dim = kv.args[1] if len(kv.args) > 1 else kv.kwargs.get("dim", 0)
    first, reference = kv.args[0]
    shape = node_shape(source)
    if (
        first is not source
        or not isinstance(reference, fx.Node)
        or shape is None
        or dim not in (1, 1 - len(shape))
    ):
        return None
    return reference


def find_attention_sites(gm: fx.GraphModule) -> list[AttentionSite]:
    """Every attention op of ``gm`` in execution order, classified, with its region (within its
    U-Net pass, for a graph that runs the U-Net more than once)."""
    sites: list[AttentionSite] = []
    spans = pass_spans(gm)
    for position, node in enumerate(gm.graph.nodes):
        qkv = _qkv(node)
        if qkv is None:
            continue
        q, k, v, form = qkv
        pq, pk, pv = (_projection_of(t) for t in (q, k, v))
        path = module_path(node)
        if pq is None or pk is None or pv is None:
            problem = "q/k/v are not linear projections"
            sites.append(AttentionSite(path=path, kind="unknown", form=form, anchor=node, input=node,
                                       output=None, problem=problem))
            continue
        source = pq.args[0]
        reference = _reference_of(pk.args[0], source) if pk.args[0] is pv.args[0] else None
        kind = ("self-attention" if (pk.args[0] is source and pv.args[0] is source) or reference is not None
                else "cross-attention")
        which = next((i for i, (start, stop) in enumerate(spans) if start <= position < stop), 0)
        nodes = region_nodes(gm.graph, path, spans[which] if len(spans) > 1 else None) if path else []
        exits = region_exits(nodes)
        shape = node_shape(source)
        tokens = shape[1] if shape is not None and len(shape) == 3 else None
        ref_shape = node_shape(reference) if reference is not None else None
        site = AttentionSite(
            path=path,
            kind=kind,
            form=form,
            anchor=node,
            input=source,
            output=exits[0] if len(exits) == 1 else None,
            nodes=nodes,
            tokens=tokens if isinstance(tokens, int) else None,
            reference=reference,
            reference_tokens=int(ref_shape[1]) if ref_shape and isinstance(ref_shape[1], int) else None,
            unet_pass=which,
        )
        if not path:
            site.problem = "no nn_module_stack metadata to scope the region"
        elif len(exits) != 1:
            site.problem = f"module region has {len(exits)} outputs, expected 1"
        elif shape is None or len(shape) != 3:
            site.problem = f"attention input has shape {shape}, expected [B, N, C]"
        elif not _static(shape[1:]):  # a symbolic batch is fine: the plan is per batch row
            site.problem = f"symbolic token count {shape[1]}"
        sites.append(site)
    return sites


def _first_conv(gm: fx.GraphModule) -> fx.Node | None:
    """The first convolution of the U-Net pass whose output the graph returns: ``conv_in`` (of the
    last pass, when a wrapper runs its U-Net more than once per call), else the first convolution."""
    starts = pass_starts(gm)
    return starts[-1] if starts else None


def pass_starts(gm: fx.GraphModule | fx.Graph) -> list[fx.Node]:
    """The first convolution of every U-Net pass in the graph, in execution order: the convolutions
    diffusers names ``conv_in`` (Zero123++'s wrapper runs its U-Net twice per call: the reference
    pass over the condition latent, then the sample), else the graph's first convolution (a DiT's
    patch embedding)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    convs = [n for n in graph.nodes if _is_call(n, _CONV_OPS)]
    named = [n for n in convs if module_path(n).rsplit(".", 1)[-1] == "conv_in"]
    return named or convs[:1]


def pass_spans(gm: fx.GraphModule | fx.Graph) -> list[tuple[int, int]]:
    """Graph positions ``[start, stop)`` of each U-Net pass (one span for a single-pass graph)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    starts = pass_starts(graph)
    if len(starts) < 2:
        return [(0, len(graph.nodes))]
    position = {n: i for i, n in enumerate(graph.nodes)}
    bounds = [0] + [position[n] for n in starts[1:]] + [len(graph.nodes)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@dataclass(frozen=True)
class UNetPass:
    """One U-Net pass of a graph: its latent (the first convolution's input), its token grid (that
    convolution's output: the patch grid of a DiT) and its rows (B x F for a video U-Net)."""

    latent: tuple[int, int] | None
    grid: tuple[int, int] | None
    rows: int | None


def unet_passes(gm: fx.GraphModule) -> list[UNetPass]:
    """Every U-Net pass of ``gm``, in execution order (see :func:`pass_starts`)."""
    out = []
    for conv in pass_starts(gm) or [None]:
        shape = node_shape(conv.args[0]) if conv is not None else None
        grid = node_shape(conv) if conv is not None else None
        four = shape is not None and len(shape) == 4
        out.append(
            UNetPass(
                latent=(int(shape[2]), int(shape[3])) if four and _static(shape[2:]) else None,
                grid=(int(grid[2]), int(grid[3]))
                if grid is not None and len(grid) == 4 and _static(grid[2:])
                else None,
                rows=int(shape[0]) if four and isinstance(shape[0], int) else None,
            )
        )
    return out


def latent_size(gm: fx.GraphModule) -> tuple[int, int] | None:
    """Spatial size (h, w) of the latent: the input of the first convolution (``conv_in``)."""
    return unet_passes(gm)[-1].latent


def token_grid(gm: fx.GraphModule) -> tuple[int, int] | None:
    """The full-resolution token grid: the output size of the first convolution — the latent for a
    U-Net (``conv_in``, stride 1), the patch grid for a DiT (PixArt's patchify conv, stride = patch)."""
    return unet_passes(gm)[-1].grid


def sample_batch(gm: fx.GraphModule) -> int | None:
    """The batch of the model's sample input (videos for a video U-Net), or None when unknown."""
    node = _sample_placeholder(gm)
    shape = node_shape(node) if node is not None else None
    return int(shape[0]) if shape and isinstance(shape[0], int) else None


def latent_batch(gm: fx.GraphModule) -> int | None:
    """Rows of the latent at ``conv_in``: the batch of an image U-Net, batch x frames of a video
    U-Net (AnimateDiff, SVD fold the frames into the batch); None when symbolic or unknown."""
    return unet_passes(gm)[-1].rows


# Video U-Nets' temporal attention, by diffusers' module names: AnimateDiff's motion modules
# (``…motion_modules.0.transformer_blocks.0.attn1``), SVD's ``temporal_transformer_blocks``,
# ModelScope / I2VGen-XL's ``temp_attentions``. Their tokens are frames, their batch B x H x W.
_TEMPORAL_PATH = re.compile(r"(^|\.)(motion_modules|temporal_transformer_blocks|temp_attentions)(\.|$)")


def temporal_reason(site: AttentionSite, rows: int | None) -> str | None:
    """Why ``site`` is a video U-Net's temporal attention (never merged), or None if it is not:
    its module path says so, or its batch is not the latent's rows (B x F for a video U-Net)."""
    shape = node_shape(site.input)
    batch = shape[0] if shape is not None and len(shape) == 3 and isinstance(shape[0], int) else None
    frames = f"its {site.tokens} tokens are frames" if site.tokens is not None else "its tokens are frames"
    if _TEMPORAL_PATH.search(site.path):
        return f"temporal attention ({frames}, batch {batch if batch is not None else '?'} = B x H x W)"
    if rows is not None and batch is not None and batch != rows:
        return (f"attention batch {batch} is not the latent's {rows} rows: not a per-image/per-frame "
                "spatial attention (temporal?)")
    return None


def block_grid(latent_hw: tuple[int, int], tokens: int) -> tuple[int, int, int]:
    """tomesd's rule: ``downsample = ceil(sqrt(N_latent // N))``, grid = ceil(latent / downsample)."""
    lh, lw = latent_hw
    downsample = int(math.ceil(math.sqrt((lh * lw) // tokens))) if tokens > 0 else 0
    downsample = max(downsample, 1)
    return downsample, int(math.ceil(lh / downsample)), int(math.ceil(lw / downsample))


# adaLN (DiT, PixArt's ada_norm_single): ``norm1(x) * (1 + scale) + shift`` feeds the attention
_MODULATION_OPS: set[Any] = {operator.add, operator.mul, torch.add, torch.mul, torch.ops.aten.add.Tensor,
                             torch.ops.aten.mul.Tensor}


def norm_input(node: fx.Node) -> fx.Node | None:
    """The tensor a layer norm normalises (the block input ``x`` of ``norm1(x)``), or None. Sees
    through an adaLN modulation ``norm1(x) * (1 + scale) + shift`` (PixArt, DiT): the metric is
    still the block input."""
    want = node_shape(node)
    for _ in range(4):  # the norm itself, or up to three modulation ops above it
        if _is_call(node, _LAYER_NORM_OPS) and isinstance(node.args[0], fx.Node):
            return node.args[0]
        if not _is_call(node, _MODULATION_OPS):
            return None
        # follow the operand of the token stream's shape (scale and shift are [B, 1, C])
        node = next((a for a in node.args if isinstance(a, fx.Node) and node_shape(a) == want), None)
    return None


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

    def timestep(self, args: Sequence[Any]) -> Any:
        """The timestep of one call, from its arguments."""
        return args[self.timestep_index] if self.timestep_index is not None else self.timestep_constant


def _is_shape_op(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _PASSTHROUGH_METHODS
            or node.op == "call_function" and node.target in _PASSTHROUGH_FUNCS)


def _sample_placeholder(gm: fx.GraphModule) -> fx.Node | None:
    """The input of the first convolution (conv_in), traced back through shape-preserving ops and
    the reshapes that fold a video's frames into the batch."""
    conv = _first_conv(gm)
    node = conv.args[0] if conv is not None else None
    for _ in range(32):
        if not isinstance(node, fx.Node) or node.op == "placeholder":
            break
        if _is_shape_op(node) and isinstance(node.args[0], fx.Node):
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
    convs = [n for n in gm.graph.nodes if _is_call(n, _CONV_OPS)]
    last = node_shape(convs[-1]) if convs else None
    if last is not None and len(last) == 4 and isinstance(shape[0], int) and shape[0] > 0:
        channels, frames = last[1], last[0] // shape[0]
        if channels != frames and (shape[1], shape[2]) in ((channels, frames), (frames, channels)):
            return 1 if shape[1] == channels else 2
    node, permuted = out, False
    for _ in range(16):  # same channel and frame counts: did the output go through a permute?
        if not isinstance(node, fx.Node) or not _is_shape_op(node):
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
    embed = next((n for n in gm.graph.nodes if _is_call(n, _TIME_EMBED_OPS)), None)
    if embed is None:
        return None, None
    ancestors = _ancestors(embed)
    for node in ancestors:  # a tensor timestep: [] or [B]
        value = node.meta.get("example_value", node.meta.get("val"))
        tensor = isinstance(value, torch.Tensor) and value.dim() <= 1
        if node.op == "placeholder" and node is not sample and tensor:
            return node, None
    for node in ancestors:  # a Python number: diffusers wraps it, torch.tensor([t])
        if _is_call(node, _TENSOR_CONSTANT_OPS) and node.args:
            flat = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
            if len(flat) == 1 and isinstance(flat[0], fx.Node) and flat[0].op == "placeholder":
                return flat[0], None  # a symbolic int/float (Dynamo made it dynamic)
            if len(flat) == 1 and isinstance(flat[0], (int, float)) and not isinstance(flat[0], bool):
                return None, float(flat[0])  # baked in: the graph runs for this value only
    return None, None


def find_unet_io(gm: fx.GraphModule) -> UNetIO:
    """Positions of the sample and timestep inputs and of the noise output, found by structure:
    the sample feeds the first convolution, the timestep the sinusoidal time embedding, and the
    output is the first graph output with the sample's batch and spatial size."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sample = _sample_placeholder(gm)
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
                  noise_channels=_noise_channels(want, node_shape(flat[output_index]) if flat else None))


def _noise_channels(sample: tuple[Any, ...] | None, out: tuple[Any, ...] | None) -> int | None:
    """A 4-D output with twice the sample's channels is ``[eps; variance]`` (learned sigma, PixArt):
    the first half is the noise the guidance map is made of."""
    if sample is None or out is None or len(sample) != 4 or len(out) != 4:
        return None
    return int(sample[1]) if isinstance(sample[1], int) and out[1] == 2 * sample[1] else None
