"""Joint attention (SD3, Flux), read from the graph: the streams of tokens one attention op runs
over — double stream (each stream projected apart, q, k and v concatenated, maybe then rotated:
SD3's ``JointAttnProcessor2_0``, Flux's double blocks) or single stream (the streams concatenated
before one projection: Flux's single blocks). Checks only, no rewriting."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tome_compile.passes.dataflow import CAT_OPS, LINEAR_OPS, is_call, node_shape
from torch import fx

__all__ = ["JointStreams", "joint_parts", "joint_streams", "same_size"]


def joint_parts(node: Any, limit: int = 32) -> tuple[list[Any], bool] | None:
    """Joint attention: queries read from a concatenation of sequences of different streams, as SD3
    and Flux build them. Double stream (SD3's ``JointAttnProcessor2_0``, Flux's double blocks):
    the image tokens' ``to_q`` and the text tokens' ``add_q_proj`` concatenated after projection
    (through a ``qk_norm`` and a rotary embedding); single stream (Flux's single blocks): one
    ``to_q`` of a ``[B, N, C]`` sequence concatenated before it. Walks back the first input of each
    node. Returns (the token count of each part, or None where unknown; single stream), or None."""
    projected = False
    for _ in range(limit):
        if not isinstance(node, fx.Node) or node.op != "call_function" and node.op != "call_method":
            return None
        if is_call(node, CAT_OPS) or (node.op == "call_method" and node.target == "cat"):
            parts = node.args[0] if node.args else node.kwargs.get("tensors")
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            shape = node_shape(node)
            if (not isinstance(parts, (list, tuple)) or len(parts) < 2 or shape is None
                    or (projected and len(shape) != 3)):
                return None
            if not projected and not all(isinstance(p, fx.Node) and _descends_to_linear(p) for p in parts):
                return None
            shapes = [node_shape(p) for p in parts]
            return [s[dim] if s is not None and -len(s) <= dim < len(s) else None for s in shapes], projected
        if is_call(node, LINEAR_OPS):
            if projected:
                return None
            projected = True
        inputs = node.all_input_nodes
        if not inputs:
            return None
        node = inputs[0]
    return None


@dataclass(frozen=True)
class JointStreams:
    """A joint attention: the tokens of two or more streams in one sequence.

    Double stream (SD3's ``JointAttnProcessor2_0``, Flux's double blocks): queries, keys and
    values each the concatenation along the tokens of one part per stream, each stream's parts
    projected from one sequence ``[B, N_i, C]``; ``cats`` are the three concatenations. Single
    stream (Flux's single blocks, ``single``): the streams concatenated before the projections;
    ``cats`` is that one concatenation ``[B, sum N_i, C]``. Between a concatenation and the
    attention op there may be norms and a rotary embedding (Flux).

    ``inputs``: the sequence each stream is projected from (single: each stream's tokens as they
    enter the concatenation — the block's inputs), in concatenation order; ``tokens``: each
    stream's token count (a size, maybe symbolic)."""

    cats: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]
    tokens: tuple[Any, ...]
    single: bool = False


def _cat_parts(node: Any) -> tuple[list[fx.Node], int] | None:
    """The tensors and dim of a concatenation node, or None."""
    if not (is_call(node, CAT_OPS) or (isinstance(node, fx.Node) and node.op == "call_method"
                                       and node.target == "cat")):
        return None
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, fx.Node) for p in parts):
        return None
    return list(parts), dim


def _first_above(node: Any, found: Callable[[fx.Node], bool], limit: int,
                 stop: Callable[[fx.Node], bool] = lambda n: False) -> fx.Node | None:
    """The first node ``found`` accepts on the way up from ``node`` (through norms, rotary products
    and shape ops: the first input of each node), or None (a node ``stop`` accepts, or no input,
    on the way)."""
    for _ in range(limit):
        if not isinstance(node, fx.Node):
            return None
        if found(node):
            return node
        if stop(node) or not node.all_input_nodes:
            return None
        node = node.all_input_nodes[0]
    return None


def _linear_above(node: Any, limit: int = 24) -> fx.Node | None:
    """The linear projection ``node`` is computed from, or None."""
    return _first_above(node, lambda n: is_call(n, LINEAR_OPS), limit)


def same_size(a: Any, b: Any) -> bool:
    """Two sizes are one: equal ints, or symbolic sizes of one expression (never a guard)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    expr = getattr(getattr(a, "node", None), "expr", None)
    return expr is not None and expr == getattr(getattr(b, "node", None), "expr", None)


def _cat_above(node: Any, limit: int = 24) -> fx.Node | None:
    """The concatenation ``node`` is computed from, before any linear, or None."""
    return _first_above(node, lambda n: _cat_parts(n) is not None, limit,
                        stop=lambda n: is_call(n, LINEAR_OPS))


def _token_axis(cat: fx.Node, dim: int, op_tokens: Any) -> bool:
    """``cat`` concatenates along the tokens the attention op attends over (``op_tokens``)."""
    shape = node_shape(cat)
    if shape is None or not -len(shape) <= dim < len(shape):
        return False
    return same_size(shape[dim], op_tokens)


def _double_streams(q: Any, k: Any, v: Any, op_tokens: Any) -> JointStreams | None:
    cats = [_cat_above(t) for t in (q, k, v)]
    found = [_cat_parts(c) for c in cats]
    if any(f is None for f in found):
        return None
    if any(len(node_shape(c) or ()) != 4 or not _token_axis(c, f[1], op_tokens)  # type: ignore[index]
           for c, f in zip(cats, found, strict=True)):
        return None
    parts = [f[0] for f in found]  # type: ignore[index]
    if len({len(p) for p in parts}) != 1 or len({c for c in cats}) != 3:
        return None
    dims = [f[1] % len(node_shape(c) or ()) for c, f in zip(cats, found, strict=True)]  # type: ignore[index]
    inputs, tokens = [], []
    for stream in zip(*parts, strict=True):  # this stream's q, k and v parts
        linears = [_linear_above(t) for t in stream]
        if any(lin is None for lin in linears):
            return None
        sources = {lin.args[0] for lin in linears}  # type: ignore[union-attr]
        counts = [shape[d] if (shape := node_shape(t)) is not None else None
                  for t, d in zip(stream, dims, strict=True)]
        source = sources.pop()
        if (sources or None in counts or not all(same_size(c, counts[0]) for c in counts)
                or len(node_shape(source) or ()) != 3):
            return None
        inputs.append(source)
        tokens.append(counts[0])
    if len(inputs) < 2 or len(set(inputs)) != len(inputs):
        return None
    return JointStreams(cats=tuple(cats), inputs=tuple(inputs), tokens=tuple(tokens))  # type: ignore[arg-type]


def _single_streams(q: Any, k: Any, v: Any, op_tokens: Any) -> JointStreams | None:
    linears = [_linear_above(t) for t in (q, k, v)]
    if any(lin is None for lin in linears) or len({lin.args[0] for lin in linears}) != 1:  # type: ignore[union-attr]
        return None
    x = linears[0].args[0]  # type: ignore[union-attr]
    cat = _cat_above(x, limit=8)  # through the block's norm and its modulation
    found = _cat_parts(cat)
    shape = node_shape(cat)
    if found is None or shape is None or len(shape) != 3 or not _token_axis(cat, found[1], op_tokens):
        return None
    parts, dim = found
    if dim % 3 != 1 or len(parts) < 2 or any(len(node_shape(p) or ()) != 3 for p in parts):
        return None
    return JointStreams(cats=(cat,), inputs=tuple(parts),  # type: ignore[arg-type]
                        tokens=tuple(node_shape(p)[1] for p in parts), single=True)  # type: ignore[index]


def joint_streams(q: Any, k: Any, v: Any) -> JointStreams | None:
    """The streams of a joint attention whose attention op reads ``q``, ``k``, ``v`` (``[B, heads,
    L, d]``): double stream (q, k and v each a concatenation of the streams' projections, maybe
    followed by a rotary embedding), else single stream (one concatenation of the streams before
    the q, k and v projections), else None."""
    shapes = [node_shape(t) for t in (q, k, v)]
    if any(s is None or len(s) != 4 for s in shapes):
        return None
    op_tokens = shapes[0][2]  # type: ignore[index]
    return _double_streams(q, k, v, op_tokens) or _single_streams(q, k, v, op_tokens)


def _descends_to_linear(node: fx.Node, limit: int = 24) -> bool:
    """``node`` is computed from a linear projection within ``limit`` nodes (through norms, rotary
    products and shape ops: the first input of each node)."""
    return _linear_above(node, limit) is not None
