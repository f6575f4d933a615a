"""Find the attention sites of a traced U-Net: checks only, no rewriting.

Find by structure, scope by module path, decide by shape (STYLE.md habit 2):

* by dataflow: an attention op (SDPA, or the classic ``baddbmm -> softmax -> bmm`` of diffusers'
  ``AttnProcessor``) whose q, k and v are projections (a ``Linear``, a fused QKV split, or PEFT's
  LoRA ``base_layer(x) + lora_B(lora_A(x)) * s``) of one token sequence — or keys and values of
  ``cat([that sequence, extra tokens], dim=1)`` (reference attention) — is self-attention; k/v
  projected from another tensor (``encoder_hidden_states``) is cross-attention;
* the module path only names the site: the deepest module holding the projections and the
  output projection (``down_blocks.0.attentions.0.transformer_blocks.0.attn1``), whatever
  processor runs inside it (a processor that is itself a module, a chained processor, one that
  splits the batch rows and runs the attention op twice); its region's input is the sequence the
  projections read (through batch-row slices), its output is the one node that leaves the region
  (to_out, before the residual add);
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
from tome_compile.passes.dataflow import (
    CONV_OPS,
    LAYER_NORM_OPS,
    common_path,
    descends,
    describe,
    entry,
    is_call,
    module_path,
    node_shape,
    output_projection,
    projection_of,
    qkv,
    readers,
    reference_of,
)
from tome_compile.passes.joint import JointStreams, joint_parts, joint_streams
from torch import fx

__all__ = [
    "AttentionSite",
    "pick_image_stream",
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


def kv_projections(site: AttentionSite) -> list[fx.Node] | str:
    """The nodes of the key and value projections of a self-attention that read its input (the
    linears; a LoRA wrapper's base layer and ``lora_A``), or why they cannot read another tensor
    than the queries' (ToDo downsamples theirs only)."""
    ops = qkv(site.anchor)
    if ops is None or site.form != "sdpa":
        return "classic AttnProcessor (the token count is baked into its reshapes)"
    if len(site.anchors) > 1:
        return f"its processor runs {len(site.anchors)} attention ops (batch rows apart)"
    pq, pk, pv = (projection_of(t) for t in ops[:3])
    if pk is None or pv is None or pk is pq or pv is pq:
        return "fused QKV projection (one linear for q, k and v)"
    if pk.args[0] is not site.input or pv.args[0] is not site.input:
        return "keys and values do not read the attention input alone (reference attention)"
    found = readers(ops[1], site.input) + readers(ops[2], site.input)
    if not found:
        return "keys and values are not projections of the attention input alone"
    return found


@dataclass
class AttentionSite:
    """One attention op in the graph, with the edges of its module region.

    ``input`` is the tensor the q (and for self-attention k, v) projections read; ``output`` is
    the single node that leaves the region; ``tokens`` is the query token count ``N``.
    """

    path: str
    kind: str  # "self-attention" | "cross-attention" | "joint-attention" | "unknown" (skipped)
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
    # every attention op of the module (a processor that runs the batch rows apart has two)
    # (``anchor`` is the last)
    anchors: tuple[fx.Node, ...] = ()
    # joint attention (SD3, Flux's double blocks): its streams; ``image`` the image stream's index
    # among them, once the pass's patch grid has told it apart (:func:`pick_image_stream`): then
    # ``input`` and ``tokens`` are the image stream's, ``output`` the attention op
    joint: JointStreams | None = None
    image: int | None = None

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


def find_attention_sites(gm: fx.GraphModule, spans: Sequence[tuple[int, int]] | None = None,
                         any_size: bool = False) -> list[AttentionSite]:
    """Every attention module of ``gm`` in execution order (one site per module and U-Net pass,
    however many attention ops its processor runs), classified by dataflow, with its region
    (within its U-Net pass, for a graph that runs the U-Net more than once). ``spans``: the
    passes' graph positions (``UNetIO.spans``), found here when not given. ``any_size``: symbolic
    token counts (an export for every image size) are read at their traced values."""
    sites: list[AttentionSite] = []
    spans = list(spans) if spans else pass_spans(gm)
    regions: dict[tuple[str, tuple[int, int] | None], list[fx.Node]] = {}
    for position, node in enumerate(gm.graph.nodes):
        ops = qkv(node)
        if ops is None:
            continue
        q, k, v, form = ops
        pq, pk, pv = (projection_of(t) for t in (q, k, v))
        streams = joint_streams(q, k, v) if pq is None or pk is None or pv is None else None
        if streams is not None:
            path = module_path(node)
            which = next((i for i, (start, stop) in enumerate(spans) if start <= position < stop), 0)
            sites.append(AttentionSite(path=path, kind="joint-attention", form=form, anchor=node,
                                       input=node, output=node, anchors=(node,), joint=streams,
                                       unet_pass=which, span=spans[which] if len(spans) > 1 else None,
                                       problem="its image tokens are not told apart yet"))
            continue
        if pq is None or pk is None or pv is None:
            joint = joint_parts(q)
            if joint is None:
                kind, problem = "unknown", "q/k/v are not linear projections"
            else:
                kind, problem = "joint-attention", _joint_problem(*joint)
            sites.append(AttentionSite(path=module_path(node), kind=kind, form=form, anchor=node,
                                       input=node, output=None, problem=problem, anchors=(node,)))
            continue
        path = common_path([pq, pk, pv, output_projection(node)]) or module_path(node)
        which = next((i for i, (start, stop) in enumerate(spans) if start <= position < stop), 0)
        span = spans[which] if len(spans) > 1 else None
        if (path, span) not in regions:
            regions[(path, span)] = region_nodes(gm.graph, path, span) if path else []
        nodes = regions[(path, span)]
        inside = set(nodes)
        source = entry(pq.args[0], inside)
        reference = reference_of(pk.args[0], source, inside) if pk.args[0] is pv.args[0] else None
        own = entry(pk.args[0], inside) is source and entry(pv.args[0], inside) is source
        kind = "self-attention" if own or reference is not None else "cross-attention"
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
            output=None,
            nodes=nodes,
            tokens=tokens if isinstance(tokens, int) else None,
            reference=reference,
            reference_tokens=int(ref_shape[1]) if ref_shape and isinstance(ref_shape[1], int) else None,
            unet_pass=which,
            span=span,
            anchors=(node,),
        )
        earlier = next((s for s in sites if path and s.path == path and s.span == span
                        and s.unet_pass == which), None)
        if earlier is not None:  # the same module's next attention op (batch rows run apart)
            _join(earlier, site)
            continue
        sites.append(site)
    for site in sites:
        if site.kind not in ("unknown", "joint-attention"):
            _bound(site, shape_ok=any_size)
    return sites


def pick_image_stream(site: AttentionSite, grid: tuple[int, int] | None) -> None:
    """Tell a joint attention's image stream apart: the one stream whose tokens are the pass's
    patch grid (``h * w``); the site then reads it (``input``, ``tokens``), or says why not."""
    streams = site.joint
    if streams is None:
        return
    counts = [size_hint(n) for n in streams.tokens]
    shown = " + ".join("?" if n is None else str(n) for n in counts)
    if grid is None:
        site.problem = (f"joint attention ({shown} tokens): no patch grid to tell its image tokens from "
                        "its text tokens (no patch-embedding convolution: a packed latent, as Flux's, needs "
                        "its grid given — tome_compile.apply(pipe) does, or tome_compile.set_packed_grid("
                        "transformer, (height // 16, width // 16)) before compiling)")
        return
    image = [i for i, n in enumerate(counts) if n == grid[0] * grid[1]]
    if len(image) != 1:
        site.problem = (f"joint attention ({shown} tokens): {len(image)} of its streams have the "
                        f"{grid[0]}x{grid[1]} patch grid's {grid[0] * grid[1]} tokens; which is the image's "
                        "is not known")
        return
    i = image[0]
    site.image, site.input, site.tokens, site.problem = i, streams.inputs[i], counts[i], None


def _joint_problem(parts: list[Any], single_stream: bool) -> str:
    """Why a joint attention (SD3 / Flux: two streams in one sequence) is skipped, with each stream's
    token count."""
    counts = " + ".join("?" if n is None else str(size_hint(n)) for n in parts)
    return (f"{'single-stream ' if single_stream else ''}joint attention over two streams in one sequence "
            f"({counts} tokens of image and text, as in SD3 / Flux): not merged yet")


def _join(site: AttentionSite, other: AttentionSite) -> None:
    """One site for a module whose processor runs several attention ops (Zero123++'s CFG rows: row
    0 without the reference, the others with it; IP-Adapter's image K/V beside the text's)."""
    site.anchors = site.anchors + other.anchors
    site.anchor = other.anchor
    if other.reference is not None and site.reference is None:
        site.reference, site.reference_tokens = other.reference, other.reference_tokens
    if site.input is not other.input:
        site.problem = (f"its attention ops read different sequences ({describe(site.input)}, "
                        f"{describe(other.input)})")
    elif site.kind != other.kind:
        site.problem = f"its attention ops are a {site.kind} and a {other.kind}"


def _bound(site: AttentionSite, shape_ok: bool) -> None:
    """The site's output (the one node its region hands out), or the problem that names what else
    the region hands out."""
    if site.problem is not None:
        return
    exits = region_exits(site.nodes)
    later = [e for e in exits if any(descends(e, a) for a in site.anchors)]
    shape = node_shape(site.input)
    if not site.path:
        site.problem = "no nn_module_stack metadata to scope the region"
    elif len(exits) != 1:
        others = [e for e in exits if e is not (later[-1] if later else None)]
        site.problem = ("its region hands out " + ", ".join(describe(e) for e in others[:3])
                        + (f" and {len(others) - 3} more" if len(others) > 3 else "")
                        + (" besides its output" if later else " and no output of the attention"))
    elif shape is None or len(shape) != 3:
        site.problem = f"attention input has shape {shape}, expected [B, N, C]"
    elif not _sized(shape[1:], shape_ok):  # a symbolic batch is fine: the plan is per batch row
        site.problem = f"symbolic token count {shape[1]}"
    if len(exits) == 1:
        site.output = exits[0]


def pass_starts(gm: fx.GraphModule | fx.Graph) -> list[fx.Node]:
    """The first convolution of every U-Net pass in the graph, in execution order: the convolutions
    diffusers names ``conv_in`` (Zero123++'s wrapper runs its U-Net twice per call: the reference
    pass over the condition latent, then the sample), else the graph's first convolution (a DiT's
    patch embedding)."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    convs = [n for n in graph.nodes if is_call(n, CONV_OPS)]
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
        if is_call(node, LAYER_NORM_OPS) and isinstance(node.args[0], fx.Node):
            return node.args[0]
        if not is_call(node, _MODULATION_OPS):
            return None
        # follow the operand of the token stream's shape (scale and shift are [B, 1, C])
        node = next((a for a in node.args if isinstance(a, fx.Node) and node_shape(a) == want), None)
    return None


