"""The ToMe pass: ``attn1(norm1(x)) -> unmerge(attn1(merge(norm1(x))))`` on a traced U-Net.

A pass is a plain function on a GraphModule that returns what it changed
(``torch.fx.passes.infra.pass_base.PassResult`` plus the site report). It works on graphs from
Dynamo (what a ``torch.compile`` backend receives) and from ``torch.export`` (``ep.module()``).

Three stages, each its own module: **find** the attention sites (:mod:`.sites`), **decide** per
site (:mod:`.decide`: a plan or a reason), **rewrite** one block (:mod:`.rewrite`). This driver
only loops over them, appends the graph inputs the plans read (described by
:class:`~tome_compile.inputs.ToMeInputSpec`) and validates the result: a site whose rewrite does
not type-check is put back and reported as skipped. Other forms of the result (randomness hashed
in the graph, plans returned for the next calls) are follow-up passes (:mod:`.follow_up`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from tome_compile.passes import sites as _sites
from tome_compile.passes.context import PassContext, pass_context, plan_makers
from tome_compile.passes.decide import BlockPlan, decide_all, select_blocks
from tome_compile.passes.report import nothing_rewritten, site_report
from tome_compile.passes.result import ToMeResult
from tome_compile.passes.rewrite import BlockInputs, geometry_values, rewrite_block
from tome_compile.passes.unet_io import UNetIO, find_unet_io
from tome_compile.passes.validate import rewrite_checked
from torch import fx

from tome_compile import merge as _merge
from tome_compile.config import ToMeConfig
from tome_compile.inputs import ToMeInputSpec, partition_spec

__all__ = ["merge_self_attention", "nothing_rewritten"]

logger = logging.getLogger("tome_compile.passes")


def _add_input(graph: fx.Graph, spec: ToMeInputSpec) -> fx.Node:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None):
        node = graph.placeholder(spec.name)
    node.meta["tome"] = {"role": "input", "spec": spec}
    return node


def _rewrite_all(gm: fx.GraphModule, plans: list[BlockPlan], context: PassContext) -> list[ToMeInputSpec]:
    """Append the inputs the plans read, rewrite every block, lint; returns the input specs."""
    layout = _layout(plans, context)
    specs, nodes = _add_plan_inputs(gm, context, layout)
    _rewrite_blocks(gm.graph, plans, context, layout, nodes)
    gm.graph.lint()
    gm.recompile()
    return specs


@dataclass(frozen=True)
class _Layout:
    """Where each block's plan comes from and what it draws: ``makers[i]`` the block whose plan
    block ``i`` uses, ``own`` the blocks that make one, ``cells`` / ``pools`` each block's share of
    the drawn partition / importance keys."""

    makers: list[int]
    own: list[int]
    cells: list[tuple[int, int]]
    pools: list[int]
    importance: bool


def _layout(plans: list[BlockPlan], context: PassContext) -> _Layout:
    config = context.config
    makers = plan_makers(plans, config)
    cells = [(p.grid[0] // config.sy, p.grid[1] // config.sx) if makers[i] == i else (0, 0)
             for i, p in enumerate(plans)]
    importance = context.method == "importance"
    pools = [_merge.importance_pool_size(p.tokens, p.merged, config.pool_factor, config.dst_fraction)
             if importance and makers[i] == i else 0 for i, p in enumerate(plans)]
    own = [i for i in range(len(plans)) if makers[i] == i]
    return _Layout(makers=makers, own=own, cells=cells, pools=pools, importance=importance)


def _add_plan_inputs(gm: fx.GraphModule, context: PassContext, layout: _Layout
                     ) -> tuple[list[ToMeInputSpec], dict[str, fx.Node]]:
    """The graph inputs the plans read: their specs and their nodes by kind."""
    specs: list[ToMeInputSpec] = []
    nodes: dict[str, fx.Node] = {}
    importance = layout.importance

    def add(spec: ToMeInputSpec) -> None:
        specs.append(spec)
        nodes[spec.draw] = _add_input(gm.graph, spec)

    images = 0
    latent, batch, layout_of_rows = context.latent, context.batch, context.guidance
    if importance:
        assert latent is not None and batch is not None and layout_of_rows is not None
        images = batch // layout_of_rows.groups
        add(ToMeInputSpec.of("importance", (images, *latent), torch.float32))
    drawn = tuple(layout.cells[i] for i in layout.own)
    if importance and context.use_rand:
        add(ToMeInputSpec.of("dst_key", (images, sum(layout.pools)), torch.float32))
    if context.use_rand and not importance:
        add(partition_spec(drawn, context.config.sx * context.config.sy))
    return specs, nodes


def _rewrite_blocks(graph: fx.Graph, plans: list[BlockPlan], context: PassContext, layout: _Layout,
                    nodes: dict[str, fx.Node]) -> dict[int, tuple[fx.Node, fx.Node] | None]:
    """Rewrite each block, reading its share of the drawn inputs (after those of the earlier
    blocks that make a plan); returns the plan nodes each block made (``None`` for a block that
    shares one)."""
    geometries = geometry_values(graph, plans, context.config)
    made: dict[int, tuple[fx.Node, fx.Node] | None] = {}
    for i, plan in enumerate(plans):
        before = tuple(geometries[j] for j in layout.own if j < i)
        io = BlockInputs(method=context.method, geometry=geometries[i], before=before,
                         partition=nodes.get("partition"), importance=nodes.get("importance"),
                         dst_key=nodes.get("dst_key"))
        maker = layout.makers[i]
        shared = made.get(maker) if maker != i else None
        made[i] = rewrite_block(graph, plan, context.config, io, shared=shared)
    return made


def _attention_batch(plans: list[BlockPlan]) -> tuple[int | None, int | None]:
    """The attention batch of the planned blocks: ``(static size or None, size to plan state by)``
    — a symbolic batch (dynamic ONNX export) sizes the plan-state specs by its traced value."""
    first = next((s[0] for p in plans if isinstance(s := _sites.node_shape(p.site.input), tuple)), None)
    batch = first if isinstance(first, int) else None
    return batch, batch if batch is not None else getattr(getattr(first, "node", None), "hint", None)


def merge_self_attention(
    gm: fx.GraphModule,
    config: ToMeConfig,
    *,
    latent_hw: tuple[int, int] | None = None,
    oracle: bool = False,
    validate: bool = True,
    method: str | None = None,
    io: UNetIO | None = None,
    any_size: bool = False,
    cfg_pairs: bool = False,
) -> ToMeResult:
    """Rewrite every high-resolution self-attention of ``gm`` in place and report every site.

    ``attn1(norm1(x)) -> unmerge(attn1(merge(norm1(x))))``; with ``merge_crossattn`` /
    ``merge_mlp`` also ``attn2`` / ``ff`` of the same block, with the same merge (tomesd).

    Args:
        gm: a GraphModule from Dynamo or ``torch.export(...).module()``, static shapes.
        config: what to merge; ``ratio=0`` leaves ``gm`` untouched.
        latent_hw: the latent's (h, w); found from the input of ``conv_in`` when omitted.
        oracle: benchmark bound: merge = first ``N - r`` tokens, unmerge = a copy; no similarity.
        validate: re-propagate shapes after the rewrite; a site whose rewrite does not
            type-check is put back and reported as skipped (never a graph that crashes).
        method: ``"tome"`` or ``"importance"`` (default ``config.method``). Importance plans read
            the ``tome_importance`` input ``[B/2, H, W]`` (and ``tome_dst_key`` with ``use_rand``).
        io: :func:`~tome_compile.passes.unet_io.find_unet_io` of ``gm`` as it is now (before any
            rewrite), when the caller has it; found here otherwise. Carried on the result.
        any_size: the graph's height and width are symbolic (an export for every image size).
        cfg_pairs: a symbolic batch holds CFG pairs laid out as its traced value (an importance
            export for any batch of pairs); without it importance cannot pair a symbolic batch's
            rows and makes ToMe plans (the report says so).
    Returns:
        :class:`ToMeResult`; ``inputs`` describes the graph inputs appended to ``gm`` (feed them
        last, in that order). The graph is the canonical form: ``plan_every``'s state (plans
        returned, reused, or either per call) and the in-graph random draws are follow-up passes
        (:mod:`.follow_up`) that the caller composes after this one.
    """
    io = io or find_unet_io(gm, any_size)
    found = _sites.find_attention_sites(gm, io.spans, any_size)
    passes = list(io.passes)
    latent = latent_hw or io.latent  # the sample's (the pass whose output the graph returns)
    decisions = select_blocks(decide_all(gm, found, passes, config, latent_hw), found, config, passes)
    plans = [d for d in decisions if isinstance(d, BlockPlan)] if config.enabled else []
    batch, hint = _attention_batch(plans)
    # the CFG pairs are pairs of samples: a video U-Net folds its frames into the attention batch
    # (1 video x 16 frames is 16 rows and still no pair)
    samples = io.sample_batch
    pairs_of = samples if samples is not None and isinstance(batch, int) and batch % samples == 0 else batch
    if pairs_of is None and cfg_pairs:
        # a symbolic batch of CFG pairs (tome-export's importance file, traced at two pairs): its
        # rows are laid out as the traced batch's; the map's rows follow the call's pairs
        pairs_of = hint
    context = pass_context(config, method=method, oracle=oracle, pairs_of=pairs_of, latent=latent, batch=hint)
    kept, specs, failures = ([], [], {})
    if plans:
        kept, specs, failures = rewrite_checked(gm, plans, lambda g, p: _rewrite_all(g, p, context), validate)
    report = site_report(found, decisions, kept, failures, context)
    return ToMeResult(graph_module=gm, modified=bool(kept), sites=report, inputs=specs, latent_hw=latent,
                      batch=batch, guidance=context.guidance if kept else None,
                      method=context.method if kept else (method or config.method), io=io, config=config,
                      plan_batch=hint)
