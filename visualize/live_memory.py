"""The live-memory plot of `legion-nn memory --plot`: live bytes per rank over the step's schedule.

A pure function returning a matplotlib `Figure` on the Agg canvas (no pyplot, no global state);
the command writes it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from legion_nn.liveness import MemoryReport

UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "bytes"))


def _unit(peak: int) -> tuple[int, str]:
    return next((size, name) for size, name in UNITS if peak >= size or size == 1)


def live_bytes_figure(report: MemoryReport) -> Figure:
    """Live bytes at each function, the forward/backward boundary and the peak marked."""
    schedule = report.schedule
    size, unit = _unit(report.peak_bytes)
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = range(len(report.live))
    ax.step(xs, [v / size for v in report.live], where="mid", color="tab:blue")
    forward = schedule.count("forward")
    if 0 < forward < len(report.live):
        ax.axvline(forward - 0.5, color="grey", linestyle="--", linewidth=1)
        ax.text(forward - 0.5, 0.02, " backward →", transform=ax.get_xaxis_transform())
    ax.axhline(schedule.param_bytes / size, color="tab:green", linestyle=":", linewidth=1)
    ax.text(0, schedule.param_bytes / size, " parameters", va="bottom", color="tab:green")
    ax.plot([report.peak_index], [report.peak_bytes / size], "o", color="tab:red")
    ax.annotate(
        f"peak {report.peak_bytes / size:.3g} {unit}\nat {report.peak_step.name}",
        (report.peak_index, report.peak_bytes / size),
        textcoords="offset points",
        xytext=(-10, -28),
        ha="right",
    )
    ax.set_xlabel("function in schedule order (forward, then backward)")
    ax.set_ylabel(f"live {unit} per rank")
    ax.set_ylim(bottom=0)
    ax.set_xlim(-0.5, len(report.live) - 0.5)
    ranks = "rank" if report.ranks == 1 else "ranks"
    ax.set_title(
        f"{Path(schedule.source).name}: batch {schedule.batch}, {report.ranks} data-parallel {ranks}"
    )
    return fig


#: ranks drawn one line each; more are drawn as their maximum, mean and minimum
RANK_LINES = 8


def rank_live_figure(
    lives: Mapping[int, np.ndarray], top: int, baseline: int, title: str
) -> Figure:
    """`lives`: per rank, the bytes its buffers hold at each task of its step (the process
    `baseline`, the same at every task, is left out and named in the title); `top`: the most any
    rank's buffers need, the arena's unused space included."""
    size, unit = _unit(top)
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if len(lives) <= RANK_LINES:
        for rank, live in lives.items():
            ax.step(range(len(live)), live / size, where="mid", label=f"rank {rank}")
    else:
        stacked = np.stack(list(lives.values()))
        for name, line in (
            ("max", stacked.max(0)),
            ("mean", stacked.mean(0)),
            ("min", stacked.min(0)),
        ):
            ax.step(range(len(line)), line / size, where="mid", label=f"{name} over ranks")
    ntasks = len(next(iter(lives.values())))
    ax.axhline(top / size, color="tab:red", linestyle=":", linewidth=1)
    ax.text(
        0, top / size, f" peak with the arena's unused space: {top / size:.3g} {unit}", va="bottom"
    )
    ax.set_xlabel(f"task in the order a rank runs them ({ntasks})")
    ax.set_ylabel(f"{unit} of buffers per rank")
    ax.set_ylim(bottom=0, top=top / size * 1.08)
    ax.legend(loc="lower right")
    ax.set_title(f"{title} (and a process baseline of {baseline / 2**20:.0f} MiB per rank)")
    return fig
