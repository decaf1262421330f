"""The `legion-nn bench scaling --hosts H --link R1,R2,... --plot F` figure: step time against
the link's bandwidth on an emulated cluster, one panel per network, one colour per strategy:
the cost model's prediction as a line, the measured step as points. Where the data-parallel line
crosses the others is where data parallelism stops paying against the other splits, and where it
crosses the one-host line (one rank, no link) where it stops paying at all.

A pure function returning a matplotlib `Figure` on the Agg canvas; the command writes it out.
"""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from visualize.palette import RANK_COLOURS


def link_sweep_figure(report: dict) -> Figure:
    rows = [row for row in report["results"] if "measured_s" in row and row["link_bits"]]
    networks = list(dict.fromkeys(row["network"] for row in rows))
    fig = Figure(figsize=(6 * max(len(networks), 1), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    for index, network in enumerate(networks, start=1):
        ax = fig.add_subplot(1, len(networks), index)
        mine = [row for row in rows if row["network"] == network]
        spread = [row for row in mine if row["ranks"] > 1]
        strategies = list(dict.fromkeys(row["strategy"] for row in spread))
        for colour, strategy in zip(RANK_COLOURS, strategies):
            points = sorted(
                (row["link_bits"] / 1e9, row["predicted_s"], row["measured_s"])
                for row in spread
                if row["strategy"] == strategy
            )
            gbits = [p[0] for p in points]
            # auto is often one of the others: dashed and crossed so that both stay visible
            line, marker = ("--", "x") if strategy == "auto" else ("-", "o")
            ax.plot(
                gbits, [p[1] for p in points], line, color=colour, label=f"{strategy} predicted"
            )
            ax.plot(gbits, [p[2] for p in points], marker, color=colour, markersize=8,
                    label=f"{strategy} measured")  # fmt: skip
        alone = [row for row in mine if row["ranks"] == 1]
        if alone:
            # no link in it: the step data parallelism has to beat
            ax.axhline(alone[0]["measured_s"], color="black", linestyle=":",
                       label="one rank on one host, measured")  # fmt: skip
            ax.axhline(alone[0]["predicted_s"], color="grey", linestyle="--",
                       label="one rank on one host, predicted")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link per host, each way (Gbit/s)")
        ax.set_ylabel("step (s)")
        ax.set_title(f"{network}, batch {mine[0]['batch']}, {spread[0]['ranks']} ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(f"{report['hosts']} emulated hosts: predicted (lines) and measured (points)")
    return fig
