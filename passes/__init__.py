"""torch.fx passes of tome_compile (installed as ``tome_compile.passes``).

The graph contract — the names of the extra inputs and outputs and how each is drawn — lives in
:mod:`tome_compile.inputs`; its names are re-exported here for callers of the pass."""

from __future__ import annotations

from tome_compile.passes.merge_self_attention import merge_self_attention
from tome_compile.passes.result import ToMeResult, ToMeSite
from tome_compile.passes.sites import AttentionSite, find_attention_sites
from tome_compile.passes.unet_io import UNetIO, find_unet_io

from tome_compile.inputs import (
    DST_KEY_INPUT,
    HAS_MAP_INPUT,
    IMPORTANCE_INPUT,
    PARTITION_INPUT,
    PLAN_SLOTS,
    PLAN_WEIGHTS,
    REUSE_INPUT,
    SEED_INPUT,
)

__all__ = [
    "DST_KEY_INPUT",
    "HAS_MAP_INPUT",
    "IMPORTANCE_INPUT",
    "PARTITION_INPUT",
    "PLAN_SLOTS",
    "PLAN_WEIGHTS",
    "REUSE_INPUT",
    "SEED_INPUT",
    "AttentionSite",
    "ToMeResult",
    "ToMeSite",
    "UNetIO",
    "find_attention_sites",
    "find_unet_io",
    "merge_self_attention",
]
