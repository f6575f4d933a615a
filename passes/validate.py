"""Validation and rollback of the ToMe rewrite: propagate fake tensors through the rewritten graph;
when it does not type-check, find the sites whose rewrite fails alone, put the graph back and
rewrite the others (never a graph that crashes; the failing sites are reported as skipped)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from tome_compile.passes.decide import BlockPlan
from tome_compile.passes.sites import size_hint
from torch import fx

from tome_compile.errors import ToMeRewriteError
from tome_compile.inputs import ToMeInputSpec

__all__ = ["check_shapes", "rewrite_checked"]

logger = logging.getLogger("tome_compile.passes")

# rewrite(gm, plans) -> the specs of the inputs it appended
RewriteFn = Callable[[fx.GraphModule, list[BlockPlan]], list[ToMeInputSpec]]


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


def check_shapes(gm: fx.GraphModule) -> str | None:
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
                shape = [size_hint(d) for d in value.shape]
                if any(d is None for d in shape):
                    return None  # symbolic shapes without traced values: nothing to check against
                if all(isinstance(d, int) for d in value.shape):
                    args.append(torch.empty_strided(tuple(value.shape), tuple(value.stride()),
                                                    dtype=value.dtype, device=value.device))
                else:  # an export for every image size: checked at the traced size
                    args.append(torch.empty(shape, dtype=value.dtype, device=value.device))
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
                               nodes=[node(n) for n in plan.site.nodes],
                               anchors=tuple(node(n) for n in plan.site.anchors),
                               reference=None if plan.site.reference is None else node(plan.site.reference),
                               joint=None if plan.site.joint is None else dataclasses.replace(
                                   plan.site.joint, cats=tuple(node(n) for n in plan.site.joint.cats),
                                   inputs=tuple(node(n) for n in plan.site.joint.inputs)))
    targets = tuple(dataclasses.replace(t, input=node(t.input), output=node(t.output),
                                        region=tuple(node(n) for n in t.region)) for t in plan.targets)
    return dataclasses.replace(plan, site=site, metric=node(plan.metric), targets=targets,
                               source=node(plan.source) if plan.source is not None else None)


def rewrite_checked(gm: fx.GraphModule, plans: list[BlockPlan], rewrite: RewriteFn, validate: bool = True
                    ) -> tuple[list[BlockPlan], list[ToMeInputSpec], dict[str, str]]:
    """``rewrite(gm, plans)`` every planned block; when the result does not type-check, find the
    sites that fail alone, put the graph back and rewrite the others. Returns (kept plans, input
    specs, failures by site path)."""
    original = copy.deepcopy(gm.graph) if validate else None
    specs = rewrite(gm, plans)
    if original is None or (error := check_shapes(gm)) is None:
        return plans, specs, {}
    logger.info("ToMe: rewritten graph failed its shape check (%s); retrying site by site", error)
    survivors, failures = [], {}
    for plan in plans:
        trial = fx.GraphModule(gm, copy.deepcopy(original))
        rewrite(trial, [_remap(plan, trial.graph)])
        err = check_shapes(trial)
        if err is None:
            survivors.append(plan)
        else:
            failures[plan.site.path] = err
            logger.info("ToMe: %s left unmerged: its rewrite fails the shape check (%s)", plan.site.path, err)
    gm.graph = copy.deepcopy(original)
    survivors = [_remap(p, gm.graph) for p in survivors]
    specs = rewrite(gm, survivors) if survivors else []
    if not survivors:
        gm.recompile()
    elif check_shapes(gm) is not None:
        raise ToMeRewriteError("ToMe rewrite failed its shape check even site by site")
    return survivors, specs, failures
