"""Where this rank's tokens sit in the sequence under the ``cp`` pass, and the collectives that
move a value between placements (cut, gather, reduce-scatter, all-reduce).

The sequence of length ``S`` is ``n`` equal chunks. Contiguous split: ``n = cp``, rank ``r``
holds chunk ``r``. Load-balanced causal split (``PassConfig.cp_load_balance``): ``n = 2 cp``,
rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, so under a causal mask every rank has the
same number of visible (query, key) pairs. A local value holds its rank's chunks in that
order; a gathered value is put back in sequence order, and a partial sum is laid out rank by
rank before it is reduce-scattered. Several values that share a placement travel in ONE
collective (keys and values, their gradients, the parameter gradients): each is flattened
behind the split dim and they are concatenated along the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = ["Seq", "SeqLayout", "SeqMoves"]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Seq:
    """Split along the sequence: global dim ``dim`` is ``outer x S x inner`` elements."""

    dim: int
    outer: int = 1


@dataclass(frozen=True)
class SeqLayout:
    """Which chunks of the sequence rank ``rank`` of ``cp`` holds (module docstring).

    ``seq`` is an int, or under a symbolic sequence a ``SymInt`` the trace knows to be a
    multiple of :attr:`chunks` (``as_multiple``): every size below is then exact in it."""

    cp: int
    rank: int
    seq: int | torch.SymInt
    load_balance: bool = False

    @property
    def chunks(self) -> int:
        """How many equal chunks the sequence is cut into."""
        return 2 * self.cp if self.load_balance else self.cp

    @property
    def chunk(self) -> int:
        """Tokens per chunk."""
        return self.seq // self.chunks

    @property
    def local(self) -> int:
        """Tokens this rank holds."""
        return self.seq // self.cp

    def held_by(self, rank: int) -> list[int]:
        """The chunks rank ``rank`` holds, in the order its local value lays them out."""
        if self.load_balance:
            return [rank, 2 * self.cp - 1 - rank]
        return [rank]

    @property
    def mine(self) -> list[int]:
        return self.held_by(self.rank)

    @property
    def rank_major(self) -> list[int]:
        """The global chunks in the order an all-gather of the local values lays them out."""
        return [c for r in range(self.cp) for c in self.held_by(r)]

    def positions(self) -> list[tuple[int, int]]:
        """``[start, end)`` of each chunk this rank holds, in local order."""
        return [(c * self.chunk, (c + 1) * self.chunk) for c in self.mine]


def _contiguous(emit, value: fx.Node) -> fx.Node:
    return emit(aten.clone.default, (value,), {"memory_format": torch.contiguous_format})


class SeqMoves:
    """Emits the ops that move values between placements, for one rewritten graph."""

    def __init__(
        self,
        emit: Callable[..., fx.Node],
        layout: SeqLayout,
        group_name: str,
        all_gather: Any,
        reduce_scatter_op: Any,
        stats: dict[str, int],
    ) -> None:
        self.emit, self.layout, self.group_name = emit, layout, group_name
        self.all_gather, self.reduce_scatter_op, self.stats = all_gather, reduce_scatter_op, stats

    # --- shapes -----------------------------------------------------------------------------

    def _to_front(self, value: fx.Node, dim: int) -> tuple[fx.Node, list[int] | None]:
        ndim = value.meta["val"].dim()
        if dim == 0:
            return value, None
        perm = [dim, *[d for d in range(ndim) if d != dim]]
        return self.emit(aten.permute.default, (value, perm)), perm

    def _from_front(
        self, value: fx.Node, perm: list[int] | None, like: torch.Tensor | None = None
    ) -> fx.Node:
        """``value`` with its dims back in place; laid out in memory as ``like`` (the value it
        stands in for, whose readers may view it) when given, else contiguous."""
        if perm is None and like is None:
            return value
        perm = perm or list(range(value.meta["val"].dim()))
        inverse = [perm.index(d) for d in range(len(perm))]
        back = self.emit(aten.permute.default, (value, inverse))
        order = list(range(len(perm)))
        if like is not None:  # dims from the outermost in memory to the innermost
            order = sorted(order, key=lambda d: (-like.stride(d), d))
        if order == list(range(len(perm))):
            return _contiguous(self.emit, back)
        laid = _contiguous(self.emit, self.emit(aten.permute.default, (back, order)))
        return self.emit(aten.permute.default, (laid, [order.index(d) for d in range(len(order))]))

    def _reorder(self, value: fx.Node, outer: int, picks: list[int], parts: int) -> fx.Node:
        """Dim 0 of ``value`` is ``outer x parts`` equal blocks (dim 1 the rest); the blocks
        ``picks`` of each outer row, in that order."""
        shape = list(value.meta["val"].shape)
        rows = shape[0] // (outer * parts)
        if picks == list(range(parts)):
            return value
        grid = self.emit(aten.view.default, (value, [outer, parts, rows, *shape[1:]]))
        runs: list[tuple[int, int]] = []  # consecutive picks become one slice
        for p in picks:
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        pieces = [self.emit(aten.slice.Tensor, (grid, 1, a, b)) for a, b in runs]
        picked = pieces[0] if len(pieces) == 1 else self.emit(aten.cat.default, (pieces, 1))
        picked = _contiguous(self.emit, picked)
        return self.emit(aten.view.default, (picked, [outer * len(picks) * rows, *shape[1:]]))

    def _flat_together(self, values: list[fx.Node], dim: int):
        """Each value with ``dim`` moved first and the rest flattened, side by side along dim 1
        (one buffer); and how to take them apart again."""
        fronts, restore = [], []
        for value in values:
            front, perm = self._to_front(value, dim)
            shape = list(front.meta["val"].shape)
            if not front.meta["val"].is_contiguous():  # views below need one block
                front = _contiguous(self.emit, front)
            if len(values) > 1 or len(shape) != 2:
                front = self.emit(aten.view.default, (front, [shape[0], -1]))
            fronts.append(front)
            restore.append((perm, shape[1:]))
        if len(fronts) == 1:
            return fronts[0], restore
        return self.emit(aten.cat.default, (fronts, 1)), restore

    def _apart(self, buffer: fx.Node, restore, like=None) -> list[fx.Node]:
        rows = buffer.meta["val"].shape[0]
        out, start = [], 0
        for index, (perm, rest) in enumerate(restore):
            width = 1
            for s in rest:
                width = width * s  # a SymInt under a symbolic sequence
            piece = buffer
            if len(restore) > 1:
                piece = self.emit(aten.slice.Tensor, (buffer, 1, start, start + width))
                piece = _contiguous(self.emit, piece)
            start += width
            piece = self.emit(aten.view.default, (piece, [rows, *rest]))
            out.append(self._from_front(piece, perm, None if like is None else like[index]))
        return out

    # --- moves ------------------------------------------------------------------------------

    def cut(self, value: fx.Node, want: Seq) -> fx.Node:
        """This rank's chunks of a whole value."""
        self.stats["cuts"] += 1
        lay = self.layout
        shape = list(value.meta["val"].shape)
        dim, outer = want.dim, want.outer
        inner = shape[dim] // (outer * lay.seq)
        split = [*shape[:dim], outer, lay.chunks, lay.chunk * inner, *shape[dim + 1 :]]
        viewed = self.emit(aten.view.default, (value, split))
        runs = [(c, c + 1) for c in lay.mine]
        pieces = [self.emit(aten.slice.Tensor, (viewed, dim + 1, a, b)) for a, b in runs]
        piece = pieces[0] if len(pieces) == 1 else self.emit(aten.cat.default, (pieces, dim + 1))
        piece = _contiguous(self.emit, piece)
        local = [*shape[:dim], shape[dim] // lay.cp, *shape[dim + 1 :]]
        return self.emit(aten.view.default, (piece, local))

    def gather(self, values: list[fx.Node], have: Seq) -> list[fx.Node]:
        """The whole values of split ``values`` (one placement, one length), in ONE
        all-gather, back in sequence order."""
        self.stats["gathers"] += 1
        lay = self.layout
        buffer, restore = self._flat_together(values, have.dim)
        gathered = self.emit(self.all_gather, (buffer, lay.cp, self.group_name))
        gathered = self.emit(c10d.wait_tensor.default, (gathered,))
        rest = list(buffer.meta["val"].shape[1:])
        rows = buffer.meta["val"].shape[0] // have.outer
        if have.outer > 1:  # [cp, outer, local, ...] -> [outer, cp, local, ...]
            grid = self.emit(aten.view.default, (gathered, [lay.cp, have.outer, rows, *rest]))
            swapped = _contiguous(self.emit, self.emit(aten.transpose.int, (grid, 0, 1)))
            gathered = self.emit(aten.view.default, (swapped, [lay.cp * have.outer * rows, *rest]))
        order = lay.rank_major
        natural = [order.index(c) for c in range(lay.chunks)]
        gathered = self._reorder(gathered, have.outer, natural, lay.chunks)
        return self._apart(gathered, restore)

    def reduce_scatter(
        self, values: list[fx.Node], want: Seq, like: list[torch.Tensor] | None = None
    ) -> list[fx.Node]:
        """This rank's chunks of the sums of partial ``values`` (one shape along ``want``),
        in ONE reduce-scatter; each laid out in memory as ``like`` says (``_from_front``)."""
        self.stats["reduce_scatters"] += 1
        lay = self.layout
        buffer, restore = self._flat_together(values, want.dim)
        buffer = self._reorder(buffer, want.outer, lay.rank_major, lay.chunks)
        shape = list(buffer.meta["val"].shape)
        rows = shape[0] // (want.outer * lay.cp)
        if want.outer > 1:  # [outer, cp, local, ...] -> [cp, outer, local, ...]
            grid = self.emit(aten.view.default, (buffer, [want.outer, lay.cp, rows, *shape[1:]]))
            swapped = _contiguous(self.emit, self.emit(aten.transpose.int, (grid, 0, 1)))
            buffer = self.emit(aten.view.default, (swapped, shape))
        scattered = self.emit(self.reduce_scatter_op, (buffer, "sum", lay.cp, self.group_name))
        scattered = self.emit(c10d.wait_tensor.default, (scattered,))
        return self._apart(scattered, restore, like)

    def all_reduce(self, value: fx.Node) -> fx.Node:
        """The sum of ``value`` over the cp group."""
        self.stats["all_reduces"] += 1
        reduced = self.emit(c10d.all_reduce.default, (value, "sum", self.group_name))
        return self.emit(c10d.wait_tensor.default, (reduced,))

    def all_reduce_many(self, values: list[fx.Node], cap_bytes: int | None) -> list[fx.Node]:
        """The sums of ``values`` over the cp group: one all-reduce per dtype and bucket of at
        most ``cap_bytes`` (``None``: one per value) over their flattened concatenation."""
        out: dict[fx.Node, fx.Node] = {}
        buckets: list[list[fx.Node]] = []
        open_: dict[torch.dtype, tuple[list[fx.Node], list[int]]] = {}
        for value in values:
            val = value.meta["val"]
            size = val.numel() * val.element_size()
            bucket, used = open_.get(val.dtype, (None, [0]))
            if bucket is None or cap_bytes is None or used[0] + size > cap_bytes:
                bucket, used = [], [0]
                buckets.append(bucket)
                open_[val.dtype] = (bucket, used)
            bucket.append(value)
            used[0] += size
        for bucket in buckets:
            if len(bucket) == 1:
                out[bucket[0]] = self.all_reduce(bucket[0])
                continue
            flats = []
            for value in bucket:
                val = value.meta["val"]
                whole = value if val.is_contiguous() else _contiguous(self.emit, value)
                flats.append(self.emit(aten.view.default, (whole, [-1])))
            reduced = self.all_reduce(self.emit(aten.cat.default, (flats,)))
            start = 0
            for value in bucket:
                val = value.meta["val"]
                piece = self.emit(aten.slice.Tensor, (reduced, 0, start, start + val.numel()))
                start += val.numel()
                out[value] = self.emit(aten.view.default, (piece, list(val.shape)))
        return [out[v] for v in values]
