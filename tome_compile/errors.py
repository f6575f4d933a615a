"""Typed errors. Every error this package raises on purpose is a :class:`ToMeError`."""

from __future__ import annotations

__all__ = ["ToMeConfigError", "ToMeError", "ToMeExportError", "ToMeModelError", "ToMeRewriteError"]


class ToMeError(Exception):
    """Base class of every error raised by tome_compile."""


class ToMeConfigError(ToMeError, ValueError):
    """A configuration value is out of range; the message names the value, the limit and the fix."""


class ToMeRewriteError(ToMeError, RuntimeError):
    """The graph rewrite could not be applied (the graph is left as it was)."""


class ToMeExportError(ToMeError, RuntimeError):
    """An ONNX export failed one of its checks (op inventory, parity); nothing is left behind."""


class ToMeModelError(ToMeError, ValueError):
    """A model could not be built or loaded (missing folder, unknown architecture name, bad config)."""
