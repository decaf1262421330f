"""The `legion-nn partition --sweep --plot` figure: step time, memory and traffic against ranks.

A pure function returning a matplotlib `Figure` on the Agg canvas; the command writes it out.
"""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def sweep_figure(rows: list[dict]) -> Figure:
    """Three log-log panels over the rank counts of a sweep's report rows."""
    fig = Figure(figsize=(12, 4), layout="constrained")
    FigureCanvasAgg(fig)
    ranks = [row["ranks"] for row in rows]
    panels = (
        ("predicted_step_seconds", "predicted step (s)", 1),
        ("memory_per_rank_max", "memory per rank, max (GiB)", 2**30),
        ("bytes_sent_total", "bytes sent per step (GB)", 1e9),
    )
    for index, (key, label, scale) in enumerate(panels, start=1):
        ax = fig.add_subplot(1, 3, index)
        ax.plot(ranks, [max(row[key], 1e-12) / scale for row in rows], "o-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"{rows[0].get('network', '')}: strategy {rows[0]['strategy']}")
    return fig
