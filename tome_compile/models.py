"""U-Nets to work on: built-in architectures (random weights) and a user's local checkpoint.

Nothing is downloaded: the SD 1.5, SD 2.1 and SDXL U-Net configs ship with the package
(``tome_compile/configs/*.json``) and build the real architectures with random weights, which is
all speed and memory measurements need. A local diffusers U-Net folder (``config.json`` +
weights) or pipeline folder (its ``unet/``) loads with ``local_files_only=True``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from tome_compile.errors import ToMeModelError
from tome_compile.families import ModelFamily, family_of, nested

__all__ = [
    "ARCHITECTURES",
    "MODEL_CLASSES",
    "UNetInputs",
    "architecture_class",
    "architecture_config",
    "build_unet",
    "example_inputs",
    "is_dit",
    "load_unet",
    "unet_input_names",
    "video_layout",
]

logger = logging.getLogger("tome_compile")

ARCHITECTURES = ("sd15", "sd21", "sdxl", "animatediff", "svd", "pixart", "sd3", "flux")
SHAPES = "shapes"  # load_unet: the U-Net of the shipped shapes model (for tome-export, tome-serve --onnx)
# The denoisers the pass knows, by diffusers class name: image U-Nets, video U-Nets, DiTs (SD3's
# joint attention).
MODEL_CLASSES = ("UNet2DConditionModel", "UNetMotionModel", "UNetSpatioTemporalConditionModel",
                 "PixArtTransformer2DModel", "SD3Transformer2DModel", "FluxTransformer2DModel")


def _shipped(name: str) -> dict[str, Any]:
    if name not in ARCHITECTURES:
        raise ToMeModelError(f"unknown architecture {name!r}; built-in ones are {ARCHITECTURES}")
    return json.loads(resources.files("tome_compile.configs").joinpath(f"{name}.json").read_text())


def architecture_config(name: str) -> dict[str, Any]:
    """The shipped config of a built-in architecture (its class: :func:`architecture_class`)."""
    return {k: v for k, v in _shipped(name).items() if not k.startswith("_")}


def architecture_class(name: str) -> str:
    """The diffusers class of a built-in architecture (``UNet2DConditionModel``, ...)."""
    return str(_shipped(name).get("_class_name", "UNet2DConditionModel"))


def _model_class(name: str) -> Any:
    import diffusers

    if name not in MODEL_CLASSES:
        raise ToMeModelError(f"{name} is not a model tome-compile knows; it takes {', '.join(MODEL_CLASSES)}")
    return getattr(diffusers, name)


def build_unet(name_or_config: str | dict[str, Any], *, seed: int = 0,
               dtype: torch.dtype = torch.float32, class_name: str | None = None) -> torch.nn.Module:
    """A denoiser with random weights (seeded, without touching the global RNG): a built-in
    architecture by name, or a config of ``class_name`` (default ``UNet2DConditionModel``)."""
    if isinstance(name_or_config, str):
        config, class_name = architecture_config(name_or_config), architecture_class(name_or_config)
    else:
        config = {k: v for k, v in name_or_config.items() if not k.startswith("_")}
        class_name = class_name or str(name_or_config.get("_class_name", "UNet2DConditionModel"))
    cls = _model_class(class_name)
    devices: list[Any] = []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        try:
            unet = cls(**config)
        except TypeError as e:
            raise ToMeModelError(f"bad {class_name} config: {e}") from e
    return (unet if dtype == torch.float32 else unet.to(dtype)).eval()


def load_unet(spec: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, str]:
    """``spec`` = a built-in name (random weights), ``"shapes"`` (the shipped trained shapes
    model's U-Net), a diffusers U-Net folder or a pipeline folder.

    Returns ``(unet, description)``; the description says where the weights came from.
    """
    if isinstance(spec, str) and spec in ARCHITECTURES:
        return build_unet(spec, dtype=dtype), f"built-in {spec} architecture with RANDOM weights"
    if spec == SHAPES:  # the project's own trained model (pixel space, 32 x 32, two-word prompts)
        from tome_compile.shapes.model import load_model

        return load_model().unet.to(dtype).eval(), "the shipped shapes model's U-Net (trained weights)"
    path = Path(spec)
    if not path.exists():
        raise ToMeModelError(f"model {str(spec)!r} not found: give a diffusers U-Net folder, a pipeline "
                             f"folder, or one of {ARCHITECTURES}")
    # a pipeline folder: its U-Net (unet/) or its DiT (transformer/, PixArt)
    folder = next(
        (path / sub for sub in ("unet", "transformer") if (path / sub / "config.json").is_file()), path
    )
    if not (folder / "config.json").is_file():
        raise ToMeModelError(f"{str(path)!r} has no config.json (nor unet/config.json); it is not a "
                             "diffusers U-Net or pipeline folder")
    cls = _model_class(_check_unet_config(folder))
    try:
        unet, info = cls.from_pretrained(
            folder, local_files_only=True, torch_dtype=dtype, output_loading_info=True
        )
    except Exception as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ToMeModelError(f"could not load a U-Net from {str(folder)!r}: {first}") from e
    missing = list(info.get("missing_keys", []))
    if missing:
        raise ToMeModelError(f"{str(folder)!r}: the weights lack {len(missing)} of the U-Net's tensors "
                             f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); the weight "
                             "file does not belong to this config.json, or is incomplete")
    kind = "U-Net" if cls.__name__ == "UNet2DConditionModel" else cls.__name__
    return unet.eval(), f"local {kind} {folder}"


def _check_unet_config(folder: Path) -> str:
    """The class name of a denoiser config tome-compile knows (``MODEL_CLASSES``), or one clear
    line saying what the folder holds instead."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ToMeModelError(f"{str(folder / 'config.json')!r} is not readable JSON: {e}") from e
    if not isinstance(config, dict):
        raise ToMeModelError(f"{str(folder / 'config.json')!r} is not a JSON object")
    kind = config.get("_class_name")
    if kind is None and "down_block_types" not in config:
        raise ToMeModelError(
            f"{str(folder / 'config.json')!r} is not a diffusers U-Net config (no _class_name, "
            "no down_block_types); give a UNet2DConditionModel folder or a pipeline folder"
        )
    if kind is not None and kind not in MODEL_CLASSES:
        raise ToMeModelError(
            f"{str(folder)!r} holds a {kind}, not a UNet2DConditionModel (nor another denoiser "
            f"tome-compile knows: {', '.join(MODEL_CLASSES[1:])}); give the U-Net folder "
            "(PIPELINE/unet) or the pipeline folder"
        )
    return str(kind or "UNet2DConditionModel")


@dataclass
class UNetInputs:
    """Positional inputs in diffusers/Optimum order: sample, timestep, encoder_hidden_states,
    and for SDXL text_embeds, time_ids."""

    sample: torch.Tensor
    timestep: torch.Tensor
    encoder_hidden_states: torch.Tensor
    text_embeds: torch.Tensor | None = None
    time_ids: torch.Tensor | None = None
    added_time_ids: torch.Tensor | None = None  # SVD: (fps, motion bucket, noise augmentation) per video
    dit: bool = False  # PixArt: the latent is ``hidden_states``; a text mask; resolution conditions
    encoder_attention_mask: torch.Tensor | None = None
    resolution: torch.Tensor | None = None
    aspect_ratio: torch.Tensor | None = None
    timestep_cond: torch.Tensor | None = None  # LCM: the guidance-scale embedding
    pooled_projections: torch.Tensor | None = None  # SD3, Flux: the pooled text embedding
    img_ids: torch.Tensor | None = None  # Flux: the positions of the latent's tokens and the text's
    txt_ids: torch.Tensor | None = None
    guidance: torch.Tensor | None = None  # Flux.1-dev: the distilled guidance scale per image
    grid: tuple[int, int] | None = None  # Flux: the packed latent's (h, w) (set_packed_grid)
    cond_lat: torch.Tensor | None = None  # multi-view (Zero123++): the condition view's latent
    noise: torch.Tensor | None = None  # and the noise the wrapper adds to it

    family: ModelFamily | None = None  # what the inputs are (set by example_inputs)

    def args(self) -> tuple[torch.Tensor, ...]:
        """The family's inputs in graph order (the order of the exported graph's inputs)."""
        assert self.family is not None
        return tuple(getattr(self, name) for name in self.family.names)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the model's ``forward``, each input at its family's keyword (in
        ``args`` order: torch.export keeps it)."""
        assert self.family is not None
        return nested((i.keyword, getattr(self, i.name)) for i in self.family.inputs)


def is_dit(unet: torch.nn.Module) -> bool:
    """A diffusion transformer (PixArt-α) rather than a U-Net."""
    return family_of(unet).dit


def video_layout(unet: torch.nn.Module) -> str | None:
    """How a video U-Net takes its sample: ``"BCFHW"`` (AnimateDiff's ``UNetMotionModel``),
    ``"BFCHW"`` (SVD's ``UNetSpatioTemporalConditionModel``); None for an image model."""
    return family_of(unet).video_layout


def unet_input_names(unet: torch.nn.Module) -> list[str]:
    """The exported graph's model inputs, in order (its family's: :mod:`tome_compile.families`)."""
    return family_of(unet).names


def _spatial_scale(unet: torch.nn.Module) -> int:
    if family_of(unet).packed:  # Flux: 8x VAE, then 2x2 latent patches packed into each token
        return family_of(unet).scale
    # Latent models (4 latent channels in or out: inpainting and SVD take 9 / 8, PixArt returns 8;
    # SD3's VAE has 16) work at 1/8 of the image; pixel-space models at 1/1.
    cfg = unet.config
    return 8 if {4, 16} & {cfg.in_channels, getattr(cfg, "out_channels", None)} else 1


def example_inputs(unet: torch.nn.Module, *, batch: int = 2, height: int = 512, width: int = 512,
                   seq_len: int | None = None, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype | None = None, frames: int | None = None) -> UNetInputs:
    """Random inputs of the right shapes for ``unet`` at an image size of ``height × width``
    (video U-Nets: ``frames`` per video, as their pipelines call them; the multi-view wrapper: the
    3 x 2 tiled views, the condition view's latent and its noise), one value per input of its
    family (:mod:`tome_compile.families`); ``seq_len`` defaults to the text tokens its pipeline
    sends (77; SD3: 333)."""
    seq_len = family_of(unet).text_tokens if seq_len is None else seq_len
    inputs = _example_values(unet, batch=batch, height=height, width=width, seq_len=seq_len, seed=seed,
                             device=device, dtype=dtype, frames=frames)
    inputs.family = family_of(unet)
    return inputs


def _example_values(unet: torch.nn.Module, *, batch: int, height: int, width: int, seq_len: int, seed: int,
                    device: str | torch.device, dtype: torch.dtype | None, frames: int | None) -> UNetInputs:
    if getattr(unet, "extra_inputs", None) == ("cond_lat", "noise"):
        if height % 24 or width % 16:
            raise ToMeModelError(
                f"height={height}, width={width}: a multi-view picture is 3 x 2 views of a "
                "multiple of 8 pixels each (height a multiple of 24, width of 16; Zero123++: 960 x 640)"
            )
        inputs = example_inputs(
            unet.unet,
            batch=batch,
            height=height,
            width=width,
            seq_len=seq_len,
            seed=seed,
            device=device,
            dtype=dtype,
        )
        g = torch.Generator().manual_seed(seed + 1)
        shape = (batch, unet.config.in_channels, height // 24, width // 16)
        inputs.cond_lat, inputs.noise = (torch.randn(shape, generator=g).to(device, inputs.sample.dtype)
                                         for _ in range(2))
        return inputs
    cfg = unet.config
    dtype = dtype or next(unet.parameters()).dtype
    scale = _spatial_scale(unet)
    if height % scale or width % scale:
        raise ToMeModelError(f"height={height}, width={width} must be multiples of {scale}")
    g = torch.Generator().manual_seed(seed)
    layout = video_layout(unet)
    if layout is not None:
        return _video_inputs(unet, layout, batch, frames or DEFAULT_FRAMES[layout], height // scale,
                             width // scale, seq_len, g, device, dtype)
    if family_of(unet).packed:
        return _packed_inputs(unet, batch, height // scale, width // scale, seq_len, g, device, dtype)
    sample = torch.randn(batch, cfg.in_channels, height // scale, width // scale, generator=g)
    if family_of(unet).name == "sd3":  # as StableDiffusion3Pipeline calls it: one timestep per image
        return UNetInputs(
            sample.to(device, dtype),
            torch.full((batch,), 999.0, device=device),
            torch.randn(batch, seq_len, cfg.joint_attention_dim, generator=g).to(device, dtype),
            dit=True,
            pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(device, dtype),
        )
    if is_dit(unet):  # as PixArtAlphaPipeline calls it: one timestep per image, T5 embeddings + mask
        ehs = torch.randn(batch, seq_len, cfg.caption_channels, generator=g)
        extra = getattr(unet, "use_additional_conditions", False)
        return UNetInputs(
            sample.to(device, dtype),
            torch.full((batch,), 999.0, device=device),
            ehs.to(device, dtype),
            dit=True,
            encoder_attention_mask=torch.ones(batch, seq_len, device=device, dtype=dtype),
            resolution=torch.tensor([[height, width]] * batch, device=device, dtype=dtype) if extra else None,
            aspect_ratio=torch.tensor([[height / width]] * batch, device=device, dtype=dtype)
            if extra
            else None,
        )
    ehs = torch.randn(batch, seq_len, cfg.cross_attention_dim, generator=g)
    inputs = UNetInputs(sample.to(device, dtype), torch.tensor(999, device=device),
                        ehs.to(device, dtype))
    if getattr(cfg, "addition_embed_type", None) == "text_time":
        text_dim = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        inputs.text_embeds = torch.randn(batch, text_dim, generator=g).to(device, dtype)
        inputs.time_ids = torch.tensor([[height, width, 0, 0, height, width]] * batch,
                                       dtype=dtype, device=device)
    if getattr(cfg, "time_cond_proj_dim", None):  # LCM: w-embedding of its guidance scale
        inputs.timestep_cond = torch.randn(batch, cfg.time_cond_proj_dim, generator=g).to(device, dtype)
    return inputs


def _packed_inputs(unet: torch.nn.Module, batch: int, h: int, w: int, seq_len: int, g: torch.Generator,
                   device: str | torch.device, dtype: torch.dtype) -> UNetInputs:
    """Flux, as FluxPipeline calls it: the packed latent ``[B, h * w, C]``, one timestep per image
    (``t / 1000``), T5 embeddings and the pooled CLIP one, the tokens' positions (row and column
    of each latent token; zeros for the text), and Flux.1-dev's guidance scale."""
    cfg = unet.config
    rows = torch.arange(h * w)
    ids = torch.stack([torch.zeros(h * w), rows // w, rows % w], dim=1)
    return UNetInputs(
        torch.randn(batch, h * w, cfg.in_channels, generator=g).to(device, dtype),
        torch.full((batch,), 1.0, device=device),
        torch.randn(batch, seq_len, cfg.joint_attention_dim, generator=g).to(device, dtype),
        dit=True,
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g).to(device, dtype),
        img_ids=ids.to(device, dtype), txt_ids=torch.zeros(seq_len, 3, device=device, dtype=dtype),
        guidance=torch.full((batch,), 3.5, device=device) if cfg.guidance_embeds else None,
        grid=(h, w),
    )


# AnimateDiff's pipelines default to 16 frames; SVD-XT to 25 (SVD: 14)
DEFAULT_FRAMES = {"BCFHW": 16, "BFCHW": 25}


def _video_inputs(unet: torch.nn.Module, layout: str, batch: int, frames: int, h: int, w: int, seq_len: int,
                  g: torch.Generator, device: str | torch.device, dtype: torch.dtype) -> UNetInputs:
    """AnimateDiff: ``[B, C, F, H, W]`` and the prompt embeddings repeated per frame (as
    ``AnimateDiffPipeline`` sends them); SVD: ``[B, F, C, H, W]``, one image embedding per video and
    ``added_time_ids``."""
    cfg = unet.config
    if frames < 1:
        raise ToMeModelError(f"frames={frames} must be >= 1")
    if layout == "BCFHW":
        sample = torch.randn(batch, cfg.in_channels, frames, h, w, generator=g)
        ehs = torch.randn(batch, seq_len, cfg.cross_attention_dim, generator=g).repeat_interleave(
            frames, dim=0
        )
        return UNetInputs(sample.to(device, dtype), torch.tensor(999, device=device), ehs.to(device, dtype))
    sample = torch.randn(batch, frames, cfg.in_channels, h, w, generator=g)
    ehs = torch.randn(batch, 1, cfg.cross_attention_dim, generator=g)
    ids = torch.tensor([[6.0, 127.0, 0.02]] * batch)  # SVD's defaults: fps 7 - 1, motion bucket 127
    return UNetInputs(sample.to(device, dtype), torch.tensor(999, device=device), ehs.to(device, dtype),
                      added_time_ids=ids.to(device, dtype))
