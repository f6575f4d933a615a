"""The project's own small text-to-image model: a pixel-space diffusers U-Net on 32x32 shapes.

The top-resolution blocks have self-attention over 32 x 32 = 1024 tokens (where ToMe works),
conditioned through cross-attention on two embedded prompt words; ``"<null> <null>"`` is the
empty prompt for classifier-free guidance. Weights load from a folder (safetensors + config),
never from a hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tome_compile.shapes.data import VOCAB, tokenize

__all__ = [
    "SHIPPED_WEIGHTS",
    "UNET_CONFIG",
    "PromptEncoder",
    "ShapesModel",
    "build_model",
    "load_model",
    "save_model",
]

SHIPPED_WEIGHTS = Path(__file__).parent / "weights"  # the model and probe that ship with the package

UNET_CONFIG: dict[str, Any] = {
    "sample_size": 32, "in_channels": 3, "out_channels": 3,
    "block_out_channels": (32, 64, 96), "layers_per_block": 1,
    "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 64, "attention_head_dim": (1, 2, 3), "norm_num_groups": 8,
}


class PromptEncoder(torch.nn.Module):
    """Two word ids -> ``[B, 2, 64]`` (word embedding + position embedding)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.words = torch.nn.Embedding(len(VOCAB), dim)
        self.position = torch.nn.Parameter(torch.zeros(2, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.words(ids) + self.position

    def encode(self, prompts: list[str]) -> torch.Tensor:
        ids = torch.tensor([tokenize(p) for p in prompts], device=self.position.device)
        return self(ids)


class ShapesModel(torch.nn.Module):
    def __init__(self, unet: torch.nn.Module, text: PromptEncoder) -> None:
        super().__init__()
        self.unet, self.text = unet, text


def build_model(seed: int = 0) -> ShapesModel:
    from diffusers import UNet2DConditionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ShapesModel(
            UNet2DConditionModel(**UNET_CONFIG), PromptEncoder(UNET_CONFIG["cross_attention_dim"])
        )


def save_model(model: ShapesModel, folder: str | Path, meta: dict[str, Any] | None = None) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"unet": UNET_CONFIG, "vocab": list(VOCAB),
                                                    **(meta or {})}, indent=1, default=list))


def load_model(folder: str | Path | None = None) -> ShapesModel:
    """The model in ``folder`` (written by ``save_model`` / the training command); the one shipped
    with the package when ``None``. Never touches the network."""
    from safetensors.torch import load_file

    from tome_compile.errors import ToMeModelError

    folder = SHIPPED_WEIGHTS if folder is None else Path(folder)
    if not (folder / "model.safetensors").is_file():
        raise ToMeModelError(f"{str(folder)!r} has no model.safetensors: give a folder written by "
                             "python -m tome_compile.shapes.train")
    model = build_model()
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    return model.eval()
