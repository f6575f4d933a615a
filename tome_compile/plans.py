"""Plan operations the rewritten graph calls: one block's plan by method, the in-graph choices
between plans (``torch.cond``: an ONNX ``If``), and the packed plan state of ``plan_every``.

The math is in :mod:`tome_compile.merge`, the random numbers in :mod:`tome_compile.sampler`; this
module only decides which math runs and moves plans in and out of the packed state. A block's
static sizes travel as one :class:`PlanGeometry` and its place in the packed state as one
:class:`PlanSlice` (NamedTuples: the graph's generated code writes them back as constructors).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from tome_compile import merge as _merge

__all__ = [
    "PlanGeometry",
    "PlanSlice",
    "block_keys",
    "downsample_kv",
    "fit_map",
    "geometry_at",
    "importance_or_tome_plan",
    "make_plan",
    "merge_count",
    "pack_plans",
    "plan_or_reuse",
    "plan_slice",
    "total_cells",
    "total_pool",
    "unpack_plan",
]


def merge_count(n: Any, cells: Any, ratio: float, importance: bool, dst_fraction: float) -> Any:
    """tomesd's ``r = int(N * ratio)``, capped at the sources (``N - cells``) and, for importance
    merging, so that both its plan and its ToMe fallback merge the same count. An int, or a
    symbolic size in an export for every image size (the same number at every size)."""
    r = torch.sym_min(_merge.floor_mul(n, ratio), n - cells)
    if importance:
        r = torch.sym_min(r, n - _merge.floor_mul(n, dst_fraction))
    return r


class PlanGeometry(NamedTuple):
    """The sizes of one block's plan: its ``h × w`` token grid, tomesd's ``sx × sy`` destination
    stride, ``r`` tokens merged away, and importance merging's pool settings; and how they follow
    the latent's size (:meth:`at`): the grid is the latent's divided by ``downsample`` (rounded up,
    as diffusers' strided convolutions and tomesd compute it), ``r`` by :func:`merge_count`.

    The pass records the traced sizes; the rewritten graph computes the sizes of each call from
    its ``sample`` (:func:`geometry_at`), so one graph serves every size where the shapes are
    symbolic (an export for every image size) and holds the traced numbers where they are not."""

    h: int
    w: int
    sx: int
    sy: int
    r: int
    pool_factor: float
    dst_fraction: float
    downsample: int = 0  # 0: the sizes are fixed (no latent to follow)
    ratio: float = 0.0
    importance: bool = False  # r capped for importance merging (merge_count)

    def at(self, height: Any, width: Any) -> PlanGeometry:
        """The geometry of this block for an ``height × width`` latent (ints or symbolic sizes)."""
        if not self.downsample:
            return self
        d = self.downsample
        return self.of_grid((height + d - 1) // d, (width + d - 1) // d)

    def of_grid(self, h: Any, w: Any) -> PlanGeometry:
        """This block's geometry for an ``h × w`` token grid (ints or symbolic sizes)."""
        if not self.downsample:
            return self
        r = merge_count(h * w, _merge.partition_cells(h, w, self.sx, self.sy), self.ratio, self.importance,
                        self.dst_fraction)
        return self._replace(h=h, w=w, r=r)

    @property
    def tokens(self) -> int:
        return self.h * self.w

    @property
    def kept(self) -> int:
        """Tokens after the merge: the plan's ``weight`` rows."""
        return self.h * self.w - self.r

    @property
    def cells(self) -> int:
        """Destination cells of ToMe's grid (one destination each)."""
        return _merge.partition_cells(self.h, self.w, self.sx, self.sy)

    @property
    def tome_r(self) -> int:
        """``r`` capped at ToMe's sources (importance merging's ``r`` may exceed them)."""
        return torch.sym_min(self.r, self.tokens - self.cells)


def downsample_kv(x: torch.Tensor, geometry: PlanGeometry, factor: int, mode: str) -> torch.Tensor:
    """ToDo's keys and values input: the block's token grid (this call's, ``geometry``) downsampled
    by ``factor`` per axis (:func:`tome_compile.merge.downsample_tokens`)."""
    return _merge.downsample_tokens(x, geometry.h, geometry.w, factor, mode)


def geometry_at(sample: torch.Tensor, geometry: PlanGeometry) -> PlanGeometry:
    """``geometry`` at the size of this call's latent (``sample``'s last two axes)."""
    return geometry.at(sample.shape[-2], sample.shape[-1])


def total_cells(*geometries: PlanGeometry) -> Any:
    """Destination cells of these blocks together: a drawn partition's length, or a block's offset in it."""
    return sum((g.cells for g in geometries), 0)


def total_pool(*geometries: PlanGeometry) -> Any:
    """Importance pools of these blocks together: the destination keys' length, or an offset in them."""
    return sum((_merge.importance_pool_size(g.tokens, g.r, g.pool_factor, g.dst_fraction)
                for g in geometries), 0)


def block_keys(dst_key: torch.Tensor, before: tuple[PlanGeometry, ...], geometry: PlanGeometry
               ) -> torch.Tensor:
    """One block's share of the destination keys ``[P, total]``: after the pools of ``before``."""
    return torch.narrow(dst_key, 1, total_pool(*before), total_pool(geometry))


def fit_map(importance: torch.Tensor, geometry: PlanGeometry) -> torch.Tensor:
    """The importance map fitted to the block's grid (:func:`tome_compile.merge.fit_importance`)."""
    return _merge.fit_importance(importance, geometry.h, geometry.w)


def plan_slice(index: int, *geometries: PlanGeometry) -> PlanSlice:
    """Where plan ``index`` of these blocks (in the order :func:`pack_plans` packs them) sits."""
    before = geometries[:index]
    return PlanSlice(slot_offset=sum((g.tokens for g in before), 0),
                     weight_offset=sum((g.kept for g in before), 0),
                     slot_total=sum((g.tokens for g in geometries), 0),
                     weight_total=sum((g.kept for g in geometries), 0))


class PlanSlice(NamedTuple):
    """Where one block's plan sits in the packed plans (:func:`pack_plans`): the offsets of its
    slot and weight columns, and the row lengths of the two packed tensors."""

    slot_offset: int
    weight_offset: int
    slot_total: int
    weight_total: int


def make_plan(method: str, metric: torch.Tensor, choice: torch.Tensor | None, geometry: PlanGeometry, *,
              has_map: torch.Tensor | None = None, importance: torch.Tensor | None = None,
              dst_key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan of one block by ``method``: "tome", "importance", or "importance_or_tome" (the
    in-graph choice of :func:`importance_or_tome_plan`, reading ``has_map``)."""
    g = geometry
    if method == "tome":
        return _merge.tome_plan(metric, choice, g.h, g.w, g.sx, g.sy, g.r)
    if importance is None:
        raise ValueError(f"make_plan({method!r}) needs the importance map")
    if method == "importance":
        return _merge.importance_plan(metric, importance, dst_key, g.h, g.w, g.r, g.pool_factor,
                                      g.dst_fraction)
    if has_map is None:
        raise ValueError(f"make_plan({method!r}) needs the has_map flag")
    return importance_or_tome_plan(metric, has_map, importance, dst_key, choice, g)


def importance_or_tome_plan(metric: torch.Tensor, has_map: torch.Tensor, importance: torch.Tensor,
                            dst_key: torch.Tensor | None, choice: torch.Tensor | None, geometry: PlanGeometry
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One graph for both steps of importance merging (used by the ONNX export):
    ``importance_plan`` when ``has_map`` (a 0-d bool tensor), else ``tome_plan`` — a
    ``torch.cond``, so ONNX gets an ``If`` and only the taken branch runs. Both plans have the
    same shapes (``[B, N]``, ``[B, N - r, 1]``) whatever their destination counts."""
    g = geometry
    optional = (dst_key, choice)
    present = tuple(t is not None for t in optional)

    def unpack(ops: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        it = iter(ops)
        return [next(it) if here else None for here in present]

    Plan = tuple[torch.Tensor, torch.Tensor]

    # Each branch takes the block's grid from an operand's shape (``grid``: [0, h, w], no data):
    # symbolic sizes computed outside a branch are not tracked in it (an export for every image
    # size). Not from the map's shape: a client that feeds no map gets the traced-size default,
    # and the ToMe branch must not read its size from that.
    def with_map(m: torch.Tensor, imp: torch.Tensor, grid: torch.Tensor, *ops: torch.Tensor) -> Plan:
        key, _ = unpack(ops)
        b = g.of_grid(grid.shape[-2], grid.shape[-1])
        slot, weight = _merge.importance_plan(m, imp, key, b.h, b.w, b.r, b.pool_factor, b.dst_fraction)
        return slot.reshape(-1).clone(), weight.reshape(-1).clone()

    def without_map(m: torch.Tensor, imp: torch.Tensor, grid: torch.Tensor, *ops: torch.Tensor) -> Plan:
        _, ch = unpack(ops)
        b = g.of_grid(grid.shape[-2], grid.shape[-1])
        slot, weight = _merge.tome_plan(m, ch, b.h, b.w, b.sx, b.sy, b.tome_r)
        return slot.reshape(-1).clone(), weight.reshape(-1).clone()

    grid = metric.new_zeros((0, g.h, g.w))
    operands = (metric, importance, grid, *(t for t in optional if t is not None))
    slot, weight = _cond(has_map, with_map, without_map, operands)
    # the branches return flat plans: a [B, N - r, 1] output's symbolic stride (Max(1, N - r))
    # fails cond's check that its outputs are dense
    return slot.reshape(-1, g.tokens), weight.reshape(-1, g.kept, 1)


def pack_plans(*plans: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan state (``plan_every``): ``slot_0, weight_0, slot_1, weight_1, ...`` of the blocks that
    make a plan -> ``(slots [B * sum N_i] int64, weights [B * sum (N_i - r_i)] float32)``: one pair
    of flat tensors whatever the number of blocks, so one graph output / input pair carries them
    all. (Flat, so that a deployed graph takes its batch from ``sample`` alone, and an empty
    default can stand for "no plans yet".)"""
    slots, weights = plans[0::2], plans[1::2]
    return (torch.cat(list(slots), dim=1).reshape(-1),
            torch.cat([w.squeeze(-1).to(torch.float32) for w in weights], dim=1).reshape(-1))


def unpack_plan(slots: torch.Tensor, weights: torch.Tensor, like: torch.Tensor, where: PlanSlice,
                geometry: PlanGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's plan ``(slot [B, N], weight [B, N - r, 1])`` out of :func:`pack_plans`' tensors;
    ``B`` is ``like``'s batch, weights in ``like``'s dtype."""
    # The fed plans must have ``like``'s batch, checked in every backend: a Concat with a [B, 1]
    # column refuses rows of another batch, and the column's Add with the rows' first column
    # refuses empty plans (ONNX Runtime's Concat skips an empty input; a Reshape(-1) / Slice /
    # Gather alone would broadcast a batch-1 plan to the batch or clamp silently).
    b = like.shape[0]
    zero = like[:, :1, 0].to(torch.int64) * 0  # [B, 1]
    rows = slots.reshape(b, where.slot_total)
    slot = torch.cat([rows, zero + rows[:, :1] * 0], dim=1).narrow(1, where.slot_offset, geometry.tokens)
    rows_w = weights.reshape(b, where.weight_total)
    weight = torch.cat([rows_w, zero.to(weights.dtype) + rows_w[:, :1] * 0], dim=1)
    weight = weight.narrow(1, where.weight_offset, geometry.kept).unsqueeze(-1).to(like.dtype)
    return slot, weight


def plan_or_reuse(reuse: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, where: PlanSlice,
                  method: str, metric: torch.Tensor, choice: torch.Tensor | None, geometry: PlanGeometry, *,
                  has_map: torch.Tensor | None = None, importance: torch.Tensor | None = None,
                  dst_key: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One graph for both kinds of ``plan_every`` call (used by the ONNX export): the block's plan
    out of the previous call's packed plans (``slots``, ``weights``) when ``reuse`` (a 0-d bool),
    else made by :func:`make_plan` — a ``torch.cond``, so ONNX gets an ``If`` and a reusing call
    skips the matching."""
    optional = (choice, has_map, importance, dst_key)
    present = tuple(t is not None for t in optional)

    def unpack(ops: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None]:
        it = iter(ops)
        return [next(it) if here else None for here in present]

    def reused(s: torch.Tensor, wt: torch.Tensor, m: torch.Tensor, *ops: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        slot, weight = unpack_plan(s, wt, m, where, geometry)
        dense = torch.contiguous_format  # cond's branches must return dense tensors
        return slot.clone(memory_format=dense), weight.clone(memory_format=dense)

    def made(s: torch.Tensor, wt: torch.Tensor, m: torch.Tensor, *ops: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        ch, flag, imp, key = unpack(ops)
        slot, weight = make_plan(method, m, ch, geometry, has_map=flag, importance=imp, dst_key=key)
        return slot.clone(), weight.clone()

    operands = (slots, weights, metric, *(t for t in optional if t is not None))
    return _cond(reuse, reused, made, operands)


def _cond(pred: torch.Tensor, true_fn: Any, false_fn: Any, operands: tuple[torch.Tensor, ...]) -> Any:
    """``torch.cond`` where it is traced (export, make_fx, Dynamo: ONNX gets an ``If``); a plain
    branch when the graph runs eagerly. (Eager ``torch.cond`` compiles its branches with Dynamo,
    which turns the branch functions' static sizes symbolic once a second block with other sizes
    calls it, and then cannot match the branches' output strides.) Under fake-tensor propagation
    (the pass's shape check) both branches run; their outputs must agree in shape."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if torch.compiler.is_dynamo_compiling():
        return torch.cond(pred, true_fn, false_fn, operands)
    if get_proxy_mode() is not None:
        # make_fx / torch.export: the operator itself, which traces both branches with make_fx at
        # the operands' own shapes. (``torch.cond`` here compiles the branches with Dynamo first,
        # which makes their sizes symbolic: the importance export took 300 s instead of 45 s.)
        from torch._higher_order_ops.cond import cond_op

        return cond_op(pred, true_fn, false_fn, operands)
    if isinstance(pred, FakeTensor):
        taken, other = true_fn(*operands), false_fn(*operands)
        if [tuple(t.shape) for t in taken] != [tuple(t.shape) for t in other]:
            raise RuntimeError(f"cond branches differ in shape: {[tuple(t.shape) for t in taken]} vs "
                               f"{[tuple(t.shape) for t in other]}")
        return other
    return true_fn(*operands) if bool(pred) else false_fn(*operands)
