"""A tiny Zero123++-like multi-view model (the wrapper of :mod:`tome_compile.multiview` around a
tiny SD 2-style U-Net with diffusers' module paths): six 2 x 3-tiled views of 4 x 4 latents.

And the loop reference the tests hold the compiled wrapper to (:func:`tomesd_reference`): tomesd's
merge applied to the view tokens of each read-mode ``attn1`` — tomesd patches the blocks, so
``attn1`` gets the merged tokens and the processor appends the reference whole — with tomesd off
for the write pass (its inputs are the reference).
"""

from __future__ import annotations

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


class _TomesdReadOnly(RefOnlyNoisedUNet):
    """The wrapper with tomesd patched into its U-Net, merging in the read pass only."""

    def forward(
        self,
        sample: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        class_labels: torch.Tensor | None = None,
        *,
        cross_attention_kwargs: dict,
        **kwargs: Any,
    ) -> Any:
        args = self.unet._tome_info["args"]
        ratio, calls = args["ratio"], []
        original = self.unet.forward

        def forward(*a: Any, **k: Any) -> Any:  # the first U-Net call of each wrapper call: the write pass
            args["ratio"] = 0.0 if not calls else ratio
            calls.append(1)
            return original(*a, **k)

        self.unet.forward = forward
        try:
            return super().forward(sample, timestep, encoder_hidden_states, class_labels,
                                   cross_attention_kwargs=cross_attention_kwargs, **kwargs)
        finally:
            self.unet.forward = original
            args["ratio"] = ratio


def tomesd_reference(wrapper: RefOnlyNoisedUNet, **options: Any) -> RefOnlyNoisedUNet:
    """A copy of ``wrapper`` whose read pass runs tomesd (``tomesd.apply_patch(unet, **options)``)."""
    import copy

    import tomesd

    unet = copy.deepcopy(wrapper.unet)
    tomesd.apply_patch(unet, **options)
    ref = _TomesdReadOnly.__new__(_TomesdReadOnly)
    torch.nn.Module.__init__(ref)
    ref.unet, ref.train_sched, ref.val_sched = (
        unet,
        copy.deepcopy(wrapper.train_sched),
        copy.deepcopy(wrapper.val_sched),
    )
    return ref.eval()
