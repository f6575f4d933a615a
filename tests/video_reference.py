"""References for ToMe on video U-Nets and DiTs, written from the spec rather than from our code.

* :func:`per_frame_tome` — each full-resolution spatial self-attention merges the tokens of each
  frame on its own (a Python loop over the ``B x F`` rows): tomesd's fixed destinations (the top
  left token of every ``sy x sx`` cell), each source's most similar destination by the cosine of
  the block input, the ``r`` best-scoring sources merged into their destination (plain mean),
  attention on the merged tokens, every token given its group's output. With ``cross=True`` the
  block's cross-attention runs on the same groups (its queries merged, the text untouched), and
  ``patch`` turns the latent into a DiT's token grid (PixArt).
* :func:`tomesd_per_frame` — ``tomesd.apply_patch`` with the two things it gets wrong on a video
  U-Net put right: its size hook reads ``sample.shape[2:4]`` (frames x height for AnimateDiff,
  frames x channels for SVD), and it patches every ``BasicTransformerBlock``, AnimateDiff's motion
  modules included (tokens = frames).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch

SPATIAL = re.compile(r"attentions\.\d+\.transformer_blocks\.\d+$")


def _groups(metric: torch.Tensor, h: int, w: int, r: int, sx: int = 2, sy: int = 2) -> list[list[int]]:
    """Token groups of one frame: each merged destination with its sources, every other token alone."""
    dst = [y * sy * w + x * sx for y in range(h // sy) for x in range(w // sx)]
    dst_set = set(dst)
    src = [t for t in range(h * w) if t not in dst_set]
    unit = metric / metric.norm(dim=-1, keepdim=True)
    sims = unit[src] @ unit[dst].T  # [Ns, Nd]
    score, best = sims.max(dim=-1)
    order = sorted(range(len(src)), key=lambda i: (-float(score[i]), i))
    merged = set(order[:r])
    groups = {d: [d] for d in dst}
    alone = []
    for i, s in enumerate(src):
        if i in merged:
            groups[dst[int(best[i])]].append(s)
        else:
            alone.append([s])
    return alone + list(groups.values())


class _PerFrameAttention(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module, block: torch.nn.Module, hw: list[tuple[int, int]], ratio: float,
                 patch: int = 1):
        super().__init__()
        self.attn, self.block, self.hw, self.ratio, self.patch = attn, block, hw, ratio, patch

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        h, w = self.hw[0][0] // self.patch, self.hw[0][1] // self.patch
        n = hidden_states.shape[1]
        if n != h * w:
            return self.attn(hidden_states, *args, **kwargs)
        out = torch.empty_like(hidden_states)
        for row in range(hidden_states.shape[0]):  # every frame of every video on its own
            groups = _groups(self.block._metric[row], h, w, int(n * self.ratio))
            merged = torch.stack([hidden_states[row, g].mean(0) for g in groups])[None]
            # cross-attention: this row's text (and mask)
            row_kwargs = {k: v[row:row + 1] if isinstance(v, torch.Tensor) and v.dim() and
                          v.shape[0] == hidden_states.shape[0] else v for k, v in kwargs.items()}
            y = self.attn(merged, *args, **row_kwargs)[0]
            for k, g in enumerate(groups):
                out[row, g] = y[k]
        return out


def per_frame_tome(unet: torch.nn.Module, ratio: float, select: re.Pattern[str] = SPATIAL, patch: int = 1,
                   cross: bool = False) -> torch.nn.Module:
    """A copy of a video U-Net (a DiT) whose full-resolution spatial attn1 (and attn2 with
    ``cross``) of the blocks ``select`` matches merges frame by frame (image by image)."""
    ref = copy.deepcopy(unet)
    hw: list[tuple[int, int]] = [(0, 0)]

    def size(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        hw[0] = tuple(args[0].shape[-2:])

    ref.register_forward_pre_hook(size)
    for name, block in ref.named_modules():
        if select.search(name):
            def keep(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                module._metric = args[0] if args else kwargs["hidden_states"]

            block.register_forward_pre_hook(keep, with_kwargs=True)
            block.attn1 = _PerFrameAttention(block.attn1, block, hw, ratio, patch)
            if cross:
                block.attn2 = _PerFrameAttention(block.attn2, block, hw, ratio, patch)
    return ref


def tomesd_per_frame(unet: torch.nn.Module, seed: int | None = None, **options: Any) -> torch.nn.Module:
    """tomesd on a video U-Net with its size taken per frame and only spatial blocks patched."""
    import tomesd

    ref = copy.deepcopy(unet)
    tomesd.apply_patch(ref, **options)
    for name, module in ref.named_modules():
        if hasattr(module, "_tome_info") and module is not ref and not SPATIAL.search(name):
            module.__class__ = module.__class__.__bases__[0]  # motion modules: not tomesd's to merge

    def size(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        module._tome_info["size"] = tuple(args[0].shape[-2:])

    ref.register_forward_pre_hook(size)  # runs after tomesd's own hook: the frame's height x width
    if seed is not None:
        ref._tome_info["args"]["generator"] = torch.Generator().manual_seed(seed)
    return ref
