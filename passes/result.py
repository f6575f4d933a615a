"""What a pass run did: the site report and the :class:`ToMeResult` that the ToMe pass returns and
every follow-up pass (:mod:`.follow_up`) takes and returns. Neither pass module imports the other:
both read this one."""

from __future__ import annotations

from dataclasses import dataclass, field

from tome_compile.passes.unet_io import UNetIO
from torch import fx

from tome_compile.config import ToMeConfig
from tome_compile.guidance import GuidanceLayout
from tome_compile.inputs import ToMeInputSpec

__all__ = ["PLAN_STATES", "ToMeResult", "ToMeSite"]

# How a graph handles plan state: None (no state, tomesd), "make" (plan every block, return the
# plans as extra outputs), "reuse" (take every plan from the inputs, no matching at all), "either"
# (one graph for both: a tome_reuse_plan input picks per call, the plans used are returned).
PLAN_STATES = (None, "make", "reuse", "either")


@dataclass(frozen=True)
class ToMeSite:
    """One row of the site report."""

    path: str
    kind: str
    tokens: int | None
    tokens_after: int | None
    grid: tuple[int, int] | None
    downsample: int | None
    rewritten: bool
    reason: str
    targets: tuple[str, ...] = ()
    cause: str = ""  # a skipped site's reason as data (decide.Skip.cause): "blocks", "downsample", ...
    block: int | None = None  # cause "blocks": the block's index among the spatial self-attention blocks
    kv_tokens: int | None = None  # ToDo: the keys' and values' tokens (every query kept)

    def line(self) -> str:
        tokens = "?" if self.tokens is None else str(self.tokens)
        after = f" -> {self.tokens_after}" if self.rewritten and self.kv_tokens is None else ""
        kv = f" (K/V {tokens} -> {self.kv_tokens})" if self.rewritten and self.kv_tokens is not None else ""
        state = "rewritten" if self.rewritten else "skipped"
        what = f" [{'+'.join(self.targets)}]" if self.targets else ""
        return f"{self.path}  {self.kind}  {tokens}{after} tokens{kv}  {state}{what}: {self.reason}"


@dataclass
class ToMeResult:
    """What the pass did: the (rewritten) module, whether it changed, and every candidate site.

    ``inputs`` describes the graph inputs the pass appended, in order: the caller feeds them last
    (:func:`tome_compile.inputs.draw_tome_inputs` draws their values). ``outputs`` describes the
    graph outputs a follow-up pass appended after the model's own (the plan state of
    ``keep_plans`` / ``either_plans``: ``plan_state`` says which). ``method`` is the method the
    graph's plans use ("tome" when importance had no CFG pair to work from).
    """

    graph_module: fx.GraphModule
    modified: bool
    sites: list[ToMeSite]
    inputs: list[ToMeInputSpec] = field(default_factory=list)
    latent_hw: tuple[int, int] | None = None
    batch: int | None = None
    method: str = "tome"
    outputs: list[ToMeInputSpec] = field(default_factory=list)
    plan_state: str | None = None
    guidance: GuidanceLayout | None = None  # importance: the layout its plans and map assume
    io: UNetIO | None = None  # the graph's U-Net inputs, output and passes, as found before the rewrite
    config: ToMeConfig | None = None  # what the pass was run with (the follow-up passes read it)
    plan_batch: int | None = None  # the batch plan state is sized by (a symbolic batch's traced value)

    @property
    def rewritten(self) -> list[ToMeSite]:
        return [s for s in self.sites if s.rewritten]

    @property
    def input_names(self) -> list[str]:
        return [spec.name for spec in self.inputs]

    def summary(self) -> str:
        """A readable table of every candidate site and its decision."""
        head = f"ToMe: rewrote {len(self.rewritten)} of {len(self.sites)} attention sites"
        return "\n".join([head] + ["  " + s.line() for s in self.sites])

    def count_nodes(self, role: str) -> int:
        """Number of inserted nodes with ``node.meta['tome']['role'] == role`` (merge, unmerge, plan)."""
        return sum(1 for n in self.graph_module.graph.nodes
                   if n.meta.get("tome", {}).get("role") == role)
