"""A tiny Zero123++-like multi-view model (the wrapper of :mod:`tome_compile.multiview` around a
tiny SD 2-style U-Net with diffusers' module paths): six 2 x 3-tiled views of 4 x 4 latents.

And the loop reference the tests hold the compiled wrapper to (:func:`tomesd_reference`): tomesd's
merge applied to the view tokens of each read-mode ``attn1`` — tomesd patches the blocks, so
``attn1`` gets the merged tokens and the processor appends the reference whole — with tomesd off
for the write pass (its inputs are the reference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tome_compile.multiview import RefOnlyNoisedUNet, build_zero123

# SD 2-style (linear projections, a head dim per block); the views are 4 x 4 latents: the sample
# is 3 rows x 2 columns of views = 12 x 8, the condition latent one view, 4 x 4.
TINY_ZERO123: dict[str, Any] = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=1,
    cross_attention_dim=24,
    attention_head_dim=(2, 4),
    norm_num_groups=8,
    use_linear_projection=True,
)


def tiny_zero123(seed: int = 0) -> RefOnlyNoisedUNet:
    from diffusers import UNet2DConditionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**TINY_ZERO123).eval()
    return build_zero123(unet, steps=4)


def tiny_zero123_inputs(batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(sample, kwargs)`` as the pipeline calls the wrapper: the tiled views' latent [B, 4, 12, 8],
    the text/image embeddings and the condition latent (its CFG row: a blank image's)."""
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 4, 12, 8, generator=g)
    return sample, {"encoder_hidden_states": torch.randn(batch, 7, 24, generator=g),
                    "cross_attention_kwargs": {"cond_lat": torch.randn(batch, 4, 4, 4, generator=g)}}


class _TomesdReadOnly(torch.nn.Module):
    """A wrapper (ours or Zero123++'s own) with tomesd patched into its U-Net, merging in the read
    pass only: the first U-Net call of each wrapper call is the write pass."""

    def __init__(self, wrapper: torch.nn.Module) -> None:
        super().__init__()
        self.wrapper = wrapper

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        unet = self.wrapper.unet
        options = unet._tome_info["args"]
        ratio, calls = options["ratio"], []
        original = unet.forward

        def forward(*a: Any, **k: Any) -> Any:
            options["ratio"] = 0.0 if not calls else ratio
            calls.append(1)
            return original(*a, **k)

        unet.forward = forward
        try:
            return self.wrapper(*args, **kwargs)
        finally:
            del unet.forward
            options["ratio"] = ratio


def tomesd_reference(wrapper: torch.nn.Module, **options: Any) -> _TomesdReadOnly:
    """A copy of ``wrapper`` whose read pass runs tomesd (``tomesd.apply_patch(unet, **options)``)."""
    import copy

    import tomesd

    ref = copy.deepcopy(wrapper)
    tomesd.apply_patch(ref.unet, **options)
    return _TomesdReadOnly(ref).eval()


ZERO123PLUS = Path(__file__).resolve().parents[2] / "shared" / "third_party" / "zero123plus" / "pipeline.py"


def zero123plus_module() -> Any:
    """Zero123++'s own pipeline file (``../shared/third_party/zero123plus/pipeline.py``, unchanged),
    imported, or None where the clone has no ``../shared``. It imports ``torchvision`` for a depth
    transform the tests never run: without torchvision, a stand-in namespace takes its place."""
    import importlib.machinery
    import importlib.util
    import sys
    import types

    if not ZERO123PLUS.is_file():
        return None
    if "zero123plus_pipeline" in sys.modules:
        return sys.modules["zero123plus_pipeline"]
    if importlib.util.find_spec("torchvision") is None and "torchvision" not in sys.modules:
        import diffusers  # noqa: F401 - its optional-package checks see the real environment first
        import transformers  # noqa: F401

        stand_in = types.ModuleType("torchvision")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
        stand_in.transforms = types.SimpleNamespace(Compose=lambda steps: steps, ToTensor=lambda: None,
                                                    Normalize=lambda *a, **k: None)
        sys.modules["torchvision"] = stand_in
    spec = importlib.util.spec_from_file_location("zero123plus_pipeline", ZERO123PLUS)
    module = importlib.util.module_from_spec(spec)
    sys.modules["zero123plus_pipeline"] = module
    spec.loader.exec_module(module)
    return module


def tiny_zero123plus(seed: int = 0) -> torch.nn.Module:
    """Zero123++'s own ``RefOnlyNoisedUNet`` around the tiny U-Net, with the schedulers its
    ``prepare()`` builds (a DDPM training scheduler of the pipeline scheduler's config)."""
    from diffusers import DDPMScheduler, EulerAncestralDiscreteScheduler, UNet2DConditionModel

    module = zero123plus_module()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(**TINY_ZERO123).eval()
    val = EulerAncestralDiscreteScheduler(timestep_spacing="trailing")
    val.set_timesteps(4)
    return module.RefOnlyNoisedUNet(unet, DDPMScheduler.from_config(val.config), val).eval()


def cfg_inputs(inputs: tuple[torch.Tensor, dict[str, Any]]) -> tuple[torch.Tensor, dict[str, Any]]:
    """The call with ``is_cfg_guidance``: row 0 (unconditional) reads no reference, so the
    condition latent and the write pass have the other rows only; class labels given, as the
    wrapper slices them."""
    sample, kwargs = inputs
    cak = dict(kwargs["cross_attention_kwargs"])
    cak["cond_lat"] = cak["cond_lat"][1:]
    cak["is_cfg_guidance"] = True
    return sample, {**kwargs, "cross_attention_kwargs": cak, "class_labels": torch.zeros(sample.shape[0])}
