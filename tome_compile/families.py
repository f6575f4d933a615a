"""Model families and their inputs, described once: what each denoiser takes, under which name, along
which axis it grows with the batch, and how a caller of the diffusers signature passes it.

Everything that describes a family's inputs reads this table: the example inputs
(:func:`tome_compile.models.example_inputs`), the export's tracing and its dynamic axes, its
metadata, the parity check's batch-1 call, and ``ToMeSession``'s feeding and refusals. Adding an
input to a family is one line here (and its example value in ``models.example_inputs``).

    family = family_of(unet)            # ModelFamily("sdxl", ...)
    family.names        # ["sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["FAMILIES", "ModelFamily", "ModelInput", "family_of", "latent_multiple", "nested", "needs"]


def latent_multiple(unet: Any) -> int:
    """What a latent's height and width must be a multiple of for ``unet``: 2 per downsampling
    stage of a U-Net (SD 1.5 / 2.1 / SDXL: 8), the patch size of a DiT; 1 when unknown."""
    config = getattr(unet, "config", None)
    blocks = getattr(config, "down_block_types", None)
    if blocks:
        return 2 ** (len(blocks) - 1)
    return int(getattr(config, "patch_size", None) or 1)


@dataclass(frozen=True)
class ModelInput:
    """One input of a family's exported graph (named as Optimum names it).

    ``per_image``: axis 0 holds one row per image of the batch (a dynamic batch axis, the rows the
    parity check's batch-1 call keeps). ``passed``: how a caller of the diffusers signature passes
    it (said when it is missing). ``drawn``: ``ToMeSession`` draws it when not given. ``call``: its
    keyword in the model's ``forward``, dotted into a dict argument (``added_cond_kwargs.time_ids``);
    default ``name``."""

    name: str
    per_image: bool
    passed: str
    drawn: bool = False
    call: str = ""

    @property
    def keyword(self) -> str:
        return self.call or self.name


_SAMPLE = ModelInput("sample", True, "sample [B, C, H, W] (the latent)")
_TIMESTEP = ModelInput("timestep", False, "the timestep of the call (a number or a tensor)")
_TEXT = ModelInput("encoder_hidden_states", True, "encoder_hidden_states [B, L, D] (the text embeddings)")


@dataclass(frozen=True)
class ModelFamily:
    """A denoiser family: its inputs in graph order and how its calls are shaped.

    ``video_layout``: ``"BCFHW"`` (AnimateDiff) / ``"BFCHW"`` (SVD) for a video U-Net.
    ``dit``: a diffusion transformer (PixArt-α: the latent is ``hidden_states``, one timestep per
    image). ``dynamic_batch``: its export can take any batch (video and DiT exports keep theirs).
    """

    name: str
    inputs: tuple[ModelInput, ...]
    video_layout: str | None = None
    dit: bool = False
    multiview: bool = False
    dynamic_batch: bool = True
    # its export can take any image size and text length (symbolic height, width and text axis, as
    # Optimum's U-Net export): the image U-Nets; video, DiT and multi-view exports keep their size
    any_size: bool = False
    # the text tokens its pipeline sends (CLIP's 77; SD3: 77 CLIP + 256 T5): example inputs' default
    text_tokens: int = 77
    # its latent comes packed, ``[B, h * w, C]`` (Flux): the grid is given to the call
    # (:func:`tome_compile.packed.set_packed_grid`); ``scale``: image pixels per latent token
    packed: bool = False
    scale: int = 8

    @property
    def names(self) -> list[str]:
        return [i.name for i in self.inputs]

    @property
    def per_image(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs if i.per_image)

    @property
    def timestep(self) -> str:
        """The exported timestep input: one per call (Optimum's ``float32[1]``) or per image (DiT)."""
        return "float32[batch]" if self.dit else "float32[1]"

    @property
    def sdxl(self) -> bool:
        return "text_embeds" in self.names

    def with_inputs(self, name: str, *extra: ModelInput, **changes: Any) -> ModelFamily:
        from dataclasses import replace

        return replace(self, name=name, inputs=self.inputs + extra, **changes)


UNET = ModelFamily("unet", (_SAMPLE, _TIMESTEP, _TEXT), any_size=True)
SDXL = UNET.with_inputs(
    "sdxl",
    ModelInput("text_embeds", True, "added_cond_kwargs['text_embeds'] (SDXL's pooled text embedding)",
               call="added_cond_kwargs.text_embeds"),
    ModelInput("time_ids", True, "added_cond_kwargs['time_ids'] (SDXL's size and crop conditioning)",
               call="added_cond_kwargs.time_ids"),
)
LCM = UNET.with_inputs(  # a U-Net distilled with its guidance scale as an input (LCM: time_cond_proj_dim)
    "lcm", ModelInput("timestep_cond", True, "timestep_cond [B, D] (LCM's guidance-scale embedding)"),
)
ANIMATEDIFF = ModelFamily("animatediff", (_SAMPLE, _TIMESTEP, _TEXT), video_layout="BCFHW",
                          dynamic_batch=False)  # any_size: not built yet (frames symbolic too)
SVD = ModelFamily("svd", (_SAMPLE, _TIMESTEP, _TEXT, ModelInput(
    "added_time_ids", True, "added_time_ids (SVD: fps, motion bucket, noise augmentation per video)")),
    video_layout="BFCHW", dynamic_batch=False)
_LATENT = ModelInput("sample", True, "hidden_states [B, C, H, W] (the latent)", call="hidden_states")
PIXART = ModelFamily("pixart", (_LATENT, _TIMESTEP, _TEXT, ModelInput(
    "encoder_attention_mask", True, "encoder_attention_mask [B, L] (the text mask)", drawn=True)),
    dit=True, dynamic_batch=False)
PIXART_SIZED = PIXART.with_inputs(  # PixArt-α 1024: resolution and aspect-ratio conditions
    "pixart-sized",
    ModelInput("resolution", True, "added_cond_kwargs['resolution'] (PixArt-α 1024)",
               call="added_cond_kwargs.resolution"),
    ModelInput("aspect_ratio", True, "added_cond_kwargs['aspect_ratio'] (PixArt-α 1024)",
               call="added_cond_kwargs.aspect_ratio"),
)
SD3 = ModelFamily("sd3", (_LATENT, _TIMESTEP, _TEXT, ModelInput(
    "pooled_projections", True, "pooled_projections [B, D] (SD3's pooled text embedding)")),
    dit=True, dynamic_batch=False, text_tokens=333, any_size=True)  # keeps its batch, as PixArt's
FLUX = ModelFamily("flux", (
    ModelInput("sample", True, "hidden_states [B, h * w, C] (the packed latent)", call="hidden_states"),
    _TIMESTEP, _TEXT,
    ModelInput("pooled_projections", True, "pooled_projections [B, D] (Flux's pooled CLIP embedding)"),
    ModelInput("img_ids", False, "img_ids [h * w, 3] (the latent tokens' positions)"),
    ModelInput("txt_ids", False, "txt_ids [L, 3] (the text tokens' positions)")),
    dit=True, dynamic_batch=False, text_tokens=512, packed=True, scale=16)
FLUX_DEV = FLUX.with_inputs(  # guidance-distilled (Flux.1-dev): the guidance scale is an input
    "flux-dev", ModelInput("guidance", True, "guidance [B] (Flux.1-dev's distilled guidance scale)"))
MULTIVIEW = UNET.with_inputs(  # Zero123++'s two-pass wrapper around its U-Net
    "multiview",
    ModelInput("cond_lat", True, "cross_attention_kwargs={'cond_lat': ...} (multi-view: the condition "
               "view's latent)"),
    ModelInput("noise", True, "the condition latent's noise (drawn as the wrapper draws it)", drawn=True),
    multiview=True, any_size=False,  # any size: not built yet (the condition latent's size too)
)
FAMILIES = (UNET, SDXL, LCM, ANIMATEDIFF, SVD, PIXART, PIXART_SIZED, SD3, FLUX, FLUX_DEV, MULTIVIEW)


def family_of(model: Any) -> ModelFamily:
    """The family of a diffusers denoiser (or of the multi-view export wrapper)."""
    if getattr(model, "extra_inputs", None) == ("cond_lat", "noise"):
        return MULTIVIEW
    kind = type(model).__name__
    if kind == "PixArtTransformer2DModel":
        return PIXART_SIZED if getattr(model, "use_additional_conditions", False) else PIXART
    if kind == "SD3Transformer2DModel":
        return SD3
    if kind == "FluxTransformer2DModel":
        return FLUX_DEV if getattr(getattr(model, "config", None), "guidance_embeds", False) else FLUX
    if kind == "UNetMotionModel":
        return ANIMATEDIFF
    if kind == "UNetSpatioTemporalConditionModel":
        return SVD
    if getattr(getattr(model, "config", None), "addition_embed_type", None) == "text_time":
        return SDXL
    if getattr(getattr(model, "config", None), "time_cond_proj_dim", None):
        return LCM
    return UNET


def needs(name: str) -> str:
    """How a caller passes input ``name`` (the first family that has it), for a one-line refusal."""
    return next((i.passed for f in FAMILIES for i in f.inputs if i.name == name), name)


def nested(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``[("sample", x), ("added_cond_kwargs.time_ids", t)]`` -> ``{"sample": x, "added_cond_kwargs":
    {"time_ids": t}}``: a family's inputs as ``forward`` keywords (or any per-input value so placed,
    such as ``torch.export``'s dynamic shapes), in the given order."""
    out: dict[str, Any] = {}
    for path, value in pairs:
        *outer, last = path.split(".")
        level = out
        for key in outer:
            level = level.setdefault(key, {})
        level[last] = value
    return out
