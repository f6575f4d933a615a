"""What every stage of one pass run shares, decided once from the config and the graph: one frozen
record handed to the rewrite, the validation and the report (never a positional bundle)."""

from __future__ import annotations

from dataclasses import dataclass

from tome_compile.passes.decide import BlockPlan

from tome_compile.config import ToMeConfig
from tome_compile.guidance import GuidanceLayout, random_destinations, resolve_guidance

__all__ = ["PassContext", "pass_context", "plan_makers"]


@dataclass(frozen=True)
class PassContext:
    """How the plans of this graph are made (the same for every block), and its sizes."""

    config: ToMeConfig
    method: str  # "tome" | "importance" | "todo" | "oracle"
    use_rand: bool
    note: str  # appended to each rewritten row's reason
    guidance: GuidanceLayout | None = None  # importance: which rows of the batch are one image's
    latent: tuple[int, int] | None = None  # the sample's latent (h, w): the importance map's size
    batch: int | None = None  # the attention batch plans and maps are sized by


def pass_context(config: ToMeConfig, *, method: str | None, oracle: bool, pairs_of: int | None,
                 latent: tuple[int, int] | None, batch: int | None) -> PassContext:
    """The method the plans use (importance falls back to ToMe where it cannot pair the rows of
    ``pairs_of`` samples), random or fixed destinations (tomesd: fixed for an odd batch)."""
    method = "oracle" if oracle else (method or config.method)
    note = ""
    layout = None
    if method == "importance":
        resolved = resolve_guidance(config.guidance, pairs_of)
        if isinstance(resolved, str):
            method, note = "tome", f"; {resolved}: ToMe plans"
        else:
            layout = resolved
    use_rand = config.use_rand and method not in ("oracle", "todo")
    if use_rand and method == "tome" and not random_destinations(True, pairs_of):
        use_rand, note = False, note + f"; batch {pairs_of} is odd: fixed destinations (as tomesd)"
    tag = {"oracle": "; oracle", "importance": f"; importance ({layout.name if layout else '?'} guidance)",
           "todo": f"; ToDo: keys and values downsampled {config.downsample_factor}x per axis "
                   f"({config.downsample_method}), every query kept"}.get(method, "")
    return PassContext(config=config, method=method, use_rand=use_rand, note=note + tag, guidance=layout,
                       latent=latent, batch=batch)


def plan_makers(plans: list[BlockPlan], config: ToMeConfig) -> list[int]:
    """For each block, the index of the block whose plan it uses: itself, or with ``share_plan``
    the first block with the same token grid and merge count (one plan per resolution level)."""
    first: dict[tuple[int, tuple[int, int], int], int] = {}
    return [first.setdefault((p.tokens, p.grid, p.merged), i) if config.share_plan else i
            for i, p in enumerate(plans)]
