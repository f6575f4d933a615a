"""The ONNX conversion of the rewritten graph (torch's dynamo exporter, every attention fused into
``com.microsoft.MultiHeadAttention`` unless portable) and the graph fixes after it: fp16 scatters
in float32, int32 scatter indices, the ToMe inputs' defaults, the fused-attention count check."""

from __future__ import annotations

import contextlib
import gc
import io
import logging
from typing import Any

import numpy as np
import torch
from tome_compile.passes import ToMeResult
from torch import fx

from tome_compile.errors import ToMeExportError
from tome_compile.inputs import ToMeInputSpec

__all__ = ["SUPPORTED_OPSETS", "check_opset", "convert_to_onnx", "default_value", "forget_rewriter_matches",
           "postprocess"]

logger = logging.getLogger("tome_compile.export")


SUPPORTED_OPSETS = range(18, 24)  # what torch 2.13's dynamo exporter writes (its ops start at 18)


def check_opset(opset: int) -> int:
    """The opset, or a one-line error for one the exporter would not honour (it silently writes
    18 for anything lower)."""
    if opset not in SUPPORTED_OPSETS:
        raise ToMeExportError(f"opset {opset} is not supported: the torch exporter writes opsets "
                              f"{SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1} (default 20; 23 has "
                              "no CUDA EP group norm)")
    return opset


def convert_to_onnx(gm: fx.GraphModule, example: tuple[torch.Tensor, ...], input_names: list[str], opset: int,
             dynamic_shapes: tuple[Any, ...] | None, portable: bool, output_names: list[str],
             any_size: bool = False, pairs: bool = False) -> Any:
    from tome_compile.export.attention import attention_translation_table

    # The exporter tries several capture strategies; a failed one (importance's torch.cond under
    # its first, symbolic-size strategy) prints the whole partial graph to stderr before the next
    # one succeeds. That text is kept out of the user's terminal (logged at DEBUG).
    chatter = io.StringIO()
    try:
        with contextlib.redirect_stderr(chatter):
            # an importance export for any batch of CFG pairs: its plans' sizes guard the pairs to a
            # range narrower than the declared axis, which torch.export refuses (about 20 s to find
            # out on a tiny U-Net); the exporter's own strategies end in draft_export, which keeps it
            captured = _captured(gm, example, dynamic_shapes) if any_size and not pairs else gm
            program = torch.onnx.export(
                captured, example, dynamo=True, opset_version=opset, input_names=input_names,
                output_names=output_names, dynamic_shapes=dynamic_shapes, external_data=True, verbose=False,
                custom_translation_table=None if portable else attention_translation_table())
    except Exception as e:
        logger.debug("exporter output:\n%s", chatter.getvalue())
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise ToMeExportError(f"ONNX conversion failed: {type(cause).__name__}: "
                              f"{str(cause).splitlines()[0][:300]}") from e
    forget_rewriter_matches()
    written = program.model.opset_imports.get("", None)
    if written != opset:
        raise ToMeExportError(f"the exporter wrote opset {written}, not the requested {opset}")
    return program


def _captured(gm: fx.GraphModule, example: tuple[torch.Tensor, ...], dynamic_shapes: tuple[Any, ...] | None
              ) -> Any:
    """``torch.export`` of the rewritten graph with its dynamic axes, handed to the ONNX exporter as
    a program: the exporter's own capture strategies guard on the symbolic sizes of an export for
    every image size (data-dependent errors in the first, whatever the others make of them). Where
    this capture fails (importance's ``torch.cond`` with a fixed size), the graph itself goes to
    the exporter, which tries its strategies."""
    try:
        with torch.no_grad():
            return torch.export.export(gm, example, dynamic_shapes=dynamic_shapes)
    except Exception as e:  # noqa: BLE001 - the exporter's strategies get their turn
        logger.debug("torch.export of the rewritten graph failed (%s: %s); the exporter captures it",
                     type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        return gm


def forget_rewriter_matches() -> None:
    """Clear what onnxscript's rewrite rules remember of the graph just exported.

    The exporter's optimizer runs onnxscript's module-level rewrite rules, whose pattern matchers
    keep their last match — a node of the exported graph, through it the whole graph, and so every
    initializer: the U-Net's weights (and the constant folder's numpy views of them) — until the
    next export. With ``release_weights`` that kept 86% of SDXL's weights (every attention
    ``Linear``) resident under the parity session. A matcher's state is rebuilt at the start of
    each match, so clearing it changes nothing for later exports. Best effort: an onnxscript
    without these attributes is left as it is
    (``test_no_rand_portable_export_equals_tomesd_at_any_batch_and_size`` notices)."""
    try:
        from onnxscript.rewriter._matcher import PatternMatcher
    except ImportError:
        return
    # ``type`` and not ``isinstance``: a dead ``weakref.proxy`` among the objects raises on the latter.
    for matcher in [o for o in gc.get_objects() if issubclass(type(o), PatternMatcher)]:
        init = getattr(matcher, "_init_match", None)
        if callable(init):
            init(0)
        for name in ("_graph", "_tracer", "_current_node"):
            if name in vars(matcher):
                setattr(matcher, name, None)


def default_value(spec: ToMeInputSpec, dynamic: bool) -> np.ndarray:
    shape = tuple(0 if dynamic and spec.default == "empty" and axis == spec.batch_axis else size
                  for axis, size in enumerate(spec.shape))
    return np.zeros(shape, dtype=spec.zeros().numpy().dtype)


def postprocess(program: Any, result: ToMeResult, fp16: bool, attentions: int, portable: bool,
                 dynamic: bool) -> dict[str, Any]:
    """fp16 scatter in float32, optional ToMe inputs, and the fused-attention count check."""
    from tome_compile.export.attention import CONTRIB_DOMAIN
    from tome_compile.export.onnx_graph import (
        count_ops,
        keep_scatter_fp32,
        name_axes,
        narrow_scatter_indices,
        set_input_defaults,
    )

    model = program.model
    wrapped = keep_scatter_fp32(model) if fp16 else 0
    narrowed = narrow_scatter_indices(model)
    name_axes(model)
    # each ToMe input's default (ToMeInputSpec.default): seed 0, no map yet (the fallback branch
    # runs), no plans yet (a dynamic export: no rows along the batch axis; a static one keeps the
    # declared size — ORT refuses a default of another shape)
    defaults = {spec.name: default_value(spec, dynamic)
                for spec in result.inputs if spec.default is not None}
    optional = set_input_defaults(model, defaults)
    fused = count_ops(model, "MultiHeadAttention", CONTRIB_DOMAIN)
    if not portable and fused != attentions:
        raise ToMeExportError(f"{fused} of the U-Net's {attentions} attentions became MultiHeadAttention "
                              "(a processor without scaled_dot_product_attention?); pass --portable "
                              "to export plain ONNX attention")
    return {"fp32_scatters": wrapped, "int32_scatter_indices": narrowed, "optional_inputs": optional,
            "fused_attention": fused}
