"""ToMe for a diffusers pipeline, with its generations known rather than guessed.

    pipe = StableDiffusionPipeline.from_pretrained(...)
    tome_compile.apply(pipe, 0.5, method="importance", plan_every=3, seed=0)
    image = pipe(prompt).images[0]

:func:`apply` compiles the pipeline's denoiser (``unet``, or PixArt's ``transformer``) with
``tome_backend`` — or, for diffusers' ONNX pipelines or with ``onnx=``, runs a ``tome-export``
file through ``ToMeSession`` — and makes the denoising loop of every pipeline call **one
generation** (``tome_compile.generation()``): the first call of each has no stale map or plan
whatever timestep it starts at (1-step models, img2img after an interrupted run), timesteps may
rise inside one (inversion), and its random draws restart from the seed. Diffusers pipelines
open their progress bar around the denoising loop, in every pipeline: that is where the mark goes
(the pipeline object keeps its class; only its ``progress_bar`` method is wrapped).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from tome_compile import packed
from tome_compile.backend import ToMeWarning, tome_backend
from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeConfigError, ToMeModelError
from tome_compile.state import current_generation, generation

__all__ = ["apply", "remove"]

logger = logging.getLogger("tome_compile")

_DENOISERS = ("unet", "transformer")


def _denoiser_name(pipe: Any) -> str:
    for name in _DENOISERS:
        if getattr(pipe, name, None) is not None:
            return name
    raise ToMeModelError(f"{type(pipe).__name__} has no unet or transformer to merge tokens in")


def guidance_layout(pipe: Any) -> str:
    """The guidance layout of ``pipe``'s batches with guidance on (``tome_compile.guidance``)."""
    name = type(pipe).__name__
    if "InstructPix2Pix" in name:
        return "pix2pix"  # [text; image; uncond]
    if "PAG" in name:
        return "pag"  # [uncond; cond; perturbed]
    if hasattr(type(pipe), "_prepare_latent_image_ids"):
        # Flux: guidance-distilled (the scale is an input, not a second row); its true CFG runs the
        # negative prompt as a call of its own: no call's rows are ever a pair
        return "none"
    return "cfg"


def _call_guidance(pipe: Any, layout: str) -> str | None:
    """This call's layout, read when the denoising loop starts (the pipeline has set its guidance
    scale by then): ``"none"`` without classifier-free guidance; None when the pipeline does not say."""
    cfg = getattr(pipe, "do_classifier_free_guidance", None)
    if not isinstance(cfg, bool):
        return None
    pag = getattr(pipe, "do_perturbed_attention_guidance", False)
    if layout == "pag":
        return "pag" if cfg and pag else ("cfg" if cfg or pag else "none")
    return layout if cfg else "none"


class _GenerationBar:
    """The pipeline's progress bar, entered and left with a ``generation()`` around it."""

    def __init__(
        self, bar: Any, open_generation: Callable[[], contextlib.AbstractContextManager[Any]]
    ) -> None:
        self._bar = bar
        self._open = open_generation
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Any:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._open())
        return self._bar.__enter__()

    def __exit__(self, *exc: object) -> Any:
        try:
            return self._bar.__exit__(*exc)
        finally:
            if self._stack is not None:
                self._stack.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)


def _iterate_in_generation(bar: Iterable[Any], open_generation: Callable[[], Any]) -> Iterator[Any]:
    with open_generation():
        yield from bar


def _generation_of_call(pipe: Any, layout: str) -> generation:
    """The generation of one pipeline call: the guidance layout this call uses, and the seed and
    guidance of a ``generation()`` the caller opened around the call, which win (a guidance that
    contradicts the pipeline's own is refused: it would pair rows of different images)."""
    outer = current_generation()
    guidance = _call_guidance(pipe, layout)
    if outer is None:
        return generation(guidance=guidance)
    if outer.guidance is not None and guidance is not None and outer.guidance != guidance:
        raise ToMeConfigError(
            f"generation(guidance={outer.guidance!r}) around a {type(pipe).__name__} call whose batch is "
            f"{guidance!r} guidance (guidance_scale and the pipeline's mode decide it); leave guidance "
            "out of generation() around a pipeline call (the pipeline knows its layout)"
        )
    return generation(seed=outer.seed, guidance=outer.guidance or guidance)


def _mark_generations(pipe: Any, layout: str) -> None:
    """Wrap ``pipe.progress_bar`` (once) so that each denoising loop runs in its own generation."""
    original = getattr(pipe, "_tome_progress_bar", None) or pipe.progress_bar

    def open_generation() -> Any:
        return _generation_of_call(pipe, layout)

    def progress_bar(iterable: Any = None, total: Any = None) -> Any:
        bar = original(iterable=iterable, total=total)
        if iterable is not None:
            return _iterate_in_generation(bar, open_generation)
        return _GenerationBar(bar, open_generation)

    object.__setattr__(pipe, "_tome_progress_bar", original)
    object.__setattr__(pipe, "progress_bar", progress_bar)


def _onnx_path(model: Any) -> Path | None:
    """The file behind diffusers' ``OnnxRuntimeModel`` (an ONNX pipeline's ``unet``)."""
    folder = getattr(model, "model_save_dir", None)
    name = getattr(model, "latest_model_name", None)
    return Path(folder) / name if folder is not None and name is not None else None


def _tome_of(model: Any) -> Any:
    """The ToMe backend or session ``model`` already runs with (a pipeline made by ``from_pipe``
    shares its denoiser), or None."""
    from tome_compile.export.session import ToMeSession

    return model if isinstance(model, ToMeSession) else getattr(model, "_tome_backend", None)


def _refuse_other_settings(path: Any, file: ToMeConfig, ratio: float | ToMeConfig | None,
                           options: dict[str, Any]) -> None:
    """An export's ToMe settings are in its graph: refuse any setting it was not made with, by name
    (``seed`` is the generations', not the graph's)."""
    asked = {k: v for k, v in options.items() if k != "seed"}
    if isinstance(ratio, ToMeConfig):
        asked = {**{f.name: getattr(ratio, f.name) for f in dataclasses.fields(ratio) if f.name != "seed"},
                 **asked}
    elif ratio is not None:
        asked = {"ratio": ratio, **asked}
    checked = ToMeConfig.from_options(**asked)  # unknown names, bad values: the usual one-line errors
    differ = [k for k in asked if getattr(checked, k) != getattr(file, k)]
    if differ:
        given = ", ".join(f"{k}={getattr(checked, k)!r}" for k in differ)
        made = ", ".join(f"{k}={getattr(file, k)!r}" for k in differ)
        raise ToMeConfigError(
            f"{given} asked of {str(path)!r}, which was exported with {made}: an export's ToMe settings "
            "are in its graph; export again with those settings (tome-export), or leave them out "
            "(seed= and providers= apply)"
        )


def _unsupported_denoiser(model: Any, name: str) -> str | None:
    """Why ``model`` cannot be compiled whole with ToMe, or None: diffusers' regional compilation
    (``compile_repeated_blocks``: each block compiled alone never sees the latent's height and width)
    and diffusers' cache hooks (which skip blocks by a data-dependent test between steps)."""
    for path, module in model.named_modules():
        where = f"pipe.{name}{'.' + path if path else ''}"
        if getattr(module, "_compiled_call_impl", None) is not None:
            return (f"{where} is compiled on its own (diffusers' compile_repeated_blocks, "
                    "module.compile()): a block compiled alone does not see the latent's height and "
                    "width, which decide every merge; load the pipeline again and apply ToMe without "
                    "regional compilation (apply() compiles the whole denoiser)")
        registry = getattr(module, "_diffusers_hook", None)
        hooks = getattr(registry, "hooks", None)
        if hooks:
            return (f"{where} has diffusers hooks {sorted(hooks)} (a cache such as apply_first_block_cache, "
                    "group offloading, ...): they decide per step in Python which blocks run, which a "
                    f"compiled ToMe graph cannot follow; remove them (pipe.{name}.disable_cache() or a "
                    "fresh pipeline) before tome_compile.apply")
    return None


def apply(pipe: Any, ratio: float | ToMeConfig | None = None, *, onnx: str | Path | None = None,
          compiler: str | Any = "inductor", mode: str | None = None, dynamic: bool | None = None,
          providers: list[str] | None = None, **options: Any) -> Any:
    r"""Merge tokens in ``pipe``'s denoiser and mark every pipeline call as one generation.

    Args:
        pipe: a diffusers pipeline (``unet`` or ``transformer``), or one of diffusers' ONNX
            pipelines whose ``unet`` is a ``tome-export`` file. A pipeline whose denoiser already
            runs with ToMe (``StableDiffusionImg2ImgPipeline.from_pipe(pipe)``) only gets its
            generations marked (give no settings then). A pipeline ``apply`` was called on before
            is :func:`remove`\ d first: the new settings replace the old ones.
        ratio: as :func:`tome_backend` (default 0.5, or a :class:`ToMeConfig`); ``**options`` its
            fields. ``guidance`` defaults to the pipeline's layout (InstructPix2Pix: ``"pix2pix"``,
            PAG: ``"pag"``, others ``"cfg"``), and each call without guidance is told so.
        onnx: run this ``tome-export`` file through ``ToMeSession`` instead of compiling (the ToMe
            settings are the file's: others are refused; ``seed`` and ``providers`` apply).
        compiler, mode, dynamic: the inner compiler, ``torch.compile``'s mode and dynamic flag.
    Returns:
        ``pipe`` (changed in place); ``pipe.tome`` is the backend or the session.
    """
    name = _denoiser_name(pipe)
    if getattr(pipe, "tome", None) is not None:
        if onnx is None and (ratio is not None or options):  # bad new settings keep the old ones
            ToMeConfig.from_options(0.5 if ratio is None else ratio, **options)
        remove(pipe)
    model = getattr(pipe, name)
    layout = options.pop("guidance", None) or guidance_layout(pipe)
    handle = _tome_of(model)
    if handle is not None:
        if ratio is not None or options or onnx is not None:
            raise ToMeConfigError(f"pipe.{name} already runs with ToMe (a pipeline sharing its denoiser); "
                                  "apply(pipe) without settings marks this pipeline's generations, or "
                                  "remove(pipe) first for other settings")
        _warn_if_other_layout(handle, layout, pipe)
    elif onnx is not None or not isinstance(model, torch.nn.Module):
        handle = _session(pipe, name, model, onnx, ratio, providers, options)
    else:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            raise ToMeConfigError(f"pipe.{name} is already torch.compile'd; give apply() the plain pipeline "
                                  "(it compiles the denoiser itself)")
        why = _unsupported_denoiser(model, name)
        if why is not None:
            raise ToMeConfigError(why)
        handle = tome_backend(0.5 if ratio is None else ratio, compiler=compiler, guidance=layout, **options)
        compiled = torch.compile(model, backend=handle, mode=mode, dynamic=dynamic)
        object.__setattr__(compiled, "_tome_backend", handle)
        object.__setattr__(compiled, "_tome_original", model)
        setattr(pipe, name, compiled)
        packed.follow_pipeline(pipe, model)  # Flux: each call's grid (its latent comes packed)
    _mark_generations(pipe, layout)
    object.__setattr__(pipe, "tome", handle)
    return pipe


def _session(pipe: Any, name: str, model: Any, onnx: str | Path | None, ratio: float | ToMeConfig | None,
             providers: list[str] | None, options: dict[str, Any]) -> Any:
    """``pipe``'s denoiser as a ``ToMeSession`` of ``onnx`` (default: the file behind ``model``)."""
    from tome_compile.export.session import ToMeSession

    onnx = onnx if onnx is not None else _onnx_path(model)
    if onnx is None:
        raise ToMeModelError(f"pipe.{name} is a {type(model).__name__}: give the tome-export file (onnx=)")
    seed = options.get("seed", ratio.seed if isinstance(ratio, ToMeConfig) else None)
    handle = ToMeSession(onnx, seed=seed, providers=providers)
    if not handle.exported:
        raise ToMeModelError(
            f"{str(onnx)!r} is not a tome-export file (no tome_compile metadata); export "
            "the U-Net with tome-export (--into for an ONNX pipeline folder)"
        )
    _refuse_other_settings(onnx, handle.meta.tome_config(), ratio, options)
    handle._tome_original = model
    setattr(pipe, name, handle)
    return handle


def _warn_if_other_layout(handle: Any, layout: str, pipe: Any) -> None:
    """A pipeline sharing an importance denoiser compiled for another guidance layout (PAG made
    ``from_pipe`` of a CFG pipeline): its calls with that layout use ToMe plans; say so now."""
    made = getattr(handle, "guidance", None)
    made = made.name if made is not None else getattr(getattr(handle, "config", None), "guidance", None)
    method = getattr(getattr(handle, "config", None), "method", None) or getattr(
        getattr(handle, "meta", None), "method", None)
    if method == "importance" and made not in (None, "auto", layout):
        message = (f"ToMe: {type(pipe).__name__} stacks {layout!r} guidance rows, but its shared denoiser's "
                   f"importance graph pairs {made!r} rows: its calls with {layout!r} guidance use ToMe plans "
                   f"(never a map of another layout); for importance merging here, remove(pipe) and apply "
                   f"it to this pipeline's own copy of the denoiser")
        logger.warning("%s", message)
        warnings.warn(message, ToMeWarning, stacklevel=3)


def remove(pipe: Any) -> Any:
    """Undo :func:`apply`: ``pipe``'s original denoiser back, its generation marks gone (the pipeline
    object as it was). Idempotent: a pipeline without ToMe is returned as it is. A pipeline that
    shares the ToMe denoiser (``from_pipe``) keeps it until it is removed there too."""
    handle = vars(pipe).pop("tome", None)
    if handle is None:
        return pipe
    name = _denoiser_name(pipe)
    original = getattr(getattr(pipe, name), "_tome_original", None)
    if original is not None:
        setattr(pipe, name, original)
        packed.clear_packed_grid(original)
    vars(pipe).pop("_prepare_latent_image_ids", None)
    vars(pipe).pop("progress_bar", None)
    vars(pipe).pop("_tome_progress_bar", None)
    return pipe
