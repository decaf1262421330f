"""Partition maps (`legion-nn partition --plot F`): which rank owns which region of each tensor.

One row per unit (a layer, or the part of a layer with one grid), in program order: the unit's
output (the largest tensor its forward tasks write; for `data`, the loaded input) and its weights
(the largest parameter its forward tasks read), each as two 2-D panels, because a tensor of 4 or 8
dims has no one faithful picture:

| tensor | left panel | right panel |
|---|---|---|
| activation (N, C, H, W) | batch × channels (N×C) | rows × columns (H×W) |
| linear weights (M, C, H, W) | outputs × input channels (M×C) | input rows × columns (H×W) |
| filter weights (K, 1, 1, C, R, S, P, Q) | output × input channels (K×C) | output positions (P×Q) |
| other | first two dims | last two dims |

The window dims R×S and the unit axes are never split, so they are left out. A panel is the
projection of the tensor onto its two dims: a region of the panel belongs to the ranks that own
some element projecting onto it. A region one rank owns is filled with its colour and numbered.
A region several ranks share is striped in their colours and labelled with their ranks: either
the tensor is split along the dims the panel does not show (a 2×2 spatial split makes N×C one
region shared by four ranks, while H×W shows four quadrants), or each of them holds a copy
(a replicated parameter; labelled `copies`).

Owners: an activation is owned by the ranks holding it after the task that writes it (the pieces
that write it, owner computes, or where the partial sums of a reduction split land); data and
parameters by their home (`Plan.homes`: every rank holding a copy). A *halo* is what a rank's pieces read
(any task, forward or backward) but that rank does not own; it is hatched in the reader's colour
and shaded, where it falls outside what that rank owns in the panel (a halo across H×W covers
all of N×C, which says nothing, so it is drawn only in H×W).

`partition_maps` computes the data (exact rects, testable); `partition_map_figure` draws it as a
matplotlib `Figure` on the Agg canvas, without pyplot; the command writes it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib import patheffects
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from legion_nn.graph import TaskGraph
from legion_nn.ir import Tensor
from legion_nn.rect import Rect
from partitioner.plan import Plan
from visualize.palette import rank_colour
from visualize.piece_view import ranks_text

#: (dims, (row label, column label)) of each panel of a tensor
Projection = tuple[tuple[int, int], tuple[str, str]]
ACTIVATION = (((0, 1), ("batch (N)", "channels (C)")), ((2, 3), ("rows (H)", "columns (W)")))
LINEAR = (
    ((0, 1), ("outputs (M)", "input channels (C)")),
    ((2, 3), ("input rows (H)", "input columns (W)")),
)
FILTER = (
    ((0, 3), ("output channels (K)", "input channels (C)")),
    ((6, 7), ("output rows (P)", "output columns (Q)")),
)
HALO_SHADE = (0, 0, 0, 0.18)
#: hatch directions by reader, so that overlapping halos of different ranks stay apart
HATCHES = ("////", "\\\\\\\\", "||||", "----")
HALO_TEXT = "halo: read by a rank, owned by another\n(hatched in the reader's colour)"
SHARED_TEXT = "striped, several ranks: split along\nthe dims not shown, or copies"
LABEL_BOX = {"facecolor": "white", "alpha": 0.8, "linewidth": 0, "pad": 1.5}
#: a region narrower or lower than this share of its panel gets no rank number
LABEL_SHARE = 0.06


@dataclass(frozen=True)
class Panel:
    """A tensor projected on two dims: owned regions and halos as 2-D rects (row, column)."""

    tensor: str
    dims: tuple[int, int]
    labels: tuple[str, str]
    extent: tuple[int, int]
    #: (region, owners): owners sorted; several when split along other dims or replicated
    regions: tuple[tuple[Rect, tuple[int, ...]], ...]
    #: (region, reader): read by `reader`'s pieces, owned by another rank
    halos: tuple[tuple[Rect, int], ...]
    replicated: bool
    #: readers whose halo is all of the panel they do not own: a regroup, not a border
    gathered: tuple[int, ...] = ()


@dataclass(frozen=True)
class UnitMap:
    unit: str
    #: its grid's label (`Plan.grid_label`: the reduction dims it cuts after `Σ`), or None
    grid: str | None
    output: tuple[Panel, ...]
    weights: tuple[Panel, ...]


def projections(tensor: Tensor) -> tuple[Projection, ...]:
    """The panels a tensor is drawn in (see the module's table)."""
    ndim = len(tensor.dims)
    if ndim == 8:
        return FILTER
    if ndim == 4:
        return LINEAR if tensor.kind == "param" else ACTIVATION
    if ndim == 1:
        return (((-1, 0), ("", "dim 0")),)
    if ndim == 2:
        return (((0, 1), ("dim 0", "dim 1")),)
    return (
        ((0, 1), ("dim 0", "dim 1")),
        ((ndim - 2, ndim - 1), (f"dim {ndim - 2}", f"dim {ndim - 1}")),
    )


def _project(rect: Rect, dims: tuple[int, int]) -> Rect:
    """`rect` seen on two dims; dim -1 is a unit axis (a 1-D tensor drawn as one row)."""
    lo = tuple(0 if d < 0 else rect.lo[d] for d in dims)
    hi = tuple(1 if d < 0 else rect.hi[d] for d in dims)
    return Rect(lo, hi)


def _subtract(rects: list[Rect], cuts: list[Rect]) -> list[Rect]:
    return [rest for rect in rects for rest in rect.minus(cuts)]


def _regions(owned: list[tuple[Rect, tuple[int, ...]]], dims) -> list[tuple[Rect, tuple]]:
    """The panel cut at every projected boundary; each cell with every rank projecting onto it."""
    shown = [(_project(rect, dims), ranks) for rect, ranks in owned if not rect.is_empty()]
    cuts = [sorted({r.lo[i] for r, _ in shown} | {r.hi[i] for r, _ in shown}) for i in (0, 1)]
    out = []
    for y0, y1 in zip(cuts[0], cuts[0][1:]):
        for x0, x1 in zip(cuts[1], cuts[1][1:]):
            cell = Rect((y0, x0), (y1, x1))
            owners = sorted(
                {rank for rect, ranks in shown if rect.contains(cell) for rank in ranks}
            )
            if owners:
                out.append((cell, tuple(owners)))
    return out


def tensor_panels(
    tensor: Tensor,
    owned: list[tuple[Rect, tuple[int, ...]]],
    reads: dict[int, list[Rect]],
) -> tuple[Panel, ...]:
    """The panels of `tensor` owned as `owned` (rect, ranks) and read as `reads` (rank: rects)."""
    mine: dict[int, list[Rect]] = {}
    for rect, ranks in owned:
        for rank in ranks:
            mine.setdefault(rank, []).append(rect)
    halos_nd = {
        rank: _subtract(list(dict.fromkeys(rects)), mine.get(rank, []))
        for rank, rects in sorted(reads.items())
    }
    replicated = any(len(ranks) > 1 for _, ranks in owned)
    panels = []
    for dims, labels in projections(tensor):
        halos = []
        gathered = []
        whole = _project(tensor.rect, dims)
        for rank, parts in halos_nd.items():
            own = [_project(rect, dims) for rect in mine.get(rank, [])]
            shown = _merge(_subtract([_project(p, dims) for p in parts], own))
            halos += [(rect, rank) for rect in shown]
            if shown and not _subtract(_subtract([whole], own), shown):
                gathered.append(rank)
        extent = whole.hi
        panels.append(
            Panel(
                tensor.name,
                dims,
                labels,
                extent,
                tuple(_regions(owned, dims)),
                tuple(halos),
                replicated,
                tuple(gathered),
            )
        )
    return tuple(panels)


def _merge(rects: list[Rect]) -> list[Rect]:
    """Distinct non-empty rects, none inside another (a halo's pieces project onto each other)."""
    rects = list(dict.fromkeys(r for r in rects if not r.is_empty()))
    return [r for r in rects if not any(o != r and o.contains(r) for o in rects)]


def _owned(graph: TaskGraph, plan: Plan, tensor: str) -> list[tuple[Rect, tuple[int, ...]]]:
    if tensor in plan.homes:
        held = plan.homes[tensor].held(graph.tensors[tensor].rect)
        return [(part, holders) for part, holders in held if holders]
    for task_plan in plan.tasks:  # where its first writer left it (a sum: where it landed)
        layout = task_plan.holdings.get(tensor)
        if layout is not None:
            held = layout.held(graph.tensors[tensor].rect)
            return [(part, holders) for part, holders in held if holders]
    return []


def _reads(plan: Plan, tensor: str) -> dict[int, list[Rect]]:
    out: dict[int, list[Rect]] = {}
    for task_plan in plan.tasks:
        for piece in task_plan.pieces:
            for req in piece.requirements:
                rect = req.read_rect
                if req.tensor == tensor and rect is not None and not rect.is_empty():
                    for rank in piece.ranks:
                        out.setdefault(rank, []).append(rect)
    return out


def partition_maps(graph: TaskGraph, plan: Plan) -> list[UnitMap]:
    """A map per unit of `plan`, in program order; units writing only scalars are left out."""
    written: dict[str, list[str]] = {}
    read: dict[str, list[str]] = {}
    for task, task_plan in zip(graph.tasks, plan.tasks):
        if task.phase != "forward":
            continue
        for req in task.requirements:
            kind = graph.tensors[req.tensor].kind
            if req.write_rect is not None and kind != "param":
                written.setdefault(task_plan.unit, []).append(req.tensor)
            elif req.read_rect is not None and kind == "param":
                read.setdefault(task_plan.unit, []).append(req.tensor)
    maps = []
    for unit, outputs in written.items():
        # The largest, the last on ties: L0's output is L0.filterNL.output, which L1 reads.
        output = max(reversed(outputs), key=lambda t: graph.tensors[t].volume)
        if graph.tensors[output].volume <= 1:
            continue
        weights = max(read.get(unit, []), key=lambda t: graph.tensors[t].volume, default=None)
        maps.append(
            UnitMap(
                unit,
                plan.grid_label(unit) if unit in plan.unit_grids else None,
                _panels(graph, plan, output),
                _panels(graph, plan, weights) if weights else (),
            )
        )
    return maps


def _panels(graph: TaskGraph, plan: Plan, tensor: str) -> tuple[Panel, ...]:
    return tensor_panels(graph.tensors[tensor], _owned(graph, plan, tensor), _reads(plan, tensor))


def _box(region: Rect, **style) -> Rectangle:
    (y0, x0), (y1, x1) = region.lo, region.hi
    return Rectangle((x0, y0), x1 - x0, y1 - y0, **style)


def _draw_regions(ax, panel: Panel) -> None:
    rows, cols = panel.extent
    for region, owners in panel.regions:
        (y0, x0), (y1, x1) = region.lo, region.hi
        if len(owners) == 1:
            ax.add_patch(_box(region, facecolor=rank_colour(owners[0]), linewidth=0))
        else:
            width = (x1 - x0) / len(owners)
            for i, rank in enumerate(owners):
                ax.add_patch(
                    Rectangle(
                        (x0 + i * width, y0),
                        width,
                        y1 - y0,
                        facecolor=rank_colour(rank),
                        alpha=0.5,
                        linewidth=0,
                    )
                )
        ax.add_patch(_box(region, fill=False, edgecolor="white", linewidth=1.5))
        if (x1 - x0) < LABEL_SHARE * cols or (y1 - y0) < LABEL_SHARE * rows:
            continue
        text = ranks_text(owners)
        if len(owners) > 1 and panel.replicated:
            text += "\ncopies"
        label = ax.text(
            (x0 + x1) / 2,
            (y0 + y1) / 2,
            text,
            ha="center",
            va="center",
            fontsize=9,
            fontweight="bold",
            color="white" if len(owners) == 1 else "black",
            bbox=None if len(owners) == 1 else LABEL_BOX,
        )
        if len(owners) == 1:
            label.set_path_effects([patheffects.withStroke(linewidth=2, foreground="black")])


def _draw_halos(ax, panel: Panel) -> None:
    for region, reader in panel.halos:
        if reader in panel.gathered:
            continue
        patch = _box(
            region,
            facecolor=HALO_SHADE,
            edgecolor=rank_colour(reader),
            hatch=HATCHES[reader % len(HATCHES)],
            linewidth=1.2,
        )
        patch.set_hatch_linewidth(1.6)
        ax.add_patch(patch)


def _ticks(bounds: list[int], extent: int) -> list[int]:
    """Cut positions to label: at most nine, none within 1/12 of the axis of the last kept
    (the extent itself is always kept; a thin cell's two cuts would print over each other)."""
    kept = [0]
    for value in bounds:
        if value - kept[-1] >= extent / 12:
            kept.append(value)
    kept = kept[:-1] if extent - kept[-1] < extent / 12 and len(kept) > 1 else kept
    if len(kept) > 8:
        kept = kept[:: -(-len(kept) // 8)]
    return [*kept, extent]


def _draw_panel(ax, panel: Panel) -> None:
    rows, cols = panel.extent
    _draw_regions(ax, panel)
    _draw_halos(ax, panel)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    row_label, col_label = panel.labels
    ax.set_xlabel(f"{col_label}: {cols}", fontsize=8)
    if row_label:
        ax.set_ylabel(f"{row_label}: {rows}", fontsize=8)
    ax.set_yticks(_ticks(sorted({r.lo[0] for r, _ in panel.regions}), rows))
    ax.set_xticks(_ticks(sorted({r.lo[1] for r, _ in panel.regions}), cols))
    ax.tick_params(labelsize=7)
    title = f"{panel.tensor}\n{' × '.join(filter(None, panel.labels))}"
    if panel.gathered:
        title += f"\nread whole by ranks {ranks_text(panel.gathered)}"
    ax.set_title(title, fontsize=8)


def partition_map_figure(maps: list[UnitMap], title: str) -> Figure:
    """One row per unit: its output in two panels, its weights in two more (or none)."""
    fig = Figure(figsize=(3.4 * 4 + 0.6, 2.6 * max(len(maps), 1) + 1.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(max(len(maps), 1), 4, squeeze=False)
    ranks: set[int] = set()
    for row, unit_map in zip(axes, maps):
        panels = [*unit_map.output[:2], None, None][:2] + list(unit_map.weights[:2])
        for i, ax in enumerate(row):
            panel = panels[i] if i < len(panels) else None
            if panel is None:
                ax.set_axis_off()
                continue
            _draw_panel(ax, panel)
            ranks.update(rank for _, owners in panel.regions for rank in owners)
        grid = unit_map.grid if unit_map.grid else "home, no grid"
        row[0].annotate(
            f"{unit_map.unit}\ngrid {grid}" if unit_map.grid else f"{unit_map.unit}\n{grid}",
            (-0.45, 0.5),
            xycoords="axes fraction",
            ha="right",
            va="center",
            fontsize=10,
            fontweight="bold",
            rotation=90,
        )
    handles = [Patch(facecolor=rank_colour(r), label=f"rank {r}") for r in sorted(ranks)[:18]]
    halo = Patch(facecolor=HALO_SHADE, edgecolor="black", hatch="////", label=HALO_TEXT)
    shared = Patch(facecolor="#dddddd", edgecolor="white", label=SHARED_TEXT)
    handles += [halo, shared]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=8)
    fig.suptitle(title, fontsize=12)
    return fig
