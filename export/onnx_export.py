"""Export a diffusers U-Net with the ToMe rewrite to ONNX, check it, and write it atomically.

    torch.export -> merge_self_attention (the same pass as the torch.compile backend)
                 -> torch.onnx.export (dynamo exporter) -> op inventory -> ORT parity -> rename

Inputs are named and typed as Optimum's U-Net export (``sample``, ``timestep`` float32 ``[1]``,
``encoder_hidden_states``, SDXL's ``text_embeds``, ``time_ids``); output ``out_sample``; the batch
axis is dynamic. Every attention is a ``com.microsoft.MultiHeadAttention`` (``portable=True``:
plain ops). With ``use_rand`` the destinations are hashed in the graph from the timestep and an
optional ``tome_seed`` input (default 0) — no Random* op, no input a standard client lacks;
``partition_input=True`` takes them as a ``tome_partition`` input instead (drawn by
``ToMeSession`` from a seeded generator: bit-exact with ``tome_backend(seed=)``). An image U-Net's
file takes any image size and text length, as Optimum's (``sample`` with symbolic batch, height and
width, ``encoder_hidden_states`` with symbolic batch and length): the graph computes every merge's
sizes from the call's shapes; ``static=True`` (and the forms whose extra inputs are sized per
export: ``partition_input``, ``plan_every``; video, DiT and multi-view U-Nets) fixes them.
What the session helper needs (the input specs, the config) is
stored in the model's ``metadata_props["tome_compile"]``.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tome_compile.export import parity
from tome_compile.export.convert import check_opset, convert_to_onnx, postprocess
from tome_compile.export.inventory import InventoryReport, check_op_inventory
from tome_compile.export.metadata import METADATA_KEY, PAIRS_AXIS, ExportMetadata
from tome_compile.export.ort_optimizer import optimize_for_ort
from tome_compile.export.output_files import (
    check_output_path,
    remove_temp_folder,
    sweep_stale_partials,
    temp_folder,
    write_error,
)
from tome_compile.export.parity import default_providers
from tome_compile.export.sizes import any_size_export, other_size_check
from tome_compile.export.tracing import (
    assert_no_scatter_mean,
    attention_count,
    drop_dead_code,
    drop_noop_squeezes,
    graph_dynamic_shapes,
    promote_mixed_concats,
    size_axes,
    trace_unet,
)
from tome_compile.passes import ToMeResult, find_unet_io, merge_self_attention
from tome_compile.passes.follow_up import either_plans, fallback_plans, hash_random, head_merges
from tome_compile.passes.report import nothing_rewritten
from torch import fx

from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeExportError
from tome_compile.families import ModelFamily, family_of, latent_multiple
from tome_compile.models import example_inputs
from tome_compile.packed import set_packed_grid

__all__ = [
    "METADATA_KEY",
    "STAGES",
    "ExportOptions",
    "ExportResult",
    "check_opset",
    "check_output_path",
    "default_providers",
    "export_onnx",
    "optimize_for_ort",
    "sweep_stale_partials",
]

logger = logging.getLogger("tome_compile.export")

OUTPUT_NAME = parity.OUTPUT_NAME


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
    optional_inputs: list[str] = field(default_factory=list)
    fused_attention: int = 0
    fusions: dict[str, int] = field(default_factory=dict)


def _dynamic_shapes(run: _Run) -> tuple[Any, ...] | None:
    assert run.result is not None
    return graph_dynamic_shapes(run.family, run.result.inputs, run.input_names, dynamic=run.dynamic,
                                pairs=run.pairs, sizes=run.sizes)


@dataclass(frozen=True)
class ExportOptions:
    """What :func:`export_onnx` takes besides the model, the path and the ToMe config.

    Attributes:
        batch: the batch of a static export; with ``dynamic_batch`` (default) the file takes any
            batch (traced at ``max(batch, 2)``, checked there and at 1). An importance export
            takes any batch of CFG pairs (even; traced at ``max(batch, 4)``, checked there and at
            2): its map input has one row per pair. With ``partition_input`` or plan reuse (inputs
            sized per image) it keeps ``batch``.
        portable: plain ONNX attention (MatMul/Softmax) instead of ``com.microsoft.MultiHeadAttention``.
        partition_input: take the destinations as a ``tome_partition`` input drawn by the caller
            (bit-exact with ``tome_backend(seed=)``) instead of hashing them in the graph from the
            optional ``tome_seed`` input and the timestep.
        frames: video U-Nets (AnimateDiff, SVD): frames per video (default 16 / 25). Their exports
            keep ``batch`` and ``frames`` fixed (the prompt embeddings' batch is batch x frames).
        release_weights: free the model's weights once the PyTorch parity references are computed,
            before ONNX Runtime loads the file (the module is unusable afterwards; ``tome-export``
            sets it: the model and the session are never resident together).
        optimize: "cpu" or "cuda": run ONNX Runtime's transformer optimizer (``model_type="unet"``,
            the fusions of ORT's Stable Diffusion pipeline for that provider) and check parity again
            (on CUDA only where a CUDA EP is present: its fused ops have no CPU kernel).
        atol: parity tolerance, relative to ``max(1, max |output|)`` (default 1e-3 fp32, 5e-2 fp16).
        static: fix the image size and text length at ``height``, ``width``, ``seq_len`` (CUDA
            graphs, TensorRT profiles). Default: an image U-Net's file takes any size whose latent
            is a multiple of the U-Net's downsampling (8 for SD 1.5 / 2.1 / SDXL) and any text
            length; ``height`` / ``width`` / ``seq_len`` are then the traced example (and parity is
            checked there and at one other size).
    """

    batch: int = 2
    height: int = 512
    width: int = 512
    seq_len: int = 77
    opset: int = 20
    fp16: bool = False
    force: bool = False
    check_parity: bool = True
    atol: float | None = None
    require_cuda_kernels: bool = True
    seed: int = 0
    oracle: bool = False
    portable: bool = False
    partition_input: bool = False
    dynamic_batch: bool = True
    optimize: str | None = None
    frames: int | None = None
    release_weights: bool = False
    static: bool = False

    def stages(self) -> list[str]:
        """The export's stages in order (the CLI's progress bar counts them)."""
        skipped = {"parity": not self.check_parity, "optimize": not self.optimize}
        return [name for name in STAGES if not skipped.get(name, False)]

    def tolerance(self) -> float:
        return self.atol if self.atol is not None else (5e-2 if self.fp16 else 1e-3)


# stage -> the progress line it starts with (also the stage clock of benchmarks.memory)
STAGES = {
    "trace": "tracing the U-Net (torch.export)",
    "rewrite": "rewriting attention sites (ToMe pass)",
    "convert": "converting to ONNX (opset {opset})",
    "inventory": "checking the op inventory",
    "parity": "checking parity: ONNX Runtime vs PyTorch (same inputs and partition)",
    "optimize": "optimizing for ONNX Runtime ({optimize})",
    "write": "writing {name}",
}


@dataclass
class _Run:
    """One export in progress: what each stage leaves for the next."""

    unet: torch.nn.Module
    out: Path
    config: ToMeConfig
    options: ExportOptions
    inputs: Any  # models.ExampleInputs
    family: ModelFamily  # its inputs' names, batch axes, layout
    dynamic: bool
    traced: int
    pairs: bool = False  # a dynamic batch in CFG pairs (importance: its map has one row per pair)
    sizes: dict[str, Any] | None = None  # symbolic height / width / text axes (tracing.size_axes)
    multiple: int = 1  # what the latent's height and width must be a multiple of
    gm: fx.GraphModule | None = None
    io: Any = None  # passes.UNetIO
    dead_attentions: int = 0
    result: ToMeResult | None = None
    extra: list[torch.Tensor] = field(default_factory=list)
    input_names: list[str] = field(default_factory=list)
    tmp: Path | None = None
    model: Path | None = None  # the file the next stage reads (unoptimised, then optimised)
    post: dict[str, Any] = field(default_factory=dict)
    export: ExportResult | None = None
    checks: list[parity.ParityCheck] = field(default_factory=list)
    references: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.inputs.args())


def export_onnx(unet: torch.nn.Module, out: str | Path, config: ToMeConfig,
                options: ExportOptions | None = None, *, step: Callable[[str], None] | None = None,
                **fields: Any) -> ExportResult:
    """Export ``unet`` with ToMe applied to ``out`` (+ ``out.data``), checked; see the module doc.

    ``options`` (an :class:`ExportOptions`) or its fields as keywords (``height=1024, fp16=True``);
    ``step`` is called with each stage's progress line as it starts (:data:`STAGES`).

    Raises:
        ToMeExportError: bad destination or opset, an op inventory problem, or a parity error above
            ``atol * max(1, max |output|)``. Nothing is left behind on failure.
    """
    try:
        options = replace(options or ExportOptions(), **fields)
    except TypeError as e:
        known = ", ".join(f.name for f in dataclasses.fields(ExportOptions))
        raise TypeError(f"export_onnx: {e}; options are {known}") from None
    run = _prepare(unet, Path(out), config, options)
    say = step or (lambda message: logger.info("%s", message))
    times: dict[str, float] = {}

    def stage(name: str) -> None:
        say(STAGES[name].format(opset=options.opset, optimize=options.optimize, name=run.out.name))
        start = time.perf_counter()
        _STAGE_FUNCTIONS[name](run)
        times[name] = time.perf_counter() - start

    names = options.stages()
    for name in names[:2]:  # trace, rewrite: nothing on disk yet
        stage(name)
    try:  # the folder is created inside: a signal right after mkdir still finds it removed
        run.tmp = temp_folder(run.out)
        for name in names[2:]:
            stage(name)
        assert run.export is not None
        run.export.seconds = times
        return run.export
    finally:
        remove_temp_folder(run.out, run.tmp)


def _prepare(unet: torch.nn.Module, out: Path, config: ToMeConfig, o: ExportOptions) -> _Run:
    """Checks that need no work, the model in the export's dtype, the example inputs."""
    out = check_output_path(out, o.force)
    check_opset(o.opset)
    if o.batch < 1:
        raise ToMeExportError(f"batch={o.batch} must be >= 1")
    dtype = torch.float16 if o.fp16 else torch.float32
    if next(unet.parameters()).dtype != dtype:
        unet = unet.to(dtype)
    unet = unet.eval()
    family = family_of(unet)
    if o.frames is not None and family.video_layout is None:
        raise ToMeExportError(f"frames={o.frames} is for video U-Nets; {type(unet).__name__} takes images")
    # importance's map input has one row per CFG pair: its file takes any batch of pairs (an even
    # batch: the uncond and cond halves), drawn and checked in pairs; with a drawn partition or fed
    # back plans (inputs sized per image) it keeps its batch
    importance = config.method == "importance" and config.enabled
    pairs = (o.dynamic_batch and importance and family.dynamic_batch and o.batch % 2 == 0
             and not o.partition_input and not config.reuses_plans)
    dynamic = o.dynamic_batch and family.dynamic_batch and (pairs or not importance)
    # torch.export specialises a dynamic axis traced at size 1: trace a dynamic batch at >= 2, in
    # pairs at >= 2 pairs (the parity check still runs batch 1, or one pair)
    traced = max(o.batch, 4 if pairs else 2) if dynamic else o.batch
    inputs = example_inputs(unet, batch=traced, height=o.height, width=o.width, seq_len=o.seq_len,
                            seed=o.seed, dtype=dtype, frames=o.frames)
    # Optimum's and diffusers' ONNX pipelines send the timestep as float32 of shape [1]; PixArt's
    # blocks need one per image ([B], as PixArtAlphaPipeline sends it).
    inputs.timestep = (inputs.timestep.to(torch.float32) if family.dit
                       else torch.tensor([float(inputs.timestep)], dtype=torch.float32))
    if inputs.grid is not None:  # Flux: the packed latent's grid, in the traced graph (fixed size)
        set_packed_grid(unet, inputs.grid)
    multiple = latent_multiple(unet)
    latent = tuple(inputs.sample.shape[-2:]) if inputs.grid is None else inputs.grid
    if latent[0] % multiple or latent[1] % multiple:  # a DiT would run, cropped to its patch grid
        raise ToMeExportError(f"height={o.height}, width={o.width}: the traced latent "
                              f"{latent[0]}x{latent[1]} must be a multiple of {multiple} (the U-Net's "
                              "downsampling, a DiT's patch size) on each side")
    sizes = size_axes(multiple) if any_size_export(family, config, o) else None
    return _Run(unet=unet, out=out, config=config, options=o, inputs=inputs, family=family, dynamic=dynamic,
                traced=traced, pairs=pairs, sizes=sizes, multiple=multiple)


def _stage_trace(run: _Run) -> None:
    run.gm = trace_unet(run.unet, run.args, run.family, run.dynamic, run.sizes)
    drop_noop_squeezes(run.gm)
    promote_mixed_concats(run.gm)
    run.dead_attentions = drop_dead_code(run.gm)
    # found once: the pass reads the passes and the timestep; the metadata the noise output's
    # channel axis and noise channels (the importance map reads them)
    run.io = find_unet_io(run.gm, any_size=run.sizes is not None)


def _stage_rewrite(run: _Run) -> None:
    # The canonical pass, then the deployment forms (passes/follow_up.py), each one graph for every
    # call: importance's ToMe plan when there is no map yet (tome_has_map, ONNX If), plans made or
    # reused per call (tome_reuse_plan, ONNX If), randomness hashed from tome_seed (no drawn input),
    # merges that scatter the r merged tokens only (ONNX Runtime's ScatterElements is one thread)
    o, gm = run.options, run.gm
    assert gm is not None
    result = fallback_plans(gm, merge_self_attention(gm, run.config, oracle=o.oracle, io=run.io,
                                                     any_size=run.sizes is not None, cfg_pairs=run.pairs))
    if run.config.reuses_plans:
        result = either_plans(gm, result)
    if not o.partition_input:
        result = hash_random(gm, result)
    result = head_merges(gm, result)
    if not o.oracle and (why := nothing_rewritten(result, run.config)) is not None:
        raise ToMeExportError(f"{why} — nothing to export with ToMe (--ratio 0 exports the plain U-Net)")
    assert_no_scatter_mean(gm)
    run.result = result
    run.extra = parity.example_tome_inputs(result, o.seed)
    run.input_names = run.family.names + result.input_names


def _stage_convert(run: _Run) -> None:
    o, result, gm = run.options, run.result, run.gm
    assert result is not None and gm is not None and run.tmp is not None
    attentions = attention_count(run.unet, gm, len(run.io.passes), run.dead_attentions)
    program = convert_to_onnx(gm, run.args + tuple(run.extra), run.input_names, o.opset,
                       _dynamic_shapes(run), o.portable,
                       [OUTPUT_NAME] + [spec.name for spec in result.outputs], any_size=run.sizes is not None,
                       pairs=run.pairs)
    run.post = postprocess(program, result, o.fp16, attentions, o.portable, run.dynamic)
    replace(_metadata(run), **run.post).write(program.model)
    run.model = run.tmp / run.out.name
    try:
        program.save(str(run.model), external_data=True)
    except Exception as e:
        raise write_error(e, run.out.parent) from e
    del program  # the in-memory ONNX model: the checks below load the file (SD 1.5: 3.4 GB each)
    gc.collect()


def _metadata(run: _Run) -> ExportMetadata:
    """What ``ToMeSession`` reads back (``metadata_props["tome_compile"]``)."""
    o, result, io, config = run.options, run.result, run.io, run.config
    assert result is not None
    multiview = None
    if run.family.multiview:
        multiview = {"cond_lat": list(run.inputs.cond_lat.shape[1:]), "passes": len(io.passes),
                     "is_cfg_guidance": bool(getattr(run.unet, "is_cfg_guidance", False)),
                     "noise": "input (ToMeSession draws it with torch.randn_like when not given)"}
    return ExportMetadata(
        config=asdict(config),
        inputs=run.input_names,
        tome_inputs=list(result.inputs),
        output=OUTPUT_NAME,
        tome_outputs=list(result.outputs),
        batch=PAIRS_AXIS if run.pairs else "dynamic" if run.dynamic else o.batch,
        height=o.height,
        width=o.width,
        seq_len=o.seq_len,
        timestep=run.family.timestep,
        latent_hw=list(result.latent_hw or ()),
        family=run.family.name,
        video_layout=run.family.video_layout,
        frames=(int(run.inputs.sample.shape[2 if run.family.video_layout == "BCFHW" else 1])
                if run.family.video_layout else None),
        channel_axis=io.channel_axis,
        noise_channels=io.noise_channels,
        method=result.method,
        guidance=result.guidance.name if result.guidance is not None else None,
        attention="plain" if o.portable else "com.microsoft.MultiHeadAttention",
        destinations="tome_partition input" if o.partition_input else "hashed from tome_seed and timestep",
        sites=[s.line() for s in result.sites],
        unet_config={k: v for k, v in dict(run.unet.config).items() if not k.startswith("_")},
        dtype="float16" if o.fp16 else "float32",
        multiview=multiview,
        any_size=run.sizes is not None,
        latent_multiple=run.multiple,
    )


def _stage_inventory(run: _Run) -> None:
    assert run.model is not None and run.result is not None
    inventory = check_op_inventory(run.model, require_cuda=run.options.require_cuda_kernels)
    if not inventory.ok:
        raise ToMeExportError("op inventory check failed: " + "; ".join(inventory.problems))
    run.export = ExportResult(path=run.out, files=[], report=run.result, input_names=run.input_names,
                              opset=run.options.opset, inventory=inventory,
                              optional_inputs=run.post["optional_inputs"],
                              fused_attention=run.post["fused_attention"])


def _stage_parity(run: _Run) -> None:
    assert run.result is not None and run.gm is not None and run.model is not None
    one = 2 if run.pairs else 1  # the smallest batch the file takes
    run.checks = parity.parity_checks(run.result, run.gm, run.args, run.extra, run.family, run.options.seed,
                                      run.traced if run.dynamic else None, keep=one)
    if run.sizes is not None:
        run.checks.append(other_size_check(run.unet, run.inputs, run.result, o=run.options,
                                           multiple=run.multiple, batch=one if run.dynamic else run.traced,
                                           pairs=run.pairs))
    run.references = parity.references(run.gm, run.checks)  # before the session loads: release_weights
    if run.options.release_weights:
        _release_weights(run.unet, run.gm)
    _compare(run, run.model)
    gc.collect()


def _stage_optimize(run: _Run) -> None:
    assert run.tmp is not None and run.model is not None and run.export is not None
    optimize = run.options.optimize
    final = run.tmp / "optimized" / run.out.name
    final.parent.mkdir()
    run.export.fusions = optimize_for_ort(run.model, final, optimize)
    run.model = final
    if run.checks and parity.can_run(optimize):  # every branch again, from the references
        _compare(run, final)
    elif run.checks:
        logger.warning("parity of the CUDA-optimised graph needs the CUDA EP (its fused ops have no "
                       "CPU kernel); the unoptimised graph passed")


def _stage_write(run: _Run) -> None:
    """Data files first, the model last (the last point where an interrupted export still stops)."""
    assert run.model is not None and run.export is not None
    parent = run.out.parent if str(run.out.parent) else Path(".")
    files = sorted(p for p in run.model.parent.iterdir() if p.is_file())
    for f in sorted(files, key=lambda p: p.suffix == ".onnx"):
        try:
            os.replace(f, parent / f.name)
        except OSError as e:
            raise ToMeExportError(f"cannot write {str(parent / f.name)!r}: {e.strerror}") from e
    run.export.files = [parent / f.name for f in files]


_STAGE_FUNCTIONS: dict[str, Callable[[_Run], None]] = {
    "trace": _stage_trace,
    "rewrite": _stage_rewrite,
    "convert": _stage_convert,
    "inventory": _stage_inventory,
    "parity": _stage_parity,
    "optimize": _stage_optimize,
    "write": _stage_write,
}


def _release_weights(*modules: torch.nn.Module) -> None:
    """Free the weights of ``modules`` (every parameter and buffer becomes an empty tensor): the
    PyTorch model and the ORT session are then never resident together."""
    for module in modules:
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    gc.collect()
    _return_freed_memory()


def _return_freed_memory() -> None:
    """Hand memory freed by Python back to the system (glibc's ``malloc_trim``). glibc keeps freed
    heap pages mapped: the released weights stayed resident under the ORT session that came next
    (SDXL fp16 parity: 6.2 GB held + the session = 14.2 GB). No-op where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)


def _compare(run: _Run, model: Path) -> None:
    """ORT on ``model`` vs the PyTorch references on every check; the worst difference goes on the result."""
    export = run.export
    assert export is not None
    report = parity.ParityReport(export.parity_max_abs or 0.0, export.parity_max_rel or 0.0)
    try:
        parity.compare(report, parity.session(model, run.options.fp16), export.input_names, run.checks,
                       run.references, run.options.tolerance())
    finally:
        export.parity_max_abs, export.parity_max_rel = report.max_abs, report.max_rel
        export.parity_provider = report.provider
