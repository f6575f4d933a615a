"""What a node of a traced U-Net computes, read from the graph alone: the op tables (Dynamo's
torch-level ops and torch.export's aten ops side by side), shapes and module paths from the node
metadata, and the dataflow walks the site finder is built from — a projection back to its input
(through shape-only ops, a fused QKV split, PEFT's LoRA sum), a sequence back to where it enters an
attention module (through batch-row slices), the reference of a reference attention, the output
projection after an attention op."""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

__all__ = [
    "BADDBMM_OPS", "BMM_OPS", "CAT_OPS", "CONV_OPS", "LAYER_NORM_OPS", "LINEAR_OPS", "SDPA_OPS",
    "SOFTMAX_OPS", "TENSOR_CONSTANT_OPS", "TIME_EMBED_OPS", "common_path", "descends", "describe", "entry",
    "is_call", "is_shape_op", "module_path", "node_shape",
    "output_projection",
    "projection_of", "qkv", "readers", "reference_of",
]

# Recognised op variants, one table: Dynamo (torch level) -> torch.export (aten level).
SDPA_OPS: set[Any] = {
    torch._C._nn.scaled_dot_product_attention,  # Dynamo: F.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,  # torch.export
}
LINEAR_OPS: set[Any] = {
    torch._C._nn.linear,  # Dynamo: F.linear / nn.Linear
    torch.nn.functional.linear,
    torch.ops.aten.linear.default,  # torch.export
}
BMM_OPS: set[Any] = {torch.bmm, torch.ops.aten.bmm.default}  # classic AttnProcessor: probs @ v
BADDBMM_OPS: set[Any] = {torch.baddbmm, torch.ops.aten.baddbmm.default}  # classic: q @ k^T
SOFTMAX_OPS: set[Any] = {torch.softmax, torch.nn.functional.softmax, torch.ops.aten.softmax.int,
                          torch.ops.aten._softmax.default}
CONV_OPS: set[Any] = {torch.conv2d, torch.nn.functional.conv2d, torch.ops.aten.conv2d.default,
                       torch.ops.aten.convolution.default}
LAYER_NORM_OPS: set[Any] = {torch.nn.functional.layer_norm, torch.layer_norm,
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
    torch.ops.aten.unflatten.int, torch.ops.aten.flatten.using_ints,  # pre-dispatch make_fx
    torch.split, torch.functional.split, torch.chunk,  # fused QKV: Dynamo
    torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.chunk.default,
    torch.nn.functional.dropout, torch.dropout, torch.ops.aten.dropout.default,  # eval-mode dropout
}
# What a region may do to its input before the projections read it, token count untouched: batch-row
# slices (a processor that runs the unconditional row apart, Zero123++'s ``is_cfg_guidance``), casts.
_ROW_SLICE_OPS: set[Any] = {operator.getitem, torch.ops.aten.slice.Tensor, torch.ops.aten.narrow.default}
_ENTRY_PASSTHROUGH: set[Any] = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype,
                                torch.ops.aten.clone.default, torch.Tensor.contiguous,
                                torch.nn.functional.dropout, torch.dropout, torch.ops.aten.dropout.default}
_ADD_OPS: set[Any] = {operator.add, torch.add, torch.ops.aten.add.Tensor}
_SCALE_OPS: set[Any] = {operator.mul, torch.mul, torch.ops.aten.mul.Tensor, operator.truediv,
                        torch.ops.aten.div.Tensor}
# The sinusoidal timestep embedding (diffusers' ``Timesteps``): the U-Net's timestep feeds it.
TIME_EMBED_OPS: set[Any] = {torch.sin, torch.cos, torch.ops.aten.sin.default, torch.ops.aten.cos.default}
# torch.tensor([t]) of a Python-number timestep: baked (999) -> torch.tensor; symbolic -> torch._refs.tensor
TENSOR_CONSTANT_OPS: set[Any] = {torch.tensor, torch.as_tensor, torch._refs.tensor}


def node_shape(node: Any) -> tuple[Any, ...] | None:
    """Shape of a node's value from Dynamo (``example_value``) or export (``val``) metadata."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


CAT_OPS: set[Any] = {torch.cat, torch.concat, torch.ops.aten.cat.default, torch.ops.aten.concat.default}


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


def is_call(node: Any, ops: set[Any]) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in ops


def is_shape_op(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _PASSTHROUGH_METHODS
            or node.op == "call_function" and node.target in _PASSTHROUGH_FUNCS)


def _through_dropout(node: Any) -> Any:
    while is_call(node, _ENTRY_PASSTHROUGH) or (isinstance(node, fx.Node) and node.op == "call_method"
                                                   and node.target in ("to", "contiguous")):
        node = node.args[0]
    return node


def _lora_base(node: Any) -> fx.Node | None:
    """PEFT's LoRA ``Linear``: ``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`` (the
    scaling on either side, or none); the base layer's linear node, or None."""
    if not is_call(node, _ADD_OPS) or len(node.args) != 2:
        return None
    for base, delta in (node.args, node.args[::-1]):
        if not is_call(base, LINEAR_OPS):
            continue
        if is_call(delta, _SCALE_OPS):
            tensors = [a for a in delta.args if isinstance(a, fx.Node)]
            delta = tensors[0] if len(tensors) == 1 else None
        if (is_call(delta, LINEAR_OPS) and is_call(delta.args[0], LINEAR_OPS)
                and _through_dropout(delta.args[0].args[0]) is base.args[0]):
            return base
    return None


_RSQRT_OPS: set[Any] = {torch.rsqrt, torch.ops.aten.rsqrt.default}
_RMS_NORM_OPS: set[Any] = {torch.nn.functional.rms_norm, torch.ops.aten.rms_norm.default}


def qk_norm_input(node: Any) -> fx.Node | None:
    """The tensor a per-token norm of queries or keys (a qk-norm: SD3.5's, Flux's) normalises, or
    None: ``layer_norm`` / ``rms_norm``, or diffusers' ``RMSNorm`` written out —
    ``x * rsqrt(mean(x², -1) + eps)``, then its casts and ``* weight``."""
    if is_call(node, LAYER_NORM_OPS | _RMS_NORM_OPS):
        return node.args[0]
    for _ in range(4):
        if not isinstance(node, fx.Node):
            return None
        if is_call(node, _SCALE_OPS) and len(node.args) == 2:
            a, b = node.args
            for x, r in ((a, b), (b, a)):
                if is_call(r, _RSQRT_OPS) and isinstance(x, fx.Node) and descends(r, x, limit=8):
                    return x
            node = a  # the weight's product: the normalised tensor is its first operand
        elif _through_dropout(node) is not node:  # a cast
            node = _through_dropout(node)
        else:
            return None
    return None


def projection_of(node: Any) -> fx.Node | None:
    """Walk back through shape-only ops and a qk-norm (:func:`qk_norm_input`) to the linear
    projection that produced ``node`` (a LoRA wrapper's: its base layer, whose input is the
    projection's input)."""
    for _ in range(16):
        if not isinstance(node, fx.Node):
            return None
        if is_call(node, LINEAR_OPS):
            return node
        lora = _lora_base(node)
        if lora is not None:
            return lora
        if is_shape_op(node):
            node = node.args[0]
        elif (normalised := qk_norm_input(node)) is not None:
            node = normalised
        else:
            return None
    return None


def readers(node: Any, x: fx.Node) -> list[fx.Node]:
    """The nodes of the projection that produced ``node`` which read ``x`` (a plain projection's
    linear; a LoRA wrapper's base layer and its ``lora_A`` / dropout), or [] if not all of it
    comes from ``x``."""
    out: list[fx.Node] = []
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in seen or n is x:
            continue
        seen.add(n)
        if x in n.all_input_nodes:
            out.append(n)
            continue
        if not (is_call(n, LINEAR_OPS | _ADD_OPS | _SCALE_OPS | _ENTRY_PASSTHROUGH) or is_shape_op(n)):
            return []
        # a linear's data is its first argument, a reshape's too (its sizes may be symbolic: the
        # sym_size nodes of an any-size export read other tensors); a sum's are all its inputs
        data = n.args[:1] if is_call(n, LINEAR_OPS) or is_shape_op(n) else n.all_input_nodes
        todo.extend(data)
    return out


def _softmax_input(node: Any) -> Any:
    """For the classic form: probs (after optional casts) -> softmax -> baddbmm(q, k^T)."""
    for _ in range(4):
        if not isinstance(node, fx.Node):
            return None
        if is_call(node, SOFTMAX_OPS) or (node.op == "call_method" and node.target == "softmax"):
            return node.args[0]
        if (
            node.op == "call_method"
            and node.target in ("to", "float", "half", "bfloat16")
            or is_call(node, {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype})
        ):
            node = node.args[0]
        else:
            return None
    return None


def qkv(node: fx.Node) -> tuple[Any, Any, Any, str] | None:
    """(q, k, v, form) of an attention op, or None if ``node`` is not one."""
    if is_call(node, SDPA_OPS):
        q, k, v = (list(node.args) + [node.kwargs.get(n) for n in ("query", "key", "value")])[:3]
        return q, k, v, "sdpa"
    if is_call(node, BMM_OPS):
        scores = _softmax_input(node.args[0])
        if is_call(scores, BADDBMM_OPS):
            return scores.args[1], scores.args[2], node.args[1], "classic"
        if is_call(scores, BMM_OPS):
            return scores.args[0], scores.args[1], node.args[1], "classic"
    return None


def entry(node: Any, region: set[fx.Node]) -> Any:
    """The sequence a projection reads, as it enters the attention's region: walks back through
    batch-row slices and casts made inside the region (``hidden_states[1:]`` of a processor that
    runs the unconditional row apart). Token counts are untouched by what it walks through."""
    for _ in range(8):
        if not isinstance(node, fx.Node) or node not in region or not node.args:
            return node
        if is_call(node, _ROW_SLICE_OPS) and _row_slice(node):
            node = node.args[0]
        elif _through_dropout(node) is not node:
            node = _through_dropout(node)
        else:
            return node
    return node


def _row_slice(node: fx.Node) -> bool:
    """``x[a:b]`` / ``x[a:b, ...]`` (getitem), or aten's slice / narrow on dim 0."""
    if node.target is operator.getitem:
        index = node.args[1]
        first = index[0] if isinstance(index, tuple) and index else index
        rest = index[1:] if isinstance(index, tuple) else ()
        return isinstance(first, slice) and all(i == slice(None) or i is Ellipsis for i in rest)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return dim == 0


def reference_of(kv: fx.Node, source: fx.Node, region: set[fx.Node]) -> fx.Node | None:
    """Reference attention (Zero123++'s read pass): keys and values are projections of
    ``cat([source, reference], dim=1)``; the reference node, or None."""
    if not is_call(kv, CAT_OPS) or not isinstance(kv.args[0], (list, tuple)) or len(kv.args[0]) != 2:
        return None
    dim = kv.args[1] if len(kv.args) > 1 else kv.kwargs.get("dim", 0)
    first, reference = kv.args[0]
    shape = node_shape(source)
    if (
        entry(first, region) is not source
        or not isinstance(reference, fx.Node)
        or shape is None
        or dim not in (1, 1 - len(shape))
    ):
        return None
    return reference


def output_projection(anchor: fx.Node) -> fx.Node | None:
    """The linear that reads the attention op's output (``to_out.0``), through shape-only ops."""
    node = anchor
    for _ in range(8):
        users = list(node.users)
        linear = next((u for u in users if is_call(u, LINEAR_OPS) and u.args[0] is node), None)
        if linear is not None:
            return linear
        shaped = [u for u in users if is_shape_op(u) and u.args and u.args[0] is node]
        if len(shaped) != 1:
            return None
        node = shaped[0]
    return None


def common_path(nodes: Sequence[fx.Node | None]) -> str:
    """The deepest module holding every one of ``nodes`` (their paths' common dotted prefix); a
    single module's path (a fused QKV's ``attn1.to_qkv``, no output projection found) is cut to
    its parent."""
    paths = [module_path(n).split(".") for n in nodes if n is not None and module_path(n)]
    if not paths:
        return ""
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    if all(len(p) == len(common) for p in paths):
        common = common[:-1]
    return ".".join(common)


def describe(node: fx.Node) -> str:
    target = getattr(node.target, "__name__", str(node.target))
    where = module_path(node)
    return f"{node.name} ({target}{' in ' + where if where else ''})"


def descends(node: fx.Node, ancestor: fx.Node, limit: int = 64) -> bool:
    """``node`` is computed from ``ancestor`` (a bounded walk back through the graph)."""
    todo, seen = [node], set()
    while todo and len(seen) < limit * 8:
        n = todo.pop()
        if n is ancestor:
            return True
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False
