"""Chrome-trace timelines of a distributed run (`legion-nn train --trace F`), for Perfetto.

Format (`legion-nn/trace-v1`): one JSON object `{"traceEvents": [...], "displayTimeUnit": "ms",
"otherData": {"format", "ranks", "network", "strategy"}}`. pid is the rank; tid 0 is compute,
tid 1 communication. Times are microseconds since the job's common start: the ranks agree on it by
a handshake with rank 0 when the run begins, so clocks are aligned to within a message latency.

- `compute` (tid 0): one event per task a rank runs, args {step, task, phase}; `step` is
  "eval" for the evaluation passes;
- `send` (tid 1): a non-blocking send, from when it was posted (right after its data was
  produced) to when its completion was seen; args {step, task, tensor, rect, bytes, peer, id};
- `recv` (tid 1): time blocked waiting for a message before a task could go on; same args, with
  `peer` the sender and the same `id` as the send;
- `collective` (tid 1): a reduction of the plan; args {step, task, tensor, bytes, algorithm,
  participants}.

Every rank records its own events; rank 0 collects them after each step and rewrites the file
atomically (at most every `flush_seconds`, and at the end), so the file is valid JSON at every
moment, even when the job dies: it then ends at the last step rank 0 wrote.
"""

from __future__ import annotations

import json
import time
from typing import Any

from legion_nn.atomic import write_text

COMPUTE, COMMUNICATION = 0, 1


class Recorder:
    """One rank's events, in microseconds since the aligned start."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.origin = time.perf_counter()
        self.events: list[dict[str, Any]] = []

    def align(self, origin: float) -> None:
        """Set time zero to `origin` (a perf_counter reading taken at the common start)."""
        self.origin = origin

    def now(self) -> float:
        return time.perf_counter()

    def add(
        self, cat: str, name: str, tid: int, start: float, end: float, args: dict[str, Any]
    ) -> None:
        self.events.append(
            {
                "ph": "X",
                "cat": cat,
                "name": name,
                "pid": self.rank,
                "tid": tid,
                "ts": round((start - self.origin) * 1e6, 3),
                "dur": round(max(end - start, 0.0) * 1e6, 3),
                "args": args,
            }
        )

    def take(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out


def metadata(nranks: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for rank in range(nranks):
        out.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        out.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
        )
        for tid, label in ((COMPUTE, "compute"), (COMMUNICATION, "communication")):
            out.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}}
            )
    return out


class TraceFile:
    """Rank 0's collected trace, rewritten atomically as events arrive."""

    def __init__(
        self, path: str, nranks: int, info: dict[str, Any], flush_seconds: float = 2.0
    ) -> None:
        self.path = path
        self.info = {"format": "legion-nn/trace-v1", "ranks": nranks, **info}
        self.chunks: list[str] = [json.dumps(e) for e in metadata(nranks)]
        self.flush_seconds = flush_seconds
        self.last_write = float("-inf")

    def extend(self, events: list[dict[str, Any]]) -> None:
        self.chunks.extend(json.dumps(e) for e in events)

    def write(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_write < self.flush_seconds:
            return
        body = ",\n".join(self.chunks)
        write_text(
            self.path,
            '{"traceEvents": [\n'
            + body
            + '\n], "displayTimeUnit": "ms", "otherData": '
            + json.dumps(self.info)
            + "}\n",
        )
        self.last_write = now
