"""The live-memory plot of `legion-nn memory --plot`: live bytes per rank over the step's schedule.

A pure function returning a matplotlib `Figure` on the Agg canvas (no pyplot, no global state);
the command writes it out.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from legion_nn.memory import MemoryReport

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
