"""A rank's CPU in the compiled step loop (`runtime.step.loop`): `runtime.step.rank_cpu`'s rules
for a kernel beside its rank's transfers between hosts, point for point as the Python simulator
(`runtime.step.simulator`) applies them: the kernel shares its core with their bytes, and those
it receives and sends move no faster than its progress thread moves them till it ends. The
arrays are the loop's (`net` and `prices`, as `runtime.step.loop` lists them).
"""

from __future__ import annotations

from runtime.step import rank_cpu
from runtime.step.wake_heap import HELPER

# the Python simulator's arithmetic for a message held back while a kernel runs, compiled
held_spread = HELPER(rank_cpu.held_spread)
held_back = HELPER(rank_cpu.held_back)
kernel_share = HELPER(rank_cpu.kernel_share)


@HELPER
def stretched(net, prices, blocked, keys, rank, begin, seconds, slowdown):
    """`_Simulator._stretched`: `seconds` of compute from `begin`, sharing the core with the
    network stack's CPU for the bytes of the rank's transfers between hosts on the wire
    meanwhile (`rank_cpu.sharing_core`, point for point, with `slowdown` times the CPU a
    byte, the rank's), those it receives and sends held back till it ends (`held_of`: their
    ends put back, and the latest end a blocked peer waits for with them); those ended
    before `begin` leave its list."""
    cpu, rate = prices[6], max(prices[8], prices[10])
    if cpu == 0.0 and rate == 0.0:
        return seconds
    src, dst, nbytes, ended, started = net[0], net[1], net[2], net[8], net[17]
    wire, base, count = net[18], net[19][rank], net[20][rank]
    kept = 0
    for k in range(count):
        t = wire[base + k]
        if ended[t] > begin:
            wire[base + kept] = t
            kept += 1
    net[20][rank] = kept
    if seconds == 0.0:
        return 0.0
    took = seconds
    if cpu != 0.0:
        took = _sharing_core(net, prices, rank, kept, begin, seconds, cpu * slowdown)
    if rate != 0.0:
        until = begin + took
        net[24][rank] = until
        for k in range(kept):
            t = wire[base + k]
            got = dst[t] == rank
            held, free = held_of(prices, got)
            later = held_back(started[t], ended[t], nbytes[t], begin, until, held, free)
            if later != ended[t]:
                put_back(net, t, later)
                other = src[t] if got else dst[t]
                if blocked[other]:
                    _pending_again(net, keys, other)
    return took


@HELPER
def _sharing_core(net, prices, rank, kept, begin, seconds, cpu):
    """`rank_cpu.sharing_core` over the rank's first `kept` transfers on the wire, each as
    `rank_cpu.held_spread` has it cross from `begin`."""
    dst, nbytes, ended, started = net[1], net[2], net[8], net[17]
    wire, base = net[18], net[19][rank]
    moved = 0.0
    low = 0.0
    while True:
        # the next point past `low` where a transfer starts or ends
        high = -1.0
        for k in range(kept):
            t = wire[base + k]
            held, free = held_of(prices, dst[t] == rank)
            a, b, _ = held_spread(started[t], ended[t], nbytes[t], begin, held, free)
            for point in (max(a, 0.0), max(b, 0.0)):
                if point > low and (high < 0.0 or point < high):
                    high = point
        if high < 0.0:
            return seconds + cpu * moved
        flow = 0.0
        for k in range(kept):
            t = wire[base + k]
            held, free = held_of(prices, dst[t] == rank)
            a, b, n = held_spread(started[t], ended[t], nbytes[t], begin, held, free)
            if a <= low and b >= high and b > a:
                flow += n / (b - a)
        if cpu * flow < 1.0:
            found = (seconds + cpu * (moved - flow * low)) / (1.0 - cpu * flow)
            if found <= high:
                return found
        moved += flow * (high - low)
        low = high


@HELPER
def held_of(prices, receives):
    """`Links.held`: (rate, bytes at once) of a held message into a computing rank, or out."""
    return (prices[8], prices[9]) if receives else (prices[10], prices[11])


@HELPER
def put_back(net, t, end):
    """`_Simulator._put_back`: transfer `t` between hosts ends at `end`, and what comes after
    it on its link waits for that."""
    if end == net[8][t]:
        return
    net[8][t] = end
    host = net[3]
    a, b = host[net[0][t]], host[net[1][t]]
    net[6][a] = max(net[6][a], end)
    net[7][b] = max(net[7][b], end)


@HELPER
def _pending_again(net, keys, rank):
    """The latest end of the scheduled keys blocked `rank` waits for, after one was put back."""
    scheduled, ended = net[9], net[8]
    latest = 0.0
    for k in range(net[25][rank], net[26][rank]):
        if scheduled[keys[k]]:
            latest = max(latest, ended[keys[k]])
    net[16][rank] = latest
