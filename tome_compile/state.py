"""Call state: what a ToMe model carries from one U-Net call to the next, who owns it, and the one
driver that runs the per-call sequence for the ``torch.compile`` backend and ``ToMeSession`` alike.

Two things live between calls: importance merging's guidance map (made from one call's output,
used by the next: Wu et al. 2025 rank tokens by the previous step's CFG magnitude) and
``plan_every``'s plans (made on one call, reused by the next ``k - 1``). Both belong to **one
generation of one caller**, never to whoever calls the model next:

* **Owner.** Inside ``with generation():`` — which :func:`tome_compile.apply` opens around every
  pipeline call's denoising loop — the state belongs to that generation (a ``ContextVar``: each
  thread and each asyncio task sees its own). Outside one, it belongs to the calling thread.
  Two threads never see each other's maps, plans or random draws.
* **Generation boundaries.** Inside ``generation()`` they are known: the first call of a generation
  has no map and no plans, and nothing is guessed (timesteps may rise: DDIM inversion). Bare calls
  outside one use a documented rule: a call starts a new generation when the latent shape (or
  batch) changes, or when its timestep is not below the previous call's — except the second call
  at a timestep the generation reached from above (Heun, DPM2: two calls per step). Its limits: a
  new generation that starts *below* where the last one stopped (img2img after an interrupted run)
  is not seen; use ``apply()`` or ``generation()`` there.
* **Random draws.** Each generation draws its destination partitions from a generator seeded at
  its start (the model's seed, or ``generation(seed=...)``), so an image never depends on what
  ran before it: a second image right after the first is the image a fresh model makes.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tome_compile.config import ToMeConfig
from tome_compile.guidance import GuidanceLayout, importance_map
from tome_compile.inputs import ToMeInputSpec, draw_tome_inputs
from tome_compile.sampler import PartitionSampler

__all__ = ["CallDriver", "CallState", "Generation", "current_generation", "generation", "timestep_value"]

logger = logging.getLogger("tome_compile")

# rises in a row (a one-call generation each) after which the bare-call rule says it is guessing
_INVERSION_CALLS = 3


class Generation:
    """One generation (a pipeline call, a request): the owner of the call state of every ToMe
    model called inside ``with generation():``. ``seed`` overrides the models' partition seed;
    ``guidance`` names this generation's guidance layout (``tome_compile.guidance``) where the
    caller knows it: an importance graph built for another layout makes no map in it."""

    explicit = True

    def __init__(self, seed: int | None = None, guidance: str | None = None) -> None:
        self.seed = seed
        self.guidance = guidance

    def __repr__(self) -> str:
        return f"Generation(seed={self.seed!r}, guidance={self.guidance!r})"


class _ThreadOwner:
    """The owner of a thread's state outside any ``generation()`` (bare calls)."""

    explicit = False
    seed = None
    guidance = None


_current: contextvars.ContextVar[Generation | None] = contextvars.ContextVar("tome_generation", default=None)


class generation:  # noqa: N801 - used as a function: ``with tome_compile.generation():``
    """Every ToMe call inside is one generation: fresh state at the first call, no guessing after.

        with tome_compile.generation():
            for t in scheduler.timesteps:
                noise = unet(latents, t, encoder_hidden_states=emb).sample
                ...

    ``seed``: seed of this generation's destination partitions (default: each model's own).
    ``guidance``: the layout of its batches (``"cfg"``, ``"pix2pix"``, ``"pag"``, ``"none"``) when
    known (``"auto"`` and ``None``: not known, each model's own rule). Nested ``generation()``
    blocks start a new generation each; the outer one resumes after. A pipeline call of a pipeline
    that :func:`tome_compile.apply` marked is a generation of its own that takes this one's seed and
    guidance. The object may be entered again (also nested): each ``with`` is a new generation.
    """

    def __init__(self, seed: int | None = None, guidance: str | None = None) -> None:
        from tome_compile.guidance import GUIDANCE

        if seed is not None:
            check_seed(seed, "generation(seed=...)")
        if guidance is not None and guidance not in GUIDANCE:
            from tome_compile.errors import ToMeConfigError

            raise ToMeConfigError(f"guidance={guidance!r} is unknown; use one of {tuple(GUIDANCE)}")
        self.seed = seed
        self.guidance = None if guidance == "auto" else guidance
        self._tokens: list[contextvars.Token[Generation | None]] = []

    def __enter__(self) -> Generation:
        current = Generation(self.seed, self.guidance)
        self._tokens.append(_current.set(current))
        return current

    def __exit__(self, *exc: object) -> None:
        token = self._tokens.pop()
        with contextlib.suppress(ValueError):  # a generator closed in another context (a GC'd loop)
            _current.reset(token)


def current_generation() -> Generation | None:
    """The innermost ``generation()`` the caller is in, or None."""
    return _current.get()


def check_seed(seed: Any, what: str) -> None:
    """One line for a seed the generators and the int64 seed input cannot take."""
    from tome_compile.errors import ToMeConfigError

    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ToMeConfigError(f"{what}={seed!r} must be an int or None")
    if not 0 <= seed < 2 ** 63:
        raise ToMeConfigError(
            f"{what}={seed} is outside [0, 2**63 - 1]; use a smaller seed (e.g. seed % 2**63)"
        )


def timestep_value(timestep: object) -> float | None:
    """The scalar timestep of a call (its first element): torch, NumPy or Python; None if unknown."""
    if isinstance(timestep, torch.Tensor):
        return float(timestep.reshape(-1)[0]) if timestep.numel() else None  # CPU tensor: no device sync
    if hasattr(timestep, "dtype") and hasattr(timestep, "reshape"):  # np.ndarray, np.generic
        flat = timestep.reshape(-1)  # type: ignore[attr-defined]
        return float(flat[0]) if flat.size else None
    if isinstance(timestep, (int, float)) and not isinstance(timestep, bool):
        return float(timestep)
    return None


class CallState:
    """What one model carries between the calls of one generation of one caller."""

    def __init__(self, sampler: PartitionSampler, epoch: int) -> None:
        self.sampler = sampler
        self.epoch = epoch
        self.map: torch.Tensor | None = None  # importance: the guidance map of the previous call
        self.plans: tuple[torch.Tensor, torch.Tensor] | None = None  # plan_every: packed plans
        self.plan_kind: str | None = None
        self.plan_age = 0  # calls that have used ``plans``, the one that made them included
        self.plans_made = 0
        self.calls = 0  # calls of this caller (every generation)
        self.generations = 0
        self.shape: tuple[int, ...] | None = None
        self.timestep: float | None = None
        self.first: float | None = None  # the generation's first timestep
        self.repeats = 0  # calls in a row at ``timestep``
        self.generation_calls = 0
        self.rises = 0  # one-call generations in a row started by a rising timestep

    def forget(self) -> None:
        """Drop the map and the plans (the next call falls back to ToMe and plans afresh)."""
        self.map = None
        self.plans = None
        self.plan_kind = None
        self.plan_age = 0

    def keep_plans(self, kind: str, plans: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.plans, self.plan_kind, self.plan_age = plans, kind, 1
        self.plans_made += 1


@dataclass
class Call:
    """What one call uses, decided before it runs (:meth:`CallDriver.begin`)."""

    state: CallState
    kind: str  # "tome" (also importance's fallback) | "importance"
    layout: GuidanceLayout | None  # the guidance layout its output's map is made with (None: no map)
    map: torch.Tensor | None
    plans: tuple[torch.Tensor, torch.Tensor] | None  # the plans it reuses (None: it plans)
    random: bool  # draw random destinations (tomesd: not at an odd batch)

    @property
    def graph(self) -> str:
        """The kind of graph that runs it: "reuse" when it reuses plans, else its kind."""
        return "reuse" if self.plans is not None else self.kind


class _NoModel:
    """The key of a driver that serves one model (``ToMeSession``)."""


_NO_MODEL = _NoModel()


class _Owned:
    """One owner's states, by model (a parameter of the model: one backend may serve two)."""

    def __init__(self) -> None:
        self.states: WeakIdKeyDictionary = WeakIdKeyDictionary()  # compared by identity, held weakly
        self.last: CallState | None = None


class CallDriver:
    """The per-call sequence of one ToMe model family, written once for the compiled backend and
    for ``ToMeSession``: :meth:`begin` (which state, a new generation or not, map or fallback,
    reuse or plan), :meth:`inputs` (the values of the graph's ToMe inputs), :meth:`finish` (what
    to keep: the plans the call returned, the map its output makes).

    Args:
        seed: partition seed of every generation (``None``: from the OS).
        generator: draw from this generator instead (shared by every caller, never restarted).
        plan_every: reuse plans for this many calls (1: never).
        say: reports a warning once (the owner's ``say_once``).
    """

    def __init__(self, *, seed: int | None, generator: torch.Generator | None = None, plan_every: int = 1,
                 say: Callable[[str], None] | None = None) -> None:
        self.base_seed = seed
        self.seed = seed
        self.generator = generator
        self.plan_every = plan_every
        self.say = say or (lambda message: logger.warning("%s", message))
        self.epoch = 0
        # calls of every caller by the plans they used ("tome" includes importance's fallback)
        self.calls_by_kind: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._owners: weakref.WeakKeyDictionary[Any, _Owned] = weakref.WeakKeyDictionary()
        self._local = threading.local()

    @classmethod
    def for_config(cls, config: ToMeConfig, *, seed: int | None, generator: torch.Generator | None = None,
                   say: Callable[[str], None] | None = None) -> CallDriver:
        """The driver of a model rewritten with ``config`` (its ``plan_every``)."""
        return cls(seed=seed, generator=generator, plan_every=config.plan_every, say=say)

    # -- who owns the state -------------------------------------------------------------------
    def _owner(self) -> Any:
        owner = _current.get()
        if owner is None:
            owner = getattr(self._local, "owner", None)
            if owner is None:
                owner = self._local.owner = _ThreadOwner()
        return owner

    def state(self, model_key: Any = None) -> CallState | None:
        """The current caller's state for ``model_key`` (default: the model it called last), if any."""
        owned = self._owners.get(self._owner())
        if owned is None:
            return None
        return owned.last if model_key is None else owned.states.get(model_key)

    def _state_for(self, owner: Any, model_key: Any) -> tuple[CallState, bool]:
        with self._lock:
            owned = self._owners.get(owner)
            if owned is None:
                owned = self._owners[owner] = _Owned()
            key = _NO_MODEL if model_key is None else model_key
            state = owned.states.get(key)
            created = state is None
            if state is None:
                state = owned.states[key] = CallState(self._sampler(owner), self.epoch)
            owned.last = state
        return state, created

    def _sampler(self, owner: Any) -> PartitionSampler:
        seed = owner.seed if owner.seed is not None else self.seed
        return PartitionSampler(seed, self.generator)

    def reset(self, seed: int | None = None) -> None:
        """Every caller's next call starts a new generation (from ``seed``, else the model's seed)."""
        self.seed = self.base_seed if seed is None else seed
        self.epoch += 1

    # -- one call ---------------------------------------------------------------------------------
    def begin(self, model_key: Any, sample_shape: Sequence[int], timestep: object, *,
              layout: GuidanceLayout | None, keeps_plans: bool, random: bool = True) -> Call:
        """Start a call: find the caller's state, start a new generation where one begins, and
        decide what the call uses. ``layout``: the guidance layout of the model's importance graph
        (None: no importance graph for this batch)."""
        owner = self._owner()
        if layout is not None and owner.guidance is not None and owner.guidance != layout.name:
            if owner.guidance == "none":  # no guidance rows to rank tokens by: ToMe, as documented
                logger.debug("ToMe: this generation has no guidance: no importance map (ToMe plans)")
            else:
                self.say(f"ToMe: this generation's batches are {owner.guidance!r} guidance but the "
                         f"importance graph pairs {layout.name!r} rows: its calls use ToMe plans, never a "
                         f"map of another layout; compile the model for this layout (tome_backend("
                         f"guidance={owner.guidance!r}), or tome_compile.apply(pipe) on its own denoiser)")
            layout = None
        state, created = self._state_for(owner, model_key)
        # the timestep is read (one scalar) only where the bare-call rule needs it
        shape = tuple(int(d) for d in sample_shape)
        t = None if owner.explicit else timestep_value(timestep)
        if created or state.epoch != self.epoch or self._starts_generation(state, owner, shape, t):
            self._start_generation(state, owner)
        elif shape != state.shape:  # inside an explicit generation: the old map / plans do not fit
            state.forget()
        if t is not None and t == state.timestep:
            state.repeats += 1
        else:
            state.repeats = 1
        if state.generation_calls == 0:
            state.first = t
        state.shape, state.timestep = shape, t
        state.generation_calls += 1
        kind = "importance" if layout is not None and state.map is not None else "tome"
        with self._lock:
            self.calls_by_kind[kind] += 1
        plans = None
        if (keeps_plans and state.plans is not None and state.plan_kind == kind
                and state.plan_age < self.plan_every):
            state.plan_age += 1
            plans = state.plans
        return Call(state=state, kind=kind, layout=layout, map=state.map if kind == "importance" else None,
                    plans=plans, random=random)

    def _starts_generation(
        self, state: CallState, owner: Any, shape: tuple[int, ...], t: float | None
    ) -> bool:
        """The bare-call rule (module doc); never inside an explicit ``generation()``."""
        if owner.explicit:
            return False
        if shape != state.shape:
            return True
        if t is None or state.timestep is None or t < state.timestep:
            return False
        if t == state.timestep and state.first is not None and t < state.first and state.repeats == 1:
            return False  # the second call of a two-call step (Heun, DPM2)
        if t > state.timestep:
            state.rises = state.rises + 1 if state.generation_calls == 1 else 1
            if state.rises >= _INVERSION_CALLS:
                self.say("ToMe: the timestep rose at every call (DDIM inversion?): each call starts a new "
                         "generation, so plan_every never reuses a plan and importance merging never has a "
                         "map; run the loop inside `with tome_compile.generation():` (tome_compile.apply() "
                         "does this for a pipeline call)")
        else:
            state.rises = 0
        return True

    def _start_generation(self, state: CallState, owner: Any) -> None:
        state.forget()
        state.sampler = self._sampler(owner)
        state.epoch = self.epoch
        state.first, state.timestep, state.repeats, state.generation_calls = None, None, 0, 0
        state.generations += 1

    def inputs(
        self, call: Call, specs: Sequence[ToMeInputSpec], device: torch.device | str
    ) -> list[torch.Tensor]:
        """Values of ``specs`` for this call, drawn from the caller's generator in tomesd's order."""
        return draw_tome_inputs(specs, call.state.sampler, call.map, device, call.plans, random=call.random)

    def finish(self, call: Call, output: torch.Tensor | None, plans: tuple[torch.Tensor, torch.Tensor] | None,
               channel_axis: int = 1, channels: int | None = None) -> None:
        """After the call: keep the plans it made (its extra outputs) and the map its output makes
        (with the call's guidance layout; none without one)."""
        state, layout = call.state, call.layout
        state.calls += 1
        if plans is not None and call.plans is None:
            state.keep_plans(call.kind, plans)
        if layout is None or output is None:
            state.map = None
            return
        if output.dim() in (4, 5) and output.shape[0] % layout.groups == 0 and output.shape[0] > 0:
            state.map = importance_map(output.detach(), layout, channel_axis, channels)
        else:
            state.map = None
