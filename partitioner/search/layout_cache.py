"""Layouts named by keys, each made once per contents, for the search's replay (`transitions.py`).

A replay meets a tensor's layout under a key naming what the layout depends on: ("write", task,
grid, tensor), the layout a task wrote on a grid, made by the function that makes a plan's record
of who holds what after each task (`plan.holdings_after`), or ("home", source,
((reader, grid), ...)), the home of data or a parameter (its gradient and optimizer state share
it), which the grids of its readers make (`plan.home_layout` of their `plan.resident_reads`).
Many keys name the same layout (a replicated parameter's home under most grids, the repeated
layers of VGG writing alike), so a layout and its `grid_loads.Geometry` are made once per digest
of the rects and ranks they come from, the digest by which the fetches and combines priced
against them are kept too (`task_prices.py`).

With them: a task's pieces and accesses by (task, grid), as `accesses.task_accesses` lists them; the
bytes a layout holds per rank; and whether a task reads (or reduces into) exactly the rect of a
tensor each of its ranks wrote, where nothing moves: that compares the rects, a check much
cheaper than listing the messages.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from legion_nn.graph import TaskGraph
from legion_nn.privilege import Privilege
from partitioner import boxes
from partitioner.accesses import TaskAccesses, task_accesses
from partitioner.grid_loads import Geometry
from partitioner.layout import Layout
from partitioner.pieces import PieceCache, PieceSet
from partitioner.plan import holdings_after, home_layout, resident_reads
from partitioner.plan_memo import digest
from partitioner.strategy import Grid

#: what a replay names a layout, a fetch or a combine by (tuples of names, grids and digests)
Key = tuple


class Memo(dict):
    """Values kept by key, each made on its first request."""

    def remember(self, key: Key, make):
        found = self.get(key)
        if found is None:
            found = self[key] = make()
        return found


class LayoutCache:
    """A graph's task accesses and layouts on `nranks` ranks by key (see the module docstring)."""

    def __init__(self, graph: TaskGraph, nranks: int, cache: PieceCache | None = None) -> None:
        self.graph, self.nranks = graph, nranks
        self.cache = cache or PieceCache(graph)
        self._memo = Memo()

    def pieces(self, name: str, grid: Grid) -> PieceSet:
        return self.cache.get(self.graph, self.graph.task(name), grid)

    def accesses(self, name: str, grid: Grid) -> TaskAccesses:
        return self._memo.remember(
            ("accesses", name, grid),
            lambda: task_accesses(self.graph.task(name), self.pieces(name, grid)),
        )

    def holdings(self, name: str, grid: Grid) -> Mapping[str, Layout]:
        """What task `name` on `grid` leaves written, as a plan records it (`plan.holdings_after`;
        the sums it reduces into keep the layouts they had, which the replay knows by key)."""
        return self._memo.remember(
            ("holdings", name, grid),
            lambda: holdings_after(
                self.graph, self.graph.task(name), self.accesses(name, grid), {}
            ),
        )

    def layout(self, key: Key) -> Layout:
        """The layout `key` names, made once per contents: different grids often leave a
        tensor the same (a replicated parameter's home), and repeated layers write alike."""

        def make() -> Layout:
            if key[0] == "home":
                return home_layout(self.graph, key[1], self._home_reads(key))
            _, name, grid, tensor = key
            return self.holdings(name, grid)[tensor]

        return self._memo.remember(
            ("layout", key),
            lambda: self._memo.remember(("layout of", key[0], self.layout_digest(key)), make),
        )

    def layout_digest(self, key: Key) -> bytes:
        """A digest naming the layout's contents: of the rects and ranks it is made from."""

        def make() -> bytes:
            if key[0] == "write":
                _, name, grid, tensor = key
                found = self.accesses(name, grid).writes[tensor]
                return digest(*(a for columns in found for a in columns))
            found = self._home_reads(key)
            if not found:
                return digest(np.asarray(self.graph.tensors[key[1]].dims))
            return digest(*(a for columns in found for a in columns))

        return self._memo.remember(("layout digest", key), make)

    def geometry(self, key: Key) -> Geometry:
        """`grid_loads.Geometry` of the layout `key` names, made once per contents."""
        return self._memo.remember(
            ("geometry", key),
            lambda: self._memo.remember(
                ("geometry of", key[0], self.layout_digest(key)),
                lambda: Geometry(self.layout(key), self.nranks),
            ),
        )

    def local(self, name: str, grid: Grid, tensor: str, layout_key: Key, reduce: bool) -> bool:
        """Whether every rank of the task reads (or reduces into) exactly the rect of `tensor`
        it wrote itself, so that nothing moves: the rects are compared, not the messages."""
        if layout_key[0] != "write":
            return False
        _, writer, written, _ = layout_key

        def make() -> bool:
            mine = self.pieces(name, grid)
            found = self.accesses(writer, written).writes.get(tensor, [])
            touch = [
                j
                for j, r in enumerate(mine.requirements)
                if r.tensor == tensor
                and (r.privilege is Privilege.REDUCE if reduce else r.privilege.reads)
            ]
            if len(found) != 1 or not np.array_equal(mine.owners, found[0][0]):
                return False
            _, lo, hi = found[0]  # what each rank wrote: its piece's rect, or its part of a sum
            return all(
                np.array_equal(mine.req_lo[j], lo) and np.array_equal(mine.req_hi[j], hi)
                for j in touch
            )

        return self._memo.remember(("local", name, grid, tensor, writer, written, reduce), make)

    def volume(self, key: Key, tensor: str) -> np.ndarray:
        """Bytes per rank that the layout `key` of `tensor` holds."""
        itemsize = self.graph.tensors[tensor].itemsize

        def make() -> np.ndarray:
            if key[0] == "write":
                _, name, grid, _ = key
                found = self.accesses(name, grid).writes[tensor]
                if len(found) == 1:  # one rect per rank, disjoint (else the plan fails)
                    ranks, lo, hi = found[0]
                    volume = boxes.volumes(lo, hi) * itemsize
                    return np.bincount(ranks, weights=volume, minlength=self.nranks).astype(
                        boxes.INDEX
                    )[: self.nranks]
            if key[0] == "home":
                found = self._home_reads(key)
                if found:
                    ranks, lo, hi = found[0]
                    same = all(
                        np.array_equal(r, ranks) and np.array_equal(a, lo) and np.array_equal(b, hi)
                        for r, a, b in found[1:]
                    )
                    if same and len(np.unique(ranks)) == len(ranks):
                        # every reader reads the same rect per rank: the home holds just it
                        volume = boxes.volumes(lo, hi) * itemsize
                        return np.bincount(ranks, weights=volume, minlength=self.nranks).astype(
                            boxes.INDEX
                        )[: self.nranks]
            return self.layout(key).volume_per_rank(self.nranks) * itemsize

        return self._memo.remember(("volume", key, itemsize), make)

    def _home_reads(self, key: Key) -> list:
        """(ranks, lo, hi) of every read making the home `key` (`plan.resident_reads`)."""
        _, source, readers = key
        found = []
        for name, grid in readers:
            pieces = self.pieces(name, grid)
            found += [
                c
                for t, c in resident_reads(self.graph, self.graph.task(name), pieces)
                if t == source
            ]
        return found
