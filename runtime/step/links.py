"""The prices a simulated step's messages see (`runtime.step.simulator`, the compiled loop of
`runtime.step.compiled`): latency and seconds per byte between hosts and within one, by
message size where `bench machine` measured the links, the burst a link lets through, and the
network stack's time a byte where a host's stack serves both directions, and how fast a
message moves while its ranks compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from partitioner.machine import Machine
from runtime.transport import progress_interval


@dataclass
class Links:
    """Latency and seconds per byte between hosts and within one; ranks sit on hosts in blocks
    of `ranks_per_host` (a machine that does not say has one rank per host: its link is
    between ranks, as the cost model reads it)."""

    alpha: float
    beta: float
    alpha_intra: float
    beta_intra: float
    ranks_per_host: int
    #: bytes a link between hosts lets through at once when idle, refilled at its rate
    burst: float = 0.0
    #: seconds per byte of a host's network stack, both ways (`Machine.stack_beta`; 0: none)
    stack_beta: float = 0.0
    #: seconds per byte of messages by their bytes, between hosts (False) or within one
    #: (`Machine.link_per_byte`); None: `beta` and `beta_intra` whatever their size
    per_byte: Callable[[np.ndarray, bool], np.ndarray] | None = None
    #: the stack's seconds per byte of messages between hosts by their bytes
    #: (`Machine.stack_per_byte`); None: `stack_beta` at the link's rate for the size
    stack_per_byte: Callable[[np.ndarray], np.ndarray] | None = None
    #: bytes a second at most a message between hosts moves while the rank it goes to runs a
    #: kernel (`Machine.computing_bytes_per_s`; 0: as fast as its link)
    computing_rate: float = 0.0
    #: the same for a message while the rank it leaves computes
    #: (`Machine.computing_send_bytes_per_s`)
    computing_send_rate: float = 0.0
    #: seconds between the progress thread's calls (`transport.progress_interval`), each
    #: moving a held message's bytes at that rate times it at once (`held`)
    progress_s: float = 0.0

    @classmethod
    def of(cls, machine: Machine, nranks: int) -> Links:
        per_host = machine.ranks_per_host or 1
        alpha_intra, beta_intra = (
            machine.link(0, 0) if per_host > 1 else (machine.alpha, machine.beta)
        )
        return cls(
            machine.alpha, machine.beta, alpha_intra, beta_intra, per_host,
            machine.link_burst_bytes, machine.stack_beta,
            machine.link_per_byte if machine.link_curves else None,
            machine.stack_per_byte if machine.stack_beta else None,
            machine.computing_bytes_per_s, machine.computing_send_bytes_per_s,
            progress_interval(),
        )  # fmt: skip

    def host(self, rank: int) -> int:
        return rank // self.ranks_per_host

    @property
    def holds(self) -> bool:
        """Whether a message between hosts is held back while a kernel runs at an end."""
        return bool(self.computing_rate or self.computing_send_rate)

    def held(self, receives: bool) -> tuple[float, float]:
        """(bytes a second at most, bytes first at its own speed) of a message between hosts
        while the rank it goes to (`receives`) or leaves computes: the rate, and what one call
        of the progress thread moves (0, 0: not held)."""
        rate = self.computing_rate if receives else self.computing_send_rate
        return rate, rate * self.progress_s

    def rates(self, nbytes: np.ndarray, between: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per message of `nbytes`, between hosts or not (`between`), the seconds per byte of its
        link, and of the network stack at its ends (between hosts; 0 within one): as measured
        for its size (`stack_per_byte`), else `stack_beta` at the link's rate for the size as
        for the large ones (the host's cores copy the bytes either way)."""
        nbytes, between = np.asarray(nbytes), np.asarray(between, bool)
        if self.per_byte is None:
            beta = np.where(between, self.beta, self.beta_intra)
        else:
            beta = np.where(between, self.per_byte(nbytes, False), self.per_byte(nbytes, True))
        if self.stack_per_byte is not None:
            return beta, np.where(between, self.stack_per_byte(nbytes), 0.0)
        return beta, np.where(between, self.stack_beta * (beta / self.beta), 0.0)
