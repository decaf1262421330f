"""The step simulator's event loop, compiled by Numba: `runtime.step.compiled` flattens every
rank's program into instructions, and `run_step` runs them with `runtime.step.simulator`'s very
rules and tie-breaks (see `compiled` for the instructions and what each stands for).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from runtime.step.loop_cpu import held_back, held_of, kernel_share, put_back, stretched
from runtime.step.wake_heap import HELPER, pop_earliest, wake

#: the instructions' codes (`compiled`'s module docstring)
ADD, SYNC, POST, WAIT, START, COMPLETE, PROGRESS, COMPUTE = range(8)
#: `awaited`'s bits: a blocked rank waits for the transfer as its source, as its destination
AWAITED_BY_SRC, AWAITED_BY_DST = 1, 2


# The loop is module-level functions over tuples of arrays, each compiled once: inner closures
# would be inlined at every call, and compiling the whole took over a minute. The helpers are
# compiled without Numba's reference counting (`_nrt=False`, as numba/numba#2350 does): they
# allocate nothing and hold no array beyond the call, and the counts Numba emits for arrays
# used across branches, which its pruning pass cannot pair, were 90% of the loop's time (an
# atomic add and subtract per array per call). They are compiled as `HELPER` says.
#   net: src, dst, nbytes, host, egress_rank, ingress_rank, egress_host, ingress_host, ended,
#        scheduled, send_posted, recv_posted, tokens_out, tokens_in (each host's burst left),
#        awaited (per transfer, which of its blocked ends wait for it to be scheduled),
#        unscheduled and pending_end (per rank, of the keys it is blocked on: how many are not
#        scheduled, and the latest end of those that are), started (per transfer, when it
#        starts on the link), wire, wire_at, wire_count (per rank, its transfers between hosts
#        in the order they were scheduled, in wire[wire_at[i]:wire_at[i] + wire_count[i]]),
#        stack (per host, when its network stack is next free), beta and stack_beta (per
#        transfer, seconds per byte of its link and of the network stack at its ends,
#        `links.Links.rates`), computing_until (per rank, when its latest kernel ends),
#        block_lo and block_hi (per rank, the keys it is blocked on: keys[lo:hi])
#   heap: wake_at, heap_time, heap_order, heap_rank, state (heap size, counter)
#   prices: alpha, beta (the link's rate between hosts whatever a message's size: the token
#           bucket's refill), alpha_intra, add (a byte added in), per_message, burst,
#           network_cpu, stack_beta,
#           and a held message's rate and bytes at once into a computing rank, then out of
#           it (`links.Links.held`)
#   ranks: clock, waiting, blocked, slowdown (how much longer its CPU work takes than alone)
#   rounds: keys, round_first, round_count, round_lo, round_hi, round_adds, current_round,
#           started, instances_of, tail (per rank, its instances in start order are
#           started[instances_of[i]:instances_of[i] + tail[i]]), live (per rank, in start
#           order, the instances with rounds left to post), live_count


@HELPER
def _schedule(net, prices, blocked, heap, t, ready):
    src, dst, nbytes, host = net[0], net[1], net[2], net[3]
    s, d = src[t], dst[t]
    between = host[s] != host[d]
    if not between:  # shared memory: each rank copies one message at a time
        egress, ingress, a, b = net[4], net[5], s, d
        alpha = prices[2]
    else:
        egress, ingress, a, b = net[6], net[7], host[s], host[d]
        alpha = prices[0]
    beta = net[22][t]
    start = max(ready, egress[a])
    if not between:  # `_Simulator._schedule`: between hosts the switch queues for the ingress
        start = max(start, ingress[b])
    arrive = max(start, ingress[b])
    burst = prices[5]
    if burst and between:
        # `_Simulator._schedule`'s token bucket at each end, the same sums in the same order
        tokens_out, tokens_in = net[12], net[13]
        left = min(
            min(burst, tokens_out[a] + (start - egress[a]) / prices[1]),
            min(burst, tokens_in[b] + (arrive - ingress[b]) / prices[1]),
        )
        paid = max(nbytes[t] - left, 0.0)
        tokens_out[a] = max(left - nbytes[t], 0.0)
        tokens_in[b] = max(left - nbytes[t], 0.0)
    else:
        paid = float(nbytes[t])
    egress[a] = start + alpha + paid * beta
    if prices[7] != 0.0 and between:
        stack, stack_beta = net[21], net[23][t]
        # `_Simulator._schedule`: each end's stack takes the bytes after what it took before
        stack[host[s]] = max(start, stack[host[s]]) + paid * stack_beta
        stack[host[d]] = max(arrive, stack[host[d]]) + paid * stack_beta
        end = alpha + max(arrive + paid * beta, max(stack[host[s]], stack[host[d]]))
    else:
        end = arrive + alpha + paid * beta
    ingress[b] = end
    net[8][t] = end
    if between and (prices[8] != 0.0 or prices[10] != 0.0):
        # `_Simulator._schedule`: held back while a kernel runs at its destination, then source
        held = end
        for rank, receives in ((d, True), (s, False)):
            rate, free = held_of(prices, receives)
            held = held_back(start, held, nbytes[t], start, net[24][rank], rate, free)
        put_back(net, t, held)
        end = net[8][t]
    net[9][t] = True
    net[17][t] = start
    if between:
        wire, wire_at, wire_count = net[18], net[19], net[20]
        wire[wire_at[s] + wire_count[s]] = t
        wire_count[s] += 1
        wire[wire_at[d] + wire_count[d]] = t
        wire_count[d] += 1
    awaited = net[14][t]
    if awaited:
        net[14][t] = 0
        unscheduled, pending_end = net[15], net[16]
        if awaited & AWAITED_BY_SRC:
            unscheduled[s] -= 1
            pending_end[s] = max(pending_end[s], end)
        if awaited & AWAITED_BY_DST:
            unscheduled[d] -= 1
            pending_end[d] = max(pending_end[d], end)
    if blocked[s]:
        wake(heap, s, end)
    if blocked[d]:
        wake(heap, d, end)


@HELPER
def _post(net, prices, blocked, heap, rank, t, now):
    if rank == net[0][t]:
        net[10][t] = True
    if rank == net[1][t]:
        net[11][t] = True
    if net[10][t] and net[11][t]:
        _schedule(net, prices, blocked, heap, t, now)


@HELPER
def _round_end(keys, ended, scheduled, lo, hi):
    """When the last of keys[lo:hi] ends, or -1.0 while one is not scheduled."""
    latest = 0.0
    for k in range(lo, hi):
        t = keys[k]
        if not scheduled[t]:
            return -1.0
        latest = max(latest, ended[t])
    return latest


@HELPER
def _post_round(net, prices, ranks, heap, rounds, rank, instance):
    keys, first, count, round_lo, round_hi, current = (
        rounds[0],
        rounds[1],
        rounds[2],
        rounds[3],
        rounds[4],
        rounds[6],
    )
    clock = ranks[0]
    r = current[instance]
    lo, hi = 0, 0
    if r < count[instance]:
        lo, hi = round_lo[first[instance] + r], round_hi[first[instance] + r]
    clock[rank] += (hi - lo) * prices[4] * ranks[3][rank]
    for k in range(lo, hi):
        _post(net, prices, ranks[2], heap, rank, keys[k], clock[rank])


@HELPER
def _advance(net, prices, ranks, heap, rounds, rank):
    """`_Simulator._advance`: post the next round of each collective whose round has ended, in
    the order they started. A collective whose rounds are all posted leaves the rank's live
    list (most of those in flight late in a step have: scanning them was most of the loop)."""
    keys, first, count, round_lo, round_hi, adds, current = rounds[:7]
    instances_of, live, live_count = rounds[8], rounds[10], rounds[11]
    ended, scheduled = net[8], net[9]
    clock = ranks[0]
    now = clock[rank]
    base = instances_of[rank]
    kept = 0
    for q in range(live_count[rank]):
        instance = live[base + q]
        while current[instance] < count[instance]:
            cell = first[instance] + current[instance]
            end = _round_end(keys, ended, scheduled, round_lo[cell], round_hi[cell])
            if end < 0.0 or end > now:
                break
            clock[rank] += adds[cell] * prices[3] * ranks[3][rank]
            current[instance] += 1
            _post_round(net, prices, ranks, heap, rounds, rank, instance)
        if current[instance] < count[instance]:
            live[base + kept] = instance
            kept += 1
    live_count[rank] = kept


@HELPER
def _next_round_end(net, ranks, rounds, rank):
    keys, first, round_lo, round_hi = rounds[0], rounds[1], rounds[3], rounds[4]
    current, instances_of, live, live_count = rounds[6], rounds[8], rounds[10], rounds[11]
    ended, scheduled = net[8], net[9]
    now = ranks[0][rank]
    base = instances_of[rank]
    best = -1.0
    for q in range(live_count[rank]):
        instance = live[base + q]
        cell = first[instance] + current[instance]
        end = _round_end(keys, ended, scheduled, round_lo[cell], round_hi[cell])
        if end >= 0.0 and end > now and (best < 0.0 or end < best):
            best = end
    return best


@HELPER
def _poll(net, prices, ranks, heap, rounds, rank, now):
    """`_Simulator._poll`; True where the wait is over (the caller runs the rank on). The keys
    still awaited are counted, not rescanned: a key once ended by a rank's clock stays ended,
    so the wait is over when none is unscheduled and the latest end is past, and while every key
    is scheduled the latest end is the one the rank wakes at."""
    clock, waiting, blocked = ranks[0], ranks[1], ranks[2]
    unscheduled, pending_end = net[15], net[16]
    waited_from = clock[rank]
    clock[rank] = max(clock[rank], now)
    _advance(net, prices, ranks, heap, rounds, rank)
    now = clock[rank]
    waiting[rank] += now - waited_from
    if unscheduled[rank] == 0 and pending_end[rank] <= now:
        blocked[rank] = False
        return True
    end = pending_end[rank] if unscheduled[rank] == 0 else -1.0
    later = _next_round_end(net, ranks, rounds, rank)
    if end >= 0.0 and later >= 0.0:
        wake(heap, rank, min(end, later))
    elif end >= 0.0:
        wake(heap, rank, end)
    elif later >= 0.0:
        wake(heap, rank, later)
    return False


@HELPER
def _block(net, prices, ranks, heap, rounds, rank, lo, hi):
    """Wait for keys[lo:hi]: True where that is over at once. A key not yet scheduled is
    marked as awaited by this end of it, for `_schedule` to count off."""
    keys, src, dst, ended, scheduled, awaited = rounds[0], net[0], net[1], net[8], net[9], net[14]
    unscheduled, pending_end = net[15], net[16]
    unscheduled[rank] = 0
    pending_end[rank] = 0.0
    net[25][rank], net[26][rank] = lo, hi
    for k in range(lo, hi):
        t = keys[k]
        if scheduled[t]:
            pending_end[rank] = max(pending_end[rank], ended[t])
            continue
        end_bit = AWAITED_BY_SRC if src[t] == rank else AWAITED_BY_DST
        if end_bit == AWAITED_BY_DST and dst[t] != rank:
            raise RuntimeError("step simulation: a rank waits on a transfer it is not an end of")
        if not awaited[t] & end_bit:
            awaited[t] |= end_bit
            unscheduled[rank] += 1
    ranks[2][rank] = True
    return _poll(net, prices, ranks, heap, rounds, rank, ranks[0][rank])


@HELPER
def _run(program, net, prices, ranks, heap, rounds, rank):
    """`_Simulator._run`: go on with `rank` at its clock until it waits, syncs or ends."""
    ops, op_ptr, amounts, pc, done, finish = program
    keys, first, count, round_lo, round_hi = rounds[:5]
    current, started, instances_of, tail, live, live_count = rounds[6:12]
    clock = ranks[0]
    while True:
        p = pc[rank]
        if p == op_ptr[rank + 1]:
            done[rank] = True
            finish[rank] = clock[rank]
            return
        code, a, b = ops[p, 0], ops[p, 1], ops[p, 2]
        if code == ADD:
            clock[rank] += amounts[a]
            pc[rank] = p + 1
        elif code == SYNC:
            pc[rank] = p + 1
            wake(heap, rank, clock[rank])
            return
        elif code == POST:
            for k in range(a, b):
                _post(net, prices, ranks[2], heap, rank, keys[k], clock[rank])
            pc[rank] = p + 1
        elif code == COMPUTE:
            pc[rank] = p + 1
            took = stretched(
                net, prices, ranks[2], keys, rank, clock[rank], amounts[a], ranks[3][rank]
            )
            clock[rank] += took
            if amounts[b]:
                ranks[4][rank] += kernel_share(took, amounts[b], amounts[a])
        elif code == PROGRESS:
            pc[rank] = p + 1
            _advance(net, prices, ranks, heap, rounds, rank)
        elif code == WAIT:
            pc[rank] = p + 1
            if not _block(net, prices, ranks, heap, rounds, rank, a, b):
                return
        elif code == START:
            started[instances_of[rank] + tail[rank]] = a
            tail[rank] += 1
            pc[rank] = p + 1
            if current[a] < count[a]:
                live[instances_of[rank] + live_count[rank]] = a
                live_count[rank] += 1
            _post_round(net, prices, ranks, heap, rounds, rank, a)
        else:  # COMPLETE: the `a`-th the rank started, round by round (`_Simulator._complete`)
            instance = started[instances_of[rank] + a]
            if current[instance] < count[instance]:
                cell = first[instance] + current[instance]
                if not _block(
                    net, prices, ranks, heap, rounds, rank, round_lo[cell], round_hi[cell]
                ):
                    return
            else:
                pc[rank] = p + 1


@njit(cache=True)
def run_step(
    ops,
    op_ptr,
    amounts,
    keys,
    src,
    dst,
    nbytes,
    host,
    hosts,
    round_first,
    round_count,
    round_lo,
    round_hi,
    round_adds,
    heap_room,
    slowdown,
    beta,
    stack_beta,
    prices,
):
    nranks = len(op_ptr) - 1
    transfers = len(src)
    # each rank's room for its transfers between hosts
    wire_at = np.zeros(nranks + 1, np.int64)
    for t in range(transfers):
        s, d = src[t], dst[t]
        if s >= 0 and d >= 0 and host[s] != host[d]:
            wire_at[s + 1] += 1
            wire_at[d + 1] += 1
    wire_at = np.cumsum(wire_at)
    net = (
        src,
        dst,
        nbytes,
        host,
        np.zeros(nranks, np.float64),
        np.zeros(nranks, np.float64),
        np.zeros(max(hosts, 1), np.float64),
        np.zeros(max(hosts, 1), np.float64),
        np.zeros(transfers, np.float64),
        np.zeros(transfers, np.bool_),
        np.zeros(transfers, np.bool_),
        np.zeros(transfers, np.bool_),
        np.full(max(hosts, 1), prices[5]),
        np.full(max(hosts, 1), prices[5]),
        np.zeros(transfers, np.int8),
        np.zeros(nranks, np.int64),
        np.zeros(nranks, np.float64),
        np.zeros(transfers, np.float64),
        np.zeros(max(wire_at[nranks], 1), np.int64),
        wire_at,
        np.zeros(nranks, np.int64),
        np.zeros(max(hosts, 1), np.float64),
        beta,
        stack_beta,
        np.zeros(nranks, np.float64),
        np.zeros(nranks, np.int64),
        np.zeros(nranks, np.int64),
    )
    heap = (
        np.full(nranks, np.inf),
        np.zeros(heap_room, np.float64),
        np.zeros(heap_room, np.int64),
        np.zeros(heap_room, np.int64),
        np.zeros(2, np.int64),
    )
    ranks = (
        np.zeros(nranks, np.float64),
        np.zeros(nranks, np.float64),
        np.zeros(nranks, np.bool_),
        slowdown,
        np.zeros(nranks, np.float64),
    )
    # per rank, its instances in start order: START takes the next, COMPLETE names one
    instances_of = np.zeros(nranks + 1, np.int64)
    for i in range(nranks):
        instances_of[i + 1] = instances_of[i] + np.sum(ops[op_ptr[i] : op_ptr[i + 1], 0] == START)
    rounds = (
        keys,
        round_first,
        round_count,
        round_lo,
        round_hi,
        round_adds,
        np.zeros(max(len(round_first), 1), np.int64),
        np.zeros(max(instances_of[nranks], 1), np.int64),
        instances_of,
        np.zeros(nranks, np.int64),
        np.zeros(max(instances_of[nranks], 1), np.int64),
        np.zeros(nranks, np.int64),
    )
    done = np.zeros(nranks, np.bool_)
    finish = np.zeros(nranks, np.float64)
    program = (
        ops,
        op_ptr,
        amounts,
        op_ptr[:-1].copy(),
        done,
        finish,
    )
    for rank in range(nranks):
        wake(heap, rank, 0.0)
    wake_at = heap[0]
    while heap[4][0] > 0:
        at, rank = pop_earliest(heap)
        if wake_at[rank] != at:
            continue
        wake_at[rank] = np.inf
        if done[rank]:
            continue
        if ranks[2][rank]:
            if _poll(net, prices, ranks, heap, rounds, rank, at):
                _run(program, net, prices, ranks, heap, rounds, rank)
        else:
            ranks[0][rank] = max(ranks[0][rank], at)
            _run(program, net, prices, ranks, heap, rounds, rank)
    return finish, ranks[1], ranks[4], done
