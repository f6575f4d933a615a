"""Export a diffusers U-Net with the ToMe rewrite to ONNX, check it, and write it atomically.

    torch.export -> merge_self_attention (the same pass as the torch.compile backend)
                 -> torch.onnx.export (dynamo exporter) -> op inventory -> ORT parity -> rename

Inputs are named as diffusers/Optimum do (``sample``, ``timestep``, ``encoder_hidden_states``,
SDXL's ``text_embeds``, ``time_ids``); output ``out_sample``. With ``use_rand`` the destination
partition is one more int64 input, ``tome_partition``: the caller draws it (``ToMeSession``
does, from a seeded generator), so there is no unseedable Random* op in the graph. The spatial
size and batch are fixed per export. What the session helper needs (the partition layout, the
config) is stored in the model's ``metadata_props["tome_compile"]``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tome_compile.export.inventory import InventoryReport, check_op_inventory
from tome_compile.passes import ToMeResult, merge_self_attention
from torch import fx

from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeExportError
from tome_compile.inputs import draw_tome_inputs
from tome_compile.models import example_inputs, unet_input_names
from tome_compile.sampler import PartitionSampler

__all__ = ["METADATA_KEY", "ExportResult", "check_output_path", "export_onnx", "sweep_stale_partials"]

logger = logging.getLogger("tome_compile.export")

METADATA_KEY = "tome_compile"
METADATA_VERSION = 2  # 2: the ToMe inputs are described by ToMeInputSpec.to_json() under "tome_inputs"
OUTPUT_NAME = "out_sample"


@dataclass
class ExportResult:
    """What was written and what was measured."""

    path: Path
    files: list[Path]
    report: ToMeResult
    input_names: list[str]
    opset: int
    inventory: InventoryReport
    parity_max_abs: float | None = None
    parity_max_rel: float | None = None
    parity_provider: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def check_output_path(out: str | Path, force: bool) -> Path:
    """Validate the destination before any work: suffix, folder, overwrite policy."""
    out = Path(out)
    if out.suffix != ".onnx":
        raise ToMeExportError(f"output {str(out)!r} must end in .onnx")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ToMeExportError(f"output folder {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ToMeExportError(f"output folder {str(parent)!r} is not writable")
    for existing in (out, out.with_name(out.name + ".data")):
        if existing.exists() and not force:
            raise ToMeExportError(f"{str(existing)!r} exists; pass --force (force=True) to overwrite it")
    return out


def _partial_prefix(out: Path) -> str:
    return f".{out.name}.partial-"


def sweep_stale_partials(out: Path) -> list[Path]:
    """Remove temp folders of earlier exports to ``out`` whose process is gone (killed for memory,
    SIGKILL): ``.OUT.partial-PID-*``. Folders of a live export are left alone. Returns the removed."""
    parent = out.parent if str(out.parent) else Path(".")
    removed = []
    for folder in parent.glob(_partial_prefix(out) + "*"):
        pid_text = folder.name[len(_partial_prefix(out)):].split("-", 1)[0]
        if pid_text.isdigit() and _alive(int(pid_text)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
        logger.info("removed %s, left by an export that did not finish", folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_error(error: BaseException, folder: Path) -> ToMeExportError:
    """One line for a failed write: the disk-full case named as such."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        return ToMeExportError(f"no space left in {str(folder)!r}: free some space there or write the "
                               "export elsewhere (an fp32 SD 1.5 U-Net takes 3.4 GB)")
    what = (cause.strerror if isinstance(cause, OSError) and cause.strerror
            else f"{type(error).__name__}: {error}")
    return ToMeExportError(f"cannot write to {str(folder)!r}: {str(what).splitlines()[0][:200]}")


def _plain_graph_module(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """``ep.module()`` without its pytree calling convention or input-spec hooks."""
    unlifted = ep.module()
    graph = unlifted.graph
    graph._codegen = fx.graph.CodeGen()
    for node in list(graph.nodes):  # constant arguments (return_dict=False) are placeholders too
        value = node.meta.get("val")
        if node.op == "placeholder" and not isinstance(value, torch.Tensor):
            def constant(a: fx.Node, node: fx.Node = node, value: Any = value) -> Any:
                return value if a is node else a

            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, constant)
                user.kwargs = fx.node.map_arg(user.kwargs, constant)
            graph.erase_node(node)
    return fx.GraphModule(unlifted, graph).eval()


def _assert_no_scatter_mean(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        if node.op == "call_function" and "scatter_reduce" in str(node.target) and "mean" in map(
                str, list(node.args) + list(node.kwargs.values())):
            raise ToMeExportError(
                f"{node.name}: scatter_reduce(mean) cannot be exported (ONNX ScatterElements has no "
                "mean; the torch exporter silently writes an overwrite); use scatter_add + counts")


def export_onnx(
    unet: torch.nn.Module,
    out: str | Path,
    config: ToMeConfig,
    *,
    batch: int = 2,
    height: int = 512,
    width: int = 512,
    seq_len: int = 77,
    opset: int = 20,
    fp16: bool = False,
    force: bool = False,
    check_parity: bool = True,
    atol: float | None = None,
    require_cuda_kernels: bool = True,
    seed: int = 0,
    step: Callable[[str], None] | None = None,
    oracle: bool = False,
) -> ExportResult:
    """Export ``unet`` with ToMe applied to ``out`` (+ ``out.data``), checked; see the module doc.

    Raises:
        ToMeExportError: bad destination, an op inventory problem, or a parity error above
            ``atol * max(1, max |output|)`` (``atol`` default 1e-3 fp32, 5e-2 fp16). Nothing is
            left behind on failure.
    """
    out = check_output_path(out, force)
    if batch < 1:
        raise ToMeExportError(f"batch={batch} must be >= 1")
    step = step or (lambda message: logger.info("%s", message))
    times: dict[str, float] = {}
    dtype = torch.float16 if fp16 else torch.float32
    if next(unet.parameters()).dtype != dtype:
        unet = unet.to(dtype)
    unet = unet.eval()
    sdxl = getattr(unet.config, "addition_embed_type", None) == "text_time"
    names = unet_input_names(unet)
    inputs = example_inputs(unet, batch=batch, height=height, width=width, seq_len=seq_len, seed=seed,
                            dtype=dtype)
    args = inputs.args()

    step("tracing the U-Net (torch.export)")
    start = time.perf_counter()
    kwargs: dict[str, Any] = {"return_dict": False}
    if sdxl:
        kwargs["added_cond_kwargs"] = {"text_embeds": inputs.text_embeds, "time_ids": inputs.time_ids}
    with torch.no_grad():
        # The U-Net itself (not a wrapper), so site paths read as in diffusers; SDXL's
        # added_cond_kwargs flatten to the text_embeds, time_ids inputs.
        ep = torch.export.export(unet, args[:3], kwargs)
    gm = _plain_graph_module(ep)
    times["trace"] = time.perf_counter() - start

    step("rewriting attention sites (ToMe pass)")
    # One graph for both kinds of importance step: a tome_has_map input picks the plan (ONNX If).
    result = merge_self_attention(gm, config, oracle=oracle, in_graph_fallback=True)
    _assert_no_scatter_mean(gm)
    extra = _example_tome_inputs(result, seed)
    input_names = names + result.input_names

    meta = {
        "version": METADATA_VERSION,
        "config": asdict(config),
        "inputs": input_names,
        "tome_inputs": [spec.to_json() for spec in result.inputs],
        "output": OUTPUT_NAME,
        "batch": batch,
        "height": height,
        "width": width,
        "latent_hw": list(result.latent_hw or ()),
        "method": result.method,
        "sites": [s.line() for s in result.sites],
        "unet_config": {k: v for k, v in dict(unet.config).items() if not k.startswith("_")},
        "dtype": "float16" if fp16 else "float32",
    }

    parent = out.parent if str(out.parent) else Path(".")
    sweep_stale_partials(out)
    try:  # the pid in the name tells a later export whether this folder's writer is still alive
        tmp = Path(tempfile.mkdtemp(prefix=f"{_partial_prefix(out)}{os.getpid()}-", dir=parent))
    except OSError as e:
        raise _write_error(e, parent) from e
    try:
        step(f"converting to ONNX (opset {opset})")
        start = time.perf_counter()
        try:
            program = torch.onnx.export(gm, tuple(args) + tuple(extra), dynamo=True, opset_version=opset,
                                        input_names=input_names, output_names=[OUTPUT_NAME],
                                        external_data=True, verbose=False)
        except Exception as e:
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            raise ToMeExportError(f"ONNX conversion failed: {type(cause).__name__}: "
                                  f"{str(cause).splitlines()[0][:300]}") from e
        program.model.metadata_props[METADATA_KEY] = json.dumps(meta, default=str)
        tmp_model = tmp / out.name
        try:
            program.save(str(tmp_model), external_data=True)
        except Exception as e:
            raise _write_error(e, parent) from e
        times["convert"] = time.perf_counter() - start

        step("checking the op inventory")
        inventory = check_op_inventory(tmp_model, require_cuda=require_cuda_kernels)
        if not inventory.ok:
            raise ToMeExportError("op inventory check failed: " + "; ".join(inventory.problems))
        export = ExportResult(path=out, files=[], report=result, input_names=input_names, opset=opset,
                              inventory=inventory, seconds=times)

        if check_parity:
            step("checking parity: ONNX Runtime vs PyTorch (same inputs and partition)")
            start = time.perf_counter()
            _parity(export, tmp_model, gm, args, extra, fp16, atol)
            if any(spec.draw == "has_map" for spec in result.inputs):  # the fallback branch too
                _parity(export, tmp_model, gm, args, _example_tome_inputs(result, seed, with_map=False),
                        fp16, atol)
            times["parity"] = time.perf_counter() - start

        files = sorted(tmp.iterdir())
        for f in sorted(files, key=lambda p: p.suffix == ".onnx"):  # data first, model last
            try:
                os.replace(f, parent / f.name)
            except OSError as e:
                raise ToMeExportError(f"cannot write {str(parent / f.name)!r}: {e.strerror}") from e
        export.files = [parent / f.name for f in files]
        return export
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _example_tome_inputs(result: ToMeResult, seed: int, with_map: bool = True) -> list[torch.Tensor]:
    """Values for the ToMe inputs used to trace and to check parity: a drawn partition, and for
    importance a random map (the importance branch; ``with_map=False``: the fallback branch)."""
    sampler = PartitionSampler(seed)
    importance = None
    spec = next((s for s in result.inputs if s.draw == "importance"), None)
    if spec is not None and with_map:
        importance = torch.rand(spec.shape, generator=torch.Generator().manual_seed(seed))
    return draw_tome_inputs(result.inputs, sampler, importance, "cpu")


def _parity(export: ExportResult, path: Path, gm: fx.GraphModule, args: tuple[torch.Tensor, ...],
            extra: list[torch.Tensor], fp16: bool, atol: float | None) -> None:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if fp16 and "CUDAExecutionProvider" not in available:
        logger.warning("fp16 parity needs the CUDA EP; skipped on %s", available)
        return
    providers = (["CUDAExecutionProvider", "CPUExecutionProvider"]
                 if "CUDAExecutionProvider" in available else ["CPUExecutionProvider"])
    session = ort.InferenceSession(str(path), providers=providers)
    feed = {name: t.detach().cpu().numpy() for name, t in zip(export.input_names, tuple(args) + tuple(extra))}
    got = session.run([OUTPUT_NAME], feed)[0].astype(np.float32)
    with torch.no_grad():
        ref = gm(*args, *extra)
    ref = (ref[0] if isinstance(ref, (tuple, list)) else ref).float().cpu().numpy()
    diff = np.abs(got - ref)
    export.parity_max_abs = float(diff.max())
    export.parity_max_rel = float(diff.max() / max(float(np.abs(ref).max()), 1e-12))
    export.parity_provider = session.get_providers()[0]
    # Scale-aware: at 16k tokens, similarity scores that are nearly tied can rank differently
    # under ORT's and torch's matmul rounding, so a few tokens merge differently (a local 1e-3).
    tol = atol if atol is not None else (5e-2 if fp16 else 1e-3)
    limit = tol * max(1.0, float(np.abs(ref).max()))
    if not np.isfinite(diff).all() or export.parity_max_abs > limit:
        raise ToMeExportError(f"parity check failed: ONNX Runtime ({export.parity_provider}) vs PyTorch "
                              f"max abs {export.parity_max_abs:.3g} > {limit:.3g} "
                              f"({tol:g} x max(1, max |output|))")
