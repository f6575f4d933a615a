"""The parity stage of ``tome-export``: the calls on which ONNX Runtime must equal PyTorch, their
PyTorch references (computed once, before any session loads), and the comparison.

An fp16 export is checked against PyTorch running the same fp16 graph. PyTorch's CPU kernels for
fp16 convolutions and matrix products are scalar loops (here: a 320-channel 3x3 convolution at
64², 23.7 s in fp16 against 0.08 s in fp32), which made the README's SDXL check at 1024² run for
hours. :class:`Fp32Compute` runs those products in fp32 on fp16 values and rounds the result back
to fp16 — what ONNX Runtime's CPU EP does with an fp16 graph (it casts the inputs of ops that have
no fp16 kernel to fp32 and the outputs back) and what a GPU does (fp32 accumulation). Every other
op, the merge's included, still runs in fp16.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tome_compile.passes import ToMeResult
from torch import fx
from torch.utils._python_dispatch import TorchDispatchMode

from tome_compile.errors import ToMeExportError
from tome_compile.families import ModelFamily
from tome_compile.inputs import draw_tome_inputs
from tome_compile.sampler import PartitionSampler

__all__ = [
    "OUTPUT_NAME",
    "Fp32Compute",
    "ParityCheck",
    "ParityReport",
    "can_run",
    "compare",
    "cpu_fp16_options",
    "default_providers",
    "example_tome_inputs",
    "parity_checks",
    "references",
    "session",
]

OUTPUT_NAME = "out_sample"

_aten = torch.ops.aten
_PRODUCTS = frozenset({_aten.convolution.default, _aten.addmm.default, _aten.mm.default, _aten.bmm.default,
                       _aten.baddbmm.default})


class Fp32Compute(TorchDispatchMode):
    """Inside this mode, convolutions and matrix products of fp16 CPU tensors compute in fp32 and
    return fp16 (see the module doc); ``upcast`` counts them. Other dtypes and devices, and every
    other op, are untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.upcast = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _PRODUCTS and any(_cpu_half(a) for a in args):
            self.upcast += 1
            up = [a.float() if _cpu_half(a) else a for a in args]
            return func(*up, **kwargs).half()
        return func(*args, **kwargs)


def _cpu_half(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.dtype == torch.float16 and a.device.type == "cpu"


@dataclass(frozen=True)
class ParityCheck:
    """One call ONNX Runtime must match: ``key`` names it in reports and errors."""

    key: str
    args: tuple[torch.Tensor, ...]
    extra: tuple[torch.Tensor, ...]
    output: np.ndarray | None = None  # the PyTorch output, when computed while making the checks


def example_tome_inputs(result: ToMeResult, seed: int, with_map: bool = True) -> list[torch.Tensor]:
    """Values for the ToMe inputs used to trace and to check parity: a drawn partition, and for
    importance a random map (the importance branch; ``with_map=False``: the fallback branch)."""
    sampler = PartitionSampler(seed)
    importance = None
    spec = next((s for s in result.inputs if s.draw == "importance"), None)
    if spec is not None and with_map:
        importance = torch.rand(spec.shape, generator=torch.Generator().manual_seed(seed))
    return draw_tome_inputs(result.inputs, sampler, importance, "cpu")


def parity_checks(result: ToMeResult, gm: fx.GraphModule, args: tuple[torch.Tensor, ...],
                  extra: list[torch.Tensor], family: ModelFamily, seed: int, traced: int | None,
                  keep: int = 1) -> list[ParityCheck]:
    """The traced call; importance's fallback branch; plan_every's reusing branch (fed the plans
    PyTorch made); with ``traced`` (a dynamic batch traced at that size) the smallest batch from
    the same file, ``keep`` rows (1; an importance file in CFG pairs: 2) of each of the family's
    per-image inputs (the timestep has no batch axis; a ToMe input has the one its spec names,
    ``ToMeInputSpec.batch_axis``, and keeps its share)."""
    made = None
    if result.outputs:  # the traced call's plans feed the reusing check; its output is the reference
        with torch.no_grad(), Fp32Compute():
            made = gm(*args, *extra)
    checks = [ParityCheck("traced", tuple(args), tuple(extra), None if made is None else _numpy(made))]
    if any(spec.draw == "has_map" for spec in result.inputs):
        fallback = example_tome_inputs(result, seed, with_map=False)
        checks.append(ParityCheck("no map", tuple(args), tuple(fallback)))
    if made is not None:
        fed = draw_tome_inputs(result.inputs, PartitionSampler(seed), None, "cpu", plans=(made[1], made[2]))
        checks.append(ParityCheck("reused plans", tuple(args), tuple(fed)))
    if traced is not None:
        one = tuple(a[:keep] if name in family.per_image else a
                    for name, a in zip(family.names, args, strict=True))
        one_extra = tuple(_share(e, spec.batch_axis, keep, traced)
                          for spec, e in zip(result.inputs, extra, strict=True))
        checks.append(ParityCheck(f"batch {keep}", one, one_extra))
    return checks


def _share(value: torch.Tensor, axis: int | None, keep: int, batch: int) -> torch.Tensor:
    """The share of ``keep`` images of a ToMe input traced at ``batch`` (its spec's batch axis: plan
    state is batch-major, the importance map one row per CFG pair)."""
    return value if axis is None else value.narrow(axis, 0, value.shape[axis] * keep // batch)


def references(gm: fx.GraphModule, checks: list[ParityCheck]) -> dict[str, np.ndarray]:
    """The PyTorch output of every check, float32 NumPy by key (fp16 products in fp32: see the module
    doc). Computed before a session loads, so the model's weights can be freed first."""
    out = {}
    with torch.no_grad(), Fp32Compute():
        for check in checks:
            known = check.output
            out[check.key] = known if known is not None else _numpy(gm(*check.args, *check.extra))
    return out


def _numpy(value: Any) -> np.ndarray:
    """The model output of a graph call (the first of several outputs) as float32 NumPy."""
    return (value[0] if isinstance(value, (tuple, list)) else value).float().cpu().numpy()


def default_providers() -> list[str]:
    """CUDA EP (falling back to CPU) where onnxruntime has it, else CPU."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def can_run(provider: str) -> bool:
    """Whether a graph optimised for ``provider`` ("cpu" / "cuda") can run here."""
    return provider == "cpu" or "CUDAExecutionProvider" in default_providers()


def session(path: Path, fp16: bool = False) -> Any:
    """An ONNX Runtime session for the check (:func:`cpu_fp16_options` for an fp16 file on the CPU)."""
    import onnxruntime as ort

    providers = default_providers()
    options = cpu_fp16_options() if fp16 and providers[0] == "CPUExecutionProvider" else None
    return ort.InferenceSession(str(path), sess_options=options, providers=providers)


def cpu_fp16_options() -> Any:
    """Session options that keep an fp16 file's weights fp16 on the CPU EP. That EP has no fp16
    kernels for convolutions and matrix products: at its default level it stores a float32 copy of
    every such weight when the session loads (fp16 SD 1.5: 5.9 GB peak for 1.7 GB of weights; the
    README's SDXL check peaked at 20.9 GB, 4.1x its 5.1 GB), and with fewer optimisations it runs
    every weight's cast first. Basic optimisations with priority-based order cast each weight when
    its op runs: SD 1.5 fp16 peak 3.1 GB (1.8x), the call ~20% slower."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    return options


@dataclass
class ParityReport:
    """The worst difference over the checks compared so far."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    provider: str | None = None


def compare(report: ParityReport, sess: Any, input_names: list[str], checks: list[ParityCheck],
            refs: dict[str, np.ndarray], tolerance: float) -> None:
    """Run every check in ``sess`` and compare with its reference; the worst difference is kept in
    ``report``. Raises :class:`ToMeExportError` above ``tolerance * max(1, max |reference|)``."""
    report.provider = sess.get_providers()[0]
    for check in checks:
        feed = {name: t.detach().cpu().numpy()
                for name, t in zip(input_names, check.args + check.extra, strict=True)}
        got = sess.run([OUTPUT_NAME], feed)[0].astype(np.float32)
        ref = refs[check.key]
        diff = np.abs(got - ref)
        scale = float(np.abs(ref).max())
        report.max_abs = max(float(diff.max()), report.max_abs)
        report.max_rel = max(float(diff.max()) / max(scale, 1e-12), report.max_rel)
        # Scale-aware: at 16k tokens, similarity scores that are nearly tied can rank differently
        # under ORT's and torch's matmul rounding, so a few tokens merge differently (a local 1e-3).
        limit = tolerance * max(1.0, scale)
        if not np.isfinite(diff).all() or float(diff.max()) > limit:
            raise ToMeExportError(f"parity check failed ({check.key}): ONNX Runtime ({report.provider}) vs "
                                  f"PyTorch max abs {float(diff.max()):.3g} > {limit:.3g} "
                                  f"({tolerance:g} x max(1, max |output|))")
