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
import functools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from tome_compile.config import ToMeConfig
from tome_compile.errors import ToMeConfigError
from tome_compile.guidance import GuidanceLayout, resolve_guidance
from tome_compile.passes import ToMeResult, UNetIO, find_unet_io, merge_self_attention
from tome_compile.passes.follow_up import keep_plans, reuse_plans
from tome_compile.passes.report import nothing_rewritten
from tome_compile.state import CallDriver, CallState

__all__ = ["ToMeBackend", "ToMeWarning", "tome", "tome_backend"]

logger = logging.getLogger("tome_compile")

CompilerFn = Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]
FollowUp = Callable[[fx.GraphModule, ToMeResult], ToMeResult]  # a follow-up pass (passes.follow_up)


class ToMeWarning(UserWarning):
    """ToMe could not do what was asked (e.g. nothing to rewrite at this max_downsample)."""


def _inductor(mode: str | None, options: dict[str, Any] | None) -> CompilerFn:
    """Inductor with ``torch.compile``'s ``mode=`` / ``options=`` (they reach a custom backend as
    keyword arguments), as the built-in inductor backend applies them."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches: dict[str, Any] = {}
    if mode is not None:
        modes = sorted(list_mode_options())
        if mode not in modes:
            raise ToMeConfigError(f"mode={mode!r} is not an inductor mode; use one of {modes}")
        patches.update(list_mode_options(mode))
    patches.update(options or {})
    return functools.partial(compile_fx, config_patches=patches) if patches else compile_fx


def _inner_compiler(compiler: str | CompilerFn, mode: str | None = None,
                    options: dict[str, Any] | None = None) -> CompilerFn:
    if compiler == "inductor":
        return _inductor(mode, options)
    if compiler == "eager":
        if mode or options:
            logger.info("ToMe: compiler='eager' runs the graph as is; mode=%r / options=%r ignored",
                        mode, options)
        return lambda gm, example_inputs: gm.forward
    kwargs = {k: v for k, v in (("mode", mode), ("options", options)) if v}
    if callable(compiler):
        return functools.partial(compiler, **kwargs) if kwargs else compiler
    if isinstance(compiler, str):
        try:
            backend = torch._dynamo.lookup_backend(compiler)
        except Exception as e:
            raise ToMeConfigError(
                f"compiler={compiler!r} is not a torch.compile backend; use 'inductor' (default), "
                f"'eager', or a backend callable") from e
        return functools.partial(backend, **kwargs) if kwargs else backend
    raise ToMeConfigError(f"compiler={compiler!r} must be a backend name or callable")


def _has_symbolic_shapes(gm: fx.GraphModule) -> bool:
    """Token counts come from tensor shapes; symbolic scalars alone (a Python-int timestep that
    Dynamo made dynamic) do not change them, so they need no specialisation. (Dynamo hands the
    backend real example tensors: the symbolic shapes are in the placeholders' metadata.)"""
    for node in gm.graph.nodes:
        value = node.meta.get("example_value", node.meta.get("val")) if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and not all(isinstance(d, int) for d in value.shape):
            return True
    return False


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    return next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))


def _fake_mode(example_inputs: Sequence[Any]) -> Any:
    from torch._guards import detect_fake_mode

    return detect_fake_mode(list(example_inputs))


def warn_if_nothing_rewritten(result: ToMeResult, config: ToMeConfig) -> None:
    """Say loudly when ToMe was asked for but no site qualified (e.g. SDXL at max_downsample=1)."""
    message = nothing_rewritten(result, config)
    if message is not None:
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
        if oracle and config.method == "todo":
            raise ToMeConfigError("oracle=True is ToMe's zero-cost bound (merge r tokens, no matching); "
                                  "method='todo' merges nothing: pass method='tome' with the oracle")
        self.config = config
        self.compiler = compiler
        _inner_compiler(compiler)  # reject a bad compiler now, not at the first call
        self.reports: list[ToMeResult] = []
        self.oracle = oracle
        # The call state (maps, plans, random draws) per caller and model: tome_compile.state
        self.driver = CallDriver.for_config(config, seed=config.seed, generator=generator, say=self.say_once)
        self._said: set[str] = set()
        self._baked_timesteps: set[float] = set()

    def __repr__(self) -> str:
        return f"ToMeBackend({self.config!r}, compiler={self.compiler!r})"

    def call_state(self, model: torch.nn.Module | None = None) -> CallState | None:
        """The calling thread's (or ``generation()``'s) state of ``model`` — the module given to
        ``torch.compile`` — or of the model it called last: its guidance map, plans, counters."""
        if model is None:
            return self.driver.state()
        return next((s for p in model.parameters() if (s := self.driver.state(p)) is not None), None)

    # The names this state had before it had an owner (kept for callers of 0.1).
    def importance_state(self, model: torch.nn.Module) -> CallState | None:
        """Old name of :meth:`call_state`."""
        return self.call_state(model)

    @property
    def importance(self) -> CallState | None:
        """Old name of ``call_state()``: the state of the model this caller called last."""
        return self.call_state()

    def reset(self, seed: int | None = None) -> None:
        """Every caller's next call starts a new generation: no map, no plans, its random sequence
        from ``seed`` (else the config's). ``torch._dynamo.reset()`` calls this too (Dynamo resets
        every backend it cached), so never call that in the middle of a generation."""
        self.driver.reset(seed)

    def say_once(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            logger.warning("%s", message)
            warnings.warn(message, ToMeWarning, stacklevel=3)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                 options: dict[str, Any] | None = None) -> Callable[..., Any]:
        compile_fn = _inner_compiler(self.compiler, mode, options)
        if not self.config.enabled:
            return compile_fn(gm, example_inputs)
        io = find_unet_io(gm)
        if _has_symbolic_shapes(gm):
            return _Specializing(self, gm, example_inputs, compile_fn, io)
        return self._compile_static(gm, example_inputs, compile_fn, io)

    def _rewrite_and_compile(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        compile_fn: CompilerFn,
        method: str,
        forms: Sequence[FollowUp] = (),
        io: UNetIO | None = None,
    ) -> tuple[ToMeResult, Callable[..., Any]]:
        # Rewrite a copy: Dynamo keeps using its own graph afterwards. ``io`` (found on ``gm``) is
        # valid for the copy: the same nodes in the same order. ``forms``: the follow-up passes of
        # this graph's form (plan_every: keep_plans for a planning graph, reuse_plans for a reusing one)
        rewritten = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        result = merge_self_attention(rewritten, self.config, oracle=self.oracle, method=method, io=io)
        for form in forms if result.modified else ():
            result = form(rewritten, result)
        mode = _fake_mode(example_inputs)
        device = _device_of(example_inputs)
        # static: a size of the ToMe inputs (3 images' maps) must not become a symbol of Dynamo's
        # shape env with no source — Dynamo fails building its guards on one (IndexError)
        extra = [mode.from_tensor(s.zeros(device), static_shapes=True) if mode is not None
                 else s.zeros(device) for s in result.inputs]
        module = rewritten if result.modified else gm
        return result, compile_fn(module, list(example_inputs) + extra)

    def _note_baked_timestep(self, io: UNetIO) -> None:
        """Dynamo bakes a Python-number timestep into the graph; a second graph with another baked
        value means it is guarding on every value (``dynamic=False``): a compile per step, and
        after Dynamo's recompile limit the plain model without ToMe."""
        if io.timestep_constant is None:
            return
        self._baked_timesteps.add(io.timestep_constant)
        if len(self._baked_timesteps) > 1:
            self.say_once("ToMe: the U-Net gets Python-number timesteps and Dynamo compiles it again for "
                          "every value (torch.compile(dynamic=False) does this for any model; after its "
                          "recompile limit it runs the plain model, without ToMe); pass torch.tensor(t), "
                          "or leave dynamic unset (one more compile at the second step, then none)")

    def _compile_static(self, gm: fx.GraphModule, example_inputs: Sequence[Any], compile_fn: CompilerFn,
                        io: UNetIO, found_on_gm: bool = True) -> Callable[..., Any]:
        """``io``: the call's inputs and output (the runner reads them); the pass reuses it when it
        was ``found_on_gm`` (not on the symbolic graph ``gm`` was specialised from)."""
        self._note_baked_timestep(io)
        graph_io = io if found_on_gm else find_unet_io(gm)  # U-Net I/O: found once per graph
        # plans that outlive a call: every planning graph also returns its plans; a third graph reuses them
        keep: tuple[FollowUp, ...] = (keep_plans,) if self.config.reuses_plans and not self.oracle else ()
        # the graph every call can run: ToMe plans (importance's fallback), or ToDo's downsampling
        base = "todo" if self.config.method == "todo" else "tome"
        result, compiled = self._rewrite_and_compile(gm, example_inputs, compile_fn, base, keep, graph_io)
        self.reports.append(result)
        logger.info("%s", result.summary())
        warn_if_nothing_rewritten(result, self.config)
        if any(site.cause == "stored-reference" for site in result.sites):
            self.say_once("ToMe: this graph stores attention inputs for a later call (a reference-only write "
                          "pass: Zero123++'s inner U-Net compiled alone?); those sites are left unmerged, as "
                          "in the wrapper compiled whole (compile pipe.unet, not pipe.unet.unet)")
        if not result.modified:
            return compiled
        if (self.config.method != "importance" or self.oracle) and not result.inputs and not result.outputs:
            return compiled  # nothing to append: the compiled graph itself, no wrapper on the hot path
        device = _device_of(example_inputs)
        runner = _Runner(self, io, device, {"tome": (compiled, result)})
        if self.config.method == "importance" and not self.oracle:
            # Importance: a second graph whose plans read the guidance map; the tome graph above is
            # the fallback for calls without a map. Both are compiled now: no recompile mid-generation.
            result_imp, compiled_imp = self._rewrite_and_compile(gm, example_inputs, compile_fn, "importance",
                                                                 keep, graph_io)
            if result_imp.method != "importance":
                sample = example_inputs[io.sample_index]
                samples = sample.shape[0] if isinstance(sample, torch.Tensor) else result_imp.batch
                why = resolve_guidance(self.config.guidance, samples)
                self.say_once(f"ToMe: importance merging cannot pair the rows of this batch ({why}); its "
                              "calls use ToMe plans")
            else:
                self.reports.append(result_imp)
                runner.graphs["importance"] = (compiled_imp, result_imp)
                runner.layout = result_imp.guidance
        if keep and result.outputs:
            result_reuse, compiled_reuse = self._rewrite_and_compile(gm, example_inputs, compile_fn, "tome",
                                                                     (reuse_plans,), graph_io)
            self.reports.append(result_reuse)
            runner.graphs["reuse"] = (compiled_reuse, result_reuse)
        return runner


class _Runner:
    """The compiled U-Net graph(s), called with this call's ToMe inputs appended.

    ``graphs`` maps a kind of call to its compiled graph and rewrite report: ``"tome"`` always;
    ``"importance"`` (importance merging) for a call whose caller has a map from its previous
    call, else the ToMe graph runs (first step, new generation) and this call's output makes the
    map; ``"reuse"`` (``plan_every`` > 1) when the caller holds plans young enough — the other
    graphs then return their plans as two more outputs, which the runner keeps and strips. What
    to run and feed, and what to keep, is :class:`~tome_compile.state.CallDriver`'s (the same
    driver runs ``ToMeSession``).
    """

    def __init__(self, backend: ToMeBackend, io: UNetIO, device: torch.device,
                 graphs: dict[str, tuple[Callable[..., Any], ToMeResult]]) -> None:
        self.driver, self.io, self.device = backend.driver, io, device
        self.graphs = graphs
        self.layout: GuidanceLayout | None = None
        self._param_index: int | None = -1  # the first parameter argument: the model's identity

    def _model_key(self, args: Sequence[Any]) -> torch.Tensor | None:
        if self._param_index == -1:
            self._param_index = next((i for i, a in enumerate(args) if isinstance(a, torch.nn.Parameter)),
                                     None)
        return args[self._param_index] if self._param_index is not None else None

    def __call__(self, *args: Any) -> Any:
        call = self.driver.begin(
            self._model_key(args),
            args[self.io.sample_index].shape,
            self.io.timestep(args),
            layout=self.layout,
            keeps_plans="reuse" in self.graphs,
        )
        fn, result = self.graphs[call.graph]
        out = fn(*args, *self.driver.inputs(call, result.inputs, self.device))
        plans = None
        if result.outputs:  # this call planned: its plans (copied: cudagraphs reuse output memory)
            n = len(out) - len(result.outputs)
            plans = (out[n].clone(), out[n + 1].clone())
            out = out[:n]
        outputs = out if isinstance(out, (list, tuple)) else [out]
        self.driver.finish(call, outputs[self.io.output_index], plans, self.io.channel_axis,
                           self.io.noise_channels)
        return out


def _baked_scalar_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> dict[int, list[fx.Node]]:
    """Inputs whose value make_fx bakes in: symbolic scalars, and the 0-d tensors Dynamo reads with
    ``.item()`` (unspecialised floats such as group norm's eps under ``dynamic=True``).
    ``{position: nodes to replace by the value}``."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    baked: dict[int, list[fx.Node]] = {}
    for i, (node, value) in enumerate(zip(placeholders, example_inputs, strict=True)):
        if isinstance(value, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(value, bool):
            baked[i] = [node]
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            items = [u for u in node.users if u.op == "call_method" and u.target == "item"]
            if items:
                baked[i] = items
    return baked


class _Specializing:
    """A graph with symbolic shapes (``dynamic=True``, or Dynamo went dynamic after a resolution
    change).

    Token counts decide which blocks merge and how many tokens; they must be static. So this
    callable specialises: for each new concrete shape it re-traces the graph at that shape
    (``make_fx``, pre-dispatch, keeping ``nn_module_stack``) with its scalar inputs set to their
    values, rewrites and compiles it, and caches the result. Dynamo sees one graph and does not
    recompile; each resolution is compiled once.
    """

    def __init__(self, backend: ToMeBackend, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 compile_fn: CompilerFn, io: UNetIO) -> None:
        self.backend, self.gm, self.compile_fn, self.io = backend, gm, compile_fn, io
        self.tensors = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor)]
        self.baked = _baked_scalar_inputs(gm, example_inputs)
        self.cache: dict[tuple[Any, ...], Callable[..., Any]] = {}
        if io.timestep_index is not None and io.timestep_index in self.baked:
            backend.say_once("ToMe: dynamic=True with a Python-number timestep: every new timestep value "
                             "is compiled again; pass the timestep as a tensor (torch.tensor(t)), or leave "
                             "dynamic unset")
        logger.info("ToMe: graph with symbolic shapes; specialising per resolution")

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        return (tuple(tuple(args[i].shape) for i in self.tensors),
                tuple(float(args[i]) for i in sorted(self.baked)))

    def __call__(self, *args: Any) -> Any:
        key = self._key(args)
        fn = self.cache.get(key)
        if fn is None:
            fn = self.cache[key] = self._specialise(args)
        return fn(*args)

    def _concrete(self, args: Sequence[Any]) -> fx.GraphModule:
        """A copy of the graph with the baked inputs replaced by this call's values."""
        gm = fx.GraphModule(self.gm, copy.deepcopy(self.gm.graph))
        names = {n.name: n for n in gm.graph.nodes}
        for i, nodes in self.baked.items():
            value = args[i].item() if isinstance(args[i], torch.Tensor) else args[i]
            for original in nodes:
                node = names[original.name]
                for user in list(node.users):
                    user.args = fx.node.map_arg(user.args, lambda a, n=node, v=value: v if a is n else a)
                    user.kwargs = fx.node.map_arg(user.kwargs, lambda a, n=node, v=value: v if a is n else a)
                if node.op != "placeholder":
                    gm.graph.erase_node(node)
        gm.recompile()
        return gm

    def _specialise(self, args: Sequence[Any]) -> Callable[..., Any]:
        import torch.fx.traceback as fx_traceback
        from torch.fx.experimental.proxy_tensor import make_fx

        gm = self._concrete(args)

        def run(*a: Any) -> Any:
            with fx_traceback.preserve_node_meta():
                return torch.fx.Interpreter(gm).run(*a)

        with torch.no_grad():
            static = make_fx(run, tracing_mode="fake", pre_dispatch=True)(*args)
        mode = _fake_mode_of(static)
        examples = [mode.from_tensor(a) if isinstance(a, torch.Tensor) and mode is not None else a
                    for a in args]
        return self.backend._compile_static(static, examples, self.compile_fn, self.io, found_on_gm=False)


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


def tome(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
         mode: str | None = None) -> Callable[..., Any]:
    """The backend registered as ``"tome"``: ``torch.compile(m, backend="tome", options={...})``.

    ``options`` are ToMe's (any :class:`ToMeConfig` field, plus ``compiler``); ``mode`` is the
    inner inductor's. A fresh backend per compile: its partition sequence starts from
    ``options["seed"]``.
    """
    opts = dict(options or {})
    compiler = opts.pop("compiler", "inductor")
    return tome_backend(compiler=compiler, **opts)(gm, example_inputs, mode=mode)
