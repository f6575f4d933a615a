"""Op inventory of an exported model: what ONNX Runtime's CUDA EP can run, and no silent means.

Three checks, each returning reasons rather than raising (the exporter raises on them):

* ``onnx.checker`` (full check, by path so that > 2 GB models with external data work);
* no ``ScatterElements(reduction="none")`` produced from a ``scatter_reduce`` — the torch
  exporter turns ``scatter_reduce("mean")`` into an overwrite without a word — and no
  ``ScatterND`` with a reduction (``index_add``), which ONNX Runtime's CPU kernel computes with
  a race on duplicate indices;
* every op at the model's opset has a kernel in ONNX Runtime's CUDA execution provider
  (``data/cuda_ep_kernels.json``, with its source) — e.g. ``GroupNormalization`` (opset >= 18
  group norm) has none, so an export that would fall back to the CPU fails here instead.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = ["InventoryReport", "check_op_inventory", "cuda_kernels"]


@lru_cache(maxsize=1)
def cuda_kernels() -> dict[str, Any]:
    """The shipped CUDA EP kernel list (``{"ops": {op: [[since, until|None], ...]}, "source": ...}``)."""
    text = resources.files("tome_compile.export").joinpath("data/cuda_ep_kernels.json").read_text()
    return json.loads(text)


@dataclass
class InventoryReport:
    """Op counts and every problem found (empty ``problems`` = passed)."""

    opset: int
    op_counts: dict[str, int]
    problems: list[str] = field(default_factory=list)
    cuda_missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _covered(ranges: list[list[int | None]], version: int) -> bool:
    return any(lo <= version and (hi is None or version <= hi) for lo, hi in ranges)  # type: ignore[operator]


def check_op_inventory(path: str | Path, *, require_cuda: bool = True, full_check: bool = True
                       ) -> InventoryReport:
    """Check the model at ``path`` (external data beside it). Never raises for a model problem."""
    import onnx
    from onnx import defs

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    counts = Counter(n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx"))
    report = InventoryReport(opset, dict(sorted(counts.items())))
    try:
        onnx.checker.check_model(str(path), full_check=full_check)
    except Exception as e:  # noqa: BLE001 - the checker's own message is the reason
        report.problems.append(f"onnx.checker: {str(e).splitlines()[0][:300]}")
    for node in model.graph.node:
        if node.op_type == "ScatterND" and any(
            a.name == "reduction" and a.s != b"none" for a in node.attribute
        ):
            report.problems.append(
                f"{node.name}: ScatterND with a reduction (from index_add / index_put accumulate): "
                "ONNX Runtime 1.32's CPU kernel loses updates to duplicate indices when threads race "
                "(measured: wrong by up to 1.5 in 2 of 20 runs under load); use scatter_add "
                "(ScatterElements), which is exact")
        if node.op_type != "ScatterElements":
            continue
        reduction = next((a.s.decode() for a in node.attribute if a.name == "reduction"), "none")
        origin = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")
        if reduction == "none" and "scatter_reduce" in origin:
            report.problems.append(
                f"{node.name}: ScatterElements(reduction='none') exported from a scatter_reduce "
                "(a mean or other reduction silently became an overwrite); use scatter_add + counts")
    if require_cuda:
        kernels = cuda_kernels()["ops"]
        for op in sorted(counts):
            try:
                since = defs.get_schema(op, opset).since_version
            except Exception:  # noqa: BLE001 - unknown to this onnx: treat as uncovered
                since = opset
            if op not in kernels or not _covered(kernels[op], since):
                report.cuda_missing.append(f"{op} (opset {opset}, version {since})")
        if report.cuda_missing:
            report.problems.append(
                "ops without a CUDA EP kernel: " + ", ".join(report.cuda_missing)
                + f"; pick another --opset (20 is known good) or pass require_cuda=False "
                f"(source: {cuda_kernels()['source_commit']})")
    return report
