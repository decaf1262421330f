"""The links of an emulated cluster (`runtime.cluster`), as `legion-nn cluster up|run` takes them:
rates (`--link`), sizes (`--burst`), and the ways real clusters' links and hosts differ
(`LinkOptions`: shaping at one end or both, burst, segmentation offload, cores per host), with
the token bucket each shaped end of a link gets (`tbf`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from legion_nn.errors import LegionNNError

_RATE = re.compile(r"^([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps)$", re.IGNORECASE)
_UNIT = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
BURST_S = 50e-6
#: the largest segment a host's device hands its queue: capped with offloads off (the default),
#: the kernel's own (64 KiB TSO/GSO super-packets) with them on
GSO_MAX, GSO_OFFLOAD = 16 * 1024, 64 * 1024
SHAPINGS = ("both", "egress")
_SIZE = re.compile(r"^([0-9]*\.?[0-9]+)\s*([kmg]?)(i?b?)$", re.IGNORECASE)


@dataclass(frozen=True)
class LinkOptions:
    """How a cluster's links and hosts are built, the ways real clusters differ:

    - `shaping`: `both` limits each host's link at both ends of its cable (the host's egress and
      the switch port's, so a host also receives at most the rate: full duplex behind a
      non-blocking switch); `egress` only where the host sends, as a NIC's own rate limit does;
    - `burst_bytes`: what the token bucket lets through faster than the rate (None: 50 us of
      the rate, and at least two of the largest segments);
    - `offload`: off caps the segments a host's device hands its queue at 16 KiB; on leaves
      the kernel's 64 KiB TSO/GSO super-packets, as a real NIC's segmentation offload does;
    - `cores_per_host`: the cores each host's processes run on (None: an even share of this
      machine's, each host its own); more than an even share makes hosts share cores.
    """

    shaping: str = "both"
    burst_bytes: int | None = None
    offload: bool = False
    cores_per_host: int | None = None

    @property
    def segment_bytes(self) -> int:
        return GSO_OFFLOAD if self.offload else GSO_MAX

    def burst_for(self, rate_bits: float) -> int:
        if self.burst_bytes is not None:
            return self.burst_bytes
        return max(int(rate_bits / 8 * BURST_S), 2 * self.segment_bytes)

    def describe(self) -> str:
        burst = "default" if self.burst_bytes is None else format_size(self.burst_bytes)
        cores = "even share" if self.cores_per_host is None else str(self.cores_per_host)
        return (
            f"shaping {self.shaping}, burst {burst}, offload {'on' if self.offload else 'off'}, "
            f"cores per host {cores}"
        )


def parse_size(text: str, flag: str = "--burst") -> int:
    """Bytes of `256k`, `64KiB`, `1m`, `32768`."""
    match = _SIZE.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise LegionNNError(f"{flag}: expected a size such as 32k, 256KiB or 65536, got {text!r}")
    return int(float(match.group(1)) * {"": 1, "k": 1024, "m": 2**20, "g": 2**30}[
        match.group(2).lower()])  # fmt: skip


def format_size(size: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 1024)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def link_options(
    link_bits: float | None,
    shaping: str | None = None,
    burst: str | None = None,
    offload: str | None = None,
    cores_per_host: int | None = None,
    cores: int | None = None,
) -> LinkOptions:
    """The options as `cluster up|run` take them, checked against each other: a contradiction
    (a burst or an egress-only shaping on an unlimited link, a burst smaller than the segments
    the hosts send, more cores per host than the machine has) is one line."""
    if shaping is not None and shaping not in SHAPINGS:
        raise LegionNNError(f"--shaping: expected egress or both, got {shaping!r}")
    if offload is not None and offload not in ("on", "off"):
        raise LegionNNError(f"--offload: expected on or off, got {offload!r}")
    options = LinkOptions(
        shaping or "both",
        parse_size(burst) if burst is not None else None,
        offload == "on",
        cores_per_host,
    )
    if link_bits is None and (shaping is not None or burst is not None):
        flag = "--shaping" if shaping is not None else "--burst"
        raise LegionNNError(f"{flag} shapes a limited link; --link unlimited has none to shape")
    if options.burst_bytes is not None and options.burst_bytes < options.segment_bytes:
        raise LegionNNError(
            f"--burst {burst}: below the {format_size(options.segment_bytes)} segments the hosts "
            f"send with --offload {'on' if options.offload else 'off'}; the link would stall"
        )
    available = cores if cores is not None else len(os.sched_getaffinity(0))
    if cores_per_host is not None and not 1 <= cores_per_host <= available:
        raise LegionNNError(
            f"--cores-per-host: expected 1 to {available} (this machine's cores), "
            f"got {cores_per_host}"
        )
    return options


def parse_rate(text: str) -> float | None:
    """Bits per second of `--link`: `1gbit`, `500mbit`, `6.5Gbit`, `100kbps`... or `unlimited`."""
    if text.strip().lower() in ("unlimited", "none"):
        return None
    match = _RATE.match(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise LegionNNError(
            f"--link: expected a rate such as 1gbit, 500mbit or unlimited, got {text!r}"
        )
    bits = float(match.group(1)) * _UNIT[match.group(2).lower()]
    return bits * 8 if match.group(3).lower() == "bps" else bits


def format_rate(bits: float | None) -> str:
    if bits is None:
        return "unlimited"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


def tbf(rate_bits: float, options: LinkOptions) -> list[str]:
    """A token bucket at `rate_bits` with the options' burst (what a message gets through
    faster than the rate). By default 50 us of the rate and at least two segments, with the
    segments capped at `GSO_MAX`: veth would hand tbf TSO super-packets of 64 KiB, which need a
    burst that large. With a 125 KiB burst a 128 KiB message crossed a 1 Gbit/s link in
    0.41 ms, not the 1.05 ms of the rate; with the defaults in 1.01 ms. The price is the
    fastest link this emulates, about 3.5 Gbit/s on the 2-core development machine (8 Gbit/s
    with TSO): `--offload on --burst 256k` builds the other kind of cluster."""
    burst = options.burst_for(rate_bits)
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "100ms"]
