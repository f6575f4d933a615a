"""A reference for ToMe on joint attention (SD3's ``JointTransformerBlock``), written from the
description of #38 rather than from our code: in each selected block, image by image (a Python
loop over the batch rows), tomesd's groups of the image tokens from the block input
(:func:`video_reference._groups`: fixed destinations, cosine similarity, the ``r`` best sources);
the image part of q, k and v — after the projections and the qk-norm, as the processor makes them —
replaced by each group's mean; the text tokens appended whole; attention over both; every image
token given its group's output, the text tokens their own; then the processor's split and output
projections as diffusers writes them. SD3.5's second, image-only attention (``attn2`` of its
dual-attention blocks) merges its input with the same groups, as tomesd merges a self-attention."""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
from video_reference import _groups, _PerFrameAttention

EVERY_BLOCK = re.compile(r"^transformer_blocks\.\d+$")


class JointToMeReference:
    """``JointAttnProcessor2_0`` with the image tokens merged per image."""

    def __init__(self, block: torch.nn.Module, grid: list[tuple[int, int]], ratio: float):
        self.block, self.grid, self.ratio = block, grid, ratio

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: Any = None, *args: Any, **kwargs: Any) -> Any:
        b, n, _ = hidden_states.shape
        heads = attn.heads

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, -1, heads, x.shape[-1] // heads).transpose(1, 2)

        q, k, v = (split(attn.to_q(hidden_states)), split(attn.to_k(hidden_states)),
                   split(attn.to_v(hidden_states)))
        if attn.norm_q is not None:
            q, k = attn.norm_q(q), attn.norm_k(k)
        text_in = encoder_hidden_states
        tq, tk, tv = (split(attn.add_q_proj(text_in)), split(attn.add_k_proj(text_in)),
                      split(attn.add_v_proj(text_in)))
        if attn.norm_added_q is not None:
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
        h, w = self.grid[0]
        image = torch.empty_like(q)
        text = torch.empty_like(tq)
        for row in range(b):
            groups = _groups(self.block._metric[row], h, w, int(n * self.ratio))

            def merged(t: torch.Tensor, groups: list[list[int]] = groups) -> torch.Tensor:
                return torch.stack([t[:, g].mean(1) for g in groups], dim=1)  # [heads, groups, d]

            out = torch.nn.functional.scaled_dot_product_attention(
                torch.cat([merged(q[row]), tq[row]], dim=1)[None],
                torch.cat([merged(k[row]), tk[row]], dim=1)[None],
                torch.cat([merged(v[row]), tv[row]], dim=1)[None])[0]
            for i, g in enumerate(groups):
                image[row, :, g] = out[:, i:i + 1]
            text[row] = out[:, len(groups):]
        image = image.transpose(1, 2).reshape(b, n, -1)
        text = text.transpose(1, 2).reshape(b, text.shape[2], -1)
        if not attn.context_pre_only:
            text = attn.to_add_out(text)
        return attn.to_out[1](attn.to_out[0](image)), text


def _keep_metric(block: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The block's image input, tomesd's metric, kept for its attention's reference processor."""
    block._metric = args[0] if args else kwargs["hidden_states"]


def joint_tome(model: torch.nn.Module, ratio: float, select: re.Pattern[str] = EVERY_BLOCK
               ) -> torch.nn.Module:
    """A copy of an SD3 transformer whose blocks ``select`` matches merge their image tokens."""
    ref = copy.deepcopy(model)
    grid: list[tuple[int, int]] = [(0, 0)]
    patch = ref.config.patch_size

    def size(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        sample = args[0] if args else kwargs["hidden_states"]
        grid[0] = (sample.shape[-2] // patch, sample.shape[-1] // patch)

    ref.register_forward_pre_hook(size, with_kwargs=True)
    for name, block in ref.named_modules():
        if select.search(name):
            block.register_forward_pre_hook(_keep_metric, with_kwargs=True)
            block.attn.set_processor(JointToMeReference(block, grid, ratio))
            if getattr(block, "attn2", None) is not None:  # SD3.5's image-only self-attention: tomesd's
                block.attn2 = _PerFrameAttention(block.attn2, block, grid, ratio)
    return ref


class FluxToMeReference:
    """Flux's ``FluxAttnProcessor`` with the image tokens merged per image, after the rotary
    embedding (each token rotated at its own position, then averaged: the choice #38 asks to
    justify, written here from its description): the image tokens are the last ``h * w`` of the
    sequence (text first) in both the double-stream blocks and the single-stream ones."""

    def __init__(self, block: torch.nn.Module, grid: tuple[int, int], ratio: float):
        self.block, self.grid, self.ratio = block, grid, ratio

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: Any = None, image_rotary_emb: Any = None) -> Any:
        from diffusers.models.embeddings import apply_rotary_emb

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, attn.head_dim))

        q, k, v = (heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)),
                   heads(attn.to_v(hidden_states)))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None:
            text_in = encoder_hidden_states
            tq, tk, tv = (heads(attn.add_q_proj(text_in)), heads(attn.add_k_proj(text_in)),
                          heads(attn.add_v_proj(text_in)))
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
            q, k, v = torch.cat([tq, q], dim=1), torch.cat([tk, k], dim=1), torch.cat([tv, v], dim=1)
        q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
        k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        b, total = q.shape[:2]
        h, w = self.grid
        n = h * w
        text = total - n
        out = torch.empty_like(q)
        for row in range(b):
            groups = _groups(self.block._metric[row], h, w, int(n * self.ratio))

            def merged(t: torch.Tensor, groups: list[list[int]] = groups) -> torch.Tensor:  # [L', H, d]
                image = torch.stack([t[[text + i for i in g]].mean(0) for g in groups], dim=0)
                return torch.cat([t[:text], image], dim=0)

            o = torch.nn.functional.scaled_dot_product_attention(
                *(merged(t[row]).transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
            out[row, :text] = o[:text]
            for i, g in enumerate(groups):
                out[row, [text + j for j in g]] = o[text + i]
        hidden_states = out.flatten(2, 3).to(q.dtype)
        if encoder_hidden_states is None:
            return hidden_states
        encoder_hidden_states, hidden_states = hidden_states[:, :text], hidden_states[:, text:]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        return hidden_states, attn.to_add_out(encoder_hidden_states.contiguous())


FLUX_BLOCKS = re.compile(r"^(single_)?transformer_blocks\.\d+$")


def flux_tome(model: torch.nn.Module, ratio: float, grid: tuple[int, int],
              select: re.Pattern[str] = FLUX_BLOCKS) -> torch.nn.Module:
    """A copy of a Flux transformer whose blocks ``select`` matches merge their image tokens on the
    ``grid`` (the packed latent's ``h, w``), the metric being the block's image input."""
    ref = copy.deepcopy(model)
    for name, block in ref.named_modules():
        if select.search(name):
            block.register_forward_pre_hook(_keep_metric, with_kwargs=True)
            block.attn.set_processor(FluxToMeReference(block, grid, ratio))
    return ref
