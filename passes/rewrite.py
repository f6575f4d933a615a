"""Rewrite one transformer block: ``attn1(norm1(x)) -> unmerge(attn1(merge(norm1(x))))``.

One *plan* node per block computes the merge from the block input ``x`` (tomesd's metric); a
merge node goes after each target region's input and an unmerge node after its output, before
the residual add. Inserted nodes are tagged ``node.meta["tome"] = {"site", "role"}``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tome_compile.passes import sites as _sites
from tome_compile.passes.dataflow import LINEAR_OPS, is_call, is_shape_op, qkv
from tome_compile.passes.decide import BlockPlan, Target
from torch import fx

from tome_compile import merge as _merge
from tome_compile import plans as _plans
from tome_compile import sampler as _sampler
from tome_compile.config import ToMeConfig
from tome_compile.plans import PlanGeometry

__all__ = ["BlockInputs", "geometry_values", "rewrite_block", "size_value", "static_geometry"]


Size = Any  # an int, or a node computing it from the call's shapes (a PlanGeometry likewise)


@dataclass(frozen=True)
class BlockInputs:
    """The graph inputs one block's plan reads, its sizes, and those of the earlier blocks that
    draw (where its share of each drawn input starts).

    ``method`` is "tome", "importance" or "oracle"; ``geometry`` a
    :class:`~tome_compile.plans.PlanGeometry` or the node that computes it per call
    (:func:`geometry_values`); ``before`` the same for every earlier block that makes a plan.
    """

    method: str
    geometry: Any = None
    before: tuple[Any, ...] = ()
    partition: fx.Node | None = None
    importance: fx.Node | None = None
    dst_key: fx.Node | None = None


def static_geometry(plan: BlockPlan, config: ToMeConfig) -> PlanGeometry:
    """The block's sizes as traced (the report's, the input specs'). ToDo plans nothing: its
    geometry is the grid alone (``r`` by ToMe's rule, unused, so that it follows the call's size
    as every other geometry does)."""
    merged = plan.merged
    if config.method == "todo":
        h, w = plan.grid
        merged = int(_plans.merge_count(h * w, _merge.partition_cells(h, w, config.sx, config.sy),
                                        config.ratio, False, config.dst_fraction))
    return PlanGeometry(*plan.grid, config.sx, config.sy, merged, config.pool_factor,
                        config.dst_fraction, downsample=plan.downsample, ratio=config.ratio,
                        importance=config.method == "importance")


def geometry_values(graph: fx.Graph, plans: Sequence[BlockPlan], config: ToMeConfig) -> list[Any]:
    """Each block's sizes as the graph uses them: a node that computes them from the call's first
    convolution (:func:`tome_compile.plans.geometry_at`, right after it; one per distinct block
    size), so that a graph with symbolic shapes (an export for every image size) merges every
    size with tomesd's numbers; the traced constant where the shapes are static (a node there
    would compute the same constants), where there is no such node or the rule does not give the
    traced sizes back."""
    made: dict[tuple[str, PlanGeometry], fx.Node] = {}
    out: list[Any] = []
    names = {n.name: n for n in graph.nodes}  # the plan's node may be of a copy of this graph
    for plan in plans:
        static = static_geometry(plan, config)
        source = names.get(plan.source.name) if plan.source is not None else None
        shape = _sites.node_shape(source) if source is not None else None
        hints = [_sites.size_hint(d) for d in shape[-2:]] if shape is not None and len(shape) == 4 else None
        fixed = shape is not None and all(isinstance(d, int) for d in shape)
        if fixed or source is None or hints is None or None in hints or static.at(*hints) != static:
            out.append(static._replace(downsample=0))
            continue
        key = (source.name, static)
        if key not in made:
            with graph.inserting_after(source):
                made[key] = _tag(graph.call_function(_plans.geometry_at, (source, static)),
                                 plan.site.path, "sizes")
        out.append(made[key])
    return out


def size_value(graph: fx.Graph, fn: Any, values: Sequence[Any], path: str) -> Size:
    """``fn(*values)``: computed now when every value is a constant, else a node (before the insert point)."""
    if not any(isinstance(v, fx.Node) for v in values):
        return fn(*values)
    return _tag(graph.call_function(fn, tuple(values)), path, "plan")


def _tag(node: fx.Node, site: str, role: str) -> fx.Node:
    node.meta["tome"] = {"site": site, "role": role}
    return node


def _replace_literal_tokens(nodes: Sequence[fx.Node], n: int, n_after: int) -> int:
    """Classic ``AttnProcessor`` bakes the token count into its reshapes (``[2, 4096, 8, 8]``):
    rewrite those literals inside the merged region. Returns how many were changed."""
    changed = 0

    def fix(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value == n:
            changed += 1
            return n_after
        if isinstance(value, (list, tuple)) and any(isinstance(v, int) and not isinstance(v, bool)
                                                    and v == n for v in value):
            return type(value)(fix(v) for v in value)
        return value

    for node in nodes:
        shape = _sites.node_shape(node)
        if node.op not in ("call_method", "call_function") or shape is None or n not in shape:
            continue
        node.args = tuple(fix(a) for a in node.args)
        node.kwargs = {k: fix(v) for k, v in node.kwargs.items()}
    return changed


def _plan(graph: fx.Graph, plan: BlockPlan, io: BlockInputs) -> fx.Node:
    """The plan node ``(slot, weight)`` of the block, right after the attention input."""
    path, geometry = plan.site.path, io.geometry

    def call(fn: Any, **operands: Any) -> fx.Node:  # by name: the follow-up passes read them so
        return _tag(graph.call_function(fn, (), operands), path, "plan")

    choice = None
    if io.partition is not None:
        choice = call(_sampler.block_cells, partition=io.partition,
                      offset=size_value(graph, _plans.total_cells, io.before, path),
                      cells=size_value(graph, _plans.total_cells, (geometry,), path), metric=plan.metric)
    if io.method != "importance":
        return call(_plans.make_plan, method="tome", metric=plan.metric, choice=choice, geometry=geometry)
    key = None
    if io.dst_key is not None:
        key = call(_plans.block_keys, dst_key=io.dst_key, before=io.before, geometry=geometry)
    fitted = call(_plans.fit_map, importance=io.importance, geometry=geometry)
    return call(_plans.make_plan, method="importance", metric=plan.metric, choice=None, geometry=geometry,
                importance=fitted, dst_key=key)


def _merge_target(graph: fx.Graph, plan: BlockPlan, target: Target, after: fx.Node,
                  slot: fx.Node | None, weight: fx.Node | None) -> None:
    """``output(region(input)) -> unmerge(output(region(merge(input))))``; oracle without a plan."""
    path, r = plan.site.path, plan.merged
    inside = set(target.region)
    with graph.inserting_after(after):
        merged = (graph.call_function(_merge.merge_tokens, (target.input, slot, weight)) if slot is not None
                  else graph.call_function(_merge.oracle_merge, (target.input, r)))
    _tag(merged, path, "merge")
    for user in list(target.input.users):
        if user in inside:
            user.replace_input_with(target.input, merged)
    if target.bakes_tokens:
        _replace_literal_tokens(target.region, plan.tokens, plan.tokens - r)
    with graph.inserting_after(target.output):
        un = (graph.call_function(_merge.unmerge_tokens, (target.output, slot)) if slot is not None
              else graph.call_function(_merge.oracle_unmerge, (target.output, r)))
    _tag(un, path, "unmerge")
    for user in list(target.output.users):
        if user is not un and user not in inside:
            user.replace_input_with(target.output, un)


def _plain_projections(plan: BlockPlan) -> list[fx.Node] | None:
    """The image stream's q, k and v linears of a joint attention when nothing but reshapes lies
    between each and its concatenation (SD3-medium: no qk-norm, no rotary embedding) and nothing
    else reads them: merging their input then equals merging their outputs (a mean commutes with an
    affine map) and spares them the merged tokens. None otherwise."""
    streams, image, x = plan.site.joint, plan.site.image, plan.site.input
    assert streams is not None and image is not None
    linears = []
    for cat in streams.cats:
        node = cat.args[0][image]
        while isinstance(node, fx.Node) and is_shape_op(node) and len(node.users) == 1:
            node = node.args[0]
        if not (is_call(node, LINEAR_OPS) and node.args[0] is x and len(node.users) == 1):
            return None
        linears.append(node)
    return linears


def _merge_joint(graph: fx.Graph, plan: BlockPlan, after: fx.Node, slot: fx.Node | None,
                 weight: fx.Node | None) -> None:
    """Joint attention: the image stream's parts of q, k and v merged, the text's whole; after the
    attention op, the image part of its output unmerged (the text part untouched), so that
    everything after the op (the split into streams by token count, ``to_out``, ``to_add_out``)
    sees every token. Where the merge goes:

    * at the image projections' input, where only reshapes follow them (SD3-medium,
      :func:`_plain_projections`): the projections then run on the merged tokens too;
    * at the concatenation of q, k and v, where it is what the attention op reads (SD3.5: after
      the qk-norm);
    * else at the attention op's inputs (Flux: after the rotary embedding, which indexes the
      concatenated sequence by position; its single-stream blocks, which concatenate before the
      projections): each token is merged as the attention would see it, rotated at its own
      position."""
    site, r = plan.site, plan.merged
    streams, image = site.joint, site.image
    assert streams is not None and image is not None
    linears = _plain_projections(plan) if not streams.single else None
    read = tuple(qkv(site.anchor)[:3])  # type: ignore[index]  # what the attention op reads
    at_cats = not streams.single and read == tuple(streams.cats)
    if linears is not None:
        with graph.inserting_after(after):
            if slot is not None:
                merged = graph.call_function(_merge.merge_tokens, (site.input, slot, weight))
            else:
                merged = graph.call_function(_merge.oracle_merge, (site.input, r))
        _tag(merged, site.path, "merge")
        for linear in linears:
            linear.replace_input_with(site.input, merged)
    elif at_cats:
        for cat in streams.cats:
            parts = list(cat.args[0])
            with graph.inserting_before(cat):
                if slot is not None:
                    merged = graph.call_function(_merge.merge_heads, (parts[image], slot, weight))
                else:
                    merged = graph.call_function(_merge.oracle_merge_heads, (parts[image], r))
            parts[image] = _tag(merged, site.path, "merge")
            cat.args = (parts, *cat.args[1:])
    else:
        for t in dict.fromkeys(read):
            with graph.inserting_before(site.anchor):
                if slot is not None:
                    merged = graph.call_function(_merge.merge_joint, (t, slot, weight, image == 0))
                else:
                    merged = graph.call_function(_merge.oracle_merge_joint, (t, r, plan.tokens, image == 0))
            site.anchor.replace_input_with(t, _tag(merged, site.path, "merge"))
    first = image == 0
    with graph.inserting_after(site.anchor):
        if slot is not None:
            un = graph.call_function(_merge.unmerge_joint, (site.anchor, slot, weight, first))
        else:
            un = graph.call_function(_merge.oracle_unmerge_joint, (site.anchor, r, plan.tokens - r, first))
    _tag(un, site.path, "unmerge")
    for user in list(site.anchor.users):
        if user is not un:
            user.replace_input_with(site.anchor, un)


def _downsample_kv(graph: fx.Graph, plan: BlockPlan, config: ToMeConfig, io: BlockInputs) -> None:
    """ToDo: ``to_k(x), to_v(x) -> to_k(down(x)), to_v(down(x))``; the queries and the output keep
    every token (one ``downsample_tokens`` node, right after the attention input)."""
    projections = _sites.kv_projections(plan.site)
    assert not isinstance(projections, str), projections  # decide_site checked
    x = plan.site.input
    with graph.inserting_after(x):
        down = _tag(graph.call_function(_plans.downsample_kv, (x, io.geometry, config.downsample_factor,
                                                               config.downsample_method)),
                    plan.site.path, "downsample")
    for projection in projections:
        projection.replace_input_with(x, down)


def rewrite_block(graph: fx.Graph, plan: BlockPlan, config: ToMeConfig, io: BlockInputs,
                  shared: tuple[fx.Node, fx.Node] | None = None) -> tuple[fx.Node, fx.Node] | None:
    """Insert the block's plan (or reuse ``shared``, the ``(slot, weight)`` of an earlier block
    with the same token grid), then merge/unmerge around every target region. Returns the
    ``(slot, weight)`` used (None for the oracle)."""
    if io.method == "todo":
        _downsample_kv(graph, plan, config, io)
        return None
    slot = weight = None
    last: fx.Node = plan.site.input
    if shared is not None:
        slot, weight = shared
    elif io.method != "oracle":
        # inserting_before(next) keeps creation order (inserting_after(n) would reverse it)
        with graph.inserting_before(plan.site.input.next):
            node = _plan(graph, plan, io)
            node.meta["tome"]["geometry"] = static_geometry(plan, config)  # the traced sizes (specs, report)
            slot = _tag(graph.call_function(operator.getitem, (node, 0)), plan.site.path, "plan")
            weight = _tag(graph.call_function(operator.getitem, (node, 1)), plan.site.path, "plan")
        # and which getitems are this block's own plan (a block that shares one has none)
        slot.meta["tome"]["made"], weight.meta["tome"]["made"] = "slot", "weight"
        last = weight
    for target in plan.targets:
        if target.joint:
            _merge_joint(graph, plan, last, slot, weight)
            continue
        _merge_target(graph, plan, target, last if target.input is plan.site.input else target.input,
                      slot, weight)
    return (slot, weight) if slot is not None and weight is not None else None
