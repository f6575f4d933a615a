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
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeConfigError
from tome_compile.importance import ImportanceState
from tome_compile.passes import (
    DST_KEY_INPUT,
    IMPORTANCE_INPUT,
    PARTITION_INPUT,
    ToMeResult,
    merge_self_attention,
)
from tome_compile.passes.sites import module_path, node_shape
from tome_compile.sampler import PartitionSampler

__all__ = ["ToMeBackend", "ToMeWarning", "tome", "tome_backend"]

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
        except Exception as e:
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


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


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
        self.importance = ImportanceState()

    def __repr__(self) -> str:
        return f"ToMeBackend({self.config!r}, compiler={self.compiler!r})"

    def reset(self, seed: int | None = None) -> None:
        """Start a new generation: forget the importance map and restart the random sequence
        (from ``seed``, else the config's seed)."""
        self.sampler.reseed(self.config.seed if seed is None else seed)
        self.importance.reset()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if not self.config.enabled:
            return self._compile(gm, example_inputs)
        if not all(_is_static(x) for x in example_inputs):
            return _Specializing(self, gm, example_inputs)
        return self._compile_static(gm, example_inputs)

    def _compile_static(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        # Rewrite a copy: Dynamo keeps using its own graph afterwards.
        rewritten = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        result = merge_self_attention(rewritten, self.config, oracle=self.oracle, method="tome")
        self.reports.append(result)
        logger.info("%s", result.summary())
        warn_if_nothing_rewritten(result, self.config)
        if not result.modified:
            return self._compile(gm, example_inputs)
        extra = self._example_extra(result, example_inputs)
        compiled = self._compile(rewritten, list(example_inputs) + extra)
        tome_fn = self._bind(compiled, result, example_inputs)
        if self.config.method != "importance" or self.oracle:
            return tome_fn
        # Importance: a second graph whose plans read the guidance map; the tome graph above is
        # the fallback for calls without a map. Both are compiled now: no recompile mid-generation.
        rewritten_imp = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        result_imp = merge_self_attention(rewritten_imp, self.config, method="importance")
        if result_imp.method != "importance":
            return tome_fn  # odd batch: no CFG pair, ToMe only
        self.reports.append(result_imp)
        extra_imp = self._example_extra(result_imp, example_inputs)
        compiled_imp = self._compile(rewritten_imp, list(example_inputs) + extra_imp)
        return self._bind_importance(tome_fn, compiled_imp, result_imp, gm, example_inputs)

    def _example_extra(self, result: ToMeResult, example_inputs: Sequence[Any]) -> list[Any]:
        device = _device_of(example_inputs)
        mode = _fake_mode(example_inputs)
        extra = []
        pairs = result.pairs
        for name in result.inputs:
            if name == PARTITION_INPUT:
                value = torch.zeros(result.partition_size, dtype=torch.int64, device=device)
            elif name == IMPORTANCE_INPUT:
                value = torch.zeros(pairs, *(result.latent_hw or (1, 1)), device=device)
            elif name == DST_KEY_INPUT:
                value = torch.zeros(pairs, sum(result.dst_key_sizes), device=device)
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
        device = _device_of(example_inputs)

        def run(*args: Any) -> Any:
            return compiled(*args, sampler.draw(cells, choices, device))

        return run

    def _bind_importance(self, tome_fn: Callable[..., Any], compiled: Callable[..., Any],
                         result: ToMeResult, gm: fx.GraphModule,
                         example_inputs: Sequence[Any]) -> Callable[..., Any]:
        sample_index, timestep_index, output_index = _unet_io(gm)
        state, sampler, use_rand = self.importance, self.sampler, DST_KEY_INPUT in result.inputs
        pairs, total = result.pairs, sum(result.dst_key_sizes)
        device = _device_of(example_inputs)

        def run(*args: Any) -> Any:
            sample = args[sample_index]
            timestep = args[timestep_index] if timestep_index is not None else None
            current = state.current(tuple(sample.shape), timestep)
            if current is None:
                out = tome_fn(*args)
            else:
                extra = [current.to(device)]
                if use_rand:
                    extra.append(sampler.draw_keys(pairs, total, device))
                out = compiled(*args, *extra)
            outputs = out if isinstance(out, (list, tuple)) else [out]
            state.update(outputs[output_index])
            return out

        return run


def _unet_io(gm: fx.GraphModule) -> tuple[int, int | None, int]:
    """Positions of the sample and timestep inputs and of the noise output in a U-Net graph."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    conv = next(n for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target))
    node = conv.args[0]
    while isinstance(node, fx.Node) and node.op != "placeholder":
        node = next((a for a in node.all_input_nodes if node_shape(a) == node_shape(node)), None)
    sample_index = placeholders.index(node) if node in placeholders else 0

    def reaches_time_proj(start: fx.Node) -> bool:
        frontier, seen = [start], set()
        for _ in range(6):
            nxt = []
            for n in frontier:
                for user in n.users:
                    if module_path(user).startswith("time_proj"):
                        return True
                    if user not in seen:
                        seen.add(user)
                        nxt.append(user)
            frontier = nxt
        return False

    timestep_index = next((i for i, p in enumerate(placeholders)
                           if i != sample_index and node_shape(p) is not None
                           and len(node_shape(p) or ()) <= 1 and reaches_time_proj(p)), None)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    sample_shape = node_shape(placeholders[sample_index]) or ()
    output_index = next((i for i, o in enumerate(flat)
                         if len(node_shape(o) or ()) == 4 and (node_shape(o) or ())[0] == sample_shape[0]
                         and (node_shape(o) or ())[2:] == sample_shape[2:]), 0)
    return sample_index, timestep_index, output_index


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
