"""Reading trace files: `legion-nn/trace-v1`, Chrome's trace format, as the MPI runtime writes it.

A file is `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {"format":
"legion-nn/trace-v1", "ranks": R, "network": ..., "strategy": ...}}`. Complete events (`"ph": "X"`)
become `Event`s (rank = `pid`, thread = `tid`, `ts` and `dur` in microseconds since the aligned job
start); metadata and any other phases are skipped. Whatever else is wrong gets one line naming the
file and the event.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from legion_nn.errors import LegionNNError

FORMAT = "legion-nn/trace-v1"


@dataclass(frozen=True)
class Event:
    rank: int
    tid: int
    ts: float
    dur: float
    name: str
    cat: str
    args: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class Trace:
    events: list[Event]
    ranks: int
    meta: dict

    def by_rank(self) -> dict[int, list[Event]]:
        """Every rank's events, in time order (ranks without events included)."""
        out: dict[int, list[Event]] = {rank: [] for rank in range(self.ranks)}
        for event in self.events:
            out[event.rank].append(event)
        return out


def _number(event: dict, key: str, where: str) -> float:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LegionNNError(f"{where}: {key!r} must be a number, got {value!r}")
    return float(value)


def _index(event: dict, key: str, where: str) -> int:
    value = _number(event, key, where)
    if value < 0 or value != int(value):
        raise LegionNNError(f"{where}: {key!r} must be a rank or thread number, got {value!r}")
    return int(value)


def parse_trace(data: object, source: str = "trace") -> Trace:
    """A trace from the decoded JSON of a `legion-nn/trace-v1` file; one-line errors."""
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise LegionNNError(f"{source}: not a Chrome trace object with a traceEvents list")
    meta = data.get("otherData")
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        raise LegionNNError(
            f"{source}: otherData.format is {found!r}, not {FORMAT!r}: not a legion-nn trace"
        )
    events = []
    for index, raw in enumerate(data["traceEvents"]):
        where = f"{source}: traceEvents[{index}]"
        if not isinstance(raw, dict):
            raise LegionNNError(f"{where}: an event must be an object")
        if raw.get("ph") != "X":
            continue
        rank, tid = _index(raw, "pid", where), _index(raw, "tid", where)
        ts, dur = _number(raw, "ts", where), _number(raw, "dur", where)
        if dur < 0:
            raise LegionNNError(f"{where}: negative dur {dur}")
        args = raw.get("args") if isinstance(raw.get("args"), dict) else {}
        events.append(
            Event(
                rank,
                tid,
                ts,
                dur,
                str(raw.get("name", "")),
                str(raw.get("cat", "")),
                args,
            )
        )
    if not events:
        raise LegionNNError(f"{source}: no complete (ph X) events to summarise")
    events.sort(key=lambda e: (e.ts, e.rank, e.tid))
    ranks = meta.get("ranks")
    if not isinstance(ranks, int) or isinstance(ranks, bool):
        ranks = max(e.rank for e in events) + 1
    return Trace(events, max(ranks, max(e.rank for e in events) + 1), meta)


def load_trace(path: str | Path) -> Trace:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LegionNNError(f"{path}:{exc.lineno}: not JSON ({exc.msg})") from None
    except UnicodeDecodeError:
        raise LegionNNError(f"{path}: not JSON (not UTF-8 text)") from None
    return parse_trace(data, str(path))
