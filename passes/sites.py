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
    "block_grid",
    "kv_projections",
    "find_attention_sites",
    "module_path",
    "node_shape",
    "norm_input",
    "pass_spans",
    "pass_starts",
    "region_exits",
    "region_nodes",
    "size_hint",
    "temporal_reason",
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


def size_hint(size: Any) -> int | None:
    """An int size as it is; a symbolic one (an export for every image size) as its traced value."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if hint is not None else None


def _sized(shape: tuple[Any, ...] | None, any_size: bool) -> bool:
    """Sizes the pass can decide on: ints, or (``any_size``) symbolic sizes with a traced value."""
    return _static(shape) or (any_size and shape is not None and all(size_hint(d) is not None for d in shape))


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


def _is_shape_op(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _PASSTHROUGH_METHODS
            or node.op == "call_function" and node.target in _PASSTHROUGH_FUNCS)


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


def kv_projections(site: AttentionSite) -> tuple[fx.Node, fx.Node] | str:
    """The key and value projections of a self-attention (the linear nodes that read its input),
    or why they cannot read another tensor than the queries' (ToDo downsamples theirs only)."""
    qkv = _qkv(site.anchor)
    if qkv is None or site.form != "sdpa":
        return "classic AttnProcessor (the token count is baked into its reshapes)"
    pq, pk, pv = (_projection_of(t) for t in qkv[:3])
    if pk is None or pv is None or pk is pq or pv is pq:
        return "fused QKV projection (one linear for q, k and v)"
    if pk.args[0] is not site.input or pv.args[0] is not site.input:
        return "keys and values do not read the attention input alone (reference attention)"
    return pk, pv


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
    span: tuple[int, int] | None = None  # that pass's graph positions, when the graph has several

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
    """Nodes of a region used outside it (a well-formed region has exactly one). Size arithmetic
    on sizes read outside the region (``8 * batch``, heads times a symbolic batch, that
    ``torch.export`` computes once where first needed and shares with later blocks) is not an exit:
    it does not depend on the region's tensors, so merging them cannot change it."""
    inside = set(nodes)

    def outside_size(n: fx.Node) -> bool:
        value = n.meta.get("val")
        return isinstance(value, (int, torch.SymInt)) and all(
            a not in inside or outside_size(a) for a in n.all_input_nodes)

    return [n for n in nodes if any(u not in inside for u in n.users) and not outside_size(n)]


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


def find_attention_sites(gm: fx.GraphModule, spans: Sequence[tuple[int, int]] | None = None,
                         any_size: bool = False) -> list[AttentionSite]:
    """Every attention op of ``gm`` in execution order, classified, with its region (within its
    U-Net pass, for a graph that runs the U-Net more than once). ``spans``: the passes' graph
    positions (``UNetIO.spans``), found here when not given. ``any_size``: symbolic token counts
    (an export for every image size) are read at their traced values."""
    sites: list[AttentionSite] = []
    spans = list(spans) if spans else pass_spans(gm)
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
        span = spans[which] if len(spans) > 1 else None
        nodes = region_nodes(gm.graph, path, span) if path else []
        exits = region_exits(nodes)
        shape = node_shape(source)
        tokens = size_hint(shape[1]) if shape is not None and len(shape) == 3 and any_size else (
            shape[1] if shape is not None and len(shape) == 3 else None)
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
            span=span,
        )
        if not path:
            site.problem = "no nn_module_stack metadata to scope the region"
        elif len(exits) != 1:
            site.problem = f"module region has {len(exits)} outputs, expected 1"
        elif shape is None or len(shape) != 3:
            site.problem = f"attention input has shape {shape}, expected [B, N, C]"
        elif not _sized(shape[1:], any_size):  # a symbolic batch is fine: the plan is per batch row
            site.problem = f"symbolic token count {shape[1]}"
        sites.append(site)
    return sites


def pass_starts(gm: fx.GraphModule | fx.Graph) -> list[fx.Node]:
    """The first convolution of every U-Net pass in the graph, in execution order: the convolutions
    diffusers names ``conv_in`` (Zero123++'s wrapper runs its U-Net twice per call: the reference
    pass over the condition latent, then the sample), else the graph's first convolution (a DiT's
    patch embedding)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    convs = [n for n in graph.nodes if _is_call(n, _CONV_OPS)]
    named = [n for n in convs if module_path(n).rsplit(".", 1)[-1] == "conv_in"]
    return named or convs[:1]


def pass_spans(gm: fx.GraphModule | fx.Graph, starts: list[fx.Node] | None = None) -> list[tuple[int, int]]:
    """Graph positions ``[start, stop)`` of each U-Net pass (one span for a single-pass graph);
    ``starts``: :func:`pass_starts`, when already found."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    starts = pass_starts(graph) if starts is None else starts
    if len(starts) < 2:
        return [(0, len(graph.nodes))]
    position = {n: i for i, n in enumerate(graph.nodes)}
    bounds = [0] + [position[n] for n in starts[1:]] + [len(graph.nodes)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


# Video U-Nets' temporal attention, by diffusers' module names: AnimateDiff's motion modules
# (``…motion_modules.0.transformer_blocks.0.attn1``), SVD's ``temporal_transformer_blocks``,
# ModelScope / I2VGen-XL's ``temp_attentions``. Their tokens are frames, their batch B x H x W.
_TEMPORAL_PATH = re.compile(r"(^|\.)(motion_modules|temporal_transformer_blocks|temp_attentions)(\.|$)")


def temporal_reason(site: AttentionSite, rows: int | None) -> str | None:
    """Why ``site`` is not a per-image spatial attention (never merged), or None if it is: a video
    U-Net's temporal attention (its module path says so, or a batch of B x H x W), or an attention
    over part of the latent's rows (PAG's perturbed layer: its processor splits the batch)."""
    shape = node_shape(site.input)
    batch = shape[0] if shape is not None and len(shape) == 3 and isinstance(shape[0], int) else None
    frames = f"its {site.tokens} tokens are frames" if site.tokens is not None else "its tokens are frames"
    if _TEMPORAL_PATH.search(site.path):
        return f"temporal attention ({frames}, batch {batch if batch is not None else '?'} = B x H x W)"
    if rows is not None and batch is not None and batch < rows:
        return (f"attention over {batch} of the latent's {rows} rows: its processor splits the batch "
                "(perturbed-attention guidance: PAG's perturbed rows take an identity attention here), "
                "so no per-image plan fits it")
    if rows is not None and batch is not None and batch != rows:
        return (f"attention batch {batch} is not the latent's {rows} rows: its tokens are not one image's "
                "or frame's (temporal attention, batch B x H x W?)")
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


