"""The collectives that move shards: one all-gather per bucket for use, one gradient
reduction per bucket back to this rank's rows, one all-reduce per replicated gradient.

A bucket is one flat buffer laid out rank-major (``[degree, piece]``: every rank's padded rows
of each parameter, one after the other), so a reduce-scatter hands each rank exactly its piece.
MindSpore's CPU backend registers no ``ReduceScatter`` kernel: there the same buffer is
all-reduced and each rank keeps its piece, the same numbers for ``degree`` times the traffic.
"""

from __future__ import annotations

from collections.abc import Sequence

import mindspore as ms
from mindspore import Tensor, ops

from gm_mindspore.layout import RowSplit


def _pad_rows(tensor: Tensor, rows: int) -> Tensor:
    """``tensor`` with ``rows`` rows of zeros appended (padding lives only in collectives)."""
    if rows == 0:
        return tensor
    return ops.cat([tensor, ops.zeros((rows, *tensor.shape[1:]), tensor.dtype)])


class Collectives:
    """The world group's collectives, as ``degree`` ranks of which this one is ``rank``."""

    def __init__(self, degree: int, rank: int, *, reduce_scatter: bool | None = None) -> None:
        self.degree = degree
        self.rank = rank
        if reduce_scatter is None:  # a kernel exists on Ascend and GPU, not on CPU
            reduce_scatter = ms.get_context("device_target") != "CPU"
        self.uses_reduce_scatter = reduce_scatter
        self._all_gather = ops.AllGather()
        self._all_reduce = ops.AllReduce(ops.ReduceOp.SUM)
        self._reduce_scatter = ops.ReduceScatter(ops.ReduceOp.SUM) if reduce_scatter else None
        self.counts = {"all_gather": 0, "reduce": 0, "all_reduce": 0}
        """Collectives issued so far, by kind (``reduce``: one bucket's gradient reduction)."""

    def gather(self, splits: Sequence[RowSplit], shards: Sequence[Tensor]) -> list[Tensor]:
        """The whole parameters of one bucket from every rank's rows (one all-gather)."""
        flats = [
            _pad_rows(shard, split.chunk - split.local_rows).reshape(-1)
            for split, shard in zip(splits, shards, strict=True)
        ]
        flat = flats[0] if len(flats) == 1 else ops.cat(flats)
        grid = self._all_gather(flat).reshape(self.degree, -1)
        self.counts["all_gather"] += 1
        whole, offset = [], 0
        for split in splits:
            piece = grid[:, offset : offset + split.piece_numel]
            offset += split.piece_numel
            rows = piece.reshape(self.degree * split.chunk, *split.shape[1:])
            whole.append(rows[: split.shape[0]])
        return whole

    def reduce_to_rows(self, splits: Sequence[RowSplit], grads: Sequence[Tensor]) -> list[Tensor]:
        """This rank's rows of the mean over ranks of one bucket's whole gradients."""
        grids = [
            _pad_rows(grad, split.chunk * self.degree - split.shape[0]).reshape(self.degree, -1)
            for split, grad in zip(splits, grads, strict=True)
        ]
        grid = grids[0] if len(grids) == 1 else ops.cat(grids, axis=1)
        flat = grid.reshape(-1) / self.degree
        if self._reduce_scatter is not None:
            mine = self._reduce_scatter(flat)
        else:
            mine = self._all_reduce(flat).reshape(self.degree, -1)[self.rank]
        self.counts["reduce"] += 1
        local, offset = [], 0
        for split in splits:
            piece = mine[offset : offset + split.piece_numel]
            offset += split.piece_numel
            rows = piece.reshape(split.chunk, *split.shape[1:])
            local.append(rows[: split.local_rows])
        return local

    def mean(self, grad: Tensor) -> Tensor:
        """The mean over ranks of a replicated parameter's gradient (one all-reduce)."""
        self.counts["all_reduce"] += 1
        return self._all_reduce(grad / self.degree)
