"""Tracing a U-Net for the export (``torch.export`` of the U-Net itself, so site paths read as in
diffusers) and the fx fixes its graph needs before the ONNX exporter sees it: constant inputs
folded, no-op squeezes dropped, mixed-dtype concatenations cast, dead code removed."""

from __future__ import annotations

import functools
from typing import Any

import torch
from tome_compile.export.metadata import PAIRS_AXIS
from tome_compile.passes.sites import node_shape as _sites_node_shape
from torch import fx

from tome_compile.errors import ToMeExportError
from tome_compile.families import ModelFamily, nested

__all__ = ["MAX_PAIRS", "assert_no_scatter_mean", "attention_count", "drop_dead_code", "drop_noop_squeezes",
           "dynamic_axes", "graph_dynamic_shapes", "plain_graph_module", "promote_mixed_concats",
           "sdpa_nodes", "size_axes", "trace_unet"]


def plain_graph_module(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """``ep.module()`` without its pytree calling convention or input-spec hooks."""
    unlifted = ep.module()
    graph = unlifted.graph
    graph._codegen = fx.graph.CodeGen()
    for node in list(graph.nodes):  # constant arguments (return_dict=False) are placeholders too
        value = node.meta.get("val")
        if node.op == "placeholder" and not isinstance(value, torch.Tensor):
            def constant(a: fx.Node, node: fx.Node = node, value: Any = value) -> Any:
                return value if a is node else a

            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, constant)
                user.kwargs = fx.node.map_arg(user.kwargs, constant)
            graph.erase_node(node)
    return fx.GraphModule(unlifted, graph).eval()


def drop_noop_squeezes(gm: fx.GraphModule) -> int:
    """``x.squeeze(d)`` of a dimension that is not 1 is a no-op in torch, but the exporter writes an
    ONNX ``Squeeze`` that fails shape inference (PixArt's ``proj_out(...).squeeze(1)`` on
    ``[B, N, C]``). Such nodes are replaced by their input. Returns how many."""
    dropped = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (
            torch.ops.aten.squeeze.dim,
            torch.ops.aten.squeeze.dims,
        ):
            continue
        shape = _sites_node_shape(node.args[0])
        dims = node.args[1] if len(node.args) > 1 else None
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        if shape is None or not dims or any(not isinstance(shape[d], int) or shape[d] == 1 for d in dims):
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        dropped += 1
    if dropped:
        gm.recompile()
    return dropped


def promote_mixed_concats(gm: fx.GraphModule) -> int:
    """``torch.cat`` promotes mixed dtypes (SDXL in fp16: ``cat([text_embeds (fp16), time_embeds
    (fp32, the sinusoidal projection)])``) but the exporter writes an ONNX ``Concat`` of the mixed
    inputs, which ``onnx.checker`` refuses ("inputs has inconsistent type"). Each input of another
    dtype gets a cast to the promoted one, as torch computes it. Returns how many casts."""
    casts = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (
            torch.ops.aten.cat.default,
            torch.ops.aten.concat.default,
        ):
            continue
        values = [t.meta.get("val") if isinstance(t, fx.Node) else None for t in node.args[0]]
        dtypes = {v.dtype for v in values if isinstance(v, torch.Tensor)}
        if len(dtypes) < 2 or len(values) != len(node.args[0]):
            continue
        promoted = functools.reduce(torch.promote_types, dtypes)
        inputs = []
        for tensor, value in zip(node.args[0], values, strict=True):
            if isinstance(value, torch.Tensor) and value.dtype != promoted:
                with gm.graph.inserting_before(node):
                    cast = gm.graph.call_function(
                        torch.ops.aten._to_copy.default, (tensor,), {"dtype": promoted}
                    )
                cast.meta = {**tensor.meta, "val": value.to(promoted)}
                tensor, casts = cast, casts + 1
            inputs.append(tensor)
        node.args = (inputs, *node.args[1:])
    if casts:
        gm.recompile()
    return casts


def assert_no_scatter_mean(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and "scatter_reduce" in str(node.target) and "mean" in map(
                str, list(node.args) + list(node.kwargs.values())):
            raise ToMeExportError(
                f"{node.name}: scatter_reduce(mean) cannot be exported (ONNX ScatterElements has no "
                "mean; the torch exporter silently writes an overwrite); use scatter_add + counts")


def sdpa_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.scaled_dot_product_attention.default]


def drop_dead_code(gm: fx.GraphModule) -> int:
    """Remove what no output reads (the multi-view wrapper's write pass after its last stored
    reference: the exporter would drop it too) and the metadata asserts and inference dropouts that
    would keep it alive.
    Returns how many attention calls went."""
    before = len(sdpa_nodes(gm))
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)

    def impure(node: fx.Node) -> bool:  # "seeded" ops that draw nothing here: inference dropout, attention
        if node.target is torch.ops.aten.dropout.default and len(node.args) > 2 and node.args[2] is False:
            return False
        if node.target is torch.ops.aten.scaled_dot_product_attention.default \
                and (node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)) == 0.0:
            return False
        return node.is_impure()

    gm.graph.eliminate_dead_code(is_impure_node=impure)
    gm.recompile()
    return before - len(sdpa_nodes(gm))


def attention_count(unet: torch.nn.Module, gm: fx.GraphModule, passes: int, dead: int = 0) -> int:
    """The attention layers (diffusers ``Attention`` modules, once per U-Net pass, less ``dead``
    ones nothing reads) that must each become one fused node: all but those with a mask (PixArt's
    text mask on cross-attention keeps the plain ONNX translation: MultiHeadAttention's bias cannot
    broadcast over the queries)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    masked = sum(1 for n in sdpa_nodes(gm) if len(n.args) > 3 and n.args[3] is not None
                 or n.kwargs.get("attn_mask") is not None)
    # ``passes``: the multi-view wrapper runs its U-Net twice
    # Flux's FluxAttention is an AttentionModuleMixin, not an Attention
    modules = sum(isinstance(m, (Attention, AttentionModuleMixin)) for m in unet.modules())
    return modules * passes - dead - masked


def size_axes(multiple: int, max_latent: int = 1024) -> dict[str, Any]:
    """The symbolic axes of an export for every image size: the latent's height and width (in
    multiples of ``multiple``, the U-Net's downsampling) and the text length."""
    dim = torch.export.Dim
    return {"height": multiple * dim("latent_height_div", min=1, max=max(1, max_latent // multiple)),
            "width": multiple * dim("latent_width_div", min=1, max=max(1, max_latent // multiple)),
            "text": dim("text_length", min=1, max=4096),
            "map_height": dim("importance_height", min=1, max=max_latent),
            "map_width": dim("importance_width", min=1, max=max_latent)}


def dynamic_axes(name: str, batch: Any, sizes: dict[str, Any] | None) -> dict[int, Any]:
    """The dynamic axes of model input ``name``: the batch (``batch``, None: fixed), and with
    ``sizes`` (:func:`size_axes`) the latent's height and width and the text length."""
    axes = {0: batch} if batch is not None else {}
    if sizes and name == "sample":
        axes.update({2: sizes["height"], 3: sizes["width"]})
    if sizes and name == "encoder_hidden_states":
        axes[1] = sizes["text"]
    return axes


def trace_unet(unet: torch.nn.Module, args: tuple[torch.Tensor, ...], family: ModelFamily,
               dynamic: bool, sizes: dict[str, Any] | None = None) -> fx.GraphModule:
    """``torch.export`` of the U-Net itself (not a wrapper), so site paths read as in diffusers.
    Every input goes where its family says (``ModelInput.keyword``: SDXL's ``added_cond_kwargs``
    flatten to the ``text_embeds``, ``time_ids`` inputs), in the family's order, which the graph's
    inputs keep; with ``dynamic`` each per-image input gets a dynamic batch axis, with ``sizes``
    (:func:`size_axes`) the latent's height and width and the text length are symbolic."""
    batch = torch.export.Dim.DYNAMIC
    if family.multiview:  # the multi-view wrapper (MultiViewExport): its inputs positional
        shapes = tuple({0: batch} if name in family.per_image else None for name in family.names)
        with torch.no_grad():
            ep = torch.export.export(unet, args, dynamic_shapes=shapes if dynamic else None)
        return plain_graph_module(ep)
    values = nested((i.keyword, value) for i, value in zip(family.inputs, args, strict=True))
    leading = 1 if family.dit else 3  # PixArt: the latent positional, the rest by name
    positional = tuple(values.pop(i.keyword) for i in family.inputs[:leading])
    shapes = None
    if dynamic or sizes:
        axes = nested((i.keyword, dynamic_axes(i.name, batch if dynamic and i.per_image else None, sizes)
                       or None) for i in family.inputs)
        shapes = {**axes, "return_dict": None}
    with torch.no_grad():
        ep = torch.export.export(unet, positional, {**values, "return_dict": False}, dynamic_shapes=shapes)
    return plain_graph_module(ep)


MAX_PAIRS = 1024  # the largest batch of CFG pairs an importance export is traced to take


def graph_dynamic_shapes(family: ModelFamily, specs: Any, input_names: list[str], *, dynamic: bool,
                         pairs: bool, sizes: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """The dynamic axes of each input of the rewritten graph: the batch of the U-Net's per-image
    inputs and of the ToMe inputs whose spec has one (plan_every's fed-back plans; with ``pairs``
    the batch is two rows per CFG pair and the importance map has one); in an export for every
    size (``sizes``) also the latent's height and width (the sample's, the importance map's) and
    the text length."""
    if not dynamic and not sizes:
        return None
    rows = batch = torch.export.Dim.DYNAMIC if dynamic else None
    if pairs:
        rows = torch.export.Dim(PAIRS_AXIS, min=1, max=MAX_PAIRS)
        batch = 2 * rows
    axes = {name: dynamic_axes(name, batch if name in family.per_image else None, sizes)
            for name in family.names}
    for spec in specs:
        has_batch = batch is not None and spec.batch_axis is not None
        axes[spec.name] = {spec.batch_axis: rows} if has_batch else {}
        if spec.draw == "importance" and sizes:  # the map [P, H, W]: the latent's size, in axes of
            # its own (merge.fit_importance resizes it to the latent's: no size is read off the map)
            axes[spec.name].update({1: sizes["map_height"], 2: sizes["map_width"]})
    return tuple(axes.get(name) or None for name in input_names)
