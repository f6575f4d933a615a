"""Tiny U-Nets that keep diffusers' real module paths (down_blocks.0.attentions.0...attn1)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tome_compile.models import build_unet, example_inputs

# Under pytest-xdist (pyproject's addopts: two workers on the CI's two cores) each worker computes
# with one thread: two workers of two threads each would fight over the cores.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("TOME_TEST_THREADS", "1") != "0":
    torch.set_num_threads(int(os.environ.get("TOME_TEST_THREADS", "1")))

# The files that convert ONNX exports or start servers, heaviest first (measured: --durations in a CI
# run). pytest-xdist hands whole files (--dist loadfile) to the two workers in collection order; the
# long files first and the many short ones last keeps both workers busy to the end (longest job
# first), where alphabetical order left one worker on the last export-heavy files alone.
HEAVY_FIRST = ["test_export_forms.py", "test_export_cli.py", "test_export.py", "test_serve.py",
               "test_video.py", "test_share_plan.py", "test_zero123.py", "test_shapes.py", "test_todo.py",
               "test_call_state.py", "test_joint.py", "test_bench.py"]


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order kept


TINY_SD15: dict[str, Any] = dict(
    sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=1, cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
)
# SD 2.x: linear projections in/out of the transformer, a head dim per block.
TINY_SD2: dict[str, Any] = dict(
    sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64, 64),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=1, cross_attention_dim=24, attention_head_dim=(2, 4, 4), norm_num_groups=8,
    use_linear_projection=True,
)
# SDXL: no attention at full resolution, several transformer layers per block, text_time embeds.
TINY_SDXL: dict[str, Any] = dict(
    sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64, 64),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    layers_per_block=1, transformer_layers_per_block=(1, 2, 2), cross_attention_dim=32,
    attention_head_dim=(2, 4, 4), norm_num_groups=8, use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=16 + 6 * 8,
)
TINY = {"sd15": TINY_SD15, "sd2": TINY_SD2, "sdxl": TINY_SDXL}
# Video U-Nets with diffusers' module paths: AnimateDiff (motion modules after each spatial
# attention) and SVD (spatial + temporal_transformer_blocks in each attention).
TINY_ANIMATEDIFF: dict[str, Any] = dict(
    sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
    up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"),
    layers_per_block=1, cross_attention_dim=32, num_attention_heads=4, norm_num_groups=8,
    motion_max_seq_length=8, motion_num_attention_heads=2,
)
TINY_SVD: dict[str, Any] = dict(
    sample_size=16, in_channels=8, out_channels=4, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
    up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
    layers_per_block=1, cross_attention_dim=32, num_attention_heads=(2, 4), addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=24,
)


# PixArt-α's DiT (adaLN-single blocks, patch 2): a 16 x 16 latent is an 8 x 8 token grid.
TINY_PIXART: dict[str, Any] = dict(
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=4,
    out_channels=8,
    num_layers=4,
    cross_attention_dim=16,
    sample_size=16,
    patch_size=2,
    norm_type="ada_norm_single",
    caption_channels=32,
    attention_bias=True,
    activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000,
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    use_additional_conditions=False,
)


def tiny_pixart(seed: int = 0) -> torch.nn.Module:
    from diffusers import PixArtTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PixArtTransformer2DModel(**TINY_PIXART).eval()


def tiny_pixart_inputs(batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(latent, kwargs)`` as ``PixArtAlphaPipeline`` calls the transformer (a timestep per image)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, 16, 16, generator=g), {
        "encoder_hidden_states": torch.randn(batch, 7, 32, generator=g),
        "timestep": torch.tensor([999] * batch),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
    }


def tiny_video_unet(kind: str, seed: int = 0) -> torch.nn.Module:
    from diffusers import UNetMotionModel, UNetSpatioTemporalConditionModel

    cls, config = {
        "animatediff": (UNetMotionModel, TINY_ANIMATEDIFF),
        "svd": (UNetSpatioTemporalConditionModel, TINY_SVD),
    }[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(**config).eval()


def tiny_video_inputs(kind: str, batch: int = 2, frames: int = 3, hw: tuple[int, int] = (16, 16),
                      seed: int = 0) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(sample, kwargs)`` as the video pipelines call the U-Net: AnimateDiff ``[B, C, F, H, W]``
    with the prompt embeddings repeated per frame; SVD ``[B, F, 8, H, W]`` with one image
    embedding per video and ``added_time_ids``."""
    g = torch.Generator().manual_seed(seed)
    if kind == "animatediff":
        sample = torch.randn(batch, 4, frames, *hw, generator=g)
        ehs = torch.randn(batch, 7, 32, generator=g).repeat_interleave(frames, dim=0)
        return sample, {"timestep": torch.tensor(999), "encoder_hidden_states": ehs}
    sample = torch.randn(batch, frames, 8, *hw, generator=g)
    return sample, {
        "timestep": torch.tensor(999),
        "encoder_hidden_states": torch.randn(batch, 1, 32, generator=g),
        "added_time_ids": torch.tensor([[6.0, 127.0, 0.02]] * batch),
    }


def tiny_vae() -> torch.nn.Module:
    """A one-level VAE (scale factor 1: a 16 x 16 image is a 16 x 16 latent)."""
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                             up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=8,
                             sample_size=16).eval()


def tiny_pipeline(cls: Any, unet: torch.nn.Module, scheduler: Any = None) -> Any:
    """A diffusers image pipeline of class ``cls`` on ``unet`` that takes prompt embeddings (no
    text encoder), with its progress bar off."""
    from diffusers import DDIMScheduler

    pipe = cls(vae=tiny_vae(), text_encoder=None, tokenizer=None, unet=unet,
               scheduler=scheduler if scheduler is not None else DDIMScheduler(), safety_checker=None,
               feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_pipeline_folder(folder: Any) -> Any:
    """A saved diffusers text-to-image pipeline with a tiny CLIP tokenizer and text encoder (letters as
    tokens), U-Net and VAE: what a user's local pipeline folder is, with no download."""
    import json
    import string

    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in string.ascii_lowercase:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=8)
    torch.manual_seed(0)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=37,
                                        num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=8,
                                        bos_token_id=0, eos_token_id=1, pad_token_id=1))
    unet = UNet2DConditionModel(sample_size=8, block_out_channels=(32, 64), layers_per_block=1,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                                attention_head_dim=2, norm_num_groups=8)
    vae = AutoencoderKL(
        block_out_channels=(8,),
        down_block_types=("DownEncoderBlock2D",),
        up_block_types=("UpDecoderBlock2D",),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=8,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=text,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=DDIMScheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder / "pipe")
    return folder / "pipe"


def tiny_unet(kind: str = "sd15", seed: int = 0) -> torch.nn.Module:
    return build_unet(dict(TINY[kind]), seed=seed)


def tiny_inputs(unet: torch.nn.Module, batch: int = 2, hw: tuple[int, int] = (16, 16), seed: int = 0):
    """Inputs for a latent of ``hw`` (the tiny models are latent-space: image = 8 × latent)."""
    return example_inputs(unet, batch=batch, height=hw[0] * 8, width=hw[1] * 8, seq_len=7, seed=seed)


def call(model: Callable[..., Any], inputs: Any) -> torch.Tensor:
    kwargs = inputs.kwargs()
    sample = kwargs.pop("sample")  # positional: tomesd's pre-hook reads args[0]
    with torch.no_grad():
        return model(sample, **kwargs).sample


def compiled(model: torch.nn.Module, **options: Any) -> tuple[Callable[..., Any], Any]:
    """``torch.compile`` of a copy with a fresh ToMe backend (eager inner compiler unless given)."""
    from tome_compile import tome_backend

    backend = tome_backend(compiler=options.pop("compiler", "eager"), **options)
    return torch.compile(copy.deepcopy(model), backend=backend, fullgraph=True), backend


def run(model: Callable[..., Any], sample: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    """``model(sample, **kwargs).sample`` without grad (video U-Nets, PixArt: their own call forms)."""
    with torch.no_grad():
        return model(sample, **kwargs).sample


def tomesd_reference(unet: torch.nn.Module, seed: int | None = None, **options: Any) -> torch.nn.Module:
    """tomesd.apply_patch on a copy: the reference oracle. ``seed`` seeds its generator."""
    import tomesd

    ref = copy.deepcopy(unet)
    tomesd.apply_patch(ref, **options)
    if seed is not None:
        ref._tome_info["args"]["generator"] = torch.Generator().manual_seed(seed)
    return ref


class GraphCapture:
    """A backend that records the Dynamo graph (and example inputs) it is given."""

    def __init__(self) -> None:
        self.graphs: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs.append((gm, list(example_inputs)))
        return gm.forward


class CountingCompiler:
    """Inner compiler that counts how often it is asked to compile (= Dynamo graphs)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.calls += 1
        return gm.forward


@pytest.fixture(scope="module")
def sd15():
    """The tiny SD 1.5-like U-Net and inputs for its 16 x 16 latent (256 tokens at the top)."""
    unet = tiny_unet("sd15")
    return unet, tiny_inputs(unet)


def dynamo_graph(unet: torch.nn.Module, inputs: Any) -> torch.fx.GraphModule:
    """The Dynamo graph of ``unet`` on ``inputs``; ``gm.graph_args`` are its (real) arguments."""
    torch._dynamo.reset()
    capture = GraphCapture()
    compiled = torch.compile(unet, backend=capture, fullgraph=True)
    call(compiled, inputs)
    gm, args = capture.graphs[0]
    copied = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    copied.graph_args = args  # type: ignore[attr-defined]
    return copied


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def unet(sd15):
    return sd15[0]


@pytest.fixture(scope="module")
def sd15_folder(tmp_path_factory, unet):
    folder = tmp_path_factory.mktemp("tiny_sd15")
    unet.save_pretrained(folder)
    return folder
