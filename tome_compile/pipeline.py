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
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from tome_compile.backend import tome_backend
from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeConfigError, ToMeModelError
from tome_compile.state import generation

__all__ = ["apply"]

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


def _mark_generations(pipe: Any, layout: str) -> None:
    """Wrap ``pipe.progress_bar`` (once) so that each denoising loop runs in its own generation."""
    original = getattr(pipe, "_tome_progress_bar", None) or pipe.progress_bar

    def open_generation() -> Any:
        return generation(guidance=_call_guidance(pipe, layout))

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


def apply(pipe: Any, ratio: float | ToMeConfig | None = None, *, onnx: str | Path | None = None,
          compiler: str | Any = "inductor", mode: str | None = None, dynamic: bool | None = None,
          providers: list[str] | None = None, **options: Any) -> Any:
    """Merge tokens in ``pipe``'s denoiser and mark every pipeline call as one generation.

    Args:
        pipe: a diffusers pipeline (``unet`` or ``transformer``), or one of diffusers' ONNX
            pipelines whose ``unet`` is a ``tome-export`` file. A pipeline whose denoiser already
            runs with ToMe (``StableDiffusionImg2ImgPipeline.from_pipe(pipe)``) only gets its
            generations marked (give no settings then).
        ratio: as :func:`tome_backend` (default 0.5, or a :class:`ToMeConfig`); ``**options`` its
            fields. ``guidance`` defaults to the pipeline's layout (InstructPix2Pix: ``"pix2pix"``,
            PAG: ``"pag"``, others ``"cfg"``), and each call without guidance is told so.
        onnx: run this ``tome-export`` file through ``ToMeSession`` instead of compiling (the ToMe
            settings are the file's; ``seed`` and ``providers`` apply).
        compiler, mode, dynamic: the inner compiler, ``torch.compile``'s mode and dynamic flag.
    Returns:
        ``pipe`` (changed in place); ``pipe.tome`` is the backend or the session.
    """
    name = _denoiser_name(pipe)
    model = getattr(pipe, name)
    if getattr(pipe, "tome", None) is not None:
        raise ToMeConfigError(
            f"{type(pipe).__name__} already has ToMe applied (pipe.tome); apply it once, to "
            "the plain pipeline"
        )
    layout = options.pop("guidance", None) or guidance_layout(pipe)
    handle = _tome_of(model)
    if handle is not None:
        if ratio is not None or options or onnx is not None:
            raise ToMeConfigError(f"pipe.{name} already runs with ToMe (a pipeline sharing its denoiser); "
                                  "apply(pipe) without settings marks this pipeline's generations")
    elif onnx is not None or not isinstance(model, torch.nn.Module):
        from tome_compile.export.session import ToMeSession

        onnx = onnx if onnx is not None else _onnx_path(model)
        if onnx is None:
            raise ToMeModelError(
                f"pipe.{name} is a {type(model).__name__}: give the tome-export file (onnx=)"
            )
        seed = options.get("seed", ratio.seed if isinstance(ratio, ToMeConfig) else None)
        handle = ToMeSession(onnx, seed=seed, providers=providers)
        if not handle.exported:
            raise ToMeModelError(
                f"{str(onnx)!r} is not a tome-export file (no tome_compile metadata); export "
                "the U-Net with tome-export (--into for an ONNX pipeline folder)"
            )
        setattr(pipe, name, handle)
    else:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            raise ToMeConfigError(f"pipe.{name} is already torch.compile'd; give apply() the plain pipeline "
                                  "(it compiles the denoiser itself)")
        handle = tome_backend(0.5 if ratio is None else ratio, compiler=compiler, guidance=layout, **options)
        compiled = torch.compile(model, backend=handle, mode=mode, dynamic=dynamic)
        object.__setattr__(compiled, "_tome_backend", handle)
        setattr(pipe, name, compiled)
    if getattr(handle, "guidance", None) is not None:  # an importance export: the layout it was made for
        layout = handle.guidance.name
    elif getattr(handle, "config", None) is not None and isinstance(handle.config, ToMeConfig):
        layout = handle.config.guidance if handle.config.guidance != "auto" else layout
    _mark_generations(pipe, layout)
    object.__setattr__(pipe, "tome", handle)
    return pipe
