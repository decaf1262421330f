"""Numba kernels: NumPy arrays in, NumPy arrays out; no graph or MPI imports.

`filter` and `conv` take the logical layouts of the design; `filter_packed` and the `*_packed`
functions of `conv` run on the packed layouts of `layout`, which an executor keeps
across training steps. `reference` holds the plain NumPy oracles.

Numba's OpenMP threads spin in a barrier for a while (GNU libgomp: 300,000 polls, about a
millisecond) before they sleep. When another process holds one of the cores, a parallel loop
waits a whole time slice for its descheduled thread while the others burn theirs spinning:
seed-lcn-small's step went from 5 ms to 123 ms beside one busy process. 3,000 polls keep the
launch of a small loop as fast on an idle machine (5.1 ms a step) and give 10 ms beside the busy
process. libgomp reads the setting when Numba first loads it, at the first parallel loop, so
setting it here, before any kernel runs, is in time; a user's own setting wins.
"""

import os

os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from runtime.kernels.conv import conv_backward, conv_forward
from runtime.kernels.filter import filter_backward, filter_forward

__all__ = ["conv_backward", "conv_forward", "filter_backward", "filter_forward"]
