"""What a simulated step reports, whichever simulator ran it (`runtime.step.simulator`, the
compiled loop of `runtime.step.compiled`): when each rank finished, how long it waited and
computed, and the timeline `render --timeline` draws.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SimulatedStep:
    seconds: float
    #: per rank, when it finished the step
    finish: dict[int, float]
    #: per rank, seconds spent waiting (for messages, partial sums and collectives)
    waiting: dict[int, float] = field(default_factory=dict)
    #: (rank, position in its program, start, end) of every task's compute that takes time, in
    #: the order the simulation ran them (`simulate_step` only; the compiled loop leaves it
    #: empty): what `render --timeline` draws
    timeline: list[tuple[int, int, float, float]] = field(default_factory=list)
    #: per rank, seconds in its tasks' compute (each task's, the per-task overhead included,
    #: stretched by the network stack's CPU meanwhile as the clock is)
    compute: dict[int, float] = field(default_factory=dict)

    @property
    def waiting_fraction(self) -> float:
        """The mean over ranks of the share of the step each waits: a pipeline's bubble."""
        if not self.waiting or not self.seconds:
            return 0.0
        return sum(self.waiting.values()) / len(self.waiting) / self.seconds

    def compute_fraction(self, step: float) -> float:
        """The mean over ranks of the share of a step of `step` seconds each computes: what a
        run measures as `compute_seconds` over its step (`bench scaling`)."""
        if not self.compute or step <= 0:
            return 0.0
        return sum(self.compute.values()) / len(self.compute) / step
