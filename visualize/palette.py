"""Rank colours, shared by the partitioned drawings and the partition maps.

Matplotlib's tab10 without its grey (grey means "nobody" in a map), then tab20's light shades:
eighteen distinguishable colours. Past them colours repeat; every drawing also prints the rank.
"""

from __future__ import annotations

RANK_COLOURS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
    "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2",
    "#dbdb8d", "#9edae5",
)  # fmt: skip


def rank_colour(rank: int) -> str:
    return RANK_COLOURS[rank % len(RANK_COLOURS)]


def tint(colour: str, amount: float) -> str:
    """`colour` mixed with white: amount 0 is the colour, 1 is white."""
    channels = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    mixed = [round(c + (255 - c) * amount) for c in channels]
    return "#" + "".join(f"{c:02x}" for c in mixed)
