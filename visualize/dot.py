"""Task graphs as Graphviz digraphs, drawn in the seed's vocabulary.

`to_graphviz(graph)` is a pure function returning a `graphviz.Digraph`; writing files is
`visualize.render_file`'s job. Two views:

- the full view (the seed's drawing): a task node shows its name, `result_dim` and `dist_*` rects
  under a header coloured by phase; a tensor node shows its name, `dim`, `read_rect` and
  `write_rect` (from `legion_nn.summary`, as the seed draws them), on a fill coloured by kind.
  Labels are HTML tables, as Legion Spy draws them. set_zero tasks are small grey hexagons with
  their name only, as in the seed. Edges carry the seed's role labels: `->role` for a tensor a task
  reads, `role->` for one it writes; a reduction is dashed and marked `(+)`, a read_write edge has
  arrowheads at both ends. Edges take the colour of their task's phase.
- the layer view (`collapse="layer"`): one node per `Task.layer` with its task count per phase and
  its parameter bytes; an edge per flow between layers (`visualize.layers`), labelled with its
  bytes and as wide as the log of them, coloured by the phase that writes it. Forward flows set
  the layout (data at the top, loss at the bottom); the gradients run back up without moving it.

Either view flows from data to loss and, in the full view, on down through the backward pass to
the updates, as the seed is drawn; `rankdir="LR"` turns it on its side. Both carry a legend.

Rects are compact by default: `lo..hi` with `hi` exclusive, the dims space-separated as in
`dim=`, and `0..` for a rect at the origin (`read_rect=0..[256 1 41 41]` for the seed's
`Rect(array([0, 0, 0, 0], dtype=int32), array([256, 1, 41, 41], dtype=int32))`); an empty rect
is `empty` and a missing one `None`. The seed's full form (`rects="seed"`) triples a node's width.
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

from legion_nn.errors import LegionNNError
from legion_nn.graph import TaskGraph
from legion_nn.ir import Requirement, Task, Tensor
from legion_nn.privilege import Privilege
from legion_nn.rect import Rect
from legion_nn.summary import TensorSummary, tensor_summaries
from legion_nn.textform import dims_text
from visualize.layers import LayerView, layer_view

if TYPE_CHECKING:
    import graphviz

COLLAPSE = ("layer",)
RANKDIRS = ("TB", "LR")
RECT_STYLES = ("compact", "seed")

#: phase: (fill, pen); pens are the fills darkened, so an edge matches its task's header
PHASE_COLOURS = {
    "forward": ("#cfe0fc", "#2d5ca8"),
    "backward": ("#fdd9bf", "#b8561b"),
    "set_zero": ("#e4e4e4", "#6f6f6f"),
    "update": ("#cdeccb", "#2e7d32"),
}
UNKNOWN_PHASE = ("#ffffff", "#000000")
KIND_FILLS = {
    "data": "#eef3fb",
    "param": "#fff4c2",
    "state": "#e2f3f1",
    "activation": "#ffffff",
    "grad": "#fff0e5",
    "stat": "#f0e8fb",
}
FONT = "Helvetica"
#: full views larger than this are laid out the fast way (see `_full_view`)
SLOW_LAYOUT_NODES = 150
SPINE = {"forward": ("input", "output"), "backward": ("output.delta", "input.delta")}


def _new_digraph(name: str) -> graphviz.Digraph:
    try:
        import graphviz
    except ImportError:
        raise LegionNNError(
            "rendering needs the graphviz Python package: pip install graphviz"
        ) from None
    return graphviz.Digraph(name)


def rect_text(rect: Rect | None, style: str = "compact") -> str:
    """A rect as a label shows it: `0..[256 1 41 41]`, `[64 0]..[128 9]`, `empty`, `None`."""
    if rect is None:
        return "None"
    if style == "seed":
        return repr(rect)
    if rect.is_empty():
        return "empty"
    start = "0" if not any(rect.lo) else dims_text(rect.lo)
    return f"{start}..{dims_text(rect.hi)}"


def bytes_text(n: int) -> str:
    for unit, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= unit:
            return f"{n / unit:.3g} {name}"
    return f"{n} B"


def forward_only(graph: TaskGraph) -> TaskGraph:
    """The forward tasks, the set_zero tasks of the tensors they write, and what these touch."""
    written = {
        req.tensor
        for task in graph.tasks
        if task.phase == "forward"
        for req in task.requirements
        if req.write_rect is not None
    }
    tasks = [
        task
        for task in graph.tasks
        if task.phase == "forward"
        or (task.phase == "set_zero" and any(r.tensor in written for r in task.requirements))
    ]
    touched = {req.tensor for task in tasks for req in task.requirements}
    tensors = [tensor for name, tensor in graph.tensors.items() if name in touched]
    return TaskGraph(tensors, tasks, network=graph.network, batch=graph.batch)


def node_count(graph: TaskGraph) -> int:
    """Nodes of the full view: one per task and one per tensor."""
    return len(graph.tasks) + len(graph.tensors)


def _node_id(kind: str, name: str) -> str:
    # The graphviz package reads `a:b` in an edge as node a, port b: escape ':' (and '%', so the
    # mapping stays one-to-one).
    return f"{kind}/" + name.replace("%", "%25").replace(":", "%3A")


def _rows(lines: list[str]) -> str:
    return "".join(f'{html.escape(line)}<BR ALIGN="LEFT"/>' for line in lines)


def _table(header: str, header_fill: str, body: list[str], body_fill: str, rounded: bool) -> str:
    style = ' STYLE="ROUNDED"' if rounded else ""
    border = ' CELLBORDER="0" BORDER="1"' if rounded else ' CELLBORDER="1" BORDER="0"'
    return (
        f'<<TABLE{border}{style} CELLSPACING="0" CELLPADDING="3">'
        f'<TR><TD BGCOLOR="{header_fill}"><B>{html.escape(header)}</B></TD></TR>'
        f'<TR><TD BGCOLOR="{body_fill}" ALIGN="LEFT"><FONT POINT-SIZE="9">'
        f"{_rows(body)}</FONT></TD></TR></TABLE>>"
    )


def _task_label(task: Task, rects: str) -> str:
    fill = PHASE_COLOURS.get(task.phase, UNKNOWN_PHASE)[0]
    # The seed lists the operand rects first and dist_result last.
    dist = sorted(task.dist.items(), key=lambda item: item[0] == "result")
    body = [f"result_dim={dims_text(task.result_dim)}"]
    body += [f"dist_{role}={rect_text(rect, rects)}" for role, rect in dist]
    return _table(task.name, fill, body, "#ffffff", rounded=False)


def _tensor_label(tensor: Tensor, summary: TensorSummary, rects: str) -> str:
    fill = KIND_FILLS.get(tensor.kind, "#ffffff")
    body = [
        f"dim={dims_text(tensor.dims)}",
        f"read_rect={rect_text(summary.read_rect, rects)}",
        f"write_rect={rect_text(summary.write_rect, rects)}",
    ]
    return _table(tensor.name, fill, body, fill, rounded=True)


def _edge(dot: graphviz.Digraph, task: Task, req: Requirement, label_key: str) -> None:
    pen = PHASE_COLOURS.get(task.phase, UNKNOWN_PHASE)[1]
    task_id, tensor_id = _node_id("task", task.name), _node_id("tensor", req.tensor)
    attrs = {"color": pen, "fontcolor": pen}
    if req.role in SPINE.get(task.phase, ()):
        # Heavier edges keep each pass's chain of activations (or their gradients) straight,
        # with parameters and the backward pass's re-reads of activations off to the sides.
        attrs["weight"] = "4"
    if req.privilege is Privilege.READ:
        dot.edge(tensor_id, task_id, **{label_key: f"->{req.role}"}, **attrs)
    elif req.privilege is Privilege.READ_WRITE:
        dot.edge(tensor_id, task_id, **{label_key: f"->{req.role}"}, dir="both", **attrs)
    elif req.privilege is Privilege.REDUCE:
        dot.edge(task_id, tensor_id, **{label_key: f"{req.role}-> (+)"}, style="dashed", **attrs)
    else:
        dot.edge(task_id, tensor_id, **{label_key: f"{req.role}->"}, **attrs)


def _full_view(dot: graphviz.Digraph, graph: TaskGraph, rects: str) -> None:
    summaries = tensor_summaries(graph)
    label_key = "label"
    if node_count(graph) > SLOW_LAYOUT_NODES:
        # dot ranks a labelled edge as two, and positions every rank a long edge crosses with
        # an unbounded network simplex: vgg19's full view took over ten minutes. Labels placed
        # after layout and a bounded simplex draw it in seconds, a little less tidily.
        label_key = "xlabel"
        dot.attr(nslimit="2", nslimit1="2")
    for name, tensor in graph.tensors.items():
        dot.node(_node_id("tensor", name), _tensor_label(tensor, summaries[name], rects))
    for task in graph.tasks:
        if task.phase == "set_zero":
            fill, pen = PHASE_COLOURS["set_zero"]
            dot.node(
                _node_id("task", task.name),
                task.name,
                shape="hexagon",
                style="filled",
                fillcolor=fill,
                color=pen,
                fontsize="9",
                margin="0.02",
            )
        else:
            dot.node(_node_id("task", task.name), _task_label(task, rects))
        for req in task.requirements:
            _edge(dot, task, req, label_key)


def _layer_label(name: str, counts: dict[str, int], param_bytes: int) -> str:
    cells = "".join(
        f'<TD BGCOLOR="{PHASE_COLOURS.get(phase, UNKNOWN_PHASE)[0]}">{count}</TD>'
        for phase, count in counts.items()
    )
    params = f"params {bytes_text(param_bytes)}" if param_bytes else "no params"
    span = max(len(counts), 1)
    return (
        '<<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3">'
        f'<TR><TD COLSPAN="{span}" BGCOLOR="#ffffff"><B>{html.escape(name)}</B></TD></TR>'
        f"<TR>{cells}</TR>"
        f'<TR><TD COLSPAN="{span}"><FONT POINT-SIZE="9">{params}</FONT></TD></TR></TABLE>>'
    )


def _layer_view(dot: graphviz.Digraph, view: LayerView) -> None:
    for layer in view.layers:
        counts = {p: layer.tasks_by_phase[p] for p in PHASE_COLOURS if layer.tasks_by_phase[p]}
        counts.update({p: n for p, n in layer.tasks_by_phase.items() if p not in PHASE_COLOURS})
        dot.node(_node_id("layer", layer.name), _layer_label(layer.name, counts, layer.param_bytes))
    if not view.flows:
        return
    # Widths by bytes on a log scale: the flows span six orders of magnitude in vgg19.
    low = math.log10(max(1, min(flow.nbytes for flow in view.flows)))
    high = math.log10(max(1, max(flow.nbytes for flow in view.flows)))
    for flow in view.flows:
        share = (math.log10(max(1, flow.nbytes)) - low) / (high - low) if high > low else 1.0
        pen = PHASE_COLOURS.get(flow.phase, UNKNOWN_PHASE)[1]
        dot.edge(
            _node_id("layer", flow.src),
            _node_id("layer", flow.dst),
            # Padding keeps the text clear of the widest lines, which dot does not allow for.
            label=f"   {bytes_text(flow.nbytes)}",
            tooltip=", ".join(flow.tensors),
            penwidth=f"{1 + 7 * share:.2f}",
            color=pen,
            fontcolor=pen,
            constraint="true" if flow.phase == "forward" else "false",
        )


def _graph_label(title: str, graph: TaskGraph, collapsed: bool) -> str:
    """The title over a legend of what the drawing holds: in the graph's label, off the layout.

    A two-column list, swatch and text: Graphviz shares out a table's spare width among its
    columns, which pulls apart any legend laid out in more columns than that.
    """
    phases = {task.phase for task in graph.tasks}
    entries = [(f"{p} task", fill, "") for p, (fill, _) in PHASE_COLOURS.items() if p in phases]
    if collapsed:
        notes = [
            "a layer: its tasks per phase (coloured cells) and its parameter bytes",
            "an edge: bytes of tensors one layer writes and another reads,",
            "wider with log(bytes), coloured by the writing phase:",
            "activations flow down, gradients up",
        ]
    else:
        kinds = {tensor.kind for tensor in graph.tensors.values()}
        rounded = ' STYLE="ROUNDED"'
        entries += [(f"{k} tensor", f, rounded) for k, f in KIND_FILLS.items() if k in kinds]
        notes = [
            "->role: the task reads the tensor; role->: the task writes it",
            "dashed, (+): reduce; arrowheads at both ends: read_write",
            "rects: lo..hi, hi exclusive; 0.. starts at the origin",
        ]
    heading = f'<FONT POINT-SIZE="16">{html.escape(title)}</FONT>'
    rows = [f'<TR><TD COLSPAN="2" ALIGN="LEFT">{heading}</TD></TR>']
    rows += [
        f'<TR><TD BGCOLOR="{fill}" BORDER="1" WIDTH="24" HEIGHT="12" FIXEDSIZE="TRUE"{style}>'
        f'</TD><TD ALIGN="LEFT">{text}</TD></TR>'
        for text, fill, style in entries
    ]
    rows += [f'<TR><TD></TD><TD ALIGN="LEFT">{html.escape(note)}</TD></TR>' for note in notes]
    return f'<<TABLE BORDER="0" CELLSPACING="2" CELLPADDING="1">{"".join(rows)}</TABLE>>'


def check_options(collapse: str | None, rankdir: str, rects: str) -> None:
    """The drawing options every renderer takes, each checked against its closed vocabulary."""
    if collapse not in (None, *COLLAPSE):
        raise LegionNNError(f"unknown collapse {collapse!r}: choose one of {', '.join(COLLAPSE)}")
    if rankdir not in RANKDIRS:
        raise LegionNNError(f"unknown rankdir {rankdir!r}: choose one of {', '.join(RANKDIRS)}")
    if rects not in RECT_STYLES:
        raise LegionNNError(f"unknown rect style {rects!r}: choose one of {', '.join(RECT_STYLES)}")


def to_graphviz(
    graph: TaskGraph,
    *,
    collapse: str | None = None,
    rankdir: str = "TB",
    rects: str = "compact",
    title: str | None = None,
) -> graphviz.Digraph:
    """The graph drawn in full (`collapse=None`) or one node per layer (`collapse="layer"`)."""
    check_options(collapse, rankdir, rects)
    if title is None:
        network = graph.network or "task graph"
        title = (
            f"{network}, batch {graph.batch}: {len(graph.tasks)} tasks, "
            f"{len(graph.tensors)} tensors"
        )
    dot = _new_digraph(graph.network or "taskgraph")
    dot.attr(
        rankdir=rankdir,
        label=_graph_label(title, graph, collapsed=collapse is not None),
        labelloc="t",
        labeljust="l",
        fontname=FONT,
        fontsize="10",
        nodesep="0.3",
        ranksep="0.45",
    )
    dot.attr("node", shape="plain", fontname=FONT, fontsize="10")
    dot.attr("edge", fontname=FONT, fontsize="9", arrowsize="0.7")
    if collapse == "layer":
        _layer_view(dot, layer_view(graph))
    else:
        _full_view(dot, graph, rects)
    return dot
