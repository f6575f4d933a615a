"""Decide, per attention site, whether and how its block is merged: a plan, or a reason not to.

Checks only (no graph change), in the manner of onnxscript's rule ``check``s: every function
returns either what the rewrite needs or a :class:`Skip` with a one-line reason for the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tome_compile.passes import sites as _sites
from torch import fx

from tome_compile import merge as _merge
from tome_compile import plans as _plans
from tome_compile.config import ToMeConfig, format_blocks

__all__ = ["STORED_REFERENCE", "BlockPlan", "Skip", "Target", "decide_all", "decide_site",
           "select_blocks"]


@dataclass(frozen=True)
class Skip:
    """Why a site is left alone (with the grid facts known so far, for the report)."""

    reason: str
    grid: tuple[int, int] | None = None
    downsample: int | None = None
    cause: str = ""  # what the reason says, as data: "blocks", "downsample", "stored-reference", ...
    block: int | None = None  # "blocks": the block's index among the spatial self-attention blocks


@dataclass(frozen=True)
class Target:
    """One region merged with the block's plan: ``output(region(input))``."""

    input: fx.Node
    output: fx.Node
    region: tuple[fx.Node, ...]
    path: str  # module path of the region (…transformer_blocks.0.attn2)
    name: str  # "attn1", "attn2", "ff"
    bakes_tokens: bool = False  # classic AttnProcessor: reshapes hold the token count literally
    # joint attention: the image stream's parts of q, k and v are merged at their concatenation
    # and the image part of the attention's output unmerged (``output`` is the attention op)
    joint: bool = False


@dataclass(frozen=True)
class BlockPlan:
    """A transformer block the pass will rewrite, everything decided from shapes."""

    site: _sites.AttentionSite
    metric: fx.Node  # the block input x of norm1(x): tomesd's similarity metric
    tokens: int  # N
    merged: int  # r
    grid: tuple[int, int]  # (h, w) of the block's token grid
    downsample: int
    targets: tuple[Target, ...] = field(default_factory=tuple)
    # the node whose last two axes are the grid ``downsample`` divides (the pass's first convolution):
    # the rewritten graph computes the block's sizes from it at every call (None: fixed sizes)
    source: fx.Node | None = None


def _short(path: str, block: str) -> str:
    return path[len(block) + 1:] if block and path.startswith(block + ".") else path


def _block_size(site: _sites.AttentionSite, config: ToMeConfig,
                latent: tuple[int, int] | None, rows: int | None = None) -> tuple[int, int, int, int] | Skip:
    """``(N, h, w, downsample)`` of a self-attention's block, or why it is not merged."""
    if site.kind not in ("self-attention", "joint-attention") or site.problem is not None:
        return Skip(site.problem or "not a self-attention (q, k, v are not projections of one tensor)")
    temporal = _sites.temporal_reason(site, rows)
    if temporal is not None:  # before the grid check: 16 frames of a 64x64 latent look like a 4x4 grid
        return Skip(temporal)
    if latent is None:
        return Skip("latent size unknown (no conv_in input shape); pass latent_hw=")
    n = int(site.tokens or 0)
    downsample, h, w = _sites.block_grid(latent, n)
    if h * w != n:
        return Skip(f"{n} tokens do not form the {h}x{w} grid of a {latent[0]}x{latent[1]} latent",
                    downsample=downsample)
    if downsample > config.max_downsample:
        threshold = (latent[0] * latent[1]) // (config.max_downsample ** 2)
        return Skip(f"downsample {downsample} > max_downsample={config.max_downsample} "
                    f"({n} tokens < {threshold})", (h, w), downsample, cause="downsample")
    if _merge.partition_cells(h, w, config.sx, config.sy) == 0:
        return Skip(f"the {h}x{w} token grid is narrower than the sx={config.sx} x sy={config.sy} "
                    "destination stride: no destination cell, left unmerged", (h, w), downsample)
    return n, h, w, downsample


def _merge_count(n: int, h: int, w: int, config: ToMeConfig) -> int:
    """tomesd's ``r = int(N * ratio)``, capped at the sources (and, for importance, so that both
    the importance and the fallback plan merge the same count)."""
    return int(_plans.merge_count(n, _merge.partition_cells(h, w, config.sx, config.sy), config.ratio,
                                  config.method == "importance", config.dst_fraction))


def _targets(site: _sites.AttentionSite, found: list[_sites.AttentionSite], graph: fx.Graph,
             config: ToMeConfig) -> list[Target] | str:
    """The regions of the block merged with one plan (attn1; attn2 / ff when asked), or why not."""
    block = site.block_path
    same = [s for s in found if s.block_path == block and s.unet_pass == site.unet_pass]  # this pass's block
    classic = {_short(s.path, block) for s in same if s.form == "classic"}
    out: list[Target] = []
    if config.merge_attn:
        assert site.output is not None
        name = _short(site.path, block)
        out.append(Target(input=site.input, output=site.output, region=tuple(site.nodes), path=site.path,
                          name=name, bakes_tokens=name in classic, joint=site.joint is not None))
    if config.merge_crossattn:
        for c in (s for s in same if s.kind == "cross-attention"):
            if c.problem is not None or c.output is None:
                return f"{c.path}: {c.problem}"
            name = _short(c.path, block)
            out.append(Target(input=c.input, output=c.output, region=tuple(c.nodes), path=c.path, name=name,
                              bakes_tokens=name in classic))
    # a single-stream joint block (Flux) has no MLP of its own: proj_mlp runs beside the attention,
    # on the concatenated streams; its attention is still merged
    if config.merge_mlp and not (site.joint is not None and site.joint.single):
        ff = _sites.region_nodes(graph, block + ".ff", site.span)
        exits = _sites.region_exits(ff)
        inside = set(ff)
        inputs = {a for node in ff for a in node.all_input_nodes
                  if a not in inside and _sites.node_shape(a) == _sites.node_shape(site.input)}
        if len(exits) != 1 or len(inputs) != 1:
            return f"{block}.ff: region has {len(inputs)} inputs / {len(exits)} outputs"
        out.append(Target(input=inputs.pop(), output=exits[0], region=tuple(ff), path=block + ".ff",
                          name="ff"))
    return out


def decide_site(
    site: _sites.AttentionSite,
    found: list[_sites.AttentionSite],
    graph: fx.Graph,
    config: ToMeConfig,
    latent: tuple[int, int] | None,
    rows: int | None = None,
    source: fx.Node | None = None,
) -> BlockPlan | Skip:
    """The plan for ``site``'s block, or why it is skipped (tomesd's rule, from shapes). ``rows``:
    the latent's batch at ``conv_in`` (B x F for a video U-Net), to tell temporal attention apart."""
    if site.kind == "cross-attention":
        temporal = _sites.temporal_reason(site, rows)
        return Skip("cross-attention" + (f" ({site.problem})" if site.problem else "")
                    + (f"; {temporal}" if temporal else ""))
    size = _block_size(site, config, latent, rows)
    if isinstance(size, Skip):
        return size
    n, h, w, downsample = size
    if config.method == "todo":
        if site.joint is not None:
            return Skip("ToDo on joint attention is not built (ToMe and importance merge it)", (h, w),
                        downsample)
        return _todo_plan(site, config, n, h, w, downsample, source)
    r = _merge_count(n, h, w, config)
    if r <= 0:
        return Skip(f"ratio={config.ratio} merges no token of {n}", (h, w), downsample)
    # tomesd's metric is the block input: what the attention's norm reads, or (a single-stream
    # joint block, which normalises the concatenated streams) the image stream as it enters
    single = site.joint is not None and site.joint.single
    metric = site.input if single else _sites.norm_input(site.input)
    if metric is None:
        return Skip("attention input is not a layer norm of the block input", (h, w), downsample)
    targets = _targets(site, found, graph, config)
    if isinstance(targets, str):
        return Skip(f"cannot merge every requested module ({targets})", (h, w), downsample)
    if not targets:
        return Skip("merge_attn, merge_crossattn and merge_mlp are all off", (h, w), downsample)
    return BlockPlan(site=site, metric=metric, tokens=n, merged=r, grid=(h, w), downsample=downsample,
                     targets=tuple(targets), source=source)


def _todo_plan(site: _sites.AttentionSite, config: ToMeConfig, n: int, h: int, w: int, downsample: int,
               source: fx.Node | None) -> BlockPlan | Skip:
    """ToDo's block: keys and values from the grid downsampled by ``downsample_factor``
    (``merged``: the K/V tokens it takes away), or why not."""
    f = config.downsample_factor
    kv = (h // f) * (w // f)
    if kv == 0:
        return Skip(f"the {h}x{w} token grid is smaller than downsample_factor={f}", (h, w), downsample)
    projections = _sites.kv_projections(site)
    if isinstance(projections, str):
        return Skip(f"keys and values cannot be downsampled alone: {projections}", (h, w), downsample)
    assert site.output is not None
    target = Target(input=site.input, output=site.output, region=tuple(site.nodes), path=site.path,
                    name=_short(site.path, site.block_path))
    return BlockPlan(site=site, metric=site.input, tokens=n, merged=n - kv, grid=(h, w),
                     downsample=downsample, targets=(target,), source=source)


# The skip reason of a self-attention whose input the graph hands out (kept for a later call)
STORED_REFERENCE = "reference write pass: its input is stored for a later call"


def decide_all(gm: fx.GraphModule, found: list[_sites.AttentionSite], passes: list[_sites.UNetPass],
                config: ToMeConfig, latent_hw: tuple[int, int] | None) -> list[BlockPlan | Skip]:
    """Each site's decision against its own U-Net pass (a DiT's patch grid, a U-Net's latent). A
    self-attention whose input is another site's reference (Zero123++'s write pass over the
    condition latent) is left unmerged: its input is the reference the read pass attends to."""
    readers = {s.reference: s for s in found if s.reference is not None}
    out: list[BlockPlan | Skip] = []
    for site in found:
        unet_pass = passes[min(site.unet_pass, len(passes) - 1)]
        reader = readers.get(site.input)
        if reader is not None and site.kind == "self-attention":
            out.append(Skip(f"reference pass: its input is the reference {reader.path} (pass "
                            f"{reader.unet_pass}) attends to; left unmerged", cause="reference-pass"))
            continue
        if site.kind == "self-attention" and any(user.op == "output" for user in site.input.users):
            out.append(Skip(STORED_REFERENCE + " (a graph output: a reference-only write pass, e.g. "
                            "Zero123++'s inner U-Net compiled alone); left unmerged",
                            cause="stored-reference"))
            continue
        grid = unet_pass.grid or latent_hw or unet_pass.latent
        if site.joint is not None:
            _sites.pick_image_stream(site, unet_pass.grid or latent_hw)
        source = unet_pass.conv if unet_pass.grid is not None else None
        out.append(decide_site(site, found, gm.graph, config, grid, unet_pass.rows, source))
    return out


def select_blocks(decisions: list[BlockPlan | Skip], found: list[_sites.AttentionSite], config: ToMeConfig,
                   passes: list[_sites.UNetPass]) -> list[BlockPlan | Skip]:
    """``config.blocks``: keep the plans of the listed blocks (index k = the k-th spatial
    self-attention block in execution order; PixArt's ``transformer_blocks.k``)."""
    if config.blocks is None:
        return decisions
    out: list[BlockPlan | Skip] = []
    k = 0
    for site, decision in zip(found, decisions, strict=True):
        rows = passes[min(site.unet_pass, len(passes) - 1)].rows
        spatial = ((site.kind == "self-attention" or site.image is not None)  # a joint attention's image
                   and _sites.temporal_reason(site, rows) is None)
        if spatial and isinstance(decision, BlockPlan) and k not in config.blocks:
            shown = format_blocks(config.blocks)
            decision = Skip(f"block {k} is not in blocks={shown}", decision.grid, decision.downsample,
                            cause="blocks", block=k)
        out.append(decision)
        k += spatial
    return out
