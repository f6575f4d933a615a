"""Which rows of a U-Net batch belong together: the guidance layout, known rather than assumed.

A classifier-free-guidance pipeline stacks the branches of its guidance along the batch, one
chunk per branch, the images of the call in the same order inside every chunk:

* ``"cfg"`` — ``[uncond; cond]`` (Stable Diffusion, SDXL, PixArt, AnimateDiff, SVD, ...);
* ``"pix2pix"`` — ``[text; image; uncond]`` (``StableDiffusionInstructPix2PixPipeline``);
* ``"pag"`` — ``[uncond; cond; perturbed]`` (diffusers' perturbed-attention-guidance pipelines);
* ``"none"`` — every row its own image (no guidance in the batch).

Image ``i`` of a batch of ``B = groups * P`` rows owns rows ``i, P + i, ...``. Importance merging
ranks the tokens by the guidance magnitude of two of the chunks, ``|eps_a - eps_b|`` (symmetric:
the order of the pair does not matter), and gives every row of an image the same partition.
``"auto"`` (default) reads ``"cfg"`` from an even batch and ``"none"`` from an odd one. Classifier-free
guidance is by far the most common layout, so a batch of 6 or 12 is read as 3 or 6 CFG pairs (three
pictures with CFG is an everyday batch). The pipelines that stack three chunks are known:
:func:`tome_compile.apply` names their layout itself (``"pix2pix"``, ``"pag"``), and a caller of a bare
``torch.compile`` who runs one says so with ``guidance=`` (or ``generation(guidance=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GUIDANCE", "GuidanceLayout", "importance_map", "random_destinations", "resolve_guidance"]


@dataclass(frozen=True)
class GuidanceLayout:
    """``groups`` chunks along the batch; the importance map is ``|chunk[a] - chunk[b]|``."""

    name: str
    groups: int
    a: int = 0
    b: int = 1

    def images(self, batch: int) -> int:
        """Images (CFG pairs / guidance groups) in a batch of ``batch`` rows."""
        return batch // self.groups


GUIDANCE: dict[str, GuidanceLayout | None] = {
    "auto": None,
    "cfg": GuidanceLayout("cfg", 2, 0, 1),
    "pix2pix": GuidanceLayout("pix2pix", 3, 0, 2),
    "pag": GuidanceLayout("pag", 3, 0, 1),
    "none": GuidanceLayout("none", 1, 0, 0),
}


def resolve_guidance(name: str, batch: int | None) -> GuidanceLayout | str:
    """The layout of a batch of ``batch`` samples (videos for a video U-Net), or why importance
    merging cannot pair its rows (one line for the report and the warning)."""
    if batch is None:
        return "the batch size is not known when the graph is rewritten"
    if name == "auto":
        layout = GUIDANCE["none"] if batch % 2 == 1 else GUIDANCE["cfg"]
    else:
        layout = GUIDANCE[name]
    assert layout is not None
    if layout.groups == 1:
        return f"a batch of {batch} holds no pair of guidance rows (guidance={name!r})"
    if batch % layout.groups or batch == 0:
        return f"a batch of {batch} is not {layout.groups} guidance chunks (guidance={layout.name!r})"
    return layout


def importance_map(eps: torch.Tensor, layout: GuidanceLayout | None = None, channel_axis: int = 1,
                   channels: int | None = None) -> torch.Tensor:
    """``[G*P, C, H, W] -> [P, H, W]``: mean over channels of ``|eps_a - eps_b|`` (the two guidance
    chunks of ``layout``, default ``[uncond; cond]``).

    A video output (``[G*P, C, F, H, W]``, AnimateDiff; ``[G*P, F, C, H, W]`` with
    ``channel_axis=2``, SVD) gives ``[P*F, H, W]``: one map per frame, in the order the U-Net
    folds frames into its batch (``b * F + f``), which is the order of its attention rows.
    ``channels``: use only the first ones (an output of ``[eps; variance]``, PixArt)."""
    layout = layout or GUIDANCE["cfg"]
    assert layout is not None
    p = eps.shape[0] // layout.groups
    if channels is not None:
        eps = eps.narrow(channel_axis, 0, channels)
    diff = (eps[layout.a * p:(layout.a + 1) * p] - eps[layout.b * p:(layout.b + 1) * p]).abs().float()
    diff = diff.mean(dim=channel_axis)
    return diff.reshape(-1, *diff.shape[-2:])


def random_destinations(use_rand: bool, samples: int | None) -> bool:
    """tomesd's rule: random destinations only for an even batch of samples. An odd batch cannot
    hold CFG pairs — a pipeline that runs the uncond and cond halves as two calls would draw two
    partitions for one image — so it takes every cell's first token. The backend compiles an odd
    batch without a partition input; ``ToMeSession`` feeds a dynamic-batch export those fixed
    destinations: the two stay equal call by call."""
    return use_rand and (samples is None or samples % 2 == 0)
