"""Merge math as pure tensor functions (ToMe for SD, importance-based, and the benchmark oracle).

Every function has fixed output shapes given its static arguments (``h, w, sx, sy, r``): no
``.item()``, no host syncs, no data-dependent sizes, no Python loop over the batch or the tokens.
The same functions run in eager mode, under inductor and in ONNX Runtime (through the exporter).

A *plan* is two tensors that describe one merge for one block call:

* ``slot``   ``[B, N]`` int64 — for every token, the output slot it goes to (``0 <= slot < N - r``);
* ``weight`` ``[B, N - r, 1]`` — ``1 / (number of tokens in the slot)``.

``merge(x) = segment_mean(x, slot)`` and ``unmerge(y) = y.gather(slot)``: a merged source copies
its destination's value back, kept tokens go back to their position (Bolya & Hoffman 2023, eq. 1-2).
The slots are laid out like tomesd's merge output: ``[kept sources (by descending score) | destinations]``.

The segment mean is a ``scatter_add`` of values and a multiply by precomputed ``1/count``; ONNX's
``ScatterElements`` has no mean reduction and the torch exporter silently turns
``scatter_reduce("mean")`` into an overwrite, so that op is never used here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = [
    "best_matches",
    "floor_mul",
    "downsample_tokens",
    "destination_partition",
    "fit_importance",
    "gather_rows",
    "importance_partition",
    "importance_plan",
    "importance_pool_size",
    "match_rows",
    "merge_heads",
    "merge_tokens",
    "merge_tokens_by_heads",
    "oracle_merge_heads",
    "oracle_merge_joint",
    "oracle_unmerge_joint",
    "merge_joint",
    "unmerge_joint",
    "oracle_merge",
    "oracle_unmerge",
    "partition_cells",
    "row_max",
    "tie_free_order",
    "tome_plan",
    "unmerge_tokens",
]


def floor_mul(n: Any, factor: float) -> Any:
    """``int(n * factor)`` (tomesd's ``int(N * ratio)``, in float64 as Python computes it) for an int
    or a symbolic size (an exported graph's: ``floor(float(n) * factor)``, the same number)."""
    if isinstance(n, int):
        return int(n * factor)
    return math.floor(torch.sym_float(n) * factor)


def partition_cells(h: int, w: int, sx: int, sy: int) -> int:
    """Number of destination cells (one destination each) of an ``h × w`` grid."""
    return (h // sy) * (w // sx)


def destination_partition(
    choice: torch.Tensor | None, h: int, w: int, sx: int, sy: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the ``h × w`` grid into destinations (one per ``sx × sy`` cell) and sources.

    Args:
        choice: ``[(h // sy) * (w // sx)]`` int64 in ``[0, sx*sy)``: which token of each cell is
            its destination (row-major inside the cell, as tomesd's ``randint(sy*sx)``); ``None``
            picks the top-left token (tomesd's ``use_rand=False``). Leftover rows/columns of a grid
            that the stride does not divide are always sources (as tomesd).
    Returns:
        ``(dst_idx [Nd], src_idx [N - Nd])``, token indices, each in ascending order.
    """
    hsy, wsx = h // sy, w // sx
    n = h * w
    cells_y = torch.arange(hsy, device=device).view(hsy, 1) * sy
    cells_x = torch.arange(wsx, device=device).view(1, wsx) * sx
    if choice is None:
        choice = torch.zeros(hsy * wsx, dtype=torch.int64, device=device)
    choice = choice.view(hsy, wsx).to(device=device, dtype=torch.int64)
    dst_tokens = ((cells_y + choice // sx) * w + cells_x + choice % sx).reshape(-1)
    is_src = torch.ones(n, dtype=torch.int64, device=device).scatter(0, dst_tokens, 0)
    # Unique keys (destinations first, then sources, each by token index): any sort, in any
    # backend, returns the same order. ONNX TopK and torch.sort break ties differently.
    order = torch.argsort(is_src * n + torch.arange(n, device=device))
    nd = hsy * wsx
    return order.narrow(0, 0, nd), order.narrow(0, nd, n - nd)  # narrow: exact sizes when symbolic


def tie_free_order(score: torch.Tensor, descending: bool = True) -> torch.Tensor:
    """``argsort`` of ``score`` along the last dim, ties broken by the lower index, in any backend.

    ONNX TopK and torch's sorts break ties differently, and ``sort(stable=True)`` has no ONNX
    export. So the key is made unique instead: ``score`` (float32 values, exact in float64)
    shifted by ``index * 2**-50``; for scores of magnitude >= 2**-10 that shift is below the
    float32 spacing, so distinct scores keep their order and equal scores order by index.
    """
    n = score.shape[-1]
    step = torch.arange(n, device=score.device, dtype=torch.float64) * 2.0 ** -50
    key = score.to(torch.float64)
    key = key - step if descending else key + step
    return torch.argsort(key, dim=-1, descending=descending)


def _plan_from_matches(
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    edge_order: torch.Tensor,
    best_dst: torch.Tensor,
    r: int,
    n: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots from a ranking of the sources.

    Args:
        src_idx: ``[B, Ns]`` or ``[Ns]`` token index of each source.
        dst_idx: ``[B, Nd]`` or ``[Nd]`` token index of each destination.
        edge_order: ``[B, Ns]`` source positions, the ``r`` to merge first, then the kept ones
            in output order.
        best_dst: ``[B, Ns]`` destination position each source would merge into.
    """
    ns = edge_order.shape[1]
    nd = dst_idx.shape[-1]
    kept = ns - r
    device = edge_order.device
    # Every tensor here is read off this block's own matches (``x * 0`` of an int64 index is
    # exactly 0; a scatter over a permutation overwrites every element of what it starts from):
    # a shape-only ``arange(...).expand(b, n)`` / ``zeros`` / ``empty`` is the same expression in
    # every block with these sizes, which the ONNX exporter and ONNX Runtime's CSE compute once
    # and keep alive from the first block of the U-Net to the last (at the peak of an ORT call).
    # [B, 1] zeros of this block: a sum, whose one column is static (a one-column slice of a symbolic
    # ``Ns`` is ``Min(1, Ns)`` columns, which an export for every image size cannot broadcast in a
    # torch.cond branch)
    none = best_dst.sum(1, keepdim=True) * 0
    rank = edge_order.scatter(1, edge_order, torch.arange(ns, device=device) + none)
    slot_src = torch.where(rank < r, kept + best_dst, rank - r)
    slot_dst = kept + torch.arange(nd, device=device) + none
    tokens = torch.cat([dst_idx + none, src_idx + none], dim=1)
    slots = torch.cat([slot_dst, slot_src], dim=1)
    slot = slots.scatter(1, tokens, slots)  # tokens: a permutation of 0..n-1
    ones = (slot * 0 + 1).to(dtype)
    count = ones.narrow(1, 0, n - r) * 0
    count = count.scatter_add(1, slot, ones)
    return slot, count.reciprocal().unsqueeze(-1)


def _cosine_matches(
    metric: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Best destination of each source by cosine similarity: ``(score [B, Ns], dst [B, Ns])``."""
    # sqrt(sum(x*x)) rather than norm(), and argmax + gather rather than max(dim): the ONNX forms
    # (ReduceSum, ArgMax) are ones ONNX Runtime's symbolic shape inference reads; ReduceL2 and
    # ReduceMax with axes as an input (opset 18) stop it, and with it the optimizer's fusions.
    unit = metric / (metric * metric).sum(dim=-1, keepdim=True).sqrt()
    if src_idx.dim() == 1:
        a = unit.index_select(1, src_idx)
        b = unit.index_select(1, dst_idx)
    else:
        a = gather_rows(unit, src_idx)
        b = gather_rows(unit, dst_idx)
    return best_matches(a, b)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[i, index[i, j]]``: ``[B, M, C]``, ``[B, N]`` -> ``[B, N, C]``, as one row gather over the
    flattened batch. Same numbers as ``x.gather(1, index[..., None].expand(B, N, C))``, but the
    ONNX form is a ``Gather`` of ``B x N`` row numbers: ONNX Runtime materialises the expanded
    ``[B, N, C]`` int64 index of a ``GatherElements`` — twice the bytes of an fp32 activation."""
    b, m, c = x.shape
    index = index.expand(b, -1)
    flat = index + (torch.arange(b, device=index.device) * m).unsqueeze(-1)
    return x.reshape(b * m, c).index_select(0, flat.reshape(-1)).reshape(b, index.shape[1], c)


def match_rows(sources: int, destinations: int, channels: int) -> int:
    """Sources per block of similarity scores: a ``[rows, Nd]`` block holds no more numbers than the
    sources' features ``[Ns, C]`` (a tensor the size of an activation the model holds anyway), so
    the matching never needs the whole ``Ns x Nd`` matrix (SD 1.5 at 1024²: 12288 x 4096 per image,
    9.6 times an activation — the largest temporary of an ONNX Runtime call with fused attention)."""
    return max(1, min(sources, sources * channels // max(destinations, 1)))


def best_matches(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_max(a @ b^T)`` — each source's best destination and its score — computed in blocks of
    :func:`match_rows` sources (a static, unrolled loop: a handful of blocks per rewritten block).
    ``a``: ``[B, Ns, C]``, ``b``: ``[B, Nd, C]`` -> ``(score [B, Ns], index [B, Ns])``."""
    ns, nd, c = a.shape[1], b.shape[1], a.shape[2]
    bt = b.transpose(-1, -2)
    if not isinstance(ns, int) or not isinstance(nd, int):
        return _best_matches_symbolic(a, bt)
    rows = match_rows(ns, nd, c)
    if rows >= ns:
        return row_max(a @ bt)
    blocks = [row_max(a.narrow(1, start, min(rows, ns - start)) @ bt) for start in range(0, ns, rows)]
    return torch.cat([v for v, _ in blocks], dim=1), torch.cat([i for _, i in blocks], dim=1)


def _hint(size: Any) -> int:
    """The traced value of a (possibly symbolic) size."""
    if isinstance(size, int):
        return size
    hint = size.node.hint
    return int(hint) if hint is not None else 1


def _best_matches_symbolic(a: torch.Tensor, bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`best_matches` where the sizes are symbolic (an export for every image size): as many
    blocks as at the traced size, each ``ceil(Ns / blocks)`` sources (the sources padded with zero
    rows to a whole number of blocks, the padding's scores dropped) — the same numbers, no
    size-dependent loop, no data-dependent shape."""
    ns = a.shape[1]
    count = -(-_hint(ns) // match_rows(_hint(ns), _hint(bt.shape[2]), _hint(a.shape[2])))
    if count <= 1:
        return row_max(a @ bt)
    rows = (ns + count - 1) // count
    # blocks picked by a constant index of a [B, count, rows, C] view, not sliced at computed
    # offsets: ONNX Runtime's symbolic shape inference cannot read a Slice at floor(...)
    parts = torch.nn.functional.pad(a, (0, 0, 0, rows * count - ns)).unflatten(1, (count, rows))
    blocks = [row_max(parts.select(1, k) @ bt) for k in range(count)]
    value = torch.cat([v for v, _ in blocks], dim=1).narrow(1, 0, ns)
    return value, torch.cat([i for _, i in blocks], dim=1).narrow(1, 0, ns)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=-1)`` as ``(values, indices)``, first index on ties, via argmax + gather."""
    index = x.argmax(dim=-1, keepdim=True)
    return x.gather(-1, index).squeeze(-1), index.squeeze(-1)


def tome_plan(
    metric: torch.Tensor,
    choice: torch.Tensor | None,
    h: int,
    w: int,
    sx: int,
    sy: int,
    r: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ToMe for SD: bipartite soft matching with a random ``sx × sy`` destination grid.

    Args:
        metric: ``[B, N, C]`` block input (``N = h * w``), the similarity metric.
        choice: see :func:`destination_partition`; shared by the whole batch.
        r: tokens to merge away; capped at the number of sources (as tomesd).
    Returns:
        the plan ``(slot [B, N], weight [B, N - r, 1])``.
    """
    b, n, _ = metric.shape
    with torch.no_grad():
        dst_idx, src_idx = destination_partition(choice, h, w, sx, sy, metric.device)
        r = torch.sym_min(r, src_idx.shape[0])
        score, best = _cosine_matches(metric, src_idx, dst_idx)
        edge_order = tie_free_order(score)
        return _plan_from_matches(src_idx, dst_idx, edge_order, best, r, n, metric.dtype)


def importance_partition(
    importance: torch.Tensor, dst_key: torch.Tensor | None, n: int, r: int, pool_factor: float,
    dst_fraction: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Destinations and sources of each CFG pair (shared by its two halves).

    Returns ``(dst_idx [P, Nd], src_idx [P, N - Nd], unimportant [P, N - Nd])``: token indices in
    ascending order, and 1 where a source is outside the important pool.
    """
    p = importance.shape[0]
    m = importance_pool_size(n, r, pool_factor, dst_fraction)
    nd = floor_mul(n, dst_fraction)
    device = importance.device
    imp = importance.reshape(p, n).to(torch.float32)
    # Unique keys: importance rank, ties by token index (every backend picks the same pool).
    imp = imp / row_max(imp)[0].unsqueeze(-1).clamp_min(1e-30)  # scale-free, for tie_free_order
    pool = tie_free_order(imp).narrow(1, 0, m)  # [P, M]
    if dst_key is None:
        pick = torch.arange(nd, device=device).expand(p, nd)  # the most important of the pool
    else:
        pick = tie_free_order(dst_key.to(torch.float32), descending=False).narrow(1, 0, nd)  # uniform subset
    dst_tok = pool.gather(1, pick)  # [P, Nd]
    is_dst = torch.zeros(p, n, dtype=torch.int64, device=device).scatter(1, dst_tok, 1)
    in_pool = torch.zeros(p, n, dtype=torch.int64, device=device).scatter(1, pool, 1)
    arange_n = torch.arange(n, device=device).expand(p, n)
    order = torch.argsort((1 - is_dst) * n + arange_n, dim=-1)  # destinations first, by token index
    dst_idx, src_idx = order.narrow(1, 0, nd), order.narrow(1, nd, n - nd)
    return dst_idx, src_idx, 1 - in_pool.gather(1, src_idx)


def importance_plan(
    metric: torch.Tensor,
    importance: torch.Tensor,
    dst_key: torch.Tensor | None,
    h: int,
    w: int,
    r: int,
    pool_factor: float,
    dst_fraction: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance-based merging (Wu et al. 2025): keep the tokens the guidance says matter.

    Args:
        metric: ``[B, N, C]`` block input.
        importance: ``[P, h, w]`` importance per token for each of the ``P`` images of the batch
            (``B = G * P``: ``G`` guidance chunks, image ``i`` in rows ``i, P + i, ...``; see
            :mod:`tome_compile.guidance`), already fitted to the block grid. Only ranks matter.
        dst_key: ``[P, M]`` random keys in ``[0, 1)``; each pair's destinations are the pool
            members with the ``int(N * dst_fraction)`` smallest keys (a uniform random subset).
            ``None`` takes the most important members of the pool (deterministic).
    Returns:
        the plan ``(slot [B, N], weight [B, N - r, 1])``; the rows of an image share its partition.

    Method: pool = top ``M = min(int((N - r) * pool_factor), N)`` tokens by importance;
    destinations are drawn from the pool; every other token is a source and takes its most
    similar destination. Every unimportant source is merged; the remaining merges go to the most
    similar important sources; the important sources left over stay independent.
    """
    b, n, _ = metric.shape
    with torch.no_grad():
        dst_idx, src_idx, unimportant = importance_partition(importance, dst_key, n, r, pool_factor,
                                                             dst_fraction)
        ns = src_idx.shape[1]
        r = torch.sym_min(r, ns)
        # Every row of an image (both halves of a CFG pair, the three chunks of a three-way
        # guidance batch) shares its partition; each row matches on its own metric (official code).
        groups = b // importance.shape[0]
        dst_b = dst_idx.repeat(groups, 1)
        src_b = src_idx.repeat(groups, 1)
        score, best = _cosine_matches(metric, src_b, dst_b)
        unimportant = unimportant.repeat(groups, 1)  # [B, Ns]
        # Unimportant sources rank first (+2 > any cosine), then important ones by similarity.
        key = score + 2.0 * unimportant.to(score.dtype)
        edge_order = tie_free_order(key)
        return _plan_from_matches(src_b, dst_b, edge_order, best, r, n, metric.dtype)


def fit_importance(importance: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``[P, H, W] -> [P, h, w]``: area interpolation down to a block's grid (as the official code)."""
    big_h, big_w = importance.shape[-2:]
    if statically_known_true(big_h == h) and statically_known_true(big_w == w):
        return importance
    if all(isinstance(d, int) for d in (big_h, big_w, h, w)):
        return torch.nn.functional.interpolate(importance.unsqueeze(1).float(), size=(h, w),
                                               mode="area")[:, 0]
    # symbolic sizes (an export for every image size): an area interpolation by a whole factor is
    # an average pool with a static window, which ONNX has (an adaptive pool to a symbolic size is
    # not). The map is first brought to ``factor`` times the block's grid (the latent) by a nearest
    # resize — the identity where it has that size: the map's axes are its own symbols, never
    # equal to the latent's, so the graph reads its sizes from the latent and a client that feeds
    # no map (the traced-size default; the ToMe branch runs) is served at every size.
    factor = _hint(big_h) // max(_hint(h), 1)
    grid = torch.nn.functional.interpolate(importance.unsqueeze(1).float(), size=(h * factor, w * factor),
                                           mode="nearest")
    return torch.nn.functional.avg_pool2d(grid, factor)[:, 0]


def importance_pool_size(n: int, r: int, pool_factor: float, dst_fraction: float) -> int:
    """``M = min(int((N - r) * pool_factor), N)``, at least the number of destinations."""
    return torch.sym_min(torch.sym_max(floor_mul(n - r, pool_factor), floor_mul(n, dst_fraction)), n)


def downsample_tokens(x: torch.Tensor, h: Any, w: Any, factor: int, mode: str = "nearest") -> torch.Tensor:
    """ToDo: ``[B, h*w, C] -> [B, (h // factor) * (w // factor), C]``, the token grid interpolated
    down by ``factor`` per axis (``torch.nn.functional.interpolate``'s ``mode``). Keys and values
    read it; the queries keep every token."""
    b, _, c = x.shape
    grid = x.reshape(b, h, w, c).permute(0, 3, 1, 2)
    small = torch.nn.functional.interpolate(grid, size=(h // factor, w // factor), mode=mode)
    return small.permute(0, 2, 3, 1).reshape(b, -1, c)


def merge_tokens(x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[B, N, C] -> [B, N - r, C]``: the mean of the tokens of each slot."""
    b, n, c = x.shape
    # The zeros the sums start from are read off this merge's own plan (``weight`` is 1 / count:
    # positive and finite, so ``weight * 0`` is exactly 0): a shape-only ``torch.zeros`` is the
    # same expression in every block with these sizes, which the ONNX exporter emits once and
    # keeps alive from the first merge of the U-Net to the last (at the peak of an ORT call).
    weight = weight.to(x.dtype)
    out = (weight * 0).expand(b, weight.shape[1], c)
    out = out.scatter_add(1, slot.unsqueeze(-1).expand(b, n, c), x)
    return out * weight


def merge_tokens_by_heads(x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`merge_tokens` with a scatter of the ``r`` merged tokens only (the ONNX form).

    Every slot has at least one token; its *head* (the first of its tokens) is gathered, and only
    the other ``r`` tokens, in ascending order, are added into it — the same float sums in the same
    order as :func:`merge_tokens`'s scatter from zeros, so the same bits. ONNX Runtime's CPU
    ``ScatterElements`` (the one exact scatter-add it has: ``ScatterND``'s reduction races) walks
    every element on one thread, so scattering ``r`` rows instead of ``N`` takes it from the merge's
    largest cost to a third of it (SD 1.5 at 512², batch 2: 32 → 15 ms a merge). In PyTorch the
    plain ``scatter_add`` (parallel) is the faster one."""
    b, n, c = x.shape
    m = weight.shape[1]
    if statically_known_true(m == n):
        return x * weight.to(x.dtype)
    # read off this merge's plan, not shape-only (see _plan_from_matches): slot * 0 is exactly 0
    tokens = torch.arange(n, device=x.device) + slot * 0
    # the smallest token of each slot (ScatterElements "min", int64: exact, deterministic)
    head = (tokens.narrow(1, 0, m) * 0 + n).scatter_reduce(1, slot, tokens, "amin")
    # the r tokens that are not a head, ascending: keys are unique, so every backend's TopK returns
    # them in one order and the sums below run in token order, as in merge_tokens
    key = (head.gather(1, slot) == tokens).to(torch.int64) * n + tokens
    others = torch.topk(key, n - m, dim=1, largest=False, sorted=True).indices
    out = gather_rows(x, head)
    out = out.scatter_add(1, slot.gather(1, others).unsqueeze(-1).expand(b, n - m, c),
                          gather_rows(x, others))
    return out * weight.to(x.dtype)


def unmerge_tokens(y: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """``[B, N - r, C] -> [B, N, C]``: every token takes its slot's value."""
    return gather_rows(y, slot)


def merge_heads(x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """:func:`merge_tokens` of a stream's queries, keys or values in heads, ``[B, H, N, d] ->
    [B, H, N - r, d]`` (joint attention merges after its projections, norms and rotary embedding):
    every head the mean of the tokens of each slot."""
    b, h, n, d = x.shape
    w = weight.to(x.dtype).unsqueeze(1)  # the plan's [B, N - r, 1] -> [B, 1, N - r, 1]
    out = (w * 0).expand(b, h, weight.shape[1], d)
    out = out.scatter_add(2, slot[:, None, :, None].expand(b, h, n, d), x)
    return out * w


def _image_text(x: torch.Tensor, n: int, image_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A joint sequence ``[B, H, L, d]`` split into its ``n`` image tokens and the text's, which
    come after them (``image_first``) or before (Flux's text then image)."""
    total = x.shape[2]
    if image_first:
        return x.narrow(2, 0, n), x.narrow(2, n, total - n)
    return x.narrow(2, total - n, n), x.narrow(2, 0, total - n)


def merge_joint(x: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, image_first: bool) -> torch.Tensor:
    """A joint attention's queries, keys or values as the attention op reads them, ``[B, H, T + N,
    d] -> [B, H, T + N - r, d]``: the image tokens merged (:func:`merge_heads`), the text's as they
    are, the streams in their order (Flux: after its rotary embedding)."""
    image, text = _image_text(x, slot.shape[1], image_first)
    merged = merge_heads(image, slot, weight)
    return torch.cat([merged, text] if image_first else [text, merged], dim=2)


def oracle_merge_joint(x: torch.Tensor, r: int, n: int, image_first: bool) -> torch.Tensor:
    """:func:`merge_joint` for the benchmark bound: the first ``n - r`` of the ``n`` image tokens."""
    image, text = _image_text(x, n, image_first)
    image = image[:, :, : n - r]
    return torch.cat([image, text] if image_first else [text, image], dim=2)


def unmerge_joint(y: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor, image_first: bool
                  ) -> torch.Tensor:
    """A joint attention's output ``[B, H, T + N - r, d]`` (its two streams' tokens, the image's
    merged) back to ``[B, H, T + N, d]``: every image token takes its slot's value, the text tokens
    stay as they are, the streams in their order."""
    b, h, _, d = y.shape
    image, text = _image_text(y, weight.shape[1], image_first)
    image = image.gather(2, slot[:, None, :, None].expand(b, h, slot.shape[1], d))
    return torch.cat([image, text] if image_first else [text, image], dim=2)


def oracle_merge_heads(x: torch.Tensor, r: int) -> torch.Tensor:
    """:func:`oracle_merge` in heads: the first ``N - r`` tokens of ``[B, H, N, d]``."""
    return x[:, :, : x.shape[2] - r]


def oracle_unmerge_joint(y: torch.Tensor, r: int, kept: int, image_first: bool) -> torch.Tensor:
    """:func:`oracle_unmerge` of a joint attention's image part (its ``kept`` tokens repeated back to
    ``kept + r``), the text part as it is."""
    image, text = _image_text(y, kept, image_first)
    image = torch.cat([image, image[:, :, :r]], dim=2)
    return torch.cat([image, text] if image_first else [text, image], dim=2)


def oracle_merge(x: torch.Tensor, r: int) -> torch.Tensor:
    """Benchmark bound: the first ``N - r`` tokens, for free (no similarity, no scatter)."""
    return x[:, : x.shape[1] - r]


def oracle_unmerge(y: torch.Tensor, r: int) -> torch.Tensor:
    """Benchmark bound: back to ``N`` tokens by repeating the first ``r`` (a plain copy)."""
    return torch.cat([y, y[:, :r]], dim=1)
