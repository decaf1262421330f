"""Partitioned task graphs as Graphviz digraphs: one cluster per rank, messages between them.

`partition_graphviz(graph, plan)` is a pure function returning a `graphviz.Digraph` of the piece
view (`visualize.piece_view`):

- a cluster `cluster_rank<r>` per rank that computes anything, tinted in the rank's colour; in it
  one node per task that runs there, headed by the task's name in its phase's colour (as in the
  full view) over the rects of the pieces it computes there (rects of the task's iteration space,
  `lo..hi` with `hi` exclusive). A homed task on a replicated parameter appears in every holder's
  cluster. set_zero tasks are left out: they run where the gradient they zero lives and move
  nothing, and drawn per rank they would be a third of the nodes;
- thin edges in the phase's colour: order within a rank (a piece reads what an earlier piece on
  the same rank wrote);
- bold red edges: a transfer, labelled with the rect it carries and its bytes (per destination);
  dashed red edges marked `(+)`: a partial sum sent to the rect's holder, drawn to the piece
  there that reads the sum;
- purple octagons outside the clusters: collectives (all-reduce, reduce, reduce-scatter), with
  edges in from each contributing piece and out to the first piece on each holder that reads the
  result, labelled with rect and bytes.

With `collapse="layer"` a node is the forward tasks, or the other tasks (backward, update), of
one unit (a layer, or the part of a layer with one grid) on one rank, labelled with their count
and the unit's grid; collectives of a unit merge, and edges are summed: their label gives the
bytes and, when several, the number of messages.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from legion_nn.graph import TaskGraph
from partitioner.plan import Plan
from visualize.dot import (
    FONT,
    PHASE_COLOURS,
    UNKNOWN_PHASE,
    _new_digraph,
    _node_id,
    bytes_text,
    check_options,
    rect_text,
)
from visualize.palette import rank_colour, tint
from visualize.piece_view import (
    CollectiveNode,
    Link,
    PieceNode,
    PieceView,
    collapse_by_unit,
    piece_view,
    ranks_text,
)

if TYPE_CHECKING:
    import graphviz

TRANSFER_PEN = "#c62828"
COLLECTIVE_PEN = "#6a1b9a"
COLLECTIVE_FILL = "#eadcf3"
TENSOR_FILL = "#ffffff"
#: past this many ranks, edge labels are placed after layout
WIDE = 4
#: rects listed in a node before the rest are summarised
MAX_RECTS = 2


def _piece_label(node: PieceNode, rects: str, grid: str | None) -> str:
    fill = PHASE_COLOURS.get(node.phase, (TENSOR_FILL, ""))[0]
    if grid is not None:
        what = "forward" if node.phase == "forward" else "backward, update"
        body = [f"{node.tasks} {what} task{'s' if node.tasks > 1 else ''}"]
        body.append("grid " + grid if grid else "on its home")
    elif node.phase == "tensor":
        body = ["tensor"]
    elif len(node.rects) <= MAX_RECTS:
        body = [rect_text(rect, rects) for rect in node.rects]
    else:
        bounds = node.rects[0]
        for rect in node.rects[1:]:
            bounds = bounds.union_bounds(rect)
        body = [f"{len(node.rects)} pieces in", rect_text(bounds, rects)]
    lines = "".join(f"{html.escape(line)}<BR/>" for line in body)
    return (
        '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="2">'
        f'<TR><TD BGCOLOR="{fill}"><B>{html.escape(node.name)}</B></TD></TR>'
        f'<TR><TD BGCOLOR="#ffffff"><FONT POINT-SIZE="8">{lines}</FONT></TD></TR></TABLE>>'
    )


def _collective_label(node: CollectiveNode, collapsed: bool) -> str:
    span = f"ranks {ranks_text(node.participants)}"
    if collapsed:
        what = f"{len(node.tensors)} tensors" if len(node.tensors) > 1 else node.tensors[0]
        return f"{node.algorithm} ({node.unit})\n{what}\n{bytes_text(node.nbytes)}, {span}"
    return f"{node.algorithm}\n{node.tensors[0]}\n{span}"


def link_label(link: Link, rects: str = "compact", collapsed: bool = False) -> str:
    """What a cross-rank edge says: the rect and the bytes it carries; collapsed, the bytes and
    the number of messages."""
    size = bytes_text(link.nbytes)
    marker = " (+)" if link.kind == "reduce" else ""
    if collapsed:
        return f"{size}{marker}" + (f" ×{link.count}" if link.count > 1 else "")
    return f"{rect_text(link.rect, rects)}\n{size}{marker}"


def _edge(
    dot: graphviz.Digraph, view: PieceView, link: Link, rects: str, label_key: str, collapsed: bool
) -> None:
    src, dst = _node_id("piece", link.src), _node_id("piece", link.dst)
    ends = (view.pieces.get(link.src), view.pieces.get(link.dst))
    # A partial sum nobody in view reads goes to the same task's piece on its holder, which
    # stands on the same row.
    free = link.kind == "reduce" and ends[0] and ends[1] and ends[0].name == ends[1].name
    attrs = {"constraint": "false"} if free else {}
    if link.kind == "local":
        pen = PHASE_COLOURS.get(link.phase, UNKNOWN_PHASE)[1]
        dot.edge(src, dst, color=pen, penwidth="0.8", arrowsize="0.5", **attrs)
        return
    tooltip = f"{link.tensor or 'several tensors'}: {link.src} → {link.dst}"
    # Labels of edges that do not rank their ends are placed after layout: as labels, dot would
    # rank them as nodes and stretch the drawing to fit them.
    attrs["xlabel" if free else label_key] = link_label(link, rects, collapsed)
    attrs.update(tooltip=tooltip, labeltooltip=tooltip)
    if link.kind == "collective":
        pen, attrs["style"] = COLLECTIVE_PEN, "bold"
    else:
        pen, attrs["style"] = TRANSFER_PEN, "bold,dashed" if link.kind == "reduce" else "bold"
    dot.edge(src, dst, color=pen, fontcolor=pen, **attrs)


def _legend(title: str, view: PieceView, collapsed: bool) -> str:
    phases = {node.phase for node in view.pieces.values()}
    heading = f'<FONT POINT-SIZE="16">{html.escape(title)}</FONT>'
    rows = [f'<TR><TD COLSPAN="2" ALIGN="LEFT">{heading}</TD></TR>']
    swatches = [(f"{p} task", fill) for p, (fill, _) in PHASE_COLOURS.items() if p in phases]
    rows += [
        f'<TR><TD BGCOLOR="{fill}" BORDER="1" WIDTH="24" HEIGHT="12" FIXEDSIZE="TRUE"></TD>'
        f'<TD ALIGN="LEFT">{html.escape(text)}</TD></TR>'
        for text, fill in swatches
    ]
    what = (
        "a node: a unit's forward, or backward and update, tasks on one rank; their grid"
        if collapsed
        else "a node: a task on one rank, with the rects of the pieces it computes there"
    )
    kinds = {link.kind for link in view.links}
    notes = [
        (what, "#000000", True),
        ("thin: order within a rank (set_zero tasks are not drawn)", "#555555", True),
        (
            "red: a transfer, labelled with the rect and bytes it carries",
            TRANSFER_PEN,
            "transfer" in kinds,
        ),
        (
            "dashed red, (+): a partial sum sent to the holder of its rect",
            TRANSFER_PEN,
            "reduce" in kinds,
        ),
        (
            "purple: a collective; partial sums in, results out"
            + (" (results back to the units that sent: not drawn)" if collapsed else ""),
            COLLECTIVE_PEN,
            bool(view.collectives),
        ),
    ]
    if collapsed:
        notes.append(("edge labels: bytes, ×messages when several", "#000000", True))
    notes = [(note, colour) for note, colour, shown in notes if shown]
    rows += [
        f'<TR><TD></TD><TD ALIGN="LEFT"><FONT COLOR="{colour}">{html.escape(note)}</FONT></TD></TR>'
        for note, colour in notes
    ]
    return f'<<TABLE BORDER="0" CELLSPACING="2" CELLPADDING="1">{"".join(rows)}</TABLE>>'


def partition_graphviz(
    graph: TaskGraph,
    plan: Plan,
    *,
    tasks: set[str] | None = None,
    collapse: str | None = None,
    rankdir: str = "TB",
    rects: str = "compact",
    title: str | None = None,
) -> graphviz.Digraph:
    """`plan` of `graph` drawn with one cluster per rank; only the named `tasks` if given."""
    check_options(collapse, rankdir, rects)
    view = piece_view(graph, plan, _shown(graph, tasks))
    collapsed = collapse == "layer"
    if collapsed:
        view = collapse_by_unit(view)
    if title is None:
        title = (
            f"{graph.network or 'task graph'}, batch {graph.batch}: strategy {plan.label} "
            f"on {plan.nranks} ranks"
        )
    dot = _new_digraph(f"{graph.network or 'taskgraph'}-partitioned")
    dot.attr(
        rankdir=rankdir,
        label=_legend(title, view, collapsed),
        labelloc="t",
        labeljust="l",
        fontname=FONT,
        fontsize="10",
        nodesep="0.25",
        ranksep="0.4",
        newrank="true",
    )
    dot.attr("node", shape="plain", fontname=FONT, fontsize="9")
    dot.attr("edge", fontname=FONT, fontsize="8", arrowsize="0.6")
    label_key = "label"
    if view.node_count() > 150:
        # As in the full view: labels placed after layout and a bounded simplex keep big
        # drawings to seconds.
        label_key = "xlabel"
        dot.attr(nslimit="2", nslimit1="2")
    elif len(view.ranks_used()) > WIDE:
        # Between many clusters, labels laid out as nodes push the clusters far apart.
        label_key = "xlabel"
    by_rank: dict[int, list[PieceNode]] = {}
    for node in view.pieces.values():
        by_rank.setdefault(node.rank, []).append(node)
    for rank in sorted(by_rank):
        colour = rank_colour(rank)
        with dot.subgraph(name=f"cluster_rank{rank}") as cluster:
            cluster.attr(
                label=f"rank {rank}",
                style="rounded,filled",
                color=colour,
                fillcolor=tint(colour, 0.85),
                fontsize="14",
                fontcolor=colour,
                penwidth="2",
            )
            for node in by_rank[rank]:
                labels = {unit: plan.grid_label(unit) for unit in plan.unit_grids}
                _node(cluster, node, rects, labels if collapsed else None)
    for node in view.collectives.values():
        dot.node(
            _node_id("piece", node.id),
            _collective_label(node, collapsed),
            shape="octagon",
            style="filled",
            fillcolor=COLLECTIVE_FILL,
            color=COLLECTIVE_PEN,
            fontcolor=COLLECTIVE_PEN,
            fontsize="9",
            margin="0.04",
        )
    for link in view.links:
        if collapsed and _returns(view, link):
            continue
        _edge(dot, view, link, rects, label_key, collapsed)
    return dot


def _returns(view: PieceView, link: Link) -> bool:
    """A collective's result going back to a node that contributed to it (a collapsed node holds
    a unit's backward and update tasks): implied by the edge in, and drawn it loops."""
    if link.src not in view.collectives:
        return False
    return any(other.src == link.dst and other.dst == link.src for other in view.links)


def _node(
    cluster: graphviz.Digraph,
    node: PieceNode,
    rects: str,
    grids: dict[str, str] | None,
) -> None:
    """`grids`: the label of each unit's grid (`Plan.grid_label`), for a collapsed view."""
    grid = grids.get(node.unit, "") if grids is not None else None
    cluster.node(_node_id("piece", node.id), _piece_label(node, rects, grid))


def piece_count(graph: TaskGraph, plan: Plan, tasks: set[str] | None = None) -> int:
    """Nodes of the partitioned full view: task pieces per rank plus collectives."""
    return piece_view(graph, plan, _shown(graph, tasks)).node_count()


def _shown(graph: TaskGraph, tasks: set[str] | None) -> set[str]:
    shown = {task.name for task in graph.tasks if task.phase != "set_zero"}
    return shown if tasks is None else shown & set(tasks)
