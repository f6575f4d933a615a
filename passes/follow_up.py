"""Follow-up passes: forms of the canonical ToMe graph, each a small rewrite of what
:func:`~tome_compile.passes.merge_self_attention` tagged.

The pass always emits one form: every random number is a graph input (``tome_partition``,
``tome_dst_key``, drawn by the caller) and no plan outlives its call. A follow-up pass is a plain
function ``(gm, result) -> result`` that changes that form in place and returns the updated
:class:`~tome_compile.passes.ToMeResult`:

* :func:`hash_random` — the deployment form of the random draws: one ``tome_seed`` input, the
  partition and keys hashed in the graph from it and the timestep (the ONNX export);
* :func:`keep_plans` — the plans the graph made, packed, as two more outputs (``plan_every``'s
  planning graphs under ``tome_backend``; the export's one-graph form);
* :func:`reuse_plans` — every plan taken from two inputs (an earlier call's kept plans) instead
  of made: no matching, nothing drawn (``plan_every``'s reusing graphs);
* :func:`either_plans` — one graph for both: a ``tome_reuse_plan`` input picks per call whether
  each block reuses the fed plan or makes one (``torch.cond``: an ONNX ``If``), and the plans used
  are returned (the export's ``plan_every`` form);
* :func:`fallback_plans` — importance merging's one graph for both kinds of step: a
  ``tome_has_map`` input picks per call the importance plan or the ToMe plan (``torch.cond``), for
  the first step of a generation, which has no map yet (the export's importance form);
* :func:`head_merges` — every merge as a gather of one token per slot and a scatter-add of the
  other ``r`` only (:func:`tome_compile.merge.merge_tokens_by_heads`): the ONNX form, where the
  scatter is single-threaded.

The export composes ``[merge, fallback_plans, either_plans, hash_random, head_merges]``; the
backend ``[merge, keep_plans]`` and ``[merge, reuse_plans]``.

A new form of the graph is one more function here, composed after the pass by its caller.

The rewrite calls every plan function with its tensor operands as keywords (``metric=``,
``choice=``, ``importance=``, ...): a follow-up pass reads them by name (``node.kwargs``), never by
position, so a new argument of a plan function breaks nothing here.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
from tome_compile.passes.result import ToMeResult, ToMeSite
from tome_compile.passes.rewrite import size_value
from torch import fx

from tome_compile import merge as _merge
from tome_compile import plans as _plans
from tome_compile import sampler as _sampler
from tome_compile.errors import ToMeRewriteError
from tome_compile.inputs import HAS_MAP_INPUT, REUSE_INPUT, ToMeInputSpec, partition_spec
from tome_compile.plans import PlanGeometry, PlanSlice

__all__ = ["either_plans", "fallback_plans", "hash_random", "head_merges", "keep_plans", "reuse_plans"]


def _inputs_by_draw(graph: fx.Graph) -> dict[str, fx.Node]:
    return {n.meta["tome"]["spec"].draw: n for n in graph.nodes
            if n.op == "placeholder" and "spec" in n.meta.get("tome", {})}


def _noted(result: ToMeResult, note: str) -> list[ToMeSite]:
    """The sites' rows with ``note`` added to each block that has a plan of its own or shared."""
    return [dataclasses.replace(s, reason=s.reason + note) if s.rewritten and s.targets else s
            for s in result.sites]


def _hash_block_cells(graph: fx.Graph, partition: fx.Node, seed: fx.Node, timestep: fx.Node, choices: int
                      ) -> None:
    """Each block's cells of ``partition`` (a ``block_cells`` node) hashed in the block: only its
    own counters, when the block runs (not the whole partition at the start of a call)."""
    for user in [u for u in partition.users if u.target is _sampler.block_cells]:
        take = user.kwargs
        with graph.inserting_before(user):
            value = graph.call_function(_sampler.hashed_block_cells, (), dict(
                seed=seed, timestep=timestep, offset=take["offset"], cells=take["cells"], choices=choices,
                metric=take["metric"]))
        value.meta["tome"] = dict(user.meta.get("tome", {}), hashed=True)
        user.replace_all_uses_with(value)
        graph.erase_node(user)


def hash_random(gm: fx.GraphModule, result: ToMeResult) -> ToMeResult:
    """Replace the drawn ``tome_partition`` / ``tome_dst_key`` inputs with one ``tome_seed`` input
    (int64 scalar, in their place among the inputs) and the same numbers' hashed form computed in
    the graph from the seed and the timestep (:func:`tome_compile.sampler.hashed_partition`,
    :func:`~tome_compile.sampler.hashed_keys`): deterministic per (seed, timestep), different
    across steps and blocks, no ``Random*`` op. A graph that draws nothing is returned as is."""
    graph = gm.graph
    inputs = _inputs_by_draw(graph)
    drawn = [inputs[d] for d in ("dst_key", "partition") if d in inputs]
    if not drawn:
        return result
    if result.io is None or result.io.timestep_index is None:
        raise ToMeRewriteError("in-graph random destinations need the timestep as a graph input; "
                               "none was found (export with partition_input=True to take tome_partition)")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    timestep = placeholders[result.io.timestep_index]
    first = min(drawn, key=placeholders.index)
    spec = ToMeInputSpec.of("seed", (), torch.int64)
    with graph.inserting_before(first):
        seed = graph.placeholder(spec.name)
    seed.meta["tome"] = {"role": "input", "spec": spec}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in drawn:
        old = node.meta["tome"]["spec"]
        if old.draw == "partition":
            _hash_block_cells(graph, node, seed, timestep, old.choices)
            if not node.users:
                graph.erase_node(node)
                continue
        first_user = min(node.users, key=order.__getitem__)
        with graph.inserting_before(first_user):  # after the sizes its length is computed from
            if old.draw == "dst_key":
                pools = [g for n, _, g in _own_plans(graph) if n.kwargs.get("importance") is not None]
                total = size_value(graph, _plans.total_pool, pools, "hashed")
                value = graph.call_function(_sampler.hashed_keys,
                                            (seed, timestep, inputs["importance"], total))
            else:
                total = size_value(graph, _plans.total_cells, [g for _, _, g in _own_plans(graph)], "hashed")
                value = graph.call_function(_sampler.hashed_partition, (seed, timestep, total, old.choices))
        value.meta["tome"] = {"role": "plan", "site": "hashed"}
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    gone = {n.name for n in drawn}
    specs: list[ToMeInputSpec] = []
    for s in result.inputs:
        if s.name not in gone:
            specs.append(s)
        elif spec not in specs:
            specs.append(spec)
    graph.lint()
    gm.recompile()
    note = "; destinations hashed from (tome_seed, timestep) in the graph"
    return dataclasses.replace(result, inputs=specs, sites=_noted(result, note))


def _own_plans(graph: fx.Graph) -> list[tuple[fx.Node, PlanGeometry, Any]]:
    """The plan nodes of the blocks that make a plan (not those that share one), in execution
    order, with their traced sizes (what the rewrite tagged) and their sizes as the graph computes
    them (the plan's ``geometry`` operand: a constant, or a node)."""
    slots = [n for n in graph.nodes if n.meta.get("tome", {}).get("made") == "slot"]
    plans = [n.args[0] for n in slots]  # operator.getitem(plan, 0)
    return [(p, p.meta["tome"]["geometry"], p.kwargs["geometry"]) for p in plans]


def _state_specs(result: ToMeResult, plans: list[tuple[fx.Node, PlanGeometry, Any]]) -> list[ToMeInputSpec]:
    """The packed plans' specs, flat ``[B * sum N]`` / ``[B * sum (N - r)]``."""
    b = result.plan_batch
    if b is None:
        raise ToMeRewriteError("plan_every needs a batch size known when the graph is rewritten")
    tokens, kept = sum(g.tokens for _, g, _ in plans), sum(g.kept for _, g, _ in plans)
    return [ToMeInputSpec.of("plan_slot", (b * tokens,), torch.int64),
            ToMeInputSpec.of("plan_weight", (b * kept,), torch.float32)]


def _plan_every_note(result: ToMeResult, what: str) -> list[ToMeSite]:
    plan_every = result.config.plan_every if result.config is not None else "?"
    return _noted(result, f"; {what} (plan_every={plan_every})")


def keep_plans(gm: fx.GraphModule, result: ToMeResult) -> ToMeResult:
    """Return the plans the graph made after the model's own outputs, packed
    (:func:`tome_compile.plans.pack_plans`): ``tome_plan_slots_out`` ``[B * sum N]`` int64 and
    ``tome_plan_weights_out`` ``[B * sum (N - r)]`` float32, the blocks in execution order — what
    a graph that reuses them takes as ``tome_plan_slots`` / ``tome_plan_weights``."""
    if result.plan_state is not None or result.outputs:
        raise ToMeRewriteError(f"keep_plans: the graph's plans are not its own (plan_state="
                               f"{result.plan_state!r}) or already returned")
    made = [n for n in gm.graph.nodes if n.meta.get("tome", {}).get("made")]
    if not made:
        return result  # nothing planned (oracle, nothing rewritten): no state to keep
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0]
    if not isinstance(values, (tuple, list)):
        raise ToMeRewriteError(f"plan_every: the graph returns {type(values).__name__}, not a tuple of "
                               "outputs; cannot append the plan state")
    outputs = [dataclasses.replace(s, name=s.fed_from) for s in _state_specs(result, _own_plans(gm.graph))]
    with gm.graph.inserting_before(output):
        packed = gm.graph.call_function(_plans.pack_plans, tuple(made))
        parts = [gm.graph.call_function(operator.getitem, (packed, k)) for k in range(len(outputs))]
    for node in (packed, *parts):
        node.meta["tome"] = {"role": "state", "site": "plans"}
    output.args = (type(values)([*values, *parts]),)
    gm.graph.lint()
    gm.recompile()
    return dataclasses.replace(result, outputs=outputs, plan_state="make",
                               sites=_plan_every_note(result, "plan kept for the next calls"))


def reuse_plans(gm: fx.GraphModule, result: ToMeResult) -> ToMeResult:
    """Take every block's plan from ``tome_plan_slots`` / ``tome_plan_weights`` inputs (what a
    :func:`keep_plans` graph returned, :func:`tome_compile.plans.unpack_plan`) instead of making
    it: the matching, and the inputs only it read (partition, keys, importance map), are removed."""
    own = _replaceable_plans(gm, result, "reuse_plans")
    if not own:
        return result
    graph = gm.graph
    specs = _state_specs(result, own)
    state = _append_inputs(graph, specs)
    for k, (node, _, geometry) in enumerate(own):
        with graph.inserting_before(node):
            where = _slice(graph, own, k)
            fed = graph.call_function(_plans.unpack_plan, (), dict(
                slots=state[0], weights=state[1], like=node.kwargs["metric"], where=where, geometry=geometry))
        _replace(node, fed)
    _drop_unused(graph)
    left = {n.name for n in graph.nodes if n.op == "placeholder"}
    graph.lint()
    gm.recompile()
    return dataclasses.replace(result, inputs=[s for s in result.inputs if s.name in left] + specs,
                               plan_state="reuse", sites=_plan_every_note(result, "plan of an earlier call"))


def _replaceable_plans(gm: fx.GraphModule, result: ToMeResult, who: str
                       ) -> list[tuple[fx.Node, PlanGeometry, Any]]:
    """The graph's own plan nodes, for a pass that replaces them; refused when it has plan state."""
    if result.plan_state is not None:
        raise ToMeRewriteError(f"{who}: the graph already has plan state ({result.plan_state!r})")
    return _own_plans(gm.graph)


def _drop_unused(graph: fx.Graph) -> None:
    """Erase the pass's nodes and inputs that nothing reads any more (a narrowed partition, a
    fitted map, then their inputs), last first so that chains go in one sweep."""
    for node in reversed(list(graph.nodes)):
        tag = node.meta.get("tome", {})
        if not node.users and tag.get("role") in ("plan", "input", "sizes"):
            graph.erase_node(node)


# The map operands each plans.make_plan method reads besides ``metric`` and ``choice`` (by name
# from the node's keywords); "importance_or_tome" is fallback_plans' importance_or_tome_plan.
_MAP_OPERANDS = {"tome": (), "importance": ("importance", "dst_key"),
                 "importance_or_tome": ("has_map", "importance", "dst_key")}


def _method(node: fx.Node) -> str:
    """The plans.make_plan method of a plan node the rewrite (or fallback_plans) made."""
    return "importance_or_tome" if node.target is _plans.importance_or_tome_plan else node.kwargs["method"]


def either_plans(gm: fx.GraphModule, result: ToMeResult) -> ToMeResult:
    """One graph for both kinds of ``plan_every`` call: ``tome_plan_slots``, ``tome_plan_weights``
    and ``tome_reuse_plan`` (0-d bool) inputs; each block's plan is
    :func:`tome_compile.plans.plan_or_reuse` (an ONNX ``If``: a reusing call skips the matching)
    and the plans used are returned (:func:`keep_plans`), so a client feeds them back."""
    own = _replaceable_plans(gm, result, "either_plans")
    if not own:
        return result
    graph = gm.graph
    specs = [*_state_specs(result, own), ToMeInputSpec.of("reuse", (), torch.bool)]
    slots, weights, reuse = _append_inputs(graph, specs)
    for k, (node, _, geometry) in enumerate(own):
        method = _method(node)
        maps = {name: node.kwargs[name] for name in _MAP_OPERANDS[method]}
        with graph.inserting_before(node):
            where = _slice(graph, own, k)
            either = graph.call_function(_plans.plan_or_reuse, (), dict(
                reuse=reuse, slots=slots, weights=weights, where=where, method=method,
                metric=node.kwargs["metric"], choice=node.kwargs.get("choice"), geometry=geometry, **maps))
        _replace(node, either)
    graph.lint()
    gm.recompile()
    kept = keep_plans(gm, dataclasses.replace(result, inputs=[*result.inputs, *specs]))
    return dataclasses.replace(kept, plan_state="either",
                               sites=_noted(result, f"; plan made or reused per call ({REUSE_INPUT})"))


def _append_inputs(graph: fx.Graph, specs: list[ToMeInputSpec]) -> list[fx.Node]:
    """Placeholders for ``specs`` after the graph's last input, in order, tagged like the pass's."""
    nodes = []
    for spec in specs:
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            node = graph.placeholder(spec.name)
        node.meta["tome"] = {"role": "input", "spec": spec}
        nodes.append(node)
    return nodes


def _slice(graph: fx.Graph, own: list[tuple[fx.Node, PlanGeometry, Any]], k: int) -> PlanSlice | fx.Node:
    """Where plan ``k`` sits in the packed state (the order keep_plans packs): a constant, or a
    node that computes it from the blocks' sizes (inserted at the current insert point)."""
    return size_value(graph, _plans.plan_slice, (k, *(g for _, _, g in own)), "plans")


def _replace(node: fx.Node, new: fx.Node) -> None:
    """``new`` in place of the plan node ``node`` (its tags — site, sizes — carried over)."""
    new.meta["tome"] = dict(node.meta["tome"])
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)


def fallback_plans(gm: fx.GraphModule, result: ToMeResult) -> ToMeResult:
    """Importance merging in one graph for every step: a ``tome_has_map`` input (0-d bool, right
    after ``tome_importance``) picks per call each block's importance plan or its ToMe plan
    (:func:`tome_compile.plans.importance_or_tome_plan`, an ONNX ``If``); a graph that draws
    ``tome_dst_key`` also takes a ``tome_partition`` input (last) for the ToMe branch's random
    destinations. Run before the plan-state passes. A graph without importance plans is returned
    as is."""
    own = [(n, g, value) for n, g, value in _replaceable_plans(gm, result, "fallback_plans")
           if n.kwargs.get("method") == "importance"]
    if not own:
        return result
    graph = gm.graph
    inputs = _inputs_by_draw(graph)
    flag = ToMeInputSpec.of("has_map", (), torch.bool)
    with graph.inserting_after(inputs["importance"]):
        has_map = graph.placeholder(flag.name)
    has_map.meta["tome"] = {"role": "input", "spec": flag}
    specs = [s for spec in result.inputs for s in ([spec, flag] if spec.draw == "importance" else [spec])]
    partition = None
    if "dst_key" in inputs:  # random destinations: the ToMe branch draws its partition too
        first = own[0][1]
        spec = partition_spec(tuple((g.h // g.sy, g.w // g.sx) for _, g, _ in own), first.sx * first.sy)
        (partition,) = _append_inputs(graph, [spec])
        specs.append(spec)
    for k, (node, _, geometry) in enumerate(own):
        metric, site = node.kwargs["metric"], node.meta["tome"]["site"]
        with graph.inserting_before(node):
            choice = None
            if partition is not None:
                before = [g for _, _, g in own[:k]]
                choice = graph.call_function(_sampler.block_cells, (), dict(
                    partition=partition, offset=size_value(graph, _plans.total_cells, before, site),
                    cells=size_value(graph, _plans.total_cells, [geometry], site), metric=metric))
                choice.meta["tome"] = {"site": site, "role": "plan"}
            either = graph.call_function(_plans.importance_or_tome_plan, (), dict(
                metric=metric, has_map=has_map, importance=node.kwargs["importance"],
                dst_key=node.kwargs["dst_key"], choice=choice, geometry=geometry))
        _replace(node, either)
    graph.lint()
    gm.recompile()
    return dataclasses.replace(result, inputs=specs,
                               sites=_noted(result, f"; ToMe plan when there is no map ({HAS_MAP_INPUT})"))


def head_merges(gm: fx.GraphModule, result: ToMeResult) -> ToMeResult:
    """Every :func:`~tome_compile.merge.merge_tokens` as
    :func:`~tome_compile.merge.merge_tokens_by_heads`: the same bits (the same sums in the same
    order) with a scatter of the ``r`` merged tokens instead of all ``N`` — ONNX Runtime's CPU
    ``ScatterElements`` is single-threaded (SD 1.5 at 512², batch 2: 32 → 15 ms a merge), while in
    PyTorch the plain ``scatter_add`` is the faster one. Plans, inputs and outputs are unchanged;
    a graph without merges (the oracle's, a plain U-Net's) is returned as is."""
    merges = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _merge.merge_tokens]
    if not merges:
        return result
    for node in merges:
        node.target = _merge.merge_tokens_by_heads
    gm.graph.lint()
    gm.recompile()
    return dataclasses.replace(result, sites=_noted(result, "; merge scatters the r merged tokens only"))
