"""``torch.compile`` backend: rewrite a copy of the Dynamo graph, then hand it to a compiler.

    unet = torch.compile(unet, backend=tome_backend(0.5))             # inductor
    unet = torch.compile(unet, backend="tome", options={"ratio": 0.5})  # by name (entry point)

The backend holds no merge logic of its own: it runs :func:`merge_self_attention` on a copy of
the graph (rewriting Dynamo's graph in place breaks Dynamo afterwards), compiles the result with
the inner compiler, and returns a callable that appends the ToMe inputs (the destination
partition, drawn from a dedicated generator) to every call.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeConfigError
from tome_compile.passes import PARTITION_INPUT, ToMeResult, merge_self_attention
from tome_compile.sampler import PartitionSampler

__all__ = ["ToMeBackend", "tome_backend", "tome", "ToMeWarning"]

logger = logging.getLogger("tome_compile")

CompilerFn = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]


class ToMeWarning(UserWarning):
    """ToMe could not do what was asked (e.g. nothing to rewrite at this max_downsample)."""


def _inner_compiler(compiler: str | CompilerFn) -> CompilerFn:
    if callable(compiler):
        return compiler
    if compiler == "eager":
        return lambda gm, example_inputs: gm.forward
    if compiler == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    if isinstance(compiler, str):
        try:
            return torch._dynamo.lookup_backend(compiler)
        except Exception as e:  # noqa: BLE001 - re-raised as a config error with the fix
            raise ToMeConfigError(
                f"compiler={compiler!r} is not a torch.compile backend; use 'inductor' (default), "
                f"'eager', or a backend callable") from e
    raise ToMeConfigError(f"compiler={compiler!r} must be a backend name or callable")


def _is_static(value: Any) -> bool:
    if isinstance(value, torch.SymInt):
        return False
    if isinstance(value, torch.Tensor):
        return all(isinstance(d, int) for d in value.shape)
    return True


def _fake_mode(example_inputs: Sequence[Any]) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode(list(example_inputs))


def warn_if_nothing_rewritten(result: ToMeResult, config: ToMeConfig) -> None:
    """Say loudly when ToMe was asked for but no site qualified (e.g. SDXL at max_downsample=1)."""
    if result.modified or not config.enabled:
        return
    downsamples = [s.downsample for s in result.sites
                   if s.kind == "self-attention" and s.downsample is not None]
    if downsamples and min(downsamples) > config.max_downsample:
        message = (f"ToMe rewrote nothing: this model's highest-resolution self-attention is "
                   f"downsampled {min(downsamples)}x, above max_downsample={config.max_downsample}; "
                   f"use max_downsample={min(downsamples)} (SDXL has no attention at full resolution)")
    elif any(s.kind == "self-attention" for s in result.sites):
        message = "ToMe rewrote nothing: " + "; ".join(
            sorted({s.reason for s in result.sites if s.kind == "self-attention"}))
    else:
        return  # a graph without self-attention (e.g. a text encoder) is not a surprise
    logger.warning("%s", message)
    warnings.warn(message, ToMeWarning, stacklevel=3)


class ToMeBackend:
    """A ``torch.compile`` backend that applies ToMe; see :func:`tome_backend`.

    Attributes:
        config: the :class:`ToMeConfig`.
        reports: one :class:`ToMeResult` per graph compiled (its ``sites`` is the site report).
    """

    def __init__(self, config: ToMeConfig, compiler: str | CompilerFn = "inductor",
                 generator: torch.Generator | None = None, oracle: bool = False) -> None:
        self.config = config
        self.compiler = compiler
        self._compile = _inner_compiler(compiler)
        self.sampler = PartitionSampler(config.seed, generator)
        self.reports: list[ToMeResult] = []
        self.oracle = oracle

    def __repr__(self) -> str:
        return f"ToMeBackend({self.config!r}, compiler={self.compiler!r})"

    def reset(self, seed: int | None = None) -> None:
        """Restart the partition sequence (from ``seed``, else the config's seed)."""
        self.sampler.reseed(self.config.seed if seed is None else seed)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if not self.config.enabled:
            return self._compile(gm, example_inputs)
        if not all(_is_static(x) for x in example_inputs):
            return _Specializing(self, gm, example_inputs)
        return self._compile_static(gm, example_inputs)

    def _compile_static(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        # Rewrite a copy: Dynamo keeps using its own graph afterwards.
        rewritten = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        result = merge_self_attention(rewritten, self.config, oracle=self.oracle)
        self.reports.append(result)
        logger.info("%s", result.summary())
        warn_if_nothing_rewritten(result, self.config)
        if not result.modified:
            return self._compile(gm, example_inputs)
        extra = self._example_extra(result, example_inputs)
        compiled = self._compile(rewritten, list(example_inputs) + extra)
        return self._bind(compiled, result, example_inputs)

    def _example_extra(self, result: ToMeResult, example_inputs: Sequence[Any]) -> list[Any]:
        device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)),
                      torch.device("cpu"))
        mode = _fake_mode(example_inputs)
        extra = []
        for name in result.inputs:
            if name == PARTITION_INPUT:
                value = torch.zeros(result.partition_size, dtype=torch.int64, device=device)
            else:  # pragma: no cover - inputs are added by this package only
                raise AssertionError(name)
            extra.append(mode.from_tensor(value) if mode is not None else value)
        return extra

    def _bind(self, compiled: Callable[..., Any], result: ToMeResult,
              example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if not result.inputs:
            return compiled
        cells = list(result.partition_cells)
        choices = self.config.sx * self.config.sy
        sampler = self.sampler
        device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)),
                      torch.device("cpu"))

        def run(*args: Any) -> Any:
            return compiled(*args, sampler.draw(cells, choices, device))

        return run


class _Specializing:
    """A graph with symbolic shapes (Dynamo went dynamic after a resolution change).

    Token counts decide which blocks merge and how many tokens; they must be static. So this
    callable specialises: for each new concrete shape it re-traces the graph at that shape
    (``make_fx``, pre-dispatch, keeping ``nn_module_stack``), rewrites and compiles it, and caches
    the result. Dynamo sees one graph and does not recompile; each resolution is compiled once.
    """

    def __init__(self, backend: ToMeBackend, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.backend = backend
        self.gm = gm
        self.symbolic = [i for i, x in enumerate(example_inputs) if not _is_static(x)]
        self.cache: dict[tuple[Any, ...], Callable[..., Any]] = {}
        logger.info("ToMe: graph with symbolic shapes; specialising per resolution")

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(tuple(args[i].shape) if isinstance(args[i], torch.Tensor) else args[i]
                     for i in self.symbolic)

    def __call__(self, *args: Any) -> Any:
        key = self._key(args)
        fn = self.cache.get(key)
        if fn is None:
            fn = self.cache[key] = self._specialise(args)
        return fn(*args)

    def _specialise(self, args: Sequence[Any]) -> Callable[..., Any]:
        import torch.fx.traceback as fx_traceback
        from torch.fx.experimental.proxy_tensor import make_fx

        gm = self.gm

        def run(*a: Any) -> Any:
            with fx_traceback.preserve_node_meta():
                return torch.fx.Interpreter(gm).run(*a)

        with torch.no_grad():
            static = make_fx(run, tracing_mode="fake", pre_dispatch=True)(*args)
        mode = _fake_mode_of(static)
        examples = [mode.from_tensor(a) if isinstance(a, torch.Tensor) and mode is not None else a
                    for a in args]
        return self.backend._compile_static(static, examples)


def _fake_mode_of(gm: fx.GraphModule) -> Any:
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and hasattr(value, "fake_mode"):
            return value.fake_mode
    return None


def tome_backend(ratio: float | ToMeConfig = 0.5, *, compiler: str | CompilerFn = "inductor",
                 generator: torch.Generator | None = None, **options: Any) -> ToMeBackend:
    """A ``torch.compile`` backend that merges tokens in the high-resolution self-attentions.

    Args:
        ratio: share of tokens merged (0.5 default; <= 0.5 recommended), or a :class:`ToMeConfig`.
        compiler: ``"inductor"`` (default), ``"eager"`` (run the rewritten graph as is), another
            backend name, or a backend callable.
        generator: draw destination partitions from this generator (else one seeded by ``seed``).
        **options: any :class:`ToMeConfig` field (``max_downsample``, ``sx``, ``sy``,
            ``use_rand``, ``merge_crossattn``, ``merge_mlp``, ``seed``, ``method``, ...).
    """
    config = ToMeConfig.from_options(ratio, **options)
    return ToMeBackend(config, compiler=compiler, generator=generator)


def tome(gm: fx.GraphModule, example_inputs: Sequence[Any],
         options: dict[str, Any] | None = None, **kwargs: Any) -> Callable[..., Any]:
    """The backend registered as ``"tome"``: ``torch.compile(m, backend="tome", options={...})``.

    A fresh backend per compile: its partition sequence starts from ``options["seed"]``.
    """
    opts = dict(options or {})
    compiler = opts.pop("compiler", "inductor")
    return tome_backend(compiler=compiler, **opts)(gm, example_inputs)
