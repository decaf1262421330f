"""The `legion-nn render --timeline` figure: a plan's simulated step, a lane per rank.

Each task a rank computes is a bar from its start to its end in the step simulator (the
command reads them from `runtime.step.simulated_step.SimulatedStep.timeline`): forwards in the colour
of their micro-batch, backwards in a lighter tint of it, the optimizer's updates and the rest
grey. Whatever is not a bar is the rank waiting (for copies, partial sums, collectives): a
pipeline's bubbles. A run of a pass's bars wide enough carries its pass and micro-batch (`F2`,
`B0`). A pure function returning a matplotlib `Figure` on the Agg canvas; the command writes it
out.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from legion_nn.ir import Task
from visualize.palette import rank_colour, tint

#: the grey of tasks outside any micro-batch's forward or backward
OTHER = "#9a9a9a"
#: the weight gradients a `-deferred` schedule computes over every micro-batch at a stage's end
WEIGHTS = "#5b5b8f"
#: a bar narrower than this share of the step carries no label
LABELLED = 0.02


def pass_of(task: Task) -> tuple[str, int | None]:
    """("F" or "B", micro-batch) of a task a micro-batch runs, ("W", None) of weight gradients
    deferred over every micro-batch (`legion_nn.micro_batches`); ("", None) for any other."""
    micro_batch = task.attrs.get("micro_batch")
    if "micro_rows" in task.attrs:
        return "W", None
    if task.phase == "forward":
        return "F", micro_batch
    if task.phase == "backward":
        return "B", micro_batch
    return "", None


def timeline_figure(
    bars: list[tuple[int, Task, float, float]],
    seconds: float,
    ranks: Sequence[int],
    waiting_fraction: float,
    title: str,
) -> Figure:
    """Lanes of `ranks` in a simulated step of `seconds`: `bars`, (rank, task, start, end) of
    every task a rank computed; `waiting_fraction`, the mean share of the step the ranks wait
    (see the module docstring)."""
    ranks = sorted(ranks)
    fig = Figure(figsize=(12, 0.6 * len(ranks) + 1.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    span = seconds or 1.0
    lane = {rank: index for index, rank in enumerate(ranks)}
    #: per rank, its runs of consecutive bars of one pass: [pass, first start, last end]
    runs: dict[int, list[list]] = {rank: [] for rank in ranks}
    for rank, task, start, end in sorted(bars, key=lambda bar: (bar[0], bar[2])):
        kind, micro_batch = pass_of(task)
        if not kind:
            colour = OTHER
        elif kind == "W":
            colour = WEIGHTS
        else:
            base = rank_colour(micro_batch or 0)
            colour = base if kind == "F" else tint(base, 0.55)
        ax.barh(lane[rank], end - start, left=start, height=0.7, color=colour, linewidth=0)
        same = runs[rank] and runs[rank][-1][0] == (kind, micro_batch)
        if same and start - runs[rank][-1][2] < LABELLED * span:
            runs[rank][-1][2] = end
        else:
            runs[rank].append([(kind, micro_batch), start, end])
    for rank, found in runs.items():
        for (kind, micro_batch), start, end in found:
            if kind and (end - start) / span >= LABELLED:
                label = f"{kind}{micro_batch if micro_batch is not None else ''}"
                ax.text((start + end) / 2, lane[rank], label, ha="center", va="center", fontsize=8)
    ax.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("seconds into the step (simulated)")
    ax.set_title(f"{title}: step {span:.4f} s, ranks waiting {100 * waiting_fraction:.0f}% of it")
    ax.legend(
        handles=[
            Patch(color=rank_colour(0), label="forward (colour: micro-batch)"),
            Patch(color=tint(rank_colour(0), 0.55), label="backward"),
            *(
                [Patch(color=WEIGHTS, label="weight gradients, deferred (W)")]
                if any(pass_of(task)[0] == "W" for _, task, _, _ in bars)
                else []
            ),
            Patch(color=OTHER, label="other (updates, zeroing)"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.3),
        ncol=4,
        fontsize=8,
    )
    return fig
