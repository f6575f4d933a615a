"""The site report: one row per attention site (rewritten, or skipped with its reason), and the one
line that says why nothing was rewritten. Skip reasons travel as data (``Skip.cause``,
``ToMeSite.cause``): nothing here parses a report string."""

from __future__ import annotations

import logging

from tome_compile.passes.context import PassContext, plan_makers
from tome_compile.passes.decide import BlockPlan, Skip
from tome_compile.passes.result import ToMeResult, ToMeSite
from tome_compile.passes.sites import AttentionSite, size_hint

from tome_compile.config import ToMeConfig, format_blocks

__all__ = ["nothing_rewritten", "site_report"]

logger = logging.getLogger("tome_compile.passes")


def site_report(found: list[AttentionSite], decisions: list[BlockPlan | Skip], kept: list[BlockPlan],
                failures: dict[str, str], context: PassContext) -> list[ToMeSite]:
    """One row per attention site, in graph order."""
    config, note = context.config, context.note
    by_path = {(p.site.path, p.site.unet_pass): p for p in kept}
    makers = plan_makers(kept, config)
    sharing = {p.site.path: kept[m].site.path for p, m in zip(kept, makers, strict=True) if kept[m] is not p}
    merged_with = {t.path: p for p in kept for t in p.targets if t.path != p.site.path}
    rows = []
    for site, decision in zip(found, decisions, strict=True):
        plan, partner = by_path.get((site.path, site.unet_pass)), merged_with.get(site.path)
        kind = site.kind + (" + reference" if site.reference is not None else "")
        row = {"path": site.path, "kind": kind, "tokens": site.tokens}
        if plan is not None:
            maker = sharing.get(site.path)
            todo = context.method == "todo"  # nothing merged, nothing planned: K/V shortened (kv_tokens)
            reason = (
                _joint_line(site, plan.tokens - plan.merged)
                + f"downsample {plan.downsample} <= max_downsample={config.max_downsample}"
                + ("" if todo else f", r={plan.merged}") + note
                + (f"; plan shared from {maker}" if maker else "")
                + (f"; {site.reference_tokens} reference tokens kept" if site.reference is not None else "")
            )
            rows.append(ToMeSite(**row, tokens_after=plan.tokens if todo else plan.tokens - plan.merged,
                                 grid=plan.grid, downsample=plan.downsample, rewritten=True, reason=reason,
                                 targets=tuple(t.name for t in plan.targets),
                                 kv_tokens=plan.tokens - plan.merged if todo else None))
        elif partner is not None:
            rows.append(ToMeSite(**row, tokens_after=partner.tokens - partner.merged, grid=partner.grid,
                                 downsample=partner.downsample, rewritten=True,
                                 reason=f"merged with the plan of {partner.site.path} (merge_crossattn)"))
        elif site.path in failures:
            rows.append(ToMeSite(**row, tokens_after=None, grid=None, downsample=None, rewritten=False,
                                 reason=f"rewrite failed the shape check ({failures[site.path]})"))
        else:
            skip = decision if isinstance(decision, Skip) else Skip("not rewritten")
            if not config.enabled and site.kind != "cross-attention":
                nothing = (f"downsample_factor={config.downsample_factor}: nothing to downsample"
                           if config.method == "todo" else f"ratio={config.ratio}: nothing to merge")
                skip = Skip(nothing, skip.grid, skip.downsample, "ratio")
            rows.append(ToMeSite(**row, tokens_after=None, grid=skip.grid, downsample=skip.downsample,
                                 rewritten=False, reason=skip.reason, cause=skip.cause, block=skip.block))
    logger.info("ToMe: rewrote %d of %d attention sites", sum(r.rewritten for r in rows), len(rows))
    for row in rows:
        logger.debug("ToMe site %s", row.line())
    return rows


def _joint_line(site: AttentionSite, kept: int) -> str:
    """A joint attention's streams, as merged: "joint attention, image 4096 → 2048, text 333 kept; "
    (Flux's single-stream blocks: "single-stream joint attention, ...")."""
    if site.joint is None or site.image is None:
        return ""
    text = [str(size_hint(n)) for i, n in enumerate(site.joint.tokens) if i != site.image]
    single = "single-stream " if site.joint.single else ""
    return f"{single}joint attention, image {site.tokens} → {kept}, text {' + '.join(text)} kept; "


def nothing_rewritten(result: ToMeResult, config: ToMeConfig) -> str | None:
    """Why ToMe was asked for but rewrote no site (one line: the fix included), or None — when
    something was rewritten, nothing was asked (``ratio=0``) or the graph has no self-attention."""
    if result.modified or not config.enabled:
        return None
    candidates = [s for s in result.sites if s.kind != "cross-attention"]
    downsamples = [s.downsample for s in candidates if s.downsample is not None]
    by_blocks = [s.block for s in candidates if s.cause == "blocks" and s.block is not None]
    if config.blocks is not None and by_blocks:
        found = format_blocks(tuple(by_blocks))
        return (f"ToMe rewrote nothing: blocks={format_blocks(config.blocks)} selects none of the blocks "
                f"max_downsample={config.max_downsample} allows in this model ({found}, in execution order)")
    if downsamples and min(downsamples) > config.max_downsample:
        return (f"ToMe rewrote nothing: this model's highest-resolution self-attention is "
                f"downsampled {min(downsamples)}x, above max_downsample={config.max_downsample}; "
                f"use max_downsample={min(downsamples)} (SDXL has no attention at full resolution)")
    if candidates:
        return "ToMe rewrote nothing: " + "; ".join(sorted({f"{s.path}: {s.reason}" for s in candidates}))
    return None  # a graph without self-attention (e.g. a text encoder) is not a surprise
