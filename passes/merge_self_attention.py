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

import copy
import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tome_compile.passes import sites as _sites
from tome_compile.passes.decide import BlockPlan, Skip, decide_site
from tome_compile.passes.result import ToMeResult, ToMeSite
from tome_compile.passes.rewrite import BlockInputs, rewrite_block
from tome_compile.passes.unet_io import UNetIO, find_unet_io
from torch import fx

from tome_compile import merge as _merge
from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeRewriteError
from tome_compile.guidance import GuidanceLayout, random_destinations, resolve_guidance
from tome_compile.inputs import ToMeInputSpec, partition_spec

__all__ = ["merge_self_attention", "nothing_rewritten"]

logger = logging.getLogger("tome_compile.passes")



@dataclass(frozen=True)
class _Mode:
    """How the plans of this graph are made (the same for every block)."""

    method: str  # "tome" | "importance" | "oracle"
    use_rand: bool
    note: str  # appended to each rewritten row's reason
    guidance: GuidanceLayout | None = None  # importance: which rows of the batch are one image's


def _choose_mode(config: ToMeConfig, method: str | None, oracle: bool, batch: int | None) -> _Mode:
    method = "oracle" if oracle else (method or config.method)
    note = ""
    layout = None
    if method == "importance":
        resolved = resolve_guidance(config.guidance, batch)
        if isinstance(resolved, str):
            method, note = "tome", f"; {resolved}: ToMe plans"
        else:
            layout = resolved
    use_rand = config.use_rand and method != "oracle"
    if use_rand and method == "tome" and not random_destinations(True, batch):
        use_rand, note = False, note + f"; batch {batch} is odd: fixed destinations (as tomesd)"
    tag = {"oracle": "; oracle", "importance": f"; importance ({layout.name if layout else '?'} guidance)"
           }.get(method, "")
    return _Mode(method=method, use_rand=use_rand, note=note + tag, guidance=layout)


def _add_input(graph: fx.Graph, spec: ToMeInputSpec) -> fx.Node:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None):
        node = graph.placeholder(spec.name)
    node.meta["tome"] = {"role": "input", "spec": spec}
    return node


def _rewrite_all(gm: fx.GraphModule, plans: list[BlockPlan], config: ToMeConfig, mode: _Mode,
                 latent: tuple[int, int] | None, batch: int | None) -> list[ToMeInputSpec]:
    """Append the inputs the plans read, rewrite every block, lint; returns the input specs."""
    layout = _layout(plans, config, mode)
    specs, nodes = _add_plan_inputs(gm, plans, config, mode, latent, batch, layout)
    _rewrite_blocks(gm.graph, plans, config, mode, layout, nodes)
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


def _layout(plans: list[BlockPlan], config: ToMeConfig, mode: _Mode) -> _Layout:
    makers = _plan_makers(plans, config)
    cells = [(p.grid[0] // config.sy, p.grid[1] // config.sx) if makers[i] == i else (0, 0)
             for i, p in enumerate(plans)]
    importance = mode.method == "importance"
    pools = [_merge.importance_pool_size(p.tokens, p.merged, config.pool_factor, config.dst_fraction)
             if importance and makers[i] == i else 0 for i, p in enumerate(plans)]
    own = [i for i in range(len(plans)) if makers[i] == i]
    return _Layout(makers=makers, own=own, cells=cells, pools=pools, importance=importance)


def _add_plan_inputs(gm: fx.GraphModule, plans: list[BlockPlan], config: ToMeConfig, mode: _Mode,
                     latent: tuple[int, int] | None, batch: int | None, layout: _Layout
                     ) -> tuple[list[ToMeInputSpec], dict[str, fx.Node]]:
    """The graph inputs the plans read: their specs and their nodes by kind."""
    specs: list[ToMeInputSpec] = []
    nodes: dict[str, fx.Node] = {}
    importance = layout.importance

    def add(spec: ToMeInputSpec) -> None:
        specs.append(spec)
        nodes[spec.draw] = _add_input(gm.graph, spec)

    images = 0
    if importance:
        assert latent is not None and batch is not None and mode.guidance is not None
        images = batch // mode.guidance.groups
        add(ToMeInputSpec.of("importance", (images, *latent), torch.float32))
    drawn = tuple(layout.cells[i] for i in layout.own)
    if importance and mode.use_rand:
        add(ToMeInputSpec.of("dst_key", (images, sum(layout.pools)), torch.float32))
    if mode.use_rand and not importance:
        add(partition_spec(drawn, config.sx * config.sy))
    return specs, nodes


def _rewrite_blocks(graph: fx.Graph, plans: list[BlockPlan], config: ToMeConfig, mode: _Mode, layout: _Layout,
                    nodes: dict[str, fx.Node]) -> dict[int, tuple[fx.Node, fx.Node] | None]:
    """Rewrite each block, reading its share of the drawn inputs (running offsets); returns the
    plan nodes each block made (``None`` for a block that shares one)."""
    cell_offset = key_offset = 0
    made: dict[int, tuple[fx.Node, fx.Node] | None] = {}
    for i, (plan, (ch, cw), pool) in enumerate(zip(plans, layout.cells, layout.pools, strict=True)):
        io = BlockInputs(method=mode.method, partition=nodes.get("partition"), cell_offset=cell_offset,
                         importance=nodes.get("importance"),
                         dst_key=nodes.get("dst_key"), key_offset=key_offset, pool=pool)
        maker = layout.makers[i]
        shared = made.get(maker) if maker != i else None
        made[i] = rewrite_block(graph, plan, config, io, shared=shared)
        cell_offset, key_offset = cell_offset + ch * cw, key_offset + pool
    return made


# The skip reason of a self-attention whose input the graph hands out (kept for a later call)
STORED_REFERENCE = "reference write pass: its input is stored for a later call"


def _decide_all(gm: fx.GraphModule, found: list[_sites.AttentionSite], passes: list[_sites.UNetPass],
                config: ToMeConfig, latent_hw: tuple[int, int] | None) -> list[BlockPlan | Skip]:
    """Each site's decision against its own U-Net pass (a DiT's patch grid, a U-Net's latent). A
    self-attention whose input is another site's reference (Zero123++'s write pass over the
    condition latent) is left unmerged: its input is the reference the read pass attends to."""
    readers = {s.reference: s for s in found if s.reference is not None}
    out: list[BlockPlan | Skip] = []
    for site in found:
        unet_pass = passes[min(site.unet_pass, len(passes) - 1)]
        reader = readers.get(site.input)
        if reader is not None and site.kind == "self-attention":
            out.append(Skip(f"reference pass: its input is the reference {reader.path} (pass "
                            f"{reader.unet_pass}) attends to; left unmerged"))
            continue
        if site.kind == "self-attention" and any(user.op == "output" for user in site.input.users):
            out.append(Skip(STORED_REFERENCE + " (a graph output: a reference-only write pass, e.g. "
                            "Zero123++'s inner U-Net compiled alone); left unmerged"))
            continue
        grid = unet_pass.grid or latent_hw or unet_pass.latent
        out.append(decide_site(site, found, gm.graph, config, grid, unet_pass.rows))
    return out


def _select_blocks(decisions: list[BlockPlan | Skip], found: list[_sites.AttentionSite], config: ToMeConfig,
                   passes: list[_sites.UNetPass]) -> list[BlockPlan | Skip]:
    """``config.blocks``: keep the plans of the listed blocks (index k = the k-th spatial
    self-attention block in execution order; PixArt's ``transformer_blocks.k``)."""
    if config.blocks is None:
        return decisions
    out: list[BlockPlan | Skip] = []
    k = 0
    for site, decision in zip(found, decisions, strict=True):
        rows = passes[min(site.unet_pass, len(passes) - 1)].rows
        spatial = site.kind == "self-attention" and _sites.temporal_reason(site, rows) is None
        if spatial and isinstance(decision, BlockPlan) and k not in config.blocks:
            shown = _ranges(config.blocks)
            decision = Skip(f"block {k} is not in blocks={shown}", decision.grid, decision.downsample)
        out.append(decision)
        k += spatial
    return out


def _ranges(values: tuple[int, ...]) -> str:
    """(7, 8, ..., 20) -> "7-20"; (1, 3, 4) -> "1,3-4"."""
    parts: list[tuple[int, int]] = []
    for v in sorted(set(values)):
        if parts and parts[-1][1] == v - 1:
            parts[-1] = (parts[-1][0], v)
        else:
            parts.append((v, v))
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in parts)


def _plan_makers(plans: list[BlockPlan], config: ToMeConfig) -> list[int]:
    """For each block, the index of the block whose plan it uses: itself, or with ``share_plan``
    the first block with the same token grid and merge count (one plan per resolution level)."""
    first: dict[tuple[int, tuple[int, int], int], int] = {}
    return [first.setdefault((p.tokens, p.grid, p.merged), i) if config.share_plan else i
            for i, p in enumerate(plans)]


@contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """Fake-tensor propagation of a rewrite that does not type-check logs the failing node at
    ERROR level (over a hundred lines); the pass reports the site itself, one line."""
    names = ["torch.fx.interpreter", "torch.fx.passes.fake_tensor_prop", "torch._subclasses.fake_tensor",
             "torch.fx.experimental.symbolic_shapes"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _check(gm: fx.GraphModule) -> str | None:
    """Propagate fake tensors through ``gm``; the error text, or None when it type-checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        spec = node.meta.get("tome", {}).get("spec")
        value = node.meta.get("example_value", node.meta.get("val"))
        with mode:
            if spec is not None:
                args.append(spec.zeros())
            elif isinstance(value, torch.Tensor):
                if not all(isinstance(d, int) for d in value.shape):
                    return None  # symbolic shapes: nothing static to check against
                args.append(torch.empty_strided(tuple(value.shape), tuple(value.stride()),
                                                dtype=value.dtype, device=value.device))
            elif isinstance(value, (torch.SymInt, torch.SymFloat)):
                args.append(value.node.hint if value.node.hint is not None else 1)
            else:
                args.append(value)
    try:
        with _quiet_torch_logs():
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    except Exception as e:  # noqa: BLE001 - any failure means "this rewrite does not type-check"
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None


def _remap(plan: BlockPlan, graph: fx.Graph) -> BlockPlan:
    """The same plan on a copy of the graph (nodes matched by name)."""
    names = {n.name: n for n in graph.nodes}

    def node(n: fx.Node) -> fx.Node:
        return names[n.name]

    site = dataclasses.replace(plan.site, input=node(plan.site.input), anchor=node(plan.site.anchor),
                               output=node(plan.site.output) if plan.site.output is not None else None,
                               nodes=[node(n) for n in plan.site.nodes])
    targets = tuple(dataclasses.replace(t, input=node(t.input), output=node(t.output),
                                        region=tuple(node(n) for n in t.region)) for t in plan.targets)
    return dataclasses.replace(plan, site=site, metric=node(plan.metric), targets=targets)


def _apply(gm: fx.GraphModule, plans: list[BlockPlan], config: ToMeConfig, mode: _Mode,
           latent: tuple[int, int] | None, batch: int | None,
           validate: bool) -> tuple[list[BlockPlan], list[ToMeInputSpec], dict[str, str]]:
    """Rewrite every planned block; when the result does not type-check, find the sites that
    fail alone, put the graph back and rewrite the others. Returns (kept plans, input specs,
    failures)."""
    original = copy.deepcopy(gm.graph) if validate else None
    specs = _rewrite_all(gm, plans, config, mode, latent, batch)
    if original is None or (error := _check(gm)) is None:
        return plans, specs, {}
    logger.info("ToMe: rewritten graph failed its shape check (%s); retrying site by site", error)
    survivors, failures = [], {}
    for plan in plans:
        trial = fx.GraphModule(gm, copy.deepcopy(original))
        _rewrite_all(trial, [_remap(plan, trial.graph)], config, mode, latent, batch)
        err = _check(trial)
        if err is None:
            survivors.append(plan)
        else:
            failures[plan.site.path] = err
            logger.info("ToMe: %s left unmerged: its rewrite fails the shape check (%s)", plan.site.path, err)
    gm.graph = copy.deepcopy(original)
    survivors = [_remap(p, gm.graph) for p in survivors]
    specs = _rewrite_all(gm, survivors, config, mode, latent, batch) if survivors else []
    if not survivors:
        gm.recompile()
    elif _check(gm) is not None:
        raise ToMeRewriteError("ToMe rewrite failed its shape check even site by site")
    return survivors, specs, failures


def _report(found: list[_sites.AttentionSite], decisions: list[BlockPlan | Skip], kept: list[BlockPlan],
            failures: dict[str, str], config: ToMeConfig, mode: _Mode) -> list[ToMeSite]:
    """One row per attention site, in graph order."""
    by_path = {(p.site.path, p.site.unet_pass): p for p in kept}
    makers = _plan_makers(kept, config)
    sharing = {p.site.path: kept[m].site.path for p, m in zip(kept, makers, strict=True) if kept[m] is not p}
    merged_with = {t.path: p for p in kept for t in p.targets if t.path != p.site.path}
    rows = []
    for site, decision in zip(found, decisions, strict=True):
        plan, partner = by_path.get((site.path, site.unet_pass)), merged_with.get(site.path)
        kind = site.kind + (" + reference" if site.reference is not None else "")
        row = {"path": site.path, "kind": kind, "tokens": site.tokens}
        if plan is not None:
            maker = sharing.get(site.path)
            reason = (
                f"downsample {plan.downsample} <= max_downsample={config.max_downsample}, "
                f"r={plan.merged}{mode.note}"
                + (f"; plan shared from {maker}" if maker else "")
                + (f"; {site.reference_tokens} reference tokens kept" if site.reference is not None else "")
            )
            rows.append(ToMeSite(**row, tokens_after=plan.tokens - plan.merged, grid=plan.grid,
                                 downsample=plan.downsample, rewritten=True, reason=reason,
                                 targets=tuple(t.name for t in plan.targets)))
        elif partner is not None:
            rows.append(ToMeSite(**row, tokens_after=partner.tokens - partner.merged, grid=partner.grid,
                                 downsample=partner.downsample, rewritten=True,
                                 reason=f"merged with the plan of {partner.site.path} (merge_crossattn)"))
        elif site.path in failures:
            rows.append(ToMeSite(**row, tokens_after=None, grid=None, downsample=None, rewritten=False,
                                 reason=f"rewrite failed the shape check ({failures[site.path]})"))
        else:
            skip = decision if isinstance(decision, Skip) else Skip("not rewritten")
            if not config.enabled and site.kind != "cross-attention":
                skip = Skip(f"ratio={config.ratio}: nothing to merge", skip.grid, skip.downsample)
            rows.append(ToMeSite(**row, tokens_after=None, grid=skip.grid, downsample=skip.downsample,
                                 rewritten=False, reason=skip.reason))
    logger.info("ToMe: rewrote %d of %d attention sites", sum(r.rewritten for r in rows), len(rows))
    for row in rows:
        logger.debug("ToMe site %s", row.line())
    return rows


def nothing_rewritten(result: ToMeResult, config: ToMeConfig) -> str | None:
    """Why ToMe was asked for but rewrote no site (one line: the fix included), or None — when
    something was rewritten, nothing was asked (``ratio=0``) or the graph has no self-attention."""
    if result.modified or not config.enabled:
        return None
    candidates = [s for s in result.sites if s.kind != "cross-attention"]
    downsamples = [s.downsample for s in candidates if s.downsample is not None]
    by_blocks = [int(s.reason.split()[1]) for s in candidates
                 if s.reason.startswith("block ") and " is not in blocks=" in s.reason]
    if config.blocks is not None and by_blocks:
        return (f"ToMe rewrote nothing: blocks={_ranges(config.blocks)} selects none of the blocks "
                f"max_downsample={config.max_downsample} allows in this model ({_ranges(tuple(by_blocks))}, "
                "in execution order)")
    if downsamples and min(downsamples) > config.max_downsample:
        return (f"ToMe rewrote nothing: this model's highest-resolution self-attention is "
                f"downsampled {min(downsamples)}x, above max_downsample={config.max_downsample}; "
                f"use max_downsample={min(downsamples)} (SDXL has no attention at full resolution)")
    if candidates:
        return "ToMe rewrote nothing: " + "; ".join(sorted({f"{s.path}: {s.reason}" for s in candidates}))
    return None  # a graph without self-attention (e.g. a text encoder) is not a surprise


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
    Returns:
        :class:`ToMeResult`; ``inputs`` describes the graph inputs appended to ``gm`` (feed them
        last, in that order). The graph is the canonical form: ``plan_every``'s state (plans
        returned, reused, or either per call) and the in-graph random draws are follow-up passes
        (:mod:`.follow_up`) that the caller composes after this one.
    """
    io = io or find_unet_io(gm)
    found = _sites.find_attention_sites(gm, io.spans)
    passes = list(io.passes)
    latent = latent_hw or io.latent  # the sample's (the pass whose output the graph returns)
    decisions = _select_blocks(_decide_all(gm, found, passes, config, latent_hw), found, config, passes)
    plans = [d for d in decisions if isinstance(d, BlockPlan)] if config.enabled else []
    batch, hint = _attention_batch(plans)
    # the CFG pairs are pairs of samples: a video U-Net folds its frames into the attention batch
    # (1 video x 16 frames is 16 rows and still no pair)
    samples = io.sample_batch
    pairs_of = samples if samples is not None and isinstance(batch, int) and batch % samples == 0 else batch
    mode = _choose_mode(config, method, oracle, pairs_of)
    kept, specs, failures = _apply(gm, plans, config, mode, latent, hint, validate) if plans else ([], [], {})
    report = _report(found, decisions, kept, failures, config, mode)
    result = ToMeResult(graph_module=gm, modified=bool(kept), sites=report, inputs=specs, latent_hw=latent,
                        batch=batch, guidance=mode.guidance if kept else None,
                        method=mode.method if kept else (method or config.method), io=io, config=config,
                        plan_batch=hint)
    return result
