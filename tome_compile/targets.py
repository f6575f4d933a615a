"""What ``tome-demo`` and a ``tome-serve`` replica generate with: a denoiser to compile and a
sampler that takes any U-Net callable — from the shipped shapes model, a shapes-model folder, a
local diffusers pipeline folder or a U-Net folder with the shapes model's interface.

    target = load_target(None)                          # the shipped shapes model
    images = target.sample(unet, ["red circle"], [0], steps=12, guidance_scale=2.5)

The neutral loader below the demo and the server: neither imports the other's command module.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tome_compile.errors import ToMeModelError

__all__ = ["Target", "load_target"]


@dataclass
class Target:
    """What the demo (and a ``tome-serve`` replica) generates with: a U-Net to compile and a sampler
    that takes any U-Net callable: ``sample(unet, prompts, seeds, steps, guidance_scale, size=None)``."""

    name: str
    unet: torch.nn.Module
    sample: Callable[..., torch.Tensor]  # -> [N, 3, H, W] in [0, 1]
    shapes_prompts: bool  # prompts are "<colour> <shape>" and the probe can score the pictures
    size: int = 32  # the picture size it makes by default (its sampler's size=None)


def load_target(model: str | None, size: int | None = None, device: str = "cpu") -> Target:
    """The shipped shapes model, a shapes-model folder, a diffusers pipeline folder
    (``model_index.json``) or a diffusers U-Net folder with the shapes model's interface, on
    ``device``."""
    from tome_compile.shapes.model import SHIPPED_WEIGHTS, load_model
    from tome_compile.shapes.sample import generate

    folder = Path(model) if model else SHIPPED_WEIGHTS
    if not folder.exists():
        raise ToMeModelError(
            f"--model {str(folder)!r} does not exist; give a shapes-model folder, a diffusers "
            "pipeline folder (with model_index.json) or a U-Net folder (config.json)"
        )
    if (folder / "model_index.json").is_file():
        return _pipeline_target(folder, size, device)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("_class_name") == "UNet2DConditionModel":
        from diffusers import UNet2DConditionModel

        interface = {"in_channels": 3, "out_channels": 3, "sample_size": 32, "cross_attention_dim": 64}
        wrong = {k: config.get(k) for k, v in interface.items() if config.get(k) != v}
        if wrong:
            raise ToMeModelError(
                f"U-Net {str(folder)!r} has {wrong}, not the shapes model's {interface}: a U-Net "
                "alone cannot make pictures without its text encoder and VAE; give the pipeline "
                "folder (the one with model_index.json) instead"
            )
        shapes = load_model()  # the shipped prompt encoder
        shapes.unet = UNet2DConditionModel.from_pretrained(folder, local_files_only=True).eval()
    else:
        shapes = load_model(folder)
    def sample(unet: Any, prompts: list[str], seeds: list[int], steps: int, guidance_scale: float,
               size: int | None = None) -> torch.Tensor:
        return generate(shapes, prompts, seeds, steps=steps, guidance_scale=guidance_scale, unet=unet,
                        size=size or 32)

    return Target(str(folder) if model else "shipped shapes model", shapes.unet, sample, True)


def _pipeline_target(folder: Path, size: int | None, device: str = "cpu") -> Target:
    from diffusers import DiffusionPipeline

    try:
        pipe = DiffusionPipeline.from_pretrained(folder, local_files_only=True, safety_checker=None)
    except Exception as e:  # diffusers raises many types for a broken folder
        raise ToMeModelError(
            f"could not load the diffusers pipeline in {str(folder)!r} ({type(e).__name__}: "
            f"{e}); check that every component named in model_index.json is saved there"
        ) from e
    if not hasattr(pipe, "unet"):
        raise ToMeModelError(
            f"pipeline {type(pipe).__name__} in {str(folder)!r} has no .unet to merge tokens in"
        )
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    original = pipe.unet

    @torch.no_grad()
    def sample(unet: Any, prompts: list[str], seeds: list[int], steps: int, guidance_scale: float,
               size: int | None = None) -> torch.Tensor:
        from tome_compile.state import generation

        pipe.unet = unet
        try:
            side = size or default
            with generation(guidance="cfg" if guidance_scale > 1 else "none"):  # the pipeline's batches
                out = pipe(
                    prompt=prompts,
                    num_inference_steps=steps,
                    guidance_scale=guidance_scale,
                    height=side,
                    width=side,
                    generator=[torch.Generator().manual_seed(s) for s in seeds],
                    output_type="pt",
                )
        finally:
            pipe.unet = original
        return out.images.float().clamp(0, 1)

    default = size or int(original.config.sample_size) * int(getattr(pipe, "vae_scale_factor", 8))
    return Target(str(folder), original, sample, False, size=default)
