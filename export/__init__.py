"""ONNX export of the ToMe-rewritten U-Net and an ONNX Runtime session helper
(installed as ``tome_compile.export``)."""

from __future__ import annotations

from tome_compile.export.inventory import InventoryReport, check_op_inventory
from tome_compile.export.onnx_export import ExportOptions, ExportResult, export_onnx
from tome_compile.export.session import ToMeSession, lean_memory_options

__all__ = [
    "ExportOptions",
    "ExportResult",
    "InventoryReport",
    "ToMeSession",
    "check_op_inventory",
    "export_onnx",
    "lean_memory_options",
]
