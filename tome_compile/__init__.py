"""tome-compile: Token Merging for diffusion U-Nets as a torch.fx compiler pass.

    import torch
    from tome_compile import tome_backend
    unet = torch.compile(unet, backend=tome_backend(0.5))

The public names load on first use (PEP 562), so ``import tome_compile.merge`` (the pure tensor
math) or ``tome_compile.config`` loads neither the pass nor the backend nor Dynamo.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tome_compile.config import ToMeConfig
from tome_compile.errors import (
    ToMeConfigError,
    ToMeError,
    ToMeExportError,
    ToMeModelError,
    ToMeRewriteError,
)

if TYPE_CHECKING:
    from tome_compile.backend import ToMeBackend, ToMeWarning, tome_backend
    from tome_compile.packed import set_packed_grid
    from tome_compile.passes import ToMeResult, ToMeSite, merge_self_attention
    from tome_compile.pipeline import apply, remove
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
    "remove",
    "set_packed_grid",
    "tome_backend",
]

__version__ = "0.1.0"

_LAZY = {
    "ToMeBackend": "tome_compile.backend",
    "ToMeWarning": "tome_compile.backend",
    "tome_backend": "tome_compile.backend",
    "ToMeResult": "tome_compile.passes",
    "ToMeSite": "tome_compile.passes",
    "merge_self_attention": "tome_compile.passes",
    "apply": "tome_compile.pipeline",
    "remove": "tome_compile.pipeline",
    "set_packed_grid": "tome_compile.packed",
    "generation": "tome_compile.state",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tome_compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
