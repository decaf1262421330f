"""The DP over units in program order: each row a factor over the grids of its unit and of the
units it depends on.

`search.auto` prices each unit's row given the grids of the units it depends on
(`transitions.UnitPricer.deps`: on a chain, the one before it); this module finds the
assignment of grids minimising the sum of those rows, over arrays of their values, knowing
nothing of grids or plans.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from math import prod

import numpy as np

from partitioner.search.transitions import NotAChain

INF = float("inf")

#: the most assignments of a frontier (and the unit joining it) the DAG's DP tabulates; beyond
#: it `auto` runs the local search
FRONTIER_LIMIT = 1 << 18


class FrontierTooWide(NotAChain):
    """The rows can be priced, but their DP would tabulate more than `FRONTIER_LIMIT`
    assignments at some unit."""


class FrontierDP:
    """The DP over units in program order, a row depending on the unit before it (a chain) or
    on others too (`UnitPricer.deps`: a residual block's add on the block's input). Unit i's row is a
    factor over its *scope*, itself and the units it depends on, added to the table once the
    last unit of its scope has joined. The table holds, for every assignment of grids to the
    *frontier* (the units joined that a factor not yet added still names), the least sum of the
    factors added so far; a unit leaves it, its grid minimised out, when no factor left names
    it. On ResNet the frontier is a block's input and the unit being chosen: at most a few
    hundred assignments."""

    def __init__(self, scopes: list[tuple[int, ...]], sizes: list[int]) -> None:
        self.scopes, self.sizes = scopes, sizes
        added_at = self._added_at = [max(scope) for scope in scopes]
        #: per step, the table before it and the choices made at it, as the last `solve` left
        self._tables: tuple[list[np.ndarray], list[tuple]] | None = None
        last = {}
        for i, scope in enumerate(scopes):
            for j in scope:
                last[j] = max(last.get(j, j), added_at[i])
        #: per unit joining: (the table's axes before, those kept, those minimised out, and the
        #: factors added then with their axes' positions among the joined axes)
        self.steps = []
        axes: list[int] = []
        for k in range(len(scopes)):
            joined = axes + [k]
            if prod(sizes[j] for j in joined) > FRONTIER_LIMIT:
                raise FrontierTooWide(f"unit {k}'s frontier {joined} is too wide to tabulate")
            factors = [
                (i, [joined.index(j) for j in scopes[i]])
                for i in range(len(scopes))
                if added_at[i] == k
            ]
            kept = [j for j in joined if last[j] > k]
            dropped = [j for j in joined if last[j] <= k]
            self.steps.append((axes, kept, dropped, factors))
            axes = kept

    def solve(
        self, factors: list[np.ndarray], changed: Iterable[int] | None = None
    ) -> list[int] | None:
        """Per unit the index of its grid minimising the sum of `factors` (each an array over
        its scope's grids), or None where every assignment is infinite. `changed`: the factors
        that changed since the last call (None: any may have); the tables of the steps before
        the first that adds one of them are those of the last call, not worked out again (the
        lazy DP changes a few factors between calls, anywhere along the units)."""
        start = 0
        if changed is not None and self._tables is not None:
            start = min((self._added_at[i] for i in changed), default=len(self.steps))
        values, backs = self._tables if start else ([np.zeros(())], [])
        del values[start + 1 :], backs[start:]
        value = values[start]
        for kept, dropped, adding, joined_shape, perm, flat_shape in self._plans[start:]:
            total = value[..., None]
            for i, order, shape in adding:
                total = total + factors[i].transpose(order).reshape(shape)
            if total.shape != joined_shape:
                total = total + np.zeros(joined_shape)
            flat = total.transpose(perm).reshape(flat_shape)
            arg = flat.argmin(axis=-1)
            value = np.minimum.reduce(flat, axis=-1)
            values.append(value)
            backs.append((kept, dropped, arg))
        self._tables = (values, backs)
        if float(value) == INF:
            return None
        chosen: dict[int, int] = {}
        for kept, dropped, arg in reversed(backs):
            index = int(arg[tuple(chosen[j] for j in kept)])
            for j, k in zip(dropped, np.unravel_index(index, [self.sizes[j] for j in dropped])):
                chosen[j] = int(k)
        return [chosen[i] for i in range(len(self.scopes))]

    @cached_property
    def _plans(self) -> list[tuple]:
        """Per step, what `solve` does with its arrays, worked out once: each factor's axes put
        in the table's order and its shape there, the joined table's shape, and the order and
        shape in which the dropped units' axes are minimised out."""
        plans = []
        for k, (axes, kept, dropped, adding) in enumerate(self.steps):
            joined = axes + [k]
            factors = []
            for i, where in adding:
                shape = [1] * len(joined)
                for axis, position in enumerate(where):
                    shape[position] = self.sizes[self.scopes[i][axis]]
                factors.append((i, tuple(np.argsort(where).tolist()), tuple(shape)))
            joined_shape = tuple(self.sizes[j] for j in joined)
            perm = tuple(joined.index(j) for j in kept + dropped)
            flat_shape = tuple(self.sizes[j] for j in kept) + (-1,)
            plans.append((kept, dropped, factors, joined_shape, perm, flat_shape))
        return plans
