"""ONNX Runtime's transformer optimizer on an exported U-Net, without loading its weights.

ORT's optimizer (``optimize_model``) edits the ``ModelProto`` in Python. Given a path it loads
every weight into the proto, and its symbolic shape inference copies the model — and, per ``If``
subgraph, every value known so far — so an SD 1.5 export needed 5.5x its weights' bytes (18.9 GB).
Its fusions and shape inference read only a few tensors' values: norm scales, biases, shape
constants (tensors with at most one dimension above 1) and, for CUDA, the convolution kernels that
``NhwcConv`` transposes. So :func:`optimize_for_ort`
loads the graph without its external data, reads those tensors in, runs the optimizer on that
proto, and writes the result with onnx-ir, which streams every other weight from the source's
data file into the new one a tensor at a time (the new file holds only the tensors the optimised
graph uses). The work-around for ORT's subgraph shape inference is kept here, apart from the export.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tome_compile.errors import ToMeExportError

__all__ = ["FUSED_OPS", "optimize_for_ort"]

logger = logging.getLogger("tome_compile.export")

# ORT's Stable Diffusion fusions that have CUDA kernels only (ONNX Runtime 1.32's CPU EP has none)
_CUDA_ONLY_FUSIONS = (
    "enable_nhwc_conv",
    "enable_group_norm",
    "enable_skip_group_norm",
    "enable_bias_splitgelu",
)
FUSED_OPS = (
    "MultiHeadAttention",
    "LayerNormalization",
    "SkipLayerNormalization",
    "GroupNorm",
    "SkipGroupNorm",
    "BiasSplitGelu",
    "NhwcConv",
    "BiasAdd",
)


def optimize_for_ort(src: Path, dst: Path, provider: str) -> dict[str, int]:
    """ONNX Runtime's transformer optimizer on ``src`` -> ``dst`` (+ ``dst.data``), as ORT's own
    Stable Diffusion pipeline runs it (``model_type="unet"``, Python fusions only, no provider-
    specific ORT graph passes baked in); for "cpu" without the CUDA-only fusions. ``src`` keeps
    its files; the weights are never all resident. Returns the fused op counts."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("unet")
    if provider == "cpu":
        for name in _CUDA_ONLY_FUSIONS:
            setattr(options, name, False)
    proto = load_for_fusions(src, provider)
    logging.disable(logging.WARNING)  # the fusions log every shape they cannot read, per node
    try:
        control_flow = _has_subgraphs(proto)
        with _subgraph_inference_reads_what_it_uses(control_flow) as patched:
            if control_flow and not patched:
                options.enable_shape_inference = False  # fewer fusions, but no copies per subgraph
            model = optimize_model(proto, model_type="unet", opt_level=0, optimization_options=options,
                                   use_gpu=provider == "cuda")
    except (OSError, ValueError) as e:  # a fusion read a weight that load_for_fusions left on disk
        raise ToMeExportError(f"ONNX Runtime's optimizer failed on {src.name}: {e}") from e
    finally:
        logging.disable(logging.NOTSET)
    if options.enable_shape_inference and not model.enable_shape_infer:
        logger.warning(
            "ONNX Runtime's shape inference failed on %s: the optimizer fused less than it can", src.name
        )
    model.topological_sort()
    optimized = model.model
    del model, proto
    counts: dict[str, int] = {}
    for node in optimized.graph.node:
        if node.op_type in FUSED_OPS:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    save_streaming(optimized, src.parent, dst)
    gc.collect()
    return counts


def load_for_fusions(src: Path, provider: str) -> Any:
    """``src``'s graph with its external data on disk, except the tensors ORT's fusions and shape
    inference read: vectors (at most one dimension above 1: norm scales, biases, shape constants)
    and, for "cuda", the convolution kernels (``NhwcConv`` transposes them). Those are read in
    and made inline; matrices and kernels (all but a few MB of a U-Net) stay on disk."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    proto = onnx.load(str(src), load_external_data=False)
    kernels = (
        {node.input[1] for node in _nodes(proto.graph) if node.op_type == "Conv"}
        if provider == "cuda"
        else set()
    )
    for tensor in _tensors(proto.graph):
        if uses_external_data(tensor) and (sum(d > 1 for d in tensor.dims) <= 1 or tensor.name in kernels):
            load_external_data_for_tensor(tensor, str(src.parent))
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    return proto


def save_streaming(proto: Any, base_dir: Path, dst: Path) -> None:
    """Write ``proto`` to ``dst`` + ``dst.data``: tensors still on disk (relative to ``base_dir``)
    are copied into the new data file one at a time by onnx-ir, inline ones over 1 KiB moved there."""
    import onnx_ir as ir

    if any(n.domain == "com.microsoft" for n in proto.graph.node) and not any(
            o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.add(domain="com.microsoft", version=1)  # as ORT's own save does
    model = ir.serde.deserialize_model(proto)
    ir.external_data.set_base_dir(model.graph, base_dir)
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        ir.save(model, dst, external_data=dst.name + ".data", size_threshold_bytes=1024)
    except OSError as e:
        raise ToMeExportError(f"cannot write {str(dst)!r}: {e.strerror or e}") from e


def _nodes(graph: Any) -> Iterator[Any]:
    """Every node of ``graph`` and of its subgraphs."""
    for node in graph.node:
        yield node
        for sub in _subgraphs(node):
            yield from _nodes(sub)


def _tensors(graph: Any) -> Iterator[Any]:
    """Every initializer and ``Constant`` tensor of ``graph`` and of its subgraphs."""
    import onnx

    yield from graph.initializer
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                yield a.t
        for sub in _subgraphs(node):
            yield from _tensors(sub)


def _subgraphs(node: Any) -> Iterator[Any]:
    import onnx

    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def _has_subgraphs(proto: Any) -> bool:
    """Whether the model has control flow (``If``: importance's in-graph fallback, ``plan_every``)."""
    return any(True for node in proto.graph.node for _ in _subgraphs(node))


@contextlib.contextmanager
def _subgraph_inference_reads_what_it_uses(needed: bool) -> Iterator[bool]:
    """Work around ONNX Runtime's symbolic shape inference on a model with ``If`` nodes
    (``plan_every``, importance's in-graph fallback): for each subgraph it builds a temporary
    model whose implicit inputs are *every* value known so far, initializers included — a copy of
    all of them per subgraph, several copies deep (> 20 GB for the SD 1.5 U-Net at the first
    ``If`` when the weights are loaded; onnxruntime 1.32). While the optimizer runs, the subgraph
    sees only the values it reads (the same shapes result). Yields whether the work-around is in
    place: False when not needed, or when this onnxruntime's internals differ (the caller then
    turns shape inference off)."""
    cls = None
    if needed:
        try:
            from shape_infer_helper import SymbolicShapeInferenceHelper  # ORT puts its folder on sys.path

            cls = next(
                (c for c in SymbolicShapeInferenceHelper.__mro__ if "_onnx_infer_subgraph" in vars(c)), None
            )
        except ImportError:
            cls = None
    if cls is None:
        yield False
        return
    original = vars(cls)["_onnx_infer_subgraph"]

    def infer_subgraph(self: Any, node: Any, subgraph: Any, *args: Any, **kwargs: Any) -> Any:
        known = self.known_vi_
        used = {name for n in _nodes(subgraph) for name in n.input}
        self.known_vi_ = {name: vi for name, vi in known.items() if name in used}
        try:
            return original(self, node, subgraph, *args, **kwargs)
        finally:
            known.update(self.known_vi_)
            self.known_vi_ = known

    cls._onnx_infer_subgraph = infer_subgraph
    try:
        yield True
    finally:
        cls._onnx_infer_subgraph = original
