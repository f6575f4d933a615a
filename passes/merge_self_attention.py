"""The ToMe pass: ``attn1(norm1(x)) -> unmerge(attn1(merge(norm1(x))))`` on a traced U-Net.

A pass is a plain function on a GraphModule that returns what it changed
(``torch.fx.passes.infra.pass_base.PassResult`` plus the site report). It works on graphs from
Dynamo (what a ``torch.compile`` backend receives) and from ``torch.export`` (``ep.module()``).

Per rewritten transformer block (tomesd's ``compute_merge``, done once at compile time from
shapes): one *plan* node computes the merge from the block input ``x`` (the metric); merge
nodes are inserted after the region inputs (``norm1(x)``, and ``norm2(x)`` / ``norm3(x)`` with
``merge_crossattn`` / ``merge_mlp``), unmerge nodes after the region outputs, before the
residual adds. Random destination choices are a graph input (``tome_partition``) so the caller
draws them from its own generator: the global RNG is never touched inside the graph.
"""

from __future__ import annotations

import copy
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tome_compile.passes import sites as _sites
from torch import fx

from tome_compile import merge as _merge
from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeRewriteError

__all__ = [
    "DST_KEY_INPUT",
    "HAS_MAP_INPUT",
    "IMPORTANCE_INPUT",
    "PARTITION_INPUT",
    "ToMeResult",
    "ToMeSite",
    "merge_self_attention",
]

logger = logging.getLogger("tome_compile.passes")

PARTITION_INPUT = "tome_partition"
IMPORTANCE_INPUT = "tome_importance"
HAS_MAP_INPUT = "tome_has_map"
DST_KEY_INPUT = "tome_dst_key"


@dataclass(frozen=True)
class ToMeSite:
    """One row of the site report."""

    path: str
    kind: str
    tokens: int | None
    tokens_after: int | None
    grid: tuple[int, int] | None
    downsample: int | None
    rewritten: bool
    reason: str
    targets: tuple[str, ...] = ()
    cells: int = 0  # destination cells drawn from tome_partition for this site (0: not random)

    def line(self) -> str:
        tokens = "?" if self.tokens is None else str(self.tokens)
        after = f" -> {self.tokens_after}" if self.rewritten else ""
        state = "rewritten" if self.rewritten else "skipped"
        what = f" [{'+'.join(self.targets)}]" if self.targets else ""
        return f"{self.path}  {self.kind}  {tokens}{after} tokens  {state}{what}: {self.reason}"


@dataclass
class ToMeResult:
    """What the pass did: the (rewritten) module, whether it changed, and every candidate site.

    ``inputs`` names the graph inputs the pass appended, in order; the caller must feed them.
    ``partition_cells`` gives, per random site in execution order, the destination grid
    ``(h // sy, w // sx)`` whose choices ``tome_partition`` concatenates.
    """

    graph_module: fx.GraphModule
    modified: bool
    sites: list[ToMeSite]
    inputs: list[str] = field(default_factory=list)
    partition_cells: list[tuple[int, int]] = field(default_factory=list)
    latent_hw: tuple[int, int] | None = None
    batch: int | None = None
    method: str = "tome"
    dst_key_sizes: list[int] = field(default_factory=list)  # importance: pool size M per site

    @property
    def rewritten(self) -> list[ToMeSite]:
        return [s for s in self.sites if s.rewritten]

    @property
    def pairs(self) -> int:
        """CFG pairs in the batch (``batch // 2``; 1 when the batch is unknown)."""
        return (self.batch or 2) // 2

    @property
    def partition_size(self) -> int:
        return sum(a * b for a, b in self.partition_cells)

    def summary(self) -> str:
        """A readable table of every candidate site and its decision."""
        head = f"ToMe: rewrote {len(self.rewritten)} of {len(self.sites)} attention sites"
        return "\n".join([head] + ["  " + s.line() for s in self.sites])

    def count_nodes(self, role: str) -> int:
        """Number of inserted nodes with ``node.meta['tome']['role'] == role`` (merge, unmerge, plan)."""
        return sum(1 for n in self.graph_module.graph.nodes
                   if n.meta.get("tome", {}).get("role") == role)


def _short(path: str, block: str) -> str:
    return path[len(block) + 1:] if block and path.startswith(block + ".") else path


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


def _tag(node: fx.Node, site: str, role: str) -> fx.Node:
    node.meta["tome"] = {"site": site, "role": role}
    return node


def _add_input(graph: fx.Graph, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> fx.Node:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None):
        node = graph.placeholder(name)
    node.meta["tome"] = {"role": "input", "shape": shape, "dtype": dtype}
    return node


@dataclass
class _Planned:
    """A block the pass will rewrite, with everything decided from shapes."""

    site: _sites.AttentionSite
    metric: fx.Node
    n: int
    r: int
    h: int
    w: int
    downsample: int
    targets: list[tuple[fx.Node, fx.Node, list[fx.Node], str]]  # (input, output, region, name)
    classic: set[str] = field(default_factory=set)  # target names whose reshapes bake N in


def merge_self_attention(
    gm: fx.GraphModule,
    config: ToMeConfig,
    *,
    latent_hw: tuple[int, int] | None = None,
    oracle: bool = False,
    validate: bool = True,
    method: str | None = None,
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
            ``"importance+fallback"``: one graph for both steps (ONNX): a ``tome_has_map`` input
            picks the importance or the ToMe plan per call (``torch.cond``).
    Returns:
        :class:`ToMeResult`; ``inputs`` lists graph inputs appended to ``gm`` (feed them last,
        in that order).
    """
    found = _sites.find_attention_sites(gm)
    latent = latent_hw or _sites.latent_size(gm)
    report: list[ToMeSite] = []
    planned: list[_Planned] = []
    batch: int | None = None

    def skip(site: _sites.AttentionSite, reason: str, **kw: Any) -> None:
        report.append(ToMeSite(site.path, site.kind, site.tokens, None, kw.get("grid"),
                               kw.get("downsample"), False, reason))

    for site in found:
        if site.kind == "cross-attention":
            if config.merge_crossattn and site.problem is None:
                continue  # reported with its block's self-attention below
            skip(site, "cross-attention" + ("" if not site.problem else f" ({site.problem})"))
            continue
        if site.kind != "self-attention" or site.problem is not None:
            skip(site, site.problem or "not a self-attention")
            continue
        if latent is None:
            skip(site, "latent size unknown (no conv_in input shape); pass latent_hw=")
            continue
        n = int(site.tokens or 0)
        downsample, h, w = _sites.block_grid(latent, n)
        if h * w != n:
            skip(site, f"{n} tokens do not form the {h}x{w} grid of a {latent[0]}x{latent[1]} latent",
                 downsample=downsample)
            continue
        if downsample > config.max_downsample:
            threshold = (latent[0] * latent[1]) // (config.max_downsample ** 2)
            skip(site, f"downsample {downsample} > max_downsample={config.max_downsample} "
                       f"({n} tokens < {threshold})", grid=(h, w), downsample=downsample)
            continue
        sources = n - _merge.partition_cells(h, w, config.sx, config.sy)
        r = min(int(n * config.ratio), sources)
        if config.method == "importance":  # both plans must merge the same count (one graph, ONNX)
            r = min(r, n - int(n * config.dst_fraction))
        if r <= 0:
            skip(site, f"ratio={config.ratio} merges no token of {n}", grid=(h, w), downsample=downsample)
            continue
        metric = _sites.norm_input(site.input)
        if metric is None:
            skip(site, "attention input is not a layer norm of the block input", grid=(h, w),
                 downsample=downsample)
            continue
        shape = _sites.node_shape(site.input) or (None,)
        batch = shape[0] if isinstance(shape[0], int) else batch
        targets: list[tuple[fx.Node, fx.Node, list[fx.Node], str]] = []
        block = site.block_path
        if config.merge_attn:
            assert site.output is not None
            targets.append((site.input, site.output, site.nodes, _short(site.path, block)))
        extra_problem = None
        if config.merge_crossattn:
            cross = [s for s in found if s.kind == "cross-attention" and s.block_path == block]
            for c in cross:
                if c.problem is not None or c.output is None:
                    extra_problem = f"{c.path}: {c.problem}"
                else:
                    targets.append((c.input, c.output, c.nodes, _short(c.path, block)))
        if config.merge_mlp:
            ff = _sites.region_nodes(gm.graph, block + ".ff")
            exits = _sites.region_exits(ff)
            inputs = {a for node in ff for a in node.all_input_nodes if a not in set(ff)
                      and _sites.node_shape(a) == _sites.node_shape(site.input)}
            if len(exits) == 1 and len(inputs) == 1:
                targets.append((inputs.pop(), exits[0], ff, "ff"))
            else:
                extra_problem = f"{block}.ff: region has {len(inputs)} inputs / {len(exits)} outputs"
        if extra_problem is not None:
            skip(site, f"cannot merge every requested module ({extra_problem})", grid=(h, w),
                 downsample=downsample)
            continue
        if not targets:
            skip(site, "merge_attn, merge_crossattn and merge_mlp are all off", grid=(h, w),
                 downsample=downsample)
            continue
        classic = {_short(s.path, block) for s in found if s.block_path == block and s.form == "classic"}
        planned.append(_Planned(site, metric, n, r, h, w, downsample, targets, classic))

    if not config.enabled or not planned:
        reason = None if config.enabled else f"ratio={config.ratio}: nothing to merge"
        if reason:
            report = [ToMeSite(s.path, s.kind, s.tokens, None, s.grid, s.downsample, False, reason)
                      for s in report]
            # ratio=0: report sites but leave the graph untouched
        _order(report, found)
        logger.info("ToMe: rewrote 0 of %d attention sites", len(report))
        return ToMeResult(gm, False, report, latent_hw=latent, batch=batch)

    method = method or config.method
    if method.startswith("importance") and (oracle or batch is None or batch % 2 == 1):
        method = "tome"  # no CFG pair in an odd batch: importance has no map to work from
    use_rand = config.use_rand and not oracle
    if use_rand and method == "tome" and batch is not None and batch % 2 == 1:
        # tomesd: an odd batch cannot hold CFG pairs, so random partitions would differ between
        # the cond and uncond calls; it falls back to fixed destinations.
        use_rand = False
        rand_note = f"; batch {batch} is odd: fixed destinations (as tomesd)"
    else:
        rand_note = ""

    original = copy.deepcopy(gm.graph) if validate else None
    skipped_rows = list(report)
    result = _rewrite(gm, config, planned, use_rand, oracle, rand_note, report, latent, batch, method)
    if validate:
        error = _check(gm)
        if error is not None:
            logger.warning("ToMe: rewritten graph failed its shape check (%s); retrying site by site",
                           error)
            gm.graph = copy.deepcopy(original)
            survivors: list[_Planned] = []
            failures: dict[str, str] = {}
            for plan in planned:
                trial = fx.GraphModule(gm, copy.deepcopy(original))
                mapped = _remap(plan, trial.graph)
                _rewrite(trial, config, [mapped], use_rand, oracle, rand_note, [], latent, batch, method)
                err = _check(trial)
                if err is None:
                    survivors.append(plan)
                else:
                    failures[plan.site.path] = err
            gm.graph = copy.deepcopy(original)
            report = list(skipped_rows)
            for path, err in failures.items():
                site = next(p.site for p in planned if p.site.path == path)
                report.append(ToMeSite(path, site.kind, site.tokens, None, None, None, False,
                                       f"rewrite failed the shape check ({err})"))
            remapped = [_remap(p, gm.graph) for p in survivors]
            result = _rewrite(gm, config, remapped, use_rand, oracle, rand_note, report, latent, batch,
                              method)
            if survivors and _check(gm) is not None:
                raise ToMeRewriteError("ToMe rewrite failed its shape check even site by site")
    _order(result.sites, found)
    logger.info("ToMe: rewrote %d of %d attention sites", len(result.rewritten), len(result.sites))
    for row in result.sites:
        logger.debug("ToMe site %s", row.line())
    return result


def _order(report: list[ToMeSite], found: list[_sites.AttentionSite]) -> None:
    rank = {s.path: i for i, s in enumerate(found)}
    report.sort(key=lambda s: rank.get(s.path, len(rank)))


def _remap(plan: _Planned, graph: fx.Graph) -> _Planned:
    """The same plan on a copy of the graph (nodes matched by name)."""
    names = {n.name: n for n in graph.nodes}
    site = copy.copy(plan.site)
    site.input, site.anchor = names[plan.site.input.name], names[plan.site.anchor.name]
    site.output = names[plan.site.output.name] if plan.site.output is not None else None
    site.nodes = [names[n.name] for n in plan.site.nodes]
    targets = [(names[i.name], names[o.name], [names[n.name] for n in region], t)
               for i, o, region, t in plan.targets]
    return _Planned(site, names[plan.metric.name], plan.n, plan.r, plan.h, plan.w, plan.downsample,
                    targets, plan.classic)


def _rewrite(
    gm: fx.GraphModule,
    config: ToMeConfig,
    planned: list[_Planned],
    use_rand: bool,
    oracle: bool,
    rand_note: str,
    report: list[ToMeSite],
    latent: tuple[int, int] | None,
    batch: int | None,
    method: str = "tome",
) -> ToMeResult:
    graph = gm.graph
    inputs: list[str] = []
    importance = method.startswith("importance")
    in_graph_fallback = method == "importance+fallback"
    cells_per_site = [(p.h // config.sy, p.w // config.sx) for p in planned]
    pools = [_merge.importance_pool_size(p.n, p.r, config.pool_factor, config.dst_fraction)
             for p in planned] if importance else []
    total_cells = sum(a * b for a, b in cells_per_site)
    partition = imp_input = dst_key = has_map = None
    if importance:
        assert latent is not None and batch is not None
        imp_input = _add_input(graph, IMPORTANCE_INPUT, (batch // 2, *latent), torch.float32)
        inputs.append(IMPORTANCE_INPUT)
        if in_graph_fallback:
            has_map = _add_input(graph, HAS_MAP_INPUT, (), torch.bool)
            inputs.append(HAS_MAP_INPUT)
        if use_rand:
            dst_key = _add_input(graph, DST_KEY_INPUT, (batch // 2, sum(pools)), torch.float32)
            inputs.append(DST_KEY_INPUT)
    if use_rand and total_cells > 0 and (not importance or in_graph_fallback):
        partition = _add_input(graph, PARTITION_INPUT, (total_cells,), torch.int64)
        inputs.append(PARTITION_INPUT)
    offset = key_offset = 0
    rows: list[ToMeSite] = []
    for plan, (ch, cw) in zip(planned, cells_per_site):
        path = plan.site.path
        n_after = plan.n - plan.r
        with graph.inserting_before(plan.site.input.next):
            choice = None
            if partition is not None:  # (never in oracle mode: use_rand is off there)
                choice = _tag(graph.call_function(torch.narrow, (partition, 0, offset, ch * cw)), path, "plan")
            plan_node = None
            if importance:
                pool = pools[len(rows)]
                key = None
                if dst_key is not None:
                    key = _tag(graph.call_function(torch.narrow, (dst_key, 1, key_offset, pool)), path, "plan")
                key_offset += pool
                fitted = _tag(graph.call_function(_merge.fit_importance, (imp_input, plan.h, plan.w)),
                              path, "plan")
                if in_graph_fallback:
                    plan_node = graph.call_function(
                        _merge.importance_or_tome_plan,
                        (plan.metric, has_map, fitted, key, choice, plan.h, plan.w, config.sx, config.sy,
                         plan.r, config.pool_factor, config.dst_fraction))
                else:
                    plan_node = graph.call_function(
                        _merge.importance_plan, (plan.metric, fitted, key, plan.h, plan.w, plan.r,
                                                 config.pool_factor, config.dst_fraction))
            elif not oracle:
                plan_node = graph.call_function(
                    _merge.tome_plan, (plan.metric, choice, plan.h, plan.w, config.sx, config.sy, plan.r))
            slot = weight = None
            if plan_node is not None:
                _tag(plan_node, path, "plan")
                slot = _tag(graph.call_function(operator.getitem, (plan_node, 0)), path, "plan")
                weight = _tag(graph.call_function(operator.getitem, (plan_node, 1)), path, "plan")
        offset += ch * cw if partition is not None else 0
        for x_in, out, region, name in plan.targets:
            inside = set(region)
            with graph.inserting_before((x_in if x_in is not plan.site.input or weight is None else weight).next):
                if oracle:
                    merged = graph.call_function(_merge.oracle_merge, (x_in, plan.r))
                else:
                    merged = graph.call_function(_merge.merge_tokens, (x_in, slot, weight))
            _tag(merged, path, "merge")
            for user in list(x_in.users):
                if user in inside:
                    user.replace_input_with(x_in, merged)
            if name in plan.classic:
                _replace_literal_tokens(region, plan.n, n_after)
            with graph.inserting_before(out.next):
                if oracle:
                    un = graph.call_function(_merge.oracle_unmerge, (out, plan.r))
                else:
                    un = graph.call_function(_merge.unmerge_tokens, (out, slot))
            _tag(un, path, "unmerge")
            for user in list(out.users):
                if user is not un and user not in inside:
                    user.replace_input_with(out, un)
        rows.append(ToMeSite(path, "self-attention", plan.n, n_after, (plan.h, plan.w),
                             plan.downsample, True,
                             f"downsample {plan.downsample} <= max_downsample={config.max_downsample}, "
                             f"r={plan.r}" + ("; oracle" if oracle else "; importance" if importance
                                              else rand_note),
                             tuple(t[3] for t in plan.targets), ch * cw if partition is not None else 0))
    graph.lint()
    gm.recompile()
    report.extend(rows)
    return ToMeResult(gm, bool(rows), report, inputs,
                      cells_per_site if partition is not None else [], latent, batch, method, pools)


def _check(gm: fx.GraphModule) -> str | None:
    """Propagate fake tensors through ``gm``; the error text, or None when it type-checks."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    args = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        spec = node.meta.get("tome")
        value = node.meta.get("example_value", node.meta.get("val"))
        with mode:
            if spec is not None:
                args.append(torch.zeros(spec["shape"], dtype=spec["dtype"]))
            elif isinstance(value, torch.Tensor):
                if not all(isinstance(d, int) for d in value.shape):
                    return None  # symbolic shapes: nothing static to check against
                args.append(torch.empty_strided(tuple(value.shape), tuple(value.stride()),
                                                dtype=value.dtype, device=value.device))
            else:
                args.append(value)
    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    except Exception as e:  # noqa: BLE001 - any failure means "this rewrite does not type-check"
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None
