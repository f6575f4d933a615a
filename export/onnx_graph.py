"""Small rewrites of the exported ONNX graph (``onnx_ir``), applied before it is saved.

* :func:`keep_scatter_fp32` — ``ScatterElements(reduction="add")`` has no float16 kernel in ONNX
  Runtime's CPU EP (the session fails at the first call): in an fp16 export the merge's segment sum
  runs in float32 between two casts (also more exact: fp16 sums of up to ``sx*sy`` tokens).
* :func:`set_input_defaults` — make the ToMe inputs optional: each gets an initializer of the same
  name (ONNX IR >= 4), the value a client that omits the input gets (seed 0, "no map yet").
* :func:`name_axes` — the free axes of an export for every size named as Optimum names them
  (``batch_size``, ``height``, ``width``, ``sequence_length``), and the exporter's shape
  expressions of intermediate values dropped (ONNX Runtime infers them again at load).
* :func:`count_ops` — structure checks (how many fused attentions the file holds).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from tome_compile.export.metadata import PAIRS_AXIS

__all__ = ["count_ops", "keep_scatter_fp32", "name_axes", "set_input_defaults"]


def keep_scatter_fp32(model: object) -> int:
    """Cast the data and updates of every float16 ``ScatterElements`` with a reduction to float32
    and its output back. Returns how many nodes were wrapped."""
    import onnx_ir as ir

    wrapped = 0  # the main graph and the If branches of importance exports
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):  # type: ignore[attr-defined]
        graph = node.graph
        reduction = node.attributes.get("reduction")
        if node.op_type != "ScatterElements" or reduction is None or reduction.as_string() == "none":
            continue
        data, indices, updates = node.inputs
        if data.dtype != ir.DataType.FLOAT16 or graph is None:
            continue
        out = node.outputs[0]
        base = out.name or f"scatter_{wrapped}"  # explicit names: If branches have their own namers
        up = [ir.node("Cast", [v], attributes={"to": ir.DataType.FLOAT}, name=f"{base}_cast_{i}",
                      outputs=[ir.Value(name=f"{base}_fp32_{i}")]) for i, v in enumerate((data, updates))]
        scatter = ir.node("ScatterElements", [up[0].outputs[0], indices, up[1].outputs[0]],
                          attributes={k: v for k, v in node.attributes.items()}, name=f"{base}_scatter_fp32",
                          outputs=[ir.Value(name=f"{base}_sum_fp32")])
        scatter.outputs[0].dtype = ir.DataType.FLOAT
        down = ir.node(
            "Cast",
            [scatter.outputs[0]],
            attributes={"to": ir.DataType.FLOAT16},
            name=f"{base}_cast_back",
            outputs=[ir.Value(name=f"{base}_fp16")],
        )
        graph.insert_before(node, [*up, scatter, down])
        new = down.outputs[0]
        ir.convenience.replace_all_uses_with(out, new)
        if out in graph.outputs:
            graph.outputs[graph.outputs.index(out)] = new
        name, shape = out.name, out.shape
        graph.remove(node, safe=True)
        new.name, new.shape, new.dtype = name, shape, ir.DataType.FLOAT16
        wrapped += 1
    return wrapped


def narrow_scatter_indices(model: object) -> int:
    """Give every ``ScatterElements`` whose indices are an ``Expand`` of int64 numbers (the merge's
    ``scatter_add``: ``slot[..., None].expand(B, N, C)``) int32 indices, cast before the Expand:
    ONNX Runtime materialises the expanded index, and int64 makes it twice the bytes of an fp32
    activation. Token numbers fit int32 many times over. Returns how many were narrowed."""
    import onnx_ir as ir

    narrowed = 0  # the main graph and the If branches
    done: dict[int, object] = {}  # one int32 index per expanded index, however many scatters read it
    replaced: list[object] = []
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):  # type: ignore[attr-defined]
        graph = node.graph
        if node.op_type != "ScatterElements" or graph is None:
            continue
        indices = node.inputs[1]
        if indices is not None and id(indices) in done:
            node.replace_input_with(1, done[id(indices)])
            narrowed += 1
            continue
        expand = indices.producer() if indices is not None else None
        if expand is None or expand.op_type != "Expand" or indices.dtype != ir.DataType.INT64 \
                or expand.graph is not graph:
            continue
        base = f"{indices.name or 'scatter_index'}_{narrowed}"
        cast = ir.node(
            "Cast",
            [expand.inputs[0]],
            attributes={"to": ir.DataType.INT32},
            name=f"{base}_to_int32",
            outputs=[ir.Value(name=f"{base}_int32_rows")],
        )
        wide = ir.node("Expand", [cast.outputs[0], expand.inputs[1]], name=f"{base}_expand_int32",
                       outputs=[ir.Value(name=f"{base}_int32")])
        wide.outputs[0].dtype, wide.outputs[0].shape = ir.DataType.INT32, indices.shape
        graph.insert_before(expand, [cast, wide])  # where the int64 index was made: before every reader
        node.replace_input_with(1, wide.outputs[0])
        done[id(indices)] = wide.outputs[0]
        replaced.append(expand)
        narrowed += 1
    for expand in replaced:  # the int64 Expands nothing reads any more
        if all(not value.uses() for value in expand.outputs):
            expand.graph.remove(expand, safe=True)
    return narrowed


def set_input_defaults(model: object, defaults: Mapping[str, np.ndarray]) -> list[str]:
    """Give the named graph inputs a default (an initializer of the same name). Returns the names set."""
    import onnx_ir as ir

    graph = model.graph  # type: ignore[attr-defined]
    done = []
    for value in graph.inputs:
        if value.name in defaults:
            value.const_value = ir.tensor(np.asarray(defaults[value.name]), name=value.name)
            graph.register_initializer(value)
            done.append(value.name)
    return done


def count_ops(model: object, op_type: str, domain: str = "") -> int:
    """Nodes of ``domain::op_type`` in the main graph and its subgraphs (If branches)."""
    import onnx_ir as ir

    return sum(1 for node in ir.traversal.RecursiveGraphIterator(model.graph)  # type: ignore[attr-defined]
               if node.op_type == op_type and node.domain == domain)


# each model input's axes, as Optimum's U-Net export names them
AXIS_NAMES = {
    "sample": ("batch_size", None, "height", "width"),
    "encoder_hidden_states": ("batch_size", "sequence_length", None),
    "text_embeds": ("batch_size", None),
    "time_ids": ("batch_size", None),
    # the latent's size, in axes of its own: a client that feeds no map gets the traced-size default
    "tome_importance": (PAIRS_AXIS, "importance_height", "importance_width"),
}


def name_axes(model: object, names: Mapping[str, tuple[str | None, ...]] = AXIS_NAMES) -> dict[str, str]:
    """Rename the symbolic axes of the graph's inputs and outputs after :data:`AXIS_NAMES` (the
    exporter's are ``s53``, ``2*latent_height_div``), and drop the symbolic shapes of intermediate
    values: the exporter writes them as expressions of its own symbols (``floor(...)``), which ONNX
    Runtime's symbolic shape inference — TensorRT's and the transformer optimizer's — would read as
    names. Returns ``{old: new}``."""
    import onnx_ir as ir

    graph = model.graph  # type: ignore[attr-defined]
    rename: dict[str, str] = {}
    for value in graph.inputs:
        if value.shape is None or value.name not in names:
            continue
        for dim, new in zip(value.shape.dims, names[value.name], strict=False):
            if new is not None and isinstance(dim, ir.SymbolicDim) and dim.value is not None:
                rename.setdefault(dim.value, new)

    def renamed(shape: ir.Shape) -> ir.Shape:
        return ir.Shape([ir.SymbolicDim(rename.get(d.value, d.value)) if isinstance(d, ir.SymbolicDim) else d
                         for d in shape.dims])

    boundary = {id(v) for v in (*graph.inputs, *graph.outputs)}
    for value in (*graph.inputs, *graph.outputs):
        if value.shape is not None:
            value.shape = renamed(value.shape)
    for node in ir.traversal.RecursiveGraphIterator(graph):
        for value in node.outputs:
            if id(value) not in boundary and value.shape is not None and any(
                    isinstance(d, ir.SymbolicDim) for d in value.shape.dims):
                value.shape = None
    return rename
