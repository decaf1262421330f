"""The families of grids `auto` offers each unit (`search.py`).

`data`, `model`, `spatial` (`strategy.builtin_grid`), the mixtures `batch2×model`,
`channels4×spatial`, `batch4×spatial`, and the reduction splits (`reduction_split`) `row` (the
first dim the unit's reducer sums over, the input channels: Megatron's row-parallel linear, or a
filter split over its input channels), `row-spatial` (a linear layer's summed input rows and
columns, matching a spatially split predecessor) and the mixture `batch4×row`. A family a unit
cannot take falls back to its batch split; families giving a unit the same grid count once
(`grid_options`).
"""

from __future__ import annotations

from partitioner.strategy import BUILTIN, Grid, Unit, balanced, builtin_grid, cells

FAMILIES = BUILTIN + (
    "batch2×model",
    "channels4×spatial",
    "batch4×spatial",
    "row",
    "row-spatial",
    "batch4×row",
)
#: the dims a unit's reducer sums over, in a mixture (see `reduction_split`)
SUMMED = "summed"
_MIXTURES = {
    "batch2×model": ((0,), 2, (1,)),
    "channels4×spatial": ((1,), 4, (2, 3)),
    "batch4×spatial": ((0,), 4, (2, 3)),
    "batch4×row": ((0,), 4, SUMMED),
}


def family_grid(unit: Unit, family: str, nranks: int) -> Grid:
    if family in BUILTIN:
        return builtin_grid(unit, family, nranks)
    if family == "row":
        return _row_grid(unit, nranks) or builtin_grid(unit, "data", nranks)
    if family == "row-spatial":
        return _row_spatial_grid(unit, nranks) or builtin_grid(unit, "data", nranks)
    first, parts, rest = _MIXTURES[family]
    if rest == SUMMED:
        rest = tuple(d for d in unit.summed if d in unit.splittable)
    usable = bool(rest) and all(d in unit.splittable for d in first + rest)
    if not usable or nranks % parts or all(unit.extents[d] == 1 for d in rest):
        return builtin_grid(unit, "data", nranks)
    head = balanced(unit.extents, first, parts)
    tail = _row_grid(unit, nranks // parts) if family.endswith("row") else None
    tail = tail or balanced(unit.extents, rest, nranks // parts)
    return tuple(max(a, b) for a, b in zip(head, tail))


def _row_spatial_grid(unit: Unit, nranks: int) -> Grid | None:
    """A reduction split over the input's rows and columns (a linear layer's summed H, W), as
    square as their extents allow: it keeps a spatially split predecessor's output where it is
    made, as `row` keeps a channel-split one's. None where the unit sums over no such dims."""
    dims = tuple(d for d in unit.summed[1:] if d in unit.splittable)
    if not dims or all(unit.extents[d] == 1 for d in dims):
        return None
    return balanced(unit.extents, dims, nranks)


def _row_grid(unit: Unit, nranks: int) -> Grid | None:
    """A reduction split of `unit` (Megatron's row-parallel linear, a filter split over its
    input channels): over the first dim its reducer sums over (the input channels) where that
    takes as many ranks as all of them would, else over all of them; None where it has none."""
    dims = tuple(d for d in unit.summed if d in unit.splittable)
    if not dims or all(unit.extents[d] == 1 for d in dims):
        return None
    alone = balanced(unit.extents, dims[:1], nranks)
    every = balanced(unit.extents, dims, nranks)
    return alone if cells(alone) >= cells(every) else every


def grid_options(units: list[Unit], nranks: int):
    """Each unit's grid under each family, and its distinct grids, each under the first family
    (in FAMILIES order) giving it."""
    grid_of = {(i, f): family_grid(u, f, nranks) for i, u in enumerate(units) for f in FAMILIES}
    options: list[dict[Grid, str]] = []
    for i in range(len(units)):
        found: dict[Grid, str] = {}
        for family in FAMILIES:
            found.setdefault(grid_of[(i, family)], family)
        options.append(found)
    return grid_of, options
