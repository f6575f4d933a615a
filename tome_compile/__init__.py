"""tome-compile: Token Merging for diffusion U-Nets as a torch.fx compiler pass.

    import torch
    from tome_compile import tome_backend
    unet = torch.compile(unet, backend=tome_backend(0.5))
"""

from __future__ import annotations

from tome_compile.backend import ToMeBackend, ToMeWarning, tome_backend
from tome_compile.config import ToMeConfig
from tome_compile.errors import (
    ToMeConfigError,
    ToMeError,
    ToMeExportError,
    ToMeModelError,
    ToMeRewriteError,
)
from tome_compile.passes import ToMeResult, ToMeSite, merge_self_attention
from tome_compile.pipeline import apply
from tome_compile.state import generation

__all__ = [
    "ToMeBackend",
    "ToMeConfig",
    "ToMeConfigError",
    "ToMeError",
    "ToMeExportError",
    "ToMeModelError",
    "ToMeResult",
    "ToMeRewriteError",
    "ToMeSite",
    "ToMeWarning",
    "apply",
    "generation",
    "merge_self_attention",
    "tome_backend",
]

__version__ = "0.1.0"
