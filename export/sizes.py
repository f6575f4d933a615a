"""The export for every image size: which exports take any size, and the parity check at a size
other than the traced one."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from tome_compile.export import parity
from tome_compile.passes import ToMeResult

from tome_compile.config import ToMeConfig
from tome_compile.families import ModelFamily
from tome_compile.models import example_inputs

__all__ = ["any_size_export", "other_size_check"]

logger = logging.getLogger("tome_compile.export")


def any_size_export(family: ModelFamily, config: ToMeConfig, o: Any) -> bool:
    """Whether this export takes every image size: an image U-Net's, unless asked for a fixed size or
    its extra inputs are sized per export (a drawn partition; plan_every's plan state). Importance
    merging's file takes every size too (its map input [pairs, H, W] follows the latent), in the
    batch it was exported for."""
    if o.static or not family.any_size:
        return False
    if o.partition_input or config.reuses_plans:
        form = "--partition-input" if o.partition_input else "--plan-every"
        logger.warning("the %s export keeps its traced image size and text length; export again for "
                       "another size", form)
        return False
    return True


def other_size_check(unet: torch.nn.Module, traced: Any, result: ToMeResult, *, o: Any, multiple: int,
                     batch: int, pairs: bool = False) -> parity.ParityCheck:
    """The call at another size from the same file: the traced latent two multiples taller, a
    shorter text, the smallest batch where the batch is dynamic (1; ``pairs``, an importance file
    in CFG pairs: 2, its map one row)."""
    scale = o.height // int(traced.sample.shape[-2])  # pixels per latent row (the VAE's 8)
    height = o.height + 2 * multiple * scale
    seq_len = max(1, o.seq_len - 7)
    inputs = example_inputs(unet, batch=batch, height=height, width=o.width, seq_len=seq_len,
                            seed=o.seed + 1, dtype=traced.sample.dtype)
    # as the traced call: one timestep per image for a DiT, Optimum's float32[1] for a U-Net
    assert inputs.family is not None
    inputs.timestep = (inputs.timestep.to(torch.float32) if inputs.family.dit
                       else torch.tensor([float(inputs.timestep)], dtype=torch.float32))
    latent = tuple(int(d) for d in inputs.sample.shape[-2:])
    specs = [spec.at_latent(*latent) for spec in result.inputs]
    if pairs:
        specs = [spec.with_rows(batch // 2) for spec in specs]
    extra = parity.example_tome_inputs(dataclasses.replace(result, inputs=specs), o.seed)
    return parity.ParityCheck(f"{height}x{o.width}, text {seq_len}, batch {batch}", tuple(inputs.args()),
                              tuple(extra))
