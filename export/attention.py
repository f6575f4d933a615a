"""Fused attention in the export: ``aten.scaled_dot_product_attention -> com.microsoft.MultiHeadAttention``.

ONNX Runtime's Stable Diffusion deployments run every attention as its contrib
``MultiHeadAttention`` (flash / memory-efficient kernels on CUDA, a tiled kernel on CPU): the
``N × N`` scores are never materialised. Its optimizer finds those nodes by pattern matching on a
TorchScript export, which neither the dynamo exporter's graph nor a merged site (q/k/v read the
merge output; the result goes through the unmerge gather) matches. So the export emits the node
itself: the translation of SDPA below is handed to ``torch.onnx.export(custom_translation_table=)``.

MultiHeadAttention takes ``[B, S, heads * head_dim]`` (BSD) queries, keys and values; SDPA has
``[B, heads, S, head_dim]`` (BNSH). The transposes added on each side cancel against diffusers'
own ``view(...).transpose(1, 2)`` in the exporter's graph optimizer. Masks, causal attention,
dropout and grouped queries keep the plain ONNX translation (``--portable`` keeps it everywhere).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONTRIB_DOMAIN", "attention_translation_table", "register_contrib_schemas"]

CONTRIB_DOMAIN = "com.microsoft"


def register_contrib_schemas() -> None:
    """Teach onnx (and through it onnxscript) the signature of the contrib op we emit.

    ONNX Runtime registers its contrib schemas only inside its own library; onnxscript needs one
    to build the node. Only the inputs and attributes we use are declared. Idempotent."""
    from onnx import defs

    if defs.has("MultiHeadAttention", CONTRIB_DOMAIN):
        return
    schema = defs.OpSchema
    defs.register_schema(schema(
        "MultiHeadAttention", CONTRIB_DOMAIN, 1,
        doc="ONNX Runtime contrib MultiHeadAttention; query, key, value as [batch, seq, heads * head_dim]",
        inputs=[schema.FormalParameter("query", "T"), schema.FormalParameter("key", "T"),
                schema.FormalParameter("value", "T")],
        outputs=[schema.FormalParameter("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "float tensors")],
        attributes=[schema.Attribute("num_heads", schema.AttrType.INT, "number of heads", required=True),
                    schema.Attribute("scale", schema.AttrType.FLOAT, "score scale", required=False)],
    ))


def _sdpa_to_mha(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
    import onnxscript
    from onnxscript import opset20 as op
    from onnxscript.function_libs.torch_lib.ops.nn import aten_scaled_dot_product_attention

    heads = query.shape[1]
    plain = (attn_mask is not None or is_causal or dropout_p != 0.0 or len(query.shape) != 4
             or (enable_gqa and key.shape[1] != heads) or not isinstance(heads, int))
    if plain:
        return aten_scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                 scale, enable_gqa)
    msft = onnxscript.values.Opset(CONTRIB_DOMAIN, 1)
    to_bsd = op.Constant(value_ints=[0, 0, -1])

    def bsd(x: Any) -> Any:
        return op.Reshape(op.Transpose(x, perm=[0, 2, 1, 3]), to_bsd)

    attributes: dict[str, Any] = {"num_heads": heads}
    if scale is not None:
        attributes["scale"] = float(scale)
    out = msft.MultiHeadAttention(bsd(query), bsd(key), bsd(value), **attributes)
    bnsh = op.Constant(value_ints=[0, 0, heads, value.shape[3]])
    return op.Transpose(op.Reshape(out, bnsh), perm=[0, 2, 1, 3])


def attention_translation_table() -> dict[Any, Any]:
    """``custom_translation_table`` for ``torch.onnx.export``: SDPA as MultiHeadAttention."""
    import torch

    register_contrib_schemas()
    return {torch.ops.aten.scaled_dot_product_attention.default: _sdpa_to_mha}
