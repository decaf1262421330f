"""Trace summaries (`legion-nn trace summary F`): where each rank's time went; the critical path.

The MPI runtime writes a Chrome trace (`legion-nn/trace-v1`, opens in Perfetto; read by
`visualize.trace_file`): per rank `pid`,
thread 0 `compute` and thread 1 `communication`; complete events (`"ph": "X"`, `ts` and `dur` in
microseconds since the aligned job start) of category `compute` (a task), `send` (a non-blocking
send, from posting to observed completion), `recv` (time blocked waiting for a message) and
`collective` (a blocking reduction), with `args.id` pairing a send with its recv. Other categories
(`checkpoint`, `io`, ...) count as busy on thread 0 and as communicating on thread 1; other phases
(metadata, instants, counters) are skipped.

Per rank, over its span (job start to the end of its last event):

- busy: the union of its thread-0 intervals;
- communicating: the union of its thread-1 intervals where it is not busy. Waits and collectives
  block, so they count in full; a send overlaps computation by design, so a send counts only
  where the rank is neither computing nor waiting (its sends still draining after its last task);
- idle: the rest.

Per rank, also the median share of a training step (its first start to last end over all ranks)
the rank spends not computing (`waiting_fractions`): a pipeline's bubble, as measured, beside
what the step simulator predicts.

The printed path leaves out idle gaps shorter than a thousandth of the path (or 100 µs): a
runtime's bookkeeping between consecutive tasks would otherwise be every other row. They still
count in the totals, and `--json` lists every stretch.

The critical path walks back from the event that ends last. From an event it goes to the latest
earlier event on the same rank (sends excepted: they gate nothing on their own rank), except
that a recv whose message is in the trace jumps at the send's posting time to the sender's
event that produced it (the one running then, else the last one to end by then), the message's
flight from posting to the wait's end being its part of the path (category `message`; a wait
whose send is missing stays `recv`); and a collective jumps
to the participant that arrived last (matched by step, task, tensor and algorithm), its part
being from that arrival to its end. Time between consecutive steps of the path that no event
covers is `idle`. A trace cut short (a job that died) may lack the matching send or the other
participants: the walk then stays on the rank.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from visualize.trace_file import FORMAT, Event, Trace

COMPUTE_TID = 0
#: timestamps within this many microseconds count as the same instant
EPS = 0.5


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        elif hi > lo:
            out.append((lo, hi))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in intervals)


def _minus(intervals: list[tuple[float, float]], cut: list[tuple[float, float]]) -> float:
    """Length of the union of `intervals` outside the union `cut`."""
    both = _union(intervals + cut)
    return _length(both) - _length(_union(cut))


@dataclass(frozen=True)
class RankTime:
    rank: int
    span: float
    busy: float
    communicating: float
    idle: float
    #: busy time by category, communicating time by category (where not busy)
    busy_by_cat: dict[str, float]
    communicating_by_cat: dict[str, float]

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "span_seconds": self.span / 1e6,
            "busy_seconds": self.busy / 1e6,
            "communicating_seconds": self.communicating / 1e6,
            "idle_seconds": self.idle / 1e6,
            "busy_by_category": {k: v / 1e6 for k, v in self.busy_by_cat.items()},
            "communicating_by_category": {k: v / 1e6 for k, v in self.communicating_by_cat.items()},
        }


def rank_times(trace: Trace) -> list[RankTime]:
    """Busy, communicating and idle time of every rank (microseconds)."""
    out = []
    for rank, events in trace.by_rank().items():
        span = max((e.end for e in events), default=0.0)
        busy_events = [e for e in events if e.tid == COMPUTE_TID]
        comm_events = [e for e in events if e.tid != COMPUTE_TID]
        busy = _union([(e.ts, e.end) for e in busy_events])
        blocking = _union([(e.ts, e.end) for e in comm_events if e.cat != "send"])
        communicating = _minus([(e.ts, e.end) for e in comm_events], busy)
        busy_by_cat = {
            cat: _length(_union([(e.ts, e.end) for e in busy_events if e.cat == cat]))
            for cat in sorted({e.cat for e in busy_events})
        }
        comm_by_cat = {}
        for cat in sorted({e.cat for e in comm_events}):
            cut = busy if cat != "send" else _union(busy + blocking)
            comm_by_cat[cat] = _minus([(e.ts, e.end) for e in comm_events if e.cat == cat], cut)
        total_busy = _length(busy)
        idle = max(span - total_busy - communicating, 0.0)
        out.append(RankTime(rank, span, total_busy, communicating, idle, busy_by_cat, comm_by_cat))
    return out


@dataclass(frozen=True)
class Segment:
    """A stretch of the critical path: `cat` on `rank` from `start` to `end` (microseconds)."""

    rank: int
    name: str
    cat: str
    start: float
    end: float
    step: object = None
    #: for a message, the rank that sent it
    sender: int | None = None

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e6

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "name": self.name,
            "cat": self.cat,
            "step": self.step,
            "sender": self.sender,
            "start_seconds": self.start / 1e6,
            "end_seconds": self.end / 1e6,
        }


@dataclass
class CriticalPath:
    segments: list[Segment]
    #: the span the path is measured against: the job start (time 0) to the last event's end
    span_start: float
    span_end: float

    @property
    def length(self) -> float:
        return sum(s.end - s.start for s in self.segments)

    def by_category(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for segment in self.segments:
            out[segment.cat] = out.get(segment.cat, 0.0) + segment.end - segment.start
        return dict(sorted(out.items(), key=lambda item: -item[1]))


class _Walk:
    """Lookups for the walk, each a bisection; an event is visited at most once, so the walk
    ends even where timestamps tie."""

    def __init__(self, trace: Trace) -> None:
        by_rank = trace.by_rank()
        self.seen: set[int] = set()
        self.by_end: dict[int, list[Event]] = {}
        self.ends: dict[int, list[float]] = {}
        self.compute_by_end: dict[int, list[Event]] = {}
        self.compute_ends: dict[int, list[float]] = {}
        self.compute_by_start: dict[int, list[Event]] = {}
        self.compute_starts: dict[int, list[float]] = {}
        for rank, events in by_rank.items():
            waits = sorted((e for e in events if e.cat != "send"), key=lambda e: (e.end, e.ts))
            compute = [e for e in waits if e.tid == COMPUTE_TID]
            self.by_end[rank], self.ends[rank] = waits, [e.end for e in waits]
            self.compute_by_end[rank], self.compute_ends[rank] = compute, [e.end for e in compute]
            by_start = sorted(compute, key=lambda e: e.ts)
            self.compute_by_start[rank] = by_start
            self.compute_starts[rank] = [e.ts for e in by_start]
        self.sends = {
            str(e.args["id"]): e for e in trace.events if e.cat == "send" and "id" in e.args
        }
        self.collectives: dict[tuple, list[Event]] = {}
        for e in trace.events:
            if e.cat == "collective":
                self.collectives.setdefault(_collective_key(e), []).append(e)

    def _last(self, events: list[Event], ends: list[float], time: float) -> Event | None:
        index = bisect_right(ends, time + EPS) - 1
        while index >= 0 and id(events[index]) in self.seen:
            index -= 1
        return events[index] if index >= 0 else None

    def before(self, rank: int, time: float) -> Event | None:
        """The unvisited event on `rank` that ended last by `time` (sends excepted)."""
        return self._last(self.by_end.get(rank, []), self.ends.get(rank, []), time)

    def producer(self, send: Event) -> Event | None:
        """The sender's compute-thread event running when `send` was posted, else the last one
        to end by then: the data was produced there, whatever the sender waited on after."""
        events = self.compute_by_start.get(send.rank, [])
        index = bisect_left(self.compute_starts.get(send.rank, []), send.ts - EPS) - 1
        if index >= 0 and events[index].end > send.ts + EPS and id(events[index]) not in self.seen:
            return events[index]
        found = self._last(
            self.compute_by_end.get(send.rank, []), self.compute_ends.get(send.rank, []), send.ts
        )
        return found if found is not None else self.before(send.rank, send.ts)

    def last_arrival(self, event: Event) -> Event | None:
        peers = self.collectives.get(_collective_key(event), [])
        if len(peers) < 2:
            return None
        return max(peers, key=lambda e: (e.ts, e.rank == event.rank))


def _collective_key(event: Event) -> tuple:
    a = event.args
    return (str(a.get("step")), str(a.get("task")), str(a.get("tensor")), str(a.get("algorithm")))


def critical_path(trace: Trace) -> CriticalPath:
    """The chain of events, rank to rank, that ends last; see the module docstring."""
    walk = _Walk(trace)
    current = max((e for e in trace.events if e.cat != "send"), key=lambda e: e.end, default=None)
    span_start = min(0.0, min(e.ts for e in trace.events))  # the job start, or earlier
    span_end = max(e.end for e in trace.events)
    if current is None:
        return CriticalPath([], span_start, span_end)
    cursor = current.end
    segments: list[Segment] = []
    while current is not None:
        walk.seen.add(id(current))
        step = current.args.get("step")
        name = str(current.args.get("task") or current.name)
        send = walk.sends.get(str(current.args.get("id"))) if current.cat == "recv" else None
        arrival = walk.last_arrival(current) if current.cat == "collective" else None
        if send is not None:
            start = min(send.ts, cursor)
            segments.append(Segment(current.rank, name, "message", start, cursor, step, send.rank))
            previous = walk.producer(send)
        elif arrival is not None and arrival.rank != current.rank:
            start = min(arrival.ts, cursor)
            segments.append(Segment(current.rank, name, current.cat, start, cursor, step))
            walk.seen.add(id(arrival))
            previous = walk.before(arrival.rank, arrival.ts)
        else:
            start = min(current.ts, cursor)
            segments.append(Segment(current.rank, name, current.cat, start, cursor, step))
            previous = walk.before(current.rank, start)
        cursor = start
        if previous is not None and previous.end < cursor - EPS:
            segments.append(Segment(previous.rank, "", "idle", previous.end, cursor, step))
            cursor = previous.end
        current = previous
    segments.reverse()
    return CriticalPath(segments, span_start, span_end)


def step_spans(trace: Trace) -> dict[str, float]:
    """Per step (`args.step`), first start to last end over all ranks (microseconds)."""
    bounds: dict[str, tuple[float, float]] = {}
    for e in trace.events:
        if "step" in e.args:
            key = str(e.args["step"])
            lo, hi = bounds.get(key, (e.ts, e.end))
            bounds[key] = (min(lo, e.ts), max(hi, e.end))
    return {key: hi - lo for key, (lo, hi) in bounds.items()}


def waiting_fractions(trace: Trace) -> dict[int, float]:
    """Per rank, the median over training steps (an int `args.step`; the first, which compiles,
    is as one among many) of the share of the step (`step_spans`) the rank spends not
    computing: what the step simulator reports as a rank's waiting, and in a pipeline its bubble
    (`partition --json`'s `bubble_fraction` is the mean over ranks of the simulated one)."""
    spans = step_spans(trace)
    shares: dict[int, list[float]] = {}
    for rank, events in trace.by_rank().items():
        busy: dict[str, list[tuple[float, float]]] = {}
        for e in events:
            step = e.args.get("step")
            if e.tid == COMPUTE_TID and isinstance(step, int) and not isinstance(step, bool):
                busy.setdefault(str(step), []).append((e.ts, e.end))
        for key, intervals in busy.items():
            if spans.get(key, 0.0) > 0:
                shares.setdefault(rank, []).append(1.0 - _length(_union(intervals)) / spans[key])
    return {rank: statistics.median(v) for rank, v in sorted(shares.items())}


def summary(trace: Trace) -> dict:
    """Everything `legion-nn trace summary` reports, in seconds (the `--json` object)."""
    path = critical_path(trace)
    spans = step_spans(trace)
    waiting = waiting_fractions(trace)
    per_step: dict[str, float] = {}
    for segment in path.segments:
        if segment.step is not None:
            key = str(segment.step)
            per_step[key] = per_step.get(key, 0.0) + segment.end - segment.start
    span = path.span_end - path.span_start
    return {
        "format": FORMAT,
        "network": trace.meta.get("network"),
        "strategy": trace.meta.get("strategy"),
        "ranks": [t.to_json() for t in rank_times(trace)],
        "waiting_per_step": {str(rank): share for rank, share in waiting.items()},
        "steps": len(spans),
        "span_seconds": span / 1e6,
        "critical_path": {
            "seconds": path.length / 1e6,
            "share_of_span": path.length / span if span else 0.0,
            "by_category": {k: v / 1e6 for k, v in path.by_category().items()},
            "per_step": [
                {"step": key, "path_seconds": per_step.get(key, 0.0) / 1e6, "span_seconds": s / 1e6}
                for key, s in spans.items()
            ],
            "segments": [s.to_json() for s in _merged(path.segments)],
        },
    }


def _merged(segments: list[Segment]) -> list[Segment]:
    """Consecutive stretches of one task on one rank, in one category, as one."""
    out: list[Segment] = []
    for s in segments:
        last = out[-1] if out else None
        if last and (last.rank, last.name, last.cat, last.step, last.sender) == (
            s.rank,
            s.name,
            s.cat,
            s.step,
            s.sender,
        ):
            out[-1] = Segment(s.rank, s.name, s.cat, last.start, s.end, s.step, s.sender)
        else:
            out.append(s)
    return out


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:5.1f}" if whole > 0 else "    -"


def format_summary(report: dict, source: str, shown: int = 40) -> str:
    """The text `legion-nn trace summary` prints: a table per rank, then the critical path."""
    what = ", ".join(
        f"{key} {report[key]}" for key in ("network", "strategy") if report.get(key) is not None
    )
    steps = f"{report['steps']} step{'' if report['steps'] == 1 else 's'}"
    title = (
        f"{source}: {what + ', ' if what else ''}{len(report['ranks'])} ranks, {steps}, "
        f"span {report['span_seconds']:.6f} s"
    )
    columns = (
        f"{'rank':>4} {'span s':>10} {'busy s':>10} {'%':>5} {'comm s':>10} {'%':>5} "
        f"{'idle s':>10} {'%':>5}"
    )
    lines = [title, "", columns]
    for row in report["ranks"]:
        span = row["span_seconds"]
        lines.append(
            f"{row['rank']:>4} {span:>10.6f} "
            f"{row['busy_seconds']:>10.6f} {_share(row['busy_seconds'], span)} "
            f"{row['communicating_seconds']:>10.6f} {_share(row['communicating_seconds'], span)} "
            f"{row['idle_seconds']:>10.6f} {_share(row['idle_seconds'], span)}"
        )
    waiting = report.get("waiting_per_step", {})
    if waiting:
        shares = ", ".join(f"rank {rank} {100 * share:.0f}%" for rank, share in waiting.items())
        mean = sum(waiting.values()) / len(waiting)
        lines += ["", f"not computing, a training step's share: {shares}; mean {100 * mean:.0f}%"]
    path = report["critical_path"]
    span = report["span_seconds"]
    lines += [
        "",
        (
            f"critical path: {path['seconds']:.6f} s of the {span:.6f} s span "
            f"({_share(path['seconds'], span).strip()}%), {len(path['segments'])} stretches"
        ),
    ]
    # Gaps of a task's bookkeeping between tasks would fill the list: it leaves out short ones.
    short = max(path["seconds"] * 1e-3, 1e-4)
    segments = [
        s
        for s in path["segments"]
        if s["cat"] != "idle" or s["end_seconds"] - s["start_seconds"] >= short
    ]
    left_out = len(path["segments"]) - len(segments)
    head = (
        f"  {'rank':>6} {'step':>5} {'task':<28} {'category':<10} {'start s':>10} {'length s':>10}"
    )
    lines.append(head)
    keep = (
        segments if len(segments) <= shown else segments[:10] + [None] + segments[-(shown - 10) :]
    )
    for s in keep:
        if s is None:
            lines.append(f"  ... {len(segments) - shown} more ...")
            continue
        step = "" if s["step"] is None else str(s["step"])
        rank = str(s["rank"]) if s["sender"] is None else f"{s['sender']}→{s['rank']}"
        lines.append(
            f"  {rank:>6} {step:>5} {s['name'][:28]:<28} {s['cat']:<10} "
            f"{s['start_seconds']:>10.6f} {s['end_seconds'] - s['start_seconds']:>10.6f}"
        )
    if left_out:
        lines.append(f"  ({left_out} idle gaps shorter than {short:.6f} s not listed)")
    lines.append(
        "  by category: "
        + ", ".join(
            f"{cat} {sec:.6f} s ({_share(sec, path['seconds']).strip()}%)"
            for cat, sec in path["by_category"].items()
        )
    )
    if len(path["per_step"]) > 1:
        n = len(path["per_step"])
        on_path = sum(s["path_seconds"] for s in path["per_step"]) / n
        step_span = sum(s["span_seconds"] for s in path["per_step"]) / n
        lines.append(
            f"  per step (mean of {n}): {on_path:.6f} s on the path, step span {step_span:.6f} s"
        )
    elif path["per_step"]:
        only = path["per_step"][0]
        lines.append(
            f"  step {only['step']}: {only['path_seconds']:.6f} s on the path, "
            f"step span {only['span_seconds']:.6f} s"
        )
    return "\n".join(lines) + "\n"
